//! `%summary VAR --input SHAPE` and `%oomcheck VAR --input SHAPE --gpu CARD`
//! for any model a cell holds: a `Network` or `Trainer` (through its spec
//! without `--input`, measured with it), a candle `Module` or a closure from
//! a tensor to a tensor (measured), and anything else refused in one line.
//!
//! The kernel evaluates `(&&Target(&var, "var")).vramlab_summary(&[...])` in
//! the cell, where the variable's type is concrete: method resolution takes
//! the first of [`BySpec`] (on `&&Target`), [`ByModule`] (on `&Target`) and
//! [`ByNothing`] (on `Target`) whose bounds the type meets.

use clap::{ColorChoice, Parser};

use super::{oomcheck_of, parse, summary_of, CardFlag, CheckOf, UsageError};
use crate::ledger::{Levers, OptimizerFlag};
use crate::measured::{measure, measure_at, Forward, ModuleReport, MEASURED_BATCHES};
use crate::models::{Network, Pass};
use crate::render::{Bundle, Render};

/// `%summary VARIABLE --input SHAPE [--opt adam]`: a model measured in real steps.
#[derive(Debug, Clone, Parser)]
#[command(name = "summary", color = ColorChoice::Never, about = "What a model built in a cell keeps for backward, and its step's bills, measured")]
pub struct SummaryModuleArgs {
    /// The batch the model's forward takes: BATCHxDIMS such as 32x3x224x224, or 64x784 for an MLP
    #[arg(long, value_parser = parse_batch_input)]
    pub input: BatchInput,
    // The optimizer of the measured steps.
    #[command(flatten)]
    pub optimizer: OptimizerFlag,
}

/// `%oomcheck VARIABLE --input SHAPE [--gpu CARD] [--opt adam]`: will a step of
/// a model built in a cell fit the card? Measured, then extrapolated.
#[derive(Debug, Clone, Parser)]
#[command(name = "oomcheck", color = ColorChoice::Never, about = "Will a training step of a model built in a cell fit? Measured in real steps")]
pub struct OomcheckModuleArgs {
    /// The batch the model's forward takes: BATCHxDIMS such as 32x3x224x224, or 64x784 for an MLP
    #[arg(long, value_parser = parse_batch_input)]
    pub input: BatchInput,
    #[command(flatten)]
    pub card: CardFlag,
    // The optimizer of the measured steps.
    #[command(flatten)]
    pub optimizer: OptimizerFlag,
}

/// A batch of any shape: its size and one sample's dimensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchInput {
    pub batch: usize,
    pub sample: Vec<usize>,
}

/// Elements a batch may have: 2^48 f32 values are a petabyte, past any card.
const MAX_ELEMENTS: u64 = 1 << 48;

fn parse_batch_input(text: &str) -> Result<BatchInput, String> {
    let usage = "expected BATCHxDIMS such as 32x3x224x224, or 64x784 for an MLP";
    let dims: Vec<usize> =
        text.split(['x', 'X', ',']).map(|d| d.trim().parse::<usize>().ok().filter(|&n| n > 0)).collect::<Option<_>>().ok_or(usage)?;
    let [batch, sample @ ..] = dims.as_slice() else { return Err(usage.to_owned()) };
    if sample.is_empty() {
        return Err(format!("{usage}: a batch and at least one more dimension"));
    }
    let elements = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64)).filter(|&n| n <= MAX_ELEMENTS);
    if elements.is_none() {
        return Err(format!("{text} is more than 2^48 elements, past any card"));
    }
    Ok(BatchInput { batch: *batch, sample: sample.to_vec() })
}

/// A cell's variable and its name, as the kernel hands it to the magics.
pub struct Target<'a, T: ?Sized>(pub &'a T, pub &'a str);

/// A model with a spec: a `Network` or a `Trainer`.
pub trait BySpec {
    fn vramlab_summary(&self, argv: &[&str]) -> Result<Bundle, UsageError>;
    fn vramlab_oomcheck(&self, argv: &[&str]) -> Result<Bundle, UsageError>;
}

/// A candle `Module`, or a closure from a tensor to a tensor.
pub trait ByModule {
    fn vramlab_summary(&self, argv: &[&str]) -> Result<Bundle, UsageError>;
    fn vramlab_oomcheck(&self, argv: &[&str]) -> Result<Bundle, UsageError>;
}

/// Anything else: not a model.
pub trait ByNothing {
    fn vramlab_summary(&self, argv: &[&str]) -> Result<Bundle, UsageError>;
    fn vramlab_oomcheck(&self, argv: &[&str]) -> Result<Bundle, UsageError>;
}

/// A network or trainer's forward as the measured steps run it, with the
/// optimizer it trains with.
pub trait Measurable {
    fn network(&self) -> &Network;
}

impl Measurable for Network {
    fn network(&self) -> &Network {
        self
    }
}

impl Measurable for crate::train::Trainer {
    fn network(&self) -> &Network {
        self.net()
    }
}

impl<T: CheckOf + Measurable> BySpec for &&Target<'_, T> {
    fn vramlab_summary(&self, argv: &[&str]) -> Result<Bundle, UsageError> {
        if !asks_for_input(argv) {
            return summary_of(self.0, argv).map(|table| table.bundle());
        }
        let net = self.0.network();
        // Batch-norm's running statistics stay as they were: the steps measure, they do not train.
        let pass = Pass { update_stats: false, ..Pass::train(candle_core::DType::F32) };
        measured(self.1, &|x| net.forward(x, pass), argv, Magic::Summary)
    }

    fn vramlab_oomcheck(&self, argv: &[&str]) -> Result<Bundle, UsageError> {
        if !asks_for_input(argv) {
            return oomcheck_of(self.0, argv);
        }
        let net = self.0.network();
        let pass = Pass { update_stats: false, ..Pass::train(candle_core::DType::F32) };
        measured(self.1, &|x| net.forward(x, pass), argv, Magic::Oomcheck)
    }
}

