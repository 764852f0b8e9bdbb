//! The `summary` and `oomcheck` commands: one parser and one report for the
//! `vramlab` binary and the kernel's `%summary` / `%oomcheck` magics.
//!
//! # The room
//!
//! The clap argument structs shared by the `vramlab` binary and the kernel's magics, each
//! flattening the levers' one group (`ledger::LeverFlags`) or the single lever it takes (its tests
//! parse back every fix's flags that `ledger/flags.rs` writes); `module.rs`: `%summary`/`%oomcheck`
//! of a cell's variable, whichever kind it is (`Target` and the `BySpec`/`ByModule`/`ByNothing`
//! traits, resolved by the variable's concrete type in the cell).

mod args;
mod check_ops;
mod data;
mod device;
mod learn;
mod module;
mod oomcheck;
mod steps;

pub use args::{CardFlag, InputShape, MemArgs, OomcheckArgs, OomcheckOfArgs, SpecFile, SummaryArgs, SummaryOfArgs};
pub use check_ops::{CheckDevice, CheckDtypes, CheckOpsArgs};
#[cfg(feature = "cuda")]
pub use data::BenchH2dArgs;
pub use data::{BenchLoaderArgs, DecoderChoice, PreprocessArgs, SynthArgs, SynthOutput};
pub use device::{DeviceArg, HoldArgs, SmokeArgs};
pub use learn::LearnArgs;
pub use module::{BatchInput, ByModule, ByNothing, BySpec, Measurable, OomcheckModuleArgs, SummaryModuleArgs, Target};
pub use oomcheck::Oomcheck;
pub use steps::{CheckDistArgs, MeasureArgs, TrainRunArgs, TrainSetup};

use clap::error::ErrorKind;
use clap::Parser;

use crate::ledger::{Levers, Mode, StepConfig};
use crate::models::{analyze, Summary};
use crate::oom::{check, host_check, sweep};
use crate::render::{Bundle, Render};

