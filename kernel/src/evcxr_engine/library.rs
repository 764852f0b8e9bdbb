//! Where the `vramlab` crate is, for cells that use it without `:dep`.

use std::path::PathBuf;

use crate::install::LIB_ENV;

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

    pub(super) fn dep_command(&self) -> Option<String> {
        let dir = self.dir.as_ref()?;
        // A kernel built for CUDA gives its cells CUDA tensors too.
        let features = if cfg!(feature = "cuda") { ", features = [\"cuda\"]" } else { "" };
        Some(format!(":dep vramlab = {{ path = {:?}{features} }}", dir.display().to_string()))
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
