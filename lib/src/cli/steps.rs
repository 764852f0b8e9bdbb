//! The arguments of `vramlab bench train` (and of every command that runs real
//! training steps on a zoo model).

use clap::{Args, ColorChoice, Parser};

use super::args::parse_model;
use super::device::DeviceArg;
use crate::ledger::{LeverFlags, Levers, OptimizerKind};
use crate::models::ModelName;
use crate::train::TrainConfig;
use crate::units::parse_positive;

/// A zoo model and how to train it: what `bench train` times and `measure` measures.
#[derive(Debug, Clone, Args)]
pub struct TrainSetup {
    /// resnet18, resnet34, resnet50, efficientnet-b0, small-cnn, vit-tiny, vit-small or unet
    #[arg(long, value_parser = parse_model)]
    pub model: ModelName,
    /// Samples per forward pass (the micro-batch when accumulating)
    #[arg(long, value_parser = parse_positive)]
    pub batch: usize,
    /// Square input resolution in pixels
    #[arg(long, value_parser = parse_positive)]
    pub res: usize,
    /// Number of classes (default: 10 for a classifier, 2 for unet: background and lesion)
    #[arg(long, value_parser = parse_positive)]
    pub classes: Option<usize>,
    /// Learning rate
    #[arg(long, default_value_t = 0.01)]
    pub lr: f64,
    // The optimizer is SGD with momentum unless --opt says otherwise.
    #[command(flatten)]
    pub levers: LeverFlags,
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
    #[arg(long, default_value_t = 5, value_parser = parse_positive)]
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
    #[arg(long, default_value_t = 2, value_parser = parse_positive)]
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

    /// The levers pulled: the flags over the lesson's defaults, with SGD and
    /// momentum for the optimizer (what the ResNet recipes train with).
    pub fn levers(&self) -> Levers {
        self.levers.over(&Levers { optimizer: OptimizerKind::SgdMomentum, ..Levers::default() })
    }

    pub fn train_config(&self) -> TrainConfig {
        TrainConfig::pulling(&self.levers(), self.lr)
    }
}

/// `check-dist --model M --batch B --res R --cards N [--shard optimizer] [--opt adamw] --steps 3`, under `mpirun -np N`
#[derive(Debug, Clone, Parser)]
#[command(name = "check-dist", color = ColorChoice::Never)]
pub struct CheckDistArgs {
    #[command(flatten)]
    pub setup: TrainSetup,
    /// Optimizer steps, each on new synthetic batches
    #[arg(long, default_value_t = 3, value_parser = parse_positive)]
    pub steps: usize,
    /// The largest difference of any weight allowed between the processes' and one process's
    #[arg(long, default_value_t = 1e-5)]
    pub tolerance: f64,
}
