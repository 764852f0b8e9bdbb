//! Where the `vramlab` crate is, for cells that use it without `:dep`.

use std::path::PathBuf;

use crate::install::LIB_ENV;

pub(super) struct Library {
    pub(super) dir: Option<PathBuf>,
    pub(super) loaded: bool,
}

impl Library {
    pub(super) fn locate() -> Library {
        let dir = std::env::var_os(LIB_ENV)
            .map(PathBuf::from)
            .or_else(|| Some(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../lib"))))
            .filter(|d| d.join("Cargo.toml").exists())
            .and_then(|d| d.canonicalize().ok());
        if dir.is_none() {
            log::warn!("the vramlab library was not found (set {LIB_ENV}); cells must add it with :dep");
        }
        Library { dir, loaded: false }
    }

    pub(super) fn dep_command(&self) -> Option<String> {
        let dir = self.dir.as_ref()?;
        // A kernel built for CUDA gives its cells CUDA tensors too.
        let features = if cfg!(feature = "cuda") { ", features = [\"cuda\"]" } else { "" };
        Some(format!(":dep vramlab = {{ path = {:?}{features} }}", dir.display().to_string()))
    }
}
