//! A persistent, locked build directory for evcxr.
//!
//! evcxr compiles every cell and every `:dep` in its build directory. By
//! default that is a temporary directory deleted on exit, so each restart
//! compiled candle again. We keep it under the user's cache directory and
//! lock it, so a restart reuses what was compiled and two running kernels
//! never share one.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

const MAX_SLOTS: usize = 16;

pub struct BuildSlot {
    dir: PathBuf,
    /// Slots passed over because running kernels hold them.
    busy: Vec<PathBuf>,
    _lock: File,
}

impl BuildSlot {
    /// Takes the first free slot under `VRAMLAB_CACHE_DIR` (default: the
    /// user's cache directory, `vramlab`).
    pub fn acquire() -> anyhow::Result<BuildSlot> {
        let cache = match std::env::var_os("VRAMLAB_CACHE_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => dirs::cache_dir().context("no cache directory (is HOME set?)")?.join("vramlab"),
        };
        Self::acquire_in(&cache)
    }

    fn acquire_in(cache: &Path) -> anyhow::Result<BuildSlot> {
        let root = cache.join("evcxr");
        if let Some(project) = root.ancestors().find(|dir| dir.join("Cargo.toml").is_file()) {
            bail!(
                "the build cache {} is inside the Cargo project at {}; evcxr cannot build cells there \
                 (set VRAMLAB_CACHE_DIR to a directory outside it)",
                root.display(),
                project.display()
            );
        }
        let unwritable = |dir: &Path| {
            format!(
                "cannot write the build cache {} (cells are compiled there); make it writable or set VRAMLAB_CACHE_DIR \
                 to a writable directory outside any Cargo project, in the kernelspec's env or before starting Jupyter",
                dir.display()
            )
        };
        let mut busy = Vec::new();
        for n in 0..MAX_SLOTS {
            let dir = root.join(format!("slot-{n}"));
            std::fs::create_dir_all(&dir).with_context(|| unwritable(&dir))?;
            // rust-analyzer, inside evcxr, cannot load a project through a path with `..` in it.
            let dir = dir.canonicalize()?;
            let lock = File::create(dir.join(".lock")).with_context(|| unwritable(&dir))?;
            match lock.try_lock() {
                Ok(()) => return Ok(BuildSlot { dir, busy, _lock: lock }),
                Err(TryLockError::WouldBlock) => busy.push(dir),
                Err(TryLockError::Error(err)) => return Err(err).with_context(|| format!("cannot lock {}", dir.display())),
            }
        }
        bail!("all {MAX_SLOTS} build directories under {} are in use by running kernels", root.display())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a previous kernel already compiled the library here.
    pub fn has_compiled(&self, crate_name: &str) -> bool {
        compiled_in(&self.dir, crate_name)
    }

    /// A slot held by a running kernel that has the library compiled, which
    /// this kernel could have used had it been free.
    pub fn busy_with(&self, crate_name: &str) -> Option<&Path> {
        self.busy.iter().find(|dir| compiled_in(dir, crate_name)).map(PathBuf::as_path)
    }

    /// Copies the build in `from`, a slot where the library is compiled, into
    /// this one, each file with its modification time, so that cargo finds it
    /// up to date: a kernel started beside another loads the library in
    /// seconds instead of building it again. Returns the bytes copied.
    pub fn copy_build_from(&self, from: &Path) -> std::io::Result<u64> {
        copy_tree(&from.join("target"), &self.dir.join("target"))
    }

    /// Puts the workspace's lock file in place before the library is added,
    /// so that cells get the dependency versions the library was tested with.
    /// (Cargo prunes a lock file to what the cells use at every build, so this
    /// must happen right before `:dep vramlab`; crates added earlier are
    /// resolved again, to the versions they had.)
    pub fn pin_dependencies(&self, workspace_lock: &Path) {
        let target = self.dir.join("Cargo.lock");
        if let Err(err) = std::fs::copy(workspace_lock, &target) {
            log::warn!("could not pin the library's dependencies with {}: {err}", workspace_lock.display());
        }
    }

    /// Gives the cells the workspace's patched dependencies (`patches/`),
    /// their paths made absolute. Without it, cells would build the published
    /// crates, and tensor ids made in two cells could collide. Cargo merges
    /// the `.cargo/config.toml` of every directory above the build; evcxr
    /// rewrites the slot's own at each build, so the patches go one level up,
    /// shared by the slots of this cache.
    pub fn patch_dependencies(&self, workspace: &Path) {
        let patches = match patch_table(workspace) {
            Ok(patches) => patches,
            Err(err) => return log::warn!("cells get no patched dependencies: {err}"),
        };
        let config = self.dir.parent().unwrap_or(&self.dir).join(".cargo");
        let mut crates_io = toml::Table::new();
        crates_io.insert("crates-io".into(), toml::Value::Table(patches));
        let mut root = toml::Table::new();
        root.insert("patch".into(), toml::Value::Table(crates_io));
        let written = std::fs::create_dir_all(&config).and_then(|()| std::fs::write(config.join("config.toml"), root.to_string()));
        if let Err(err) = written {
            log::warn!("cells get no patched dependencies: {}: {err}", config.display());
        }
    }
}

/// `[patch.crates-io]` of the workspace manifest, each path absolute.
fn patch_table(workspace: &Path) -> Result<toml::Table, String> {
    let manifest = workspace.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).map_err(|e| format!("{}: {e}", manifest.display()))?;
    let doc: toml::Table = text.parse().map_err(|e| format!("{}: {e}", manifest.display()))?;
    let patches = doc.get("patch").and_then(|p| p.get("crates-io")).and_then(toml::Value::as_table).cloned().unwrap_or_default();
    Ok(patches
        .into_iter()
        .filter_map(|(name, spec)| {
            let path = workspace.join(spec.get("path")?.as_str()?);
            let mut absolute = toml::Table::new();
            absolute.insert("path".into(), toml::Value::String(path.to_str()?.to_owned()));
            path.join("Cargo.toml").exists().then_some((name, toml::Value::Table(absolute)))
        })
        .collect())
}

