//! `vramlab-kernel install`: writes the kernelspec Jupyter uses to start us.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::json;

pub const KERNEL_NAME: &str = "vramlab";
pub const DISPLAY_NAME: &str = "Rust (vramlab)";
/// The variable, set by the kernelspec, that says where the `vramlab` crate lives.
pub const LIB_ENV: &str = "VRAMLAB_LIB";

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("place").args(["user", "sys_prefix", "prefix"])))]
pub struct InstallArgs {
    /// Install for the current user (the default).
    #[arg(long)]
    user: bool,
    /// Install into the active Python environment (virtualenv or conda).
    #[arg(long)]
    sys_prefix: bool,
    /// Install under PREFIX/share/jupyter/kernels.
    #[arg(long, value_name = "PREFIX")]
    prefix: Option<PathBuf>,
    /// Where the `vramlab` crate is; cells use it without a `:dep` line.
    /// Defaults to the copy this kernel was built from.
    #[arg(long, value_name = "DIR")]
    lib: Option<PathBuf>,
}

pub fn install(args: &InstallArgs) -> anyhow::Result<()> {
    let data_dir = if let Some(prefix) = &args.prefix {
        prefix.join("share/jupyter")
    } else if args.sys_prefix {
        sys_prefix()?.join("share/jupyter")
    } else {
        user_data_dir()?
    };
    let lib = library_dir(args.lib.as_deref())?;
    let exe = std::env::current_exe().and_then(|p| p.canonicalize()).context("cannot locate the vramlab-kernel executable")?;
    let dir = data_dir.join("kernels").join(KERNEL_NAME);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let spec = json!({
        "argv": [exe, "--connection-file", "{connection_file}"],
        "display_name": DISPLAY_NAME,
        "language": "rust",
        "interrupt_mode": "message",
        "env": { LIB_ENV: lib },
        "metadata": { "debugger": false },
    });
    let files: [(&str, &[u8]); 3] = [
        ("logo-32x32.png", include_bytes!("../assets/logo-32x32.png")),
        ("logo-64x64.png", include_bytes!("../assets/logo-64x64.png")),
        ("logo-svg.svg", include_bytes!("../assets/logo-svg.svg")),
    ];
    for (name, bytes) in files {
        write(&dir.join(name), bytes)?;
    }
    write(&dir.join("kernel.json"), serde_json::to_string_pretty(&spec)?.as_bytes())?;
    println!("Installed kernelspec {KERNEL_NAME} (\"{DISPLAY_NAME}\") in {}", dir.display());
    println!("Cells can `use vramlab::...` from {}", lib.display());
    Ok(())
}

fn write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// Jupyter's per-user data directory, as jupyter_core computes it on Linux.
fn user_data_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("JUPYTER_DATA_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(xdg) = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(xdg).join("jupyter"));
    }
    dirs::data_dir().map(|d| d.join("jupyter")).context("cannot find the user's data directory (is HOME set?)")
}

fn sys_prefix() -> anyhow::Result<PathBuf> {
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            return Ok(PathBuf::from(prefix));
        }
    }
    let output = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.prefix)"])
        .output()
        .context("--sys-prefix: no VIRTUAL_ENV or CONDA_PREFIX, and python3 could not be run")?;
    if !output.status.success() {
        bail!("--sys-prefix: python3 could not report sys.prefix");
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()))
}

fn library_dir(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let dir = match given {
        Some(dir) => dir.to_path_buf(),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../lib"),
    };
    let manifest = dir.join("Cargo.toml");
    let text =
        std::fs::read_to_string(&manifest).with_context(|| format!("the vramlab library is not at {} (pass --lib DIR)", dir.display()))?;
    if !text.lines().any(|l| l.trim() == "name = \"vramlab\"") {
        bail!("{} is not the vramlab crate (pass --lib DIR)", manifest.display());
    }
    Ok(dir.canonicalize()?)
}
