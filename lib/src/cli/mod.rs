//! The `summary` and `oomcheck` commands: one parser and one report for the
//! `vramlab` binary and the kernel's `%summary` / `%oomcheck` magics.

mod args;
mod check;
mod data;
mod device;
mod fit;
mod module;
mod report;
mod train;

pub use args::{InputShape, MemArgs, OomcheckArgs, OomcheckOfArgs, SpecFile, SummaryArgs, SummaryOfArgs};
pub use check::{CheckDevice, CheckDtypes, CheckOpsArgs};
#[cfg(feature = "cuda")]
pub use data::BenchH2dArgs;
pub use data::{BenchLoaderArgs, DecoderChoice, PreprocessArgs, SynthArgs, SynthOutput};
pub use device::{DeviceArg, HoldArgs, SmokeArgs};
pub use fit::FitArgs;
pub use module::{BatchInput, ByModule, ByNothing, BySpec, Measurable, OomcheckModuleArgs, SummaryModuleArgs, Target};
pub use report::Oomcheck;
pub use train::{MeasureArgs, TrainRunArgs, TrainSetup};

use clap::error::ErrorKind;
use clap::Parser;

use crate::ledger::{Checkpointing, Mode, OptimizerKind, StepConfig};
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
    Summary::new(&spec, args.input.batch, args.input.sample, args.dtype, args.layers, !args.eval).map_err(|e| UsageError(e.to_string()))
}

/// The fit report (and sweep) an [`OomcheckArgs`] asks for.
pub fn run_oomcheck(args: &OomcheckArgs) -> Result<Oomcheck, UsageError> {
    let spec = args.model_spec()?;
    let config = args.step_config();
    let usage = |e: crate::ledger::LedgerError| UsageError(e.to_string());
    let report = check(&spec, &config, &args.gpu).map_err(usage)?;
    let sweep = args.sweep.as_ref().map(|plan| sweep(&spec, &config, &args.gpu, plan)).transpose().map_err(usage)?;
    let masks = analyze(&spec, config.input, config.precision, config.layers).is_ok_and(|cost| cost.labels_per_sample() > 1);
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
    /// The optimizer, accumulation and checkpointing it trains with.
    fn levers(&self) -> (OptimizerKind, usize, Checkpointing);
}

/// A bare network is checked as a zoo model is, with Adam and neither
/// accumulation nor checkpointing unless a flag says otherwise.
impl CheckOf for crate::models::Network {
    fn levers(&self) -> (OptimizerKind, usize, Checkpointing) {
        (OptimizerKind::Adam, 1, Checkpointing::None)
    }
}

impl CheckOf for crate::train::Trainer {
    fn levers(&self) -> (OptimizerKind, usize, Checkpointing) {
        let c = self.config();
        (c.optimizer.kind(), c.accumulation, c.checkpointing.clone())
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
    let (optimizer, accumulation, checkpointing) = model.levers();
    let config = StepConfig {
        batch: args.batch,
        input,
        precision: args.amp.unwrap_or(model.summary_precision()),
        optimizer: args.opt.unwrap_or(optimizer),
        accumulation: args.accum.unwrap_or(accumulation),
        checkpointing: args.ckpt.unwrap_or(checkpointing),
        mode: if args.eval { Mode::Inference } else { Mode::Training },
        layers: args.layers.unwrap_or(model.summary_layers()),
    };
    let spec = model.summary_spec();
    let usage = |e: crate::ledger::LedgerError| UsageError(e.to_string());
    let report = check(spec, &config, &args.gpu).map_err(usage)?;
    let sweep = args.sweep.as_ref().map(|plan| sweep(spec, &config, &args.gpu, plan)).transpose().map_err(usage)?;
    Ok(Oomcheck { report, sweep, host: None, brief: false, fixes_only: false }.bundle())
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