/// Bad arguments, or a configuration the model cannot take. Display is one
/// short plain-text message: what is wrong and the valid choices.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Parses `argv` (the words after the command name) into `T`. `Ok(Err(help))`
/// when help was asked for.
pub fn parse<T: Parser>(command: &str, argv: &[String]) -> Result<Result<T, String>, UsageError> {
    match T::try_parse_from(std::iter::once(command.to_owned()).chain(argv.iter().cloned())) {
        Ok(args) => Ok(Ok(args)),
        Err(err) if matches!(err.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => Ok(Err(err.render().to_string())),
        Err(err) => Err(UsageError(err.render().to_string().trim_end().to_owned())),
    }
}

/// The summary a [`SummaryArgs`] asks for.
pub fn run_summary(args: &SummaryArgs) -> Result<Summary, UsageError> {
    let spec = args.model_spec()?;
    Summary::new(&spec, args.input.batch, args.input.sample, args.dtype, args.layers.layers.unwrap_or_default(), !args.eval)
        .map_err(|e| UsageError(e.to_string()))
}

/// The fit report (and sweep) an [`OomcheckArgs`] asks for.
pub fn run_oomcheck(args: &OomcheckArgs) -> Result<Oomcheck, UsageError> {
    let spec = args.model_spec()?;
    let config = args.step_config();
    let usage = |e: crate::ledger::LedgerError| UsageError(e.to_string());
    let report = check(&spec, &config, &args.card.gpu).map_err(usage)?;
    let sweep = args.sweep.as_ref().map(|plan| sweep(&spec, &config, &args.card.gpu, plan)).transpose().map_err(usage)?;
    let masks = analyze(&spec, config.input, config.levers.precision, config.levers.layers).is_ok_and(|cost| cost.labels_per_sample() > 1);
    let host = args.loader_shape(masks).map(|shape| host_check(shape, args.host_ram));
    Ok(Oomcheck { report, sweep, host, brief: args.brief, fixes_only: args.fixes })
}

/// `%summary MODEL [--input 32x3x224x224] [--dtype f16] [--depth N] [--eval]` as a bundle.
pub fn summary(argv: &[String]) -> Result<Bundle, UsageError> {
    match parse::<SummaryArgs>("summary", argv)? {
        Ok(args) => Ok(run_summary(&args)?.table(args.depth).bundle()),
        Err(help) => Ok(Bundle::plain(help)),
    }
}

/// `%summary VARIABLE [...]`: the layer table of `model`, a network or
/// trainer built in a cell. The kernel turns the magic into a call of this.
pub fn summary_of(model: &dyn crate::models::Summarize, argv: &[&str]) -> Result<crate::render::Table, UsageError> {
    let argv: Vec<String> = argv.iter().map(|&a| a.to_owned()).collect();
    let args = parse::<SummaryOfArgs>("%summary VARIABLE", &argv)?.map_err(UsageError)?;
    let precision = args.dtype.unwrap_or(model.summary_precision());
    let summary = Summary::new(model.summary_spec(), args.batch, model.summary_input(), precision, model.summary_layers(), !args.eval)
        .map_err(|e| UsageError(e.to_string()))?;
    Ok(summary.table(args.depth))
}

/// What `%oomcheck VARIABLE` needs of a model built in a cell beyond its
/// spec and input: the levers of its training step.
pub trait CheckOf: crate::models::Summarize {
    fn levers(&self) -> Levers;
}

/// A bare network is checked as a zoo model is, with Adam and neither
/// accumulation nor checkpointing unless a flag says otherwise, on the
/// layers it was built with.
impl CheckOf for crate::models::Network {
    fn levers(&self) -> Levers {
        Levers { layers: self.layers(), ..Levers::default() }
    }
}

impl CheckOf for crate::train::Trainer {
    fn levers(&self) -> Levers {
        self.levers()
    }
}

/// `%oomcheck VARIABLE --batch B [...]`: the same report as a zoo model's
/// for `model`, a network or trainer built in a cell. The kernel turns the
/// magic into a call of this.
pub fn oomcheck_of(model: &dyn CheckOf, argv: &[&str]) -> Result<Bundle, UsageError> {
    let argv: Vec<String> = argv.iter().map(|&a| a.to_owned()).collect();
    let args = match parse::<OomcheckOfArgs>("%oomcheck VARIABLE", &argv)? {
        Ok(args) => args,
        Err(help) => return Ok(Bundle::plain(help)),
    };
    let input = match (args.res, model.summary_input()) {
        (None, input) => input,
        (Some(res), crate::models::Shape::Map { c, .. }) => crate::models::Shape::map(c, res, res),
        (Some(_), flat) => return Err(UsageError(format!("--res needs an image input; this model takes {flat}"))),
    };
    let mode = if args.eval { Mode::Inference } else { Mode::Training };
    let config = StepConfig { batch: args.batch, input, levers: args.levers.over(&model.levers()), mode };
    let spec = model.summary_spec();
    let usage = |e: crate::ledger::LedgerError| UsageError(e.to_string());
    let report = check(spec, &config, &args.card.gpu).map_err(usage)?;
    let sweep = args.sweep.as_ref().map(|plan| sweep(spec, &config, &args.card.gpu, plan)).transpose().map_err(usage)?;
    Ok(Oomcheck { report, sweep, host: None, brief: args.brief, fixes_only: args.fixes }.bundle())
}

/// `%oomcheck MODEL --batch B --res R [...]` as a bundle: verdict, ledger
/// table, chart, timeline, fixes, and the sweep when asked.
pub fn oomcheck(argv: &[String]) -> Result<Bundle, UsageError> {
    match parse::<OomcheckArgs>("oomcheck", argv)? {
        Ok(args) if args.host => {
            run_oomcheck(&args)?.host.map(|host| host.bundle()).ok_or_else(|| UsageError("--host needs the loader's --workers".to_owned()))
        }
        Ok(args) => Ok(run_oomcheck(&args)?.bundle()),
        Err(help) => Ok(Bundle::plain(help)),
    }
}

#[cfg(test)]
mod tests;
