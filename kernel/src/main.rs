//! `vramlab-kernel`: a Jupyter kernel for Rust cells, with memory magics.

mod cell;
mod connection;
mod display;
mod engine;
mod evcxr_engine;
mod final_value;
mod history;
mod install;
mod iopub;
mod is_complete;
mod magic;
mod outcome;
mod parent;
mod server;
#[cfg(test)]
mod server_tests;
mod slot;
mod syntax;
mod wire;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

// Every `malloc` of the process, cell libraries' included, is counted for
// `%mem`. The kernel's own allocations (rust-analyzer's, above all) use glibc's
// malloc too: on mimalloc the kernel grew by 18-80 MiB over 1,000 cells, while
// glibc kept it within 1 MiB (BENCHMARKS.md, "A long session").
vramlab::install_allocation_counters!();

#[derive(Parser)]
#[command(name = "vramlab-kernel", version, about = "A Jupyter kernel for Rust cells (evcxr) with GPU-memory magics")]
struct Cli {
    /// The connection file Jupyter writes for the kernel.
    #[arg(long, value_name = "FILE")]
    connection_file: Option<PathBuf>,
    /// The largest message a client may send (all its frames and buffers
    /// together), such as 256MiB; a client that sends more is disconnected
    #[arg(long, env = "VRAMLAB_MAX_MESSAGE_SIZE", value_name = "SIZE", default_value = "256MiB", value_parser = vramlab::units::parse_bytes)]
    max_message_size: u64,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Install the kernelspec `vramlab` ("Rust (vramlab)") where Jupyter finds it.
    Install(install::InstallArgs),
    /// Build the vramlab library for notebook cells now (the first cell that
    /// uses it otherwise does, for many minutes), in the build cache kernels use.
    BuildCells,
}

fn main() -> ExitCode {
    // In the cell process this attaches the counters to the region the
    // kernel reads; it must precede the threads evcxr starts.
    vramlab::memory::install();
    // The cell process is this same binary started again by evcxr; in that
    // role it never returns from here.
    evcxr::runtime_hook();
    // From here on this process is the kernel, not the cell process that trains.
    vramlab::memory::map_large_blocks();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).format_target(false).init();
    let cli = Cli::parse();
    let result = match (cli.command, cli.connection_file) {
        (Some(Command::Install(args)), _) => install::install(&args),
        (Some(Command::BuildCells), _) => {
            ensure_cargo_on_path();
            evcxr_engine::build_cells().map(|()| std::process::exit(0))
        }
        (None, Some(file)) => run_kernel(&file, cli.max_message_size),
        (None, None) => Err(anyhow::anyhow!("nothing to do: pass --connection-file FILE (as Jupyter does) or `install`; see --help")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("vramlab-kernel: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_kernel(connection_file: &std::path::Path, max_message_size: u64) -> anyhow::Result<()> {
    let info = connection::read(connection_file)?;
    parent::exit_when_orphaned();
    // Set before any thread starts: the cell process inherits it and
    // `vramlab::render` then sends live displays to us instead of printing text.
    std::env::set_var("VRAMLAB_KERNEL", "1");
    ensure_cargo_on_path();
    let engine = evcxr_engine::EvcxrEngine::start()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let max_message_size = usize::try_from(max_message_size).unwrap_or(usize::MAX);
    runtime.block_on(server::serve(info, std::sync::Arc::new(engine), max_message_size))?;
    // The engine thread may be inside a long compile; nothing of it needs to outlive us.
    std::process::exit(0)
}

/// Front ends started from a desktop menu often lack `~/.cargo/bin` on PATH;
/// evcxr needs cargo and rustc to compile cells.
fn ensure_cargo_on_path() {
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|dir| dir.join("cargo").is_file()) {
        return;
    }
    let cargo_home = std::env::var_os("CARGO_HOME").map(PathBuf::from).or_else(|| dirs::home_dir().map(|h| h.join(".cargo")));
    if let Some(bin) = cargo_home.map(|home| home.join("bin")).filter(|bin| bin.join("cargo").is_file()) {
        let paths = std::iter::once(bin).chain(std::env::split_paths(&path));
        if let Ok(joined) = std::env::join_paths(paths) {
            std::env::set_var("PATH", joined);
        }
    }
}
