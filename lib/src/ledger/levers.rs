//! The training levers, declared once: what a learner pulls to make a step
//! fit (precision, optimizer, accumulation, checkpointing, layers, and the
//! cards the step is spread over with what they shard), their
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
    /// The cards the step is spread over, and what they shard.
    pub cards: Cards,
}

impl Default for Levers {
    fn default() -> Self {
        Levers {
            precision: Precision::F32,
            optimizer: OptimizerKind::Adam,
            accumulation: 1,
            checkpointing: Checkpointing::None,
            layers: Layers::Lean,
            cards: Cards::default(),
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
        if self.cards.count > 1 {
            flags.push_str(&format!(" --cards {} --shard {}", self.cards.count, self.cards.shard.flag()));
        }
        if self.cards.sync_batch_norm {
            flags.push_str(" --sync-bn");
        }
        if self.cards.bucket_bytes != DDP_BUCKET_BYTES {
            flags.push_str(&format!(" --bucket-mb {}", self.cards.bucket_bytes.div_ceil(MIB)));
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
    #[command(flatten)]
    pub cards: CardsFlags,
}

/// `--cards`, `--shard`, `--bucket-mb`: the step spread over several cards.
#[derive(Debug, Clone, Copy, Default, PartialEq, clap::Args)]
pub struct CardsFlags {
    /// Cards (one process each) the step is spread over; --batch is each card's (default 1)
    #[arg(long, value_parser = parse_positive)]
    pub cards: Option<usize>,
    /// What the cards divide among them: none (DDP), optimizer (ZeRO-1), gradients (ZeRO-2),
    /// parameters (ZeRO-3, FSDP's full shard); default none
    #[arg(long, value_enum)]
    pub shard: Option<Shard>,
    /// Gradient bucket in MiB, reduced as one message (default 25, PyTorch DDP's)
    #[arg(long = "bucket-mb", value_parser = parse_positive)]
    pub bucket_mb: Option<usize>,
    /// Batch-norm normalises by the statistics of every card's batch, summed over the cards
    /// (PyTorch's SyncBatchNorm), not each card's own
    #[arg(long = "sync-bn")]
    pub sync_bn: bool,
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
    /// Refuses the levers of several cards where `what` runs in this one
    /// process, and `--shard` and `--sync-bn` without them.
    pub fn on_one_card(&self, what: &str) -> Result<(), String> {
        match (self.cards.cards, self.cards.shard) {
            (Some(count), _) if count > 1 => Err(format!("--cards {count}: {what} runs in one process, on one card")),
            (_, Some(shard)) if shard != Shard::None => Err(LedgerError::ShardOnOneCard(shard.flag()).to_string()),
            _ if self.cards.sync_bn => Err(LedgerError::SyncOnOneCard.to_string()),
            _ => Ok(()),
        }
    }

    /// `base` with each lever a flag names replaced by the flag's.
    pub fn over(&self, base: &Levers) -> Levers {
        Levers {
            precision: self.amp.unwrap_or(base.precision),
            optimizer: self.optimizer.opt.unwrap_or(base.optimizer),
            accumulation: self.accum.unwrap_or(base.accumulation),
            checkpointing: self.ckpt.clone().unwrap_or_else(|| base.checkpointing.clone()),
            layers: self.layers.layers.unwrap_or(base.layers),
            cards: Cards {
                count: self.cards.cards.unwrap_or(base.cards.count),
                shard: self.cards.shard.unwrap_or(base.cards.shard),
                bucket_bytes: self.cards.bucket_mb.map_or(base.cards.bucket_bytes, |mb| mb as u64 * MIB),
                sync_batch_norm: self.cards.sync_bn || base.cards.sync_batch_norm,
            },
        }
    }
}

const MIB: u64 = 1 << 20;
/// PyTorch DDP's `bucket_cap_mb` default.
pub const DDP_BUCKET_BYTES: u64 = 25 * MIB;

/// Data parallelism: `count` cards, one process each, each running the
/// step on its own batch (the `StepConfig`'s) and keeping what `shard`
/// leaves it; gradients are reduced in buckets of `bucket_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cards {
    pub count: usize,
    pub shard: Shard,
    pub bucket_bytes: u64,
    /// Batch-norm normalising by every card's batch (`--sync-bn`): a few
    /// floats per channel exchanged, nothing kept beyond each card's own
    /// batch-norm.
    #[serde(default)]
    pub sync_batch_norm: bool,
}

impl Default for Cards {
    fn default() -> Self {
        Cards { count: 1, shard: Shard::None, bucket_bytes: DDP_BUCKET_BYTES, sync_batch_norm: false }
    }
}

impl Cards {
    pub fn several(self) -> bool {
        self.count > 1
    }

    /// `bytes` of a state `shard` divides: one card's part of it, the flat
    /// state padded to a multiple of the cards as ZeRO pads it.
    pub fn part_of(self, bytes: u64, divided_from: Shard) -> u64 {
        if self.shard >= divided_from {
            bytes.div_ceil(self.count as u64)
        } else {
            bytes
        }
    }
}

/// ZeRO's stages: what the cards divide among them instead of each keeping
/// it whole. Each stage divides what the one before divides, and more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Shard {
    /// DDP: every card keeps everything; gradients are all-reduced.
    None,
    /// ZeRO-1: each card keeps and updates its part of the optimizer state.
    Optimizer,
    /// ZeRO-2: and keeps only its part of the reduced gradients.
    Gradients,
    /// ZeRO-3 (FSDP's full shard): and of the weights, gathering a stage's while it runs.
    Parameters,
}

impl Shard {
    pub const ALL: [Shard; 4] = [Shard::None, Shard::Optimizer, Shard::Gradients, Shard::Parameters];

    pub fn flag(self) -> &'static str {
        match self {
            Shard::None => "none",
            Shard::Optimizer => "optimizer",
            Shard::Gradients => "gradients",
            Shard::Parameters => "parameters",
        }
    }

    /// The name the field knows it by.
    pub fn name(self) -> &'static str {
        match self {
            Shard::None => "DDP",
            Shard::Optimizer => "ZeRO-1",
            Shard::Gradients => "ZeRO-2",
            Shard::Parameters => "ZeRO-3",
        }
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Shard::None => "DDP (nothing sharded)",
            Shard::Optimizer => "ZeRO-1 (optimizer state sharded)",
            Shard::Gradients => "ZeRO-2 (optimizer state and gradients sharded)",
            Shard::Parameters => "ZeRO-3 (optimizer state, gradients and weights sharded)",
        })
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
