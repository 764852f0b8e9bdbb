//! The training levers, declared once: what a learner pulls to make a step
//! fit (precision, optimizer, accumulation, checkpointing, layers), their
//! values, the one clap group every command and magic flattens to read them,
//! and the flags that write them back.
//!
//! A new lever is a field of [`Levers`], a flag of [`LeverFlags`] and a word
//! in [`Levers::flags`]; `StepConfig`, the commands and the magics take it
//! from there.

use std::fmt;
use std::str::FromStr;

use clap::builder::TypedValueParser as _;
use clap::ValueEnum as _;
use serde::{Deserialize, Serialize};

use super::{LedgerError, Mode};
use crate::models::{Layers, Precision, StageCost};
use crate::units::parse_positive;

/// The levers of one training step. The default is the lesson's: f32, Adam,
/// no accumulation, no checkpointing, lean layers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Levers {
    pub precision: Precision,
    pub optimizer: OptimizerKind,
    /// Micro-batches whose gradients are summed before one optimizer step.
    pub accumulation: usize,
    pub checkpointing: Checkpointing,
    /// The layers the network is built from.
    pub layers: Layers,
}

impl Default for Levers {
    fn default() -> Self {
        Levers {
            precision: Precision::F32,
            optimizer: OptimizerKind::Adam,
            accumulation: 1,
            checkpointing: Checkpointing::None,
            layers: Layers::Lean,
        }
    }
}

impl Levers {
    /// The flags that pull these levers where they differ from no flag at
    /// all, each with a leading space; the optimizer only in training.
    pub fn flags(&self, mode: Mode) -> String {
        let mut flags = String::new();
        if self.precision.is_mixed() {
            flags.push_str(&format!(" --amp {}", self.precision.flag()));
        }
        if mode == Mode::Training {
            flags.push_str(&format!(" --opt {}", self.optimizer.flag()));
        }
        if self.accumulation > 1 {
            flags.push_str(&format!(" --accum {}", self.accumulation));
        }
        if self.checkpointing != Checkpointing::None {
            flags.push_str(&format!(" --ckpt {}", self.checkpointing));
        }
        if self.layers != Layers::default() {
            flags.push_str(&format!(" --layers {}", self.layers.flag()));
        }
        flags
    }
}

/// The levers' flags, one clap group that every command and magic flattens.
/// A flag left out keeps the lever of the base it is laid [`over`](Self::over):
/// [`Levers::default`] for a zoo model, the trainer's own for one built in a
/// cell, SGD with momentum for the commands that time real steps.
#[derive(Debug, Clone, Default, PartialEq, clap::Args)]
pub struct LeverFlags {
    /// Mixed precision: f16 (with loss scaling) or bf16; f32 without the flag
    #[arg(long, value_parser = amp_parser())]
    pub amp: Option<Precision>,
    #[command(flatten)]
    pub optimizer: OptimizerFlag,
    /// Gradient accumulation: micro-batches per optimizer step (default 1)
    #[arg(long, value_parser = parse_positive)]
    pub accum: Option<usize>,
    /// Activation checkpointing: none, stages, or stage names such as layer3,layer4 (default none)
    #[arg(long, value_parser = Checkpointing::from_str)]
    pub ckpt: Option<Checkpointing>,
    #[command(flatten)]
    pub layers: LayersFlag,
}

/// `--opt`, alone: what the magics that measure a candle module take of the
/// levers.
#[derive(Debug, Clone, Copy, Default, PartialEq, clap::Args)]
pub struct OptimizerFlag {
    /// Optimizer (default adam; sgd-momentum for bench train and measure; a trainer's own for a
    /// model built in a cell)
    #[arg(long = "opt", value_enum)]
    pub opt: Option<OptimizerKind>,
}

/// `--layers`, alone: what `summary` takes of the levers.
#[derive(Debug, Clone, Copy, Default, PartialEq, clap::Args)]
pub struct LayersFlag {
    /// Layers: lean (batch-norm fused with what reads it) or plain (what an ordinary autograd keeps); default lean,
    /// for a model built in a cell the layers it was built with
    #[arg(long = "layers", value_enum)]
    pub layers: Option<Layers>,
}

impl LeverFlags {
    /// `base` with each lever a flag names replaced by the flag's.
    pub fn over(&self, base: &Levers) -> Levers {
        Levers {
            precision: self.amp.unwrap_or(base.precision),
            optimizer: self.optimizer.opt.unwrap_or(base.optimizer),
            accumulation: self.accum.unwrap_or(base.accumulation),
            checkpointing: self.ckpt.clone().unwrap_or_else(|| base.checkpointing.clone()),
            layers: self.layers.layers.unwrap_or(base.layers),
        }
    }
}

