//! `vramlab`: the command-line twin of the `%summary` and `%oomcheck` magics.

use std::process::ExitCode;

use clap::{Args, ColorChoice, Parser, Subcommand};
use serde::Serialize;
use vramlab::cli::{run_oomcheck, run_summary, OomcheckArgs, SummaryArgs, UsageError};
use vramlab::render::Render;

// Every heap allocation of this process is counted, so that measurements
// made here are exact (vramlab::memory::HostMemory).
vramlab::install_allocation_counters!();

#[derive(Parser)]
#[command(name = "vramlab", version, color = ColorChoice::Never, about = "GPU memory in image training: the ledger, before anything runs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Per-layer shapes, parameters, saved-for-backward bytes and MACs of a zoo model
    Summary(WithJson<SummaryArgs>),
    /// Will a training step fit? The five bills, the peak, and ranked fixes
    Oomcheck(WithJson<OomcheckArgs>),
}

#[derive(Args)]
struct WithJson<T: Args> {
    #[command(flatten)]
    args: T,
    /// Print the result as JSON (every amount in bytes) instead of text
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    vramlab::memory::install();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            // Help and version go to stdout with success; usage errors to stderr.
            let _ = err.print();
            return if err.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let printed = match &cli.command {
        Command::Summary(cmd) => run_summary(&cmd.args).and_then(|summary| {
            emit(cmd.json, &summary, || {
                summary.table(cmd.args.depth).to_string()
            })
        }),
        Command::Oomcheck(cmd) => run_oomcheck(&cmd.args)
            .and_then(|result| emit(cmd.json, &result, || result.bundle().text().to_owned())),
    };
    match printed {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::from(2)
        }
    }
}

fn emit<T: Serialize>(
    json: bool,
    value: &T,
    text: impl FnOnce() -> String,
) -> Result<(), UsageError> {
    if json {
        let out = serde_json::to_string_pretty(value)
            .map_err(|e| UsageError(format!("cannot write JSON: {e}")))?;
        println!("{out}");
    } else {
        print!("{}", text());
    }
    Ok(())
}
