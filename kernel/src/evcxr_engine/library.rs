//! Where the `vramlab` crate is, for cells that use it without `:dep`.

use std::path::PathBuf;

use crate::install::LIB_ENV;

/// The crates cells may name directly, at the versions the library uses.
const CANDLE_CRATES: [&str; 2] = ["candle-core", "candle-nn"];

/// Whether a cell's code needs the library: it names it, or one of the candle crates it brings, or
/// adds a crate of candle's with `:dep`. Such a crate (candle-transformers, candle-datasets) builds
/// on the library's candle; added first, cargo would resolve and build candle for it alone, and
/// again, with the library's versions and features, once the library came.
pub(super) fn wants_library(code: &str) -> bool {
    ["vramlab", "candle_core", "candle_nn"].iter().any(|name| code.contains(name))
        || code.lines().filter_map(|line| line.trim().strip_prefix(":dep")).any(|spec| spec.trim_start().starts_with("candle"))
}

pub(super) struct Library {
    pub(super) dir: Option<PathBuf>,
    /// Where the library was looked for.
    wanted: PathBuf,
    pub(super) loaded: bool,
}

impl Library {
    pub(super) fn locate() -> Library {
        let wanted =
            std::env::var_os(LIB_ENV).map(PathBuf::from).unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../lib")));
        let dir = Some(&wanted).filter(|d| d.join("Cargo.toml").exists()).and_then(|d| d.canonicalize().ok());
        if dir.is_none() {
            log::warn!("the vramlab library is not at {} (set {LIB_ENV}); cells must add it with :dep", wanted.display());
        }
        Library { dir, wanted, loaded: false }
    }

    /// The `:dep` lines that give cells the library and, by their own names, the candle crates it
    /// is built on (`use candle_core::Tensor`, as candle's examples write it).
    pub(super) fn dep_command(&self) -> Option<String> {
        let dir = self.dir.as_ref()?;
        // A kernel built for CUDA gives its cells CUDA tensors too.
        let features = if cfg!(feature = "cuda") { ", features = [\"cuda\"]" } else { "" };
        let mut command = format!(":dep vramlab = {{ path = {:?}{features} }}", dir.display().to_string());
        let lock = dir.parent().map(|workspace| workspace.join("Cargo.lock"));
        let versions = lock.as_deref().map(locked_versions).unwrap_or_default();
        for name in CANDLE_CRATES {
            match versions.iter().find(|(locked, _)| locked == name) {
                // The library's exact version and its features: cargo finds the crate already
                // built with the library, and the workspace's patches apply to it as to the library.
                Some((_, version)) => command.push_str(&format!("\n:dep {name} = \"={version}\"")),
                None => log::warn!("{name} is not in the library's lock file; cells reach it only as vramlab's"),
            }
        }
        Some(command)
    }

    /// What to tell a cell that uses the library when it is not where the
    /// kernelspec says.
    pub(super) fn missing_message(&self) -> Option<String> {
        if self.dir.is_some() {
            return None;
        }
        Some(format!(
            "the vramlab library is not at {} ({LIB_ENV} in the kernelspec): the checkout has moved or been deleted. \
             Install the kernelspec again from where the checkout is now (`target/release/vramlab-kernel install --user`, \
             or `--lib DIR` for the library's folder), then restart the kernel; or add it in a cell with \
             `:dep vramlab = {{ path = \"DIR\" }}`",
            self.wanted.display()
        ))
    }
}

/// Each package of a Cargo lock file with its version.
fn locked_versions(lock: &std::path::Path) -> Vec<(String, String)> {
    let Ok(text) = std::fs::read_to_string(lock) else { return Vec::new() };
    let Ok(doc) = text.parse::<toml::Table>() else { return Vec::new() };
    let packages = doc.get("package").and_then(toml::Value::as_array).map(Vec::as_slice).unwrap_or_default();
    packages
        .iter()
        .filter_map(|package| Some((package.get("name")?.as_str()?.to_owned(), package.get("version")?.as_str()?.to_owned())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_get_the_candle_crates_at_the_versions_locked_for_the_library() {
        let workspace = tempfile::tempdir().unwrap();
        let lib = workspace.path().join("lib");
        std::fs::create_dir(&lib).unwrap();
        std::fs::write(lib.join("Cargo.toml"), "[package]\nname = \"vramlab\"\n").unwrap();
        std::fs::write(
            workspace.path().join("Cargo.lock"),
            "version = 4\n\n[[package]]\nname = \"candle-core\"\nversion = \"0.11.1\"\n\n\
             [[package]]\nname = \"candle-nn\"\nversion = \"0.11.1\"\nsource = \"registry+https://github.com/rust-lang/crates.io-index\"\n",
        )
        .unwrap();
        let library = Library { dir: Some(lib.clone()), wanted: lib.clone(), loaded: false };
        let command = library.dep_command().unwrap();
        let lines: Vec<&str> = command.lines().collect();
        assert!(lines[0].starts_with(":dep vramlab = { path = ") && lines[0].contains(&*lib.display().to_string()), "{command}");
        assert_eq!(lines[1..], [":dep candle-core = \"=0.11.1\"", ":dep candle-nn = \"=0.11.1\""]);

        // Without a lock file the library alone is added.
        std::fs::remove_file(workspace.path().join("Cargo.lock")).unwrap();
        assert_eq!(library.dep_command().unwrap().lines().count(), 1);
    }

    #[test]
    fn a_cell_that_names_a_candle_crate_loads_the_library() {
        assert!(wants_library("use candle_core::{DType, Device};"));
        assert!(wants_library("let m = candle_nn::VarMap::new();"));
        assert!(wants_library("vramlab::models::zoo()"));
        assert!(!wants_library("let candle = 1;"));
    }

    #[test]
    fn a_candle_crate_added_with_dep_loads_the_library_first() {
        assert!(wants_library(":dep candle-transformers = \"=0.11.1\""));
        assert!(wants_library("  :dep  candle-datasets = \"0.11\"\n1 + 1"));
        assert!(!wants_library(":dep itoa = \"1\""));
        assert!(!wants_library("// :dep candle-transformers"));
    }
}