/// `--amp f16|bf16`: the mixed precisions (f32 is what leaving the flag out means).
fn amp_parser() -> impl clap::builder::TypedValueParser<Value = Precision> {
    let mixed = Precision::value_variants().iter().filter(|p| p.is_mixed()).map(|p| p.flag());
    clap::builder::PossibleValuesParser::new(mixed).try_map(|flag| <Precision as clap::ValueEnum>::from_str(&flag, true))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    Sgd,
    SgdMomentum,
    Adam,
    #[value(name = "adamw")]
    AdamW,
    /// Adam with block-wise 8-bit moments (bitsandbytes' scheme).
    Adam8bit,
}

impl OptimizerKind {
    pub fn flag(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::SgdMomentum => "sgd-momentum",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Adam8bit => "adam8bit",
        }
    }

    pub fn is_adam(self) -> bool {
        matches!(self, OptimizerKind::Adam | OptimizerKind::AdamW)
    }

    /// Bytes per element of the tensor being updated that the step holds in
    /// temporaries. On a GPU, with candle tensor ops, f32 temporaries: for
    /// AdamW, `m*b1 + g*(1-b1)`, `v*b2 + g^2*(1-b2)`, the bias corrections and
    /// `m_hat / (sqrt(v_hat) + eps)` overlap up to about six; SGD needs `g*lr`
    /// and `w - g*lr`. On the host the step is one fused in-place pass per
    /// state tensor and needs none, except 8-bit Adam, which works on host
    /// copies of the gradient and parameter (f32) and of both moments' codes (u8).
    pub fn step_temporary_bytes(self, on_host: bool) -> u64 {
        match (self, on_host) {
            (OptimizerKind::Adam8bit, true) => 2 * 4 + 2,
            (_, true) => 0,
            (OptimizerKind::Sgd, false) => 2 * 4,
            (OptimizerKind::SgdMomentum, false) => 3 * 4,
            (OptimizerKind::Adam | OptimizerKind::AdamW, false) => 6 * 4,
            // Dequantised f32 moments next to Adam's temporaries.
            (OptimizerKind::Adam8bit, false) => 8 * 4,
        }
    }
}

impl fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OptimizerKind::Sgd => "SGD",
            OptimizerKind::SgdMomentum => "SGD with momentum",
            OptimizerKind::Adam => "Adam",
            OptimizerKind::AdamW => "AdamW",
            OptimizerKind::Adam8bit => "8-bit Adam",
        })
    }
}

/// Which stages recompute their activations in backward instead of keeping them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Checkpointing {
    None,
    /// Every stage but the last (the head is small and feeds the loss directly).
    Stages,
    /// The named stages.
    Segments(Vec<String>),
}

impl Checkpointing {
    /// For each stage, whether it is checkpointed.
    pub fn resolve(&self, stages: &[StageCost]) -> Result<Vec<bool>, LedgerError> {
        let names: Vec<&str> = stages.iter().map(|s| s.name.as_str()).collect();
        self.resolve_names(&names)
    }

    /// For each of the named stages, in order, whether it is checkpointed.
    pub fn resolve_names(&self, stages: &[&str]) -> Result<Vec<bool>, LedgerError> {
        let last = stages.len().saturating_sub(1);
        match self {
            Checkpointing::None => Ok(vec![false; stages.len()]),
            Checkpointing::Stages => Ok((0..stages.len()).map(|i| i != last).collect()),
            Checkpointing::Segments(names) => {
                let mut chosen = vec![false; stages.len()];
                for name in names {
                    let index = stages
                        .iter()
                        .position(|s| s == name)
                        .ok_or_else(|| LedgerError::UnknownStage { name: name.clone(), valid: stages.join(", ") })?;
                    chosen[index] = true;
                }
                Ok(chosen)
            }
        }
    }
}

impl fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpointing::None => f.write_str("none"),
            Checkpointing::Stages => f.write_str("stages"),
            Checkpointing::Segments(names) => f.write_str(&names.join(",")),
        }
    }
}

/// `none`, `stages` (or `off`, `all`), or stage names such as `layer3,layer4`.
impl FromStr for Checkpointing {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "none" | "off" => Ok(Checkpointing::None),
            "stages" | "all" => Ok(Checkpointing::Stages),
            names => {
                let names: Vec<String> = names.split(',').map(|n| n.trim().to_owned()).filter(|n| !n.is_empty()).collect();
                if names.is_empty() {
                    Err("expected none, stages, or stage names such as layer3,layer4".to_owned())
                } else {
                    Ok(Checkpointing::Segments(names))
                }
            }
        }
    }
}