/// `from` copied into `to`, files with their modification times (copies of
/// whole files: on file systems that can, the kernel shares their blocks).
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<u64> {
    std::fs::create_dir_all(to)?;
    let mut bytes = 0;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type()?;
        if kind.is_dir() {
            bytes += copy_tree(&source, &target)?;
        } else if kind.is_file() {
            bytes += std::fs::copy(&source, &target)?;
            let modified = entry.metadata()?.modified()?;
            std::fs::File::options().write(true).open(&target)?.set_modified(modified)?;
        }
    }
    Ok(bytes)
}

fn compiled_in(slot: &Path, crate_name: &str) -> bool {
    walk_has_prefix(&slot.join("target"), &format!("lib{crate_name}-"), 4)
}

fn walk_has_prefix(dir: &Path, prefix: &str, depth: usize) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else { return false };
    entries.flatten().any(|entry| {
        let path = entry.path();
        if path.is_dir() {
            depth > 0 && walk_has_prefix(&path, prefix, depth - 1)
        } else {
            entry.file_name().to_string_lossy().starts_with(prefix)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_get_the_workspace_patches_with_absolute_paths() {
        let workspace = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(workspace.path().join("patches/candle-core")).unwrap();
        std::fs::write(workspace.path().join("patches/candle-core/Cargo.toml"), "[package]\nname = \"candle-core\"\n").unwrap();
        std::fs::write(
            workspace.path().join("Cargo.toml"),
            "[workspace]\n[patch.crates-io]\ncandle-core = { path = \"patches/candle-core\" }\ngone = { path = \"patches/gone\" }\n",
        )
        .unwrap();
        let patches = patch_table(workspace.path()).unwrap();
        let expected = workspace.path().join("patches/candle-core");
        assert_eq!(patches.len(), 1, "a patch whose copy is missing is left out: {patches:?}");
        assert_eq!(patches["candle-core"]["path"].as_str(), expected.to_str());
        assert!(patch_table(&workspace.path().join("missing")).unwrap_err().contains("Cargo.toml"));
    }

    #[test]
    fn two_kernels_get_different_slots_and_a_freed_slot_is_reused() {
        let root = std::env::temp_dir().join(format!("vramlab-slot-test-{}", std::process::id()));
        let first = BuildSlot::acquire_in(&root).unwrap();
        let second = BuildSlot::acquire_in(&root).unwrap();
        assert_ne!(first.dir(), second.dir());
        let first_dir = first.dir().to_path_buf();
        drop(first);
        let third = BuildSlot::acquire_in(&root).unwrap();
        assert_eq!(third.dir(), first_dir);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_kernel_passed_over_a_busy_slot_knows_whether_it_holds_the_library() {
        let root = tempfile::tempdir().unwrap();
        let first = BuildSlot::acquire_in(root.path()).unwrap();
        let second = BuildSlot::acquire_in(root.path()).unwrap();
        assert_eq!(second.busy_with("vramlab"), None);
        let deps = first.dir().join("target/x86_64-unknown-linux-gnu/debug/deps");
        std::fs::create_dir_all(&deps).unwrap();
        std::fs::write(deps.join("libvramlab-0123.rlib"), b"").unwrap();
        assert_eq!(second.busy_with("vramlab"), Some(first.dir()));
        assert!(!second.has_compiled("vramlab"));
    }

    #[test]
    fn a_new_slot_starts_from_a_copy_of_a_busy_slot_s_build() {
        let root = tempfile::tempdir().unwrap();
        let first = BuildSlot::acquire_in(root.path()).unwrap();
        let deps = first.dir().join("target/x86_64-unknown-linux-gnu/debug/deps");
        std::fs::create_dir_all(&deps).unwrap();
        std::fs::write(deps.join("libvramlab-0123.rlib"), b"compiled").unwrap();
        let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        std::fs::File::options().write(true).open(deps.join("libvramlab-0123.rlib")).unwrap().set_modified(old).unwrap();
        let second = BuildSlot::acquire_in(root.path()).unwrap();
        let busy = second.busy_with("vramlab").unwrap().to_owned();
        assert_eq!(second.copy_build_from(&busy).unwrap(), 8);
        assert!(second.has_compiled("vramlab"));
        let copy = second.dir().join("target/x86_64-unknown-linux-gnu/debug/deps/libvramlab-0123.rlib");
        assert_eq!(std::fs::read(&copy).unwrap(), b"compiled");
        assert_eq!(std::fs::metadata(&copy).unwrap().modified().unwrap(), old, "cargo judges freshness by modification times");
    }

    #[test]
    fn an_unwritable_cache_says_what_to_do() {
        // A file where the cache should be: refused for root too, unlike permission bits.
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("cache"), b"").unwrap();
        let err = format!("{:#}", BuildSlot::acquire_in(&root.path().join("cache")).err().unwrap());
        assert!(err.contains("cannot write the build cache") && err.contains("VRAMLAB_CACHE_DIR"), "{err}");
    }

    #[test]
    fn a_cache_inside_a_cargo_project_is_refused_by_name() {
        let project = std::env::temp_dir().join(format!("vramlab-slot-project-{}", std::process::id()));
        std::fs::create_dir_all(&project).unwrap();
        std::fs::write(project.join("Cargo.toml"), "[workspace]\n").unwrap();
        let err = BuildSlot::acquire_in(&project.join("cache")).err().unwrap().to_string();
        assert!(err.contains("is inside the Cargo project at") && err.contains("VRAMLAB_CACHE_DIR"), "{err}");
        std::fs::remove_dir_all(project).unwrap();
    }
}
