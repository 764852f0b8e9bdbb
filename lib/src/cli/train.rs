//! The arguments of `vramlab bench train` (and of every command that runs real
//! training steps on a zoo model).

use clap::{Args, ColorChoice, Parser};

use super::args::{amp_parser, parse_checkpointing, parse_model, positive};
use super::device::DeviceArg;
use crate::ledger::Checkpointing;
use crate::ledger::OptimizerKind;
use crate::models::{Layers, ModelName, Precision};
use crate::train::{OptimizerConfig, TrainConfig};

/// A zoo model and how to train it: what `bench train` times and `measure` measures.
#[derive(Debug, Clone, Args)]
pub struct TrainSetup {
    /// resnet18, resnet34, resnet50, efficientnet-b0, small-cnn, vit-tiny, vit-small or unet
    #[arg(long, value_parser = parse_model)]
    pub model: ModelName,
    /// Samples per forward pass (the micro-batch when accumulating)
    #[arg(long, value_parser = positive)]
    pub batch: usize,
    /// Square input resolution in pixels
    #[arg(long, value_parser = positive)]
    pub res: usize,
    /// Number of classes (default: 10 for a classifier, 2 for unet: background and lesion)
    #[arg(long, value_parser = positive)]
    pub classes: Option<usize>,
    /// Mixed precision
    #[arg(long, value_parser = amp_parser())]
    pub amp: Option<Precision>,
    /// Optimizer
    #[arg(long, value_enum, default_value_t = OptimizerKind::SgdMomentum)]
    pub opt: OptimizerKind,
    /// Learning rate
    #[arg(long, default_value_t = 0.01)]
    pub lr: f64,
    /// Gradient accumulation steps per optimizer step
    #[arg(long, default_value_t = 1, value_parser = positive)]
    pub accum: usize,
    /// Activation checkpointing: none, stages, or stage names (layer3,layer4)
    #[arg(long, value_parser = parse_checkpointing, default_value = "none")]
    pub ckpt: Checkpointing,
    /// Layers: lean (batch-norm fused with what reads it; on the CPU and, through cuDNN, on CUDA) or plain (what an ordinary autograd keeps)
    #[arg(long, value_enum, default_value_t = Layers::Lean)]
    pub layers: Layers,
    /// Seed of the weights and the synthetic images
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where the steps run (cuda needs a build with the cuda feature)
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
}

/// `bench train --model M --batch B --res R [--amp f16] [--ckpt stages] [--opt adam] [--accum N] --steps N`
#[derive(Debug, Clone, Parser)]
#[command(name = "train", color = ColorChoice::Never, about = "Time real training steps of a zoo model on synthetic images")]
pub struct TrainRunArgs {
    #[command(flatten)]
    pub setup: TrainSetup,
    /// Timed optimizer steps
    #[arg(long, default_value_t = 5, value_parser = positive)]
    pub steps: usize,
    /// Untimed steps first (allocator and caches warm up)
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
}

/// `measure --model M --batch B --res R [--amp f16] [--opt adam] [--ckpt stages] [--accum N]`
#[derive(Debug, Clone, Parser)]
#[command(name = "measure", color = ColorChoice::Never, about = "Run real training steps and print every bill predicted and measured, and both peaks")]
pub struct MeasureArgs {
    #[command(flatten)]
    pub setup: TrainSetup,
    /// Steps before the measured one: the first creates the optimizer state,
    /// unless f16 loss scaling skips it (65536 overflows at first), hence two
    #[arg(long, default_value_t = 2, value_parser = positive)]
    pub warmup: usize,
    /// Simulate a card of this size (`256MiB`, `8GiB`, `rtx4060-laptop`):
    /// a step that would not fit in it fails with CUDA's out-of-memory error
    #[arg(long)]
    pub budget: Option<String>,
}

impl TrainSetup {
    /// The classes asked for, or the model's default here.
    pub fn classes(&self) -> usize {
        self.classes.unwrap_or(if self.model.segments() { 2 } else { 10 })
    }

    pub fn precision(&self) -> Precision {
        self.amp.unwrap_or(Precision::F32)
    }

    pub fn train_config(&self) -> TrainConfig {
        TrainConfig {
            precision: self.precision(),
            accumulation: self.accum,
            checkpointing: self.ckpt.clone(),
            optimizer: OptimizerConfig::for_kind(self.opt, self.lr),
            ..TrainConfig::default()
        }
    }
}
