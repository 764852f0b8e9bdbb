//! The command that starts the cell process.

use std::path::PathBuf;

/// The cell process: this binary again, able to load the standard library
/// that cells link to. Cargo writes each cell library's RUNPATH relative to
/// the `deps` directory, but evcxr loads it from the directory above, so
/// when the build directory and the toolchain share a parent (as
/// `~/.cache` and `~/.rustup` do) that RUNPATH misses by one level.
pub(super) fn cell_process_command() -> Result<std::process::Command, evcxr::Error> {
    let mut command = std::process::Command::new(std::env::current_exe()?);
    let sysroot = std::process::Command::new("rustc").args(["--print", "sysroot"]).output()?;
    if !sysroot.status.success() {
        return Err(evcxr::Error::Message("`rustc --print sysroot` failed: is a Rust toolchain installed?".into()));
    }
    let std_dir =
        PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim()).join("lib/rustlib").join(env!("VRAMLAB_TARGET")).join("lib");
    let mut paths = vec![std_dir];
    paths.extend(std::env::var_os("LD_LIBRARY_PATH").iter().flat_map(std::env::split_paths));
    if let Ok(joined) = std::env::join_paths(paths) {
        command.env("LD_LIBRARY_PATH", joined);
    }
    // evcxr sets RUST_BACKTRACE=1 in the cell process for panics' backtraces, which also makes
    // every candle and anyhow error capture one and print it under its message: an error a cell
    // returns (a shape mismatch in a training step) would read as a page of `<unknown>` frames.
    // RUST_LIB_BACKTRACE governs errors alone; a learner who sets it keeps their choice.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        command.env("RUST_LIB_BACKTRACE", "0");
    }
    Ok(command)
}