impl<T: candle_core::Module> ByModule for &Target<'_, T> {
    fn vramlab_summary(&self, argv: &[&str]) -> Result<Bundle, UsageError> {
        measured(self.1, &|x| self.0.forward(x), argv, Magic::Summary)
    }

    fn vramlab_oomcheck(&self, argv: &[&str]) -> Result<Bundle, UsageError> {
        measured(self.1, &|x| self.0.forward(x), argv, Magic::Oomcheck)
    }
}

impl<T: ?Sized> ByNothing for Target<'_, T> {
    fn vramlab_summary(&self, _: &[&str]) -> Result<Bundle, UsageError> {
        Err(not_a_model::<T>(self.1, "%summary"))
    }

    fn vramlab_oomcheck(&self, _: &[&str]) -> Result<Bundle, UsageError> {
        Err(not_a_model::<T>(self.1, "%oomcheck"))
    }
}

fn not_a_model<T: ?Sized>(name: &str, magic: &str) -> UsageError {
    UsageError(format!(
        "`{name}` is a {}, not a model: {magic} VARIABLE takes a vramlab Network or Trainer, or a candle Module \
         (or a closure from &Tensor to Result<Tensor>) with --input SHAPE",
        std::any::type_name::<T>()
    ))
}

fn asks_for_input(argv: &[&str]) -> bool {
    argv.iter().any(|a| *a == "--input" || a.starts_with("--input="))
}

#[derive(Clone, Copy)]
enum Magic {
    Summary,
    Oomcheck,
}

/// Measures `forward` as the magic's arguments ask and reports it.
fn measured(name: &str, forward: Forward<'_>, argv: &[&str], magic: Magic) -> Result<Bundle, UsageError> {
    if !asks_for_input(argv) {
        return Err(UsageError(format!(
            "`{name}` is measured at an input: give --input SHAPE, such as 32x3x224x224, or 64x784 for an MLP"
        )));
    }
    let argv: Vec<String> = argv.iter().map(|&a| a.to_owned()).collect();
    let usage = |e: crate::measured::MeasureError| UsageError(format!("{name}: {e}"));
    let (input, opt, card) = match magic {
        Magic::Summary => match parse::<SummaryModuleArgs>("%summary VARIABLE", &argv)? {
            Ok(args) => (args.input, args.optimizer, None),
            Err(help) => return Ok(Bundle::plain(help)),
        },
        Magic::Oomcheck => match parse::<OomcheckModuleArgs>("%oomcheck VARIABLE", &argv)? {
            Ok(args) => (args.input, args.optimizer, Some(args.card.gpu)),
            Err(help) => return Ok(Bundle::plain(help)),
        },
    };
    let opt = opt.opt.unwrap_or(Levers::default().optimizer);
    // A model that runs only one sample at a time (candle-transformers' DINOv2 concatenates its
    // one class token with the batch's patches) is measured at batch 1 when that is what is asked.
    let measured = if input.batch < MEASURED_BATCHES[0] {
        measure_at(forward, &input.sample, opt, &[input.batch])
    } else {
        measure(forward, &input.sample, opt)
    }
    .map_err(usage)?;
    Ok(ModuleReport::new(name, measured, input.batch, card).bundle())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    #[test]
    fn shapes_of_any_rank_parse_and_absurd_ones_are_refused() {
        assert_eq!(parse_batch_input("32x3x224x224"), Ok(BatchInput { batch: 32, sample: vec![3, 224, 224] }));
        assert_eq!(parse_batch_input("64x784"), Ok(BatchInput { batch: 64, sample: vec![784] }));
        assert!(parse_batch_input("64").unwrap_err().contains("at least one more dimension"));
        assert!(parse_batch_input("0x784").unwrap_err().contains("BATCHxDIMS"));
        assert!(parse_batch_input("99999999x99999999x99999999").unwrap_err().contains("past any card"));
    }

    // The calls are written as the kernel's cells write them: the two borrows are what picks the trait.
    #[allow(clippy::needless_borrow)]
    #[test]
    fn a_variable_finds_its_kind_and_anything_else_is_not_a_model() {
        let number = 7i32;
        let err = (&&Target(&number, "x")).vramlab_oomcheck(&["--input", "8x784"]).unwrap_err().0;
        assert_eq!(
            err,
            "`x` is a i32, not a model: %oomcheck VARIABLE takes a vramlab Network or Trainer, or a candle Module \
             (or a closure from &Tensor to Result<Tensor>) with --input SHAPE"
        );
        let closure = |x: &Tensor| x.relu();
        let err = (&&Target(&closure, "f")).vramlab_summary(&[]).unwrap_err().0;
        assert!(err.contains("--input"), "{err}");
        let net =
            Network::new(&crate::models::ModelName::SmallCnn.spec(10), crate::models::Shape::map(3, 32, 32), &Device::Cpu, 0).unwrap();
        let table = (&&Target(&net, "net")).vramlab_summary(&["--depth", "1"]).unwrap();
        assert!(table.get("text/html").is_some(), "the spec's layer table, as before: {}", table.text());
        // The unit tests' process counts no allocation: measuring says so in one line.
        let err = (&&Target(&net, "net")).vramlab_summary(&["--input", "2x3x32x32"]).unwrap_err().0;
        assert!(err.starts_with("net: measuring a step needs the allocation counters"), "{err}");
    }
}
