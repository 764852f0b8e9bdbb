//! How a trainer trains: precision, accumulation, checkpointing, the
//! optimizer and its schedule, clipping, loss scaling.

use serde::{Deserialize, Serialize};

use super::amp::GradScalerConfig;
use super::optim::OptimizerConfig;
use super::schedule::Schedule;
use crate::ledger::{Checkpointing, Levers};
use crate::models::{Layers, Precision};

/// How to train. Defaults: f32, no accumulation, no checkpointing, SGD with
/// momentum 0.9 at 0.01, no clipping, a constant learning rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub precision: Precision,
    /// Micro-batches per optimizer step; the loss of each is divided by this.
    pub accumulation: usize,
    pub checkpointing: Checkpointing,
    pub optimizer: OptimizerConfig,
    /// Clip the gradients' global L2 norm to this before each step.
    pub clip_norm: Option<f64>,
    /// The learning rate per optimizer step; `None` keeps the optimizer's.
    #[serde(skip)]
    pub schedule: Option<Schedule>,
    /// Loss scaling under f16 (bf16 has f32's range and needs none).
    pub scaler: GradScalerConfig,
}

impl TrainConfig {
    /// The levers this configuration pulls, on a network of `layers`.
    pub fn levers(&self, layers: Layers) -> Levers {
        Levers {
            precision: self.precision,
            optimizer: self.optimizer.kind(),
            accumulation: self.accumulation,
            checkpointing: self.checkpointing.clone(),
            layers,
            cards: crate::ledger::Cards::default(),
        }
    }

    /// These defaults with `levers`' precision, accumulation and
    /// checkpointing, and its optimizer at `learning_rate`.
    pub fn pulling(levers: &Levers, learning_rate: f64) -> Self {
        TrainConfig {
            precision: levers.precision,
            accumulation: levers.accumulation,
            checkpointing: levers.checkpointing.clone(),
            optimizer: OptimizerConfig::for_kind(levers.optimizer, learning_rate),
            ..TrainConfig::default()
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            precision: Precision::F32,
            accumulation: 1,
            checkpointing: Checkpointing::None,
            optimizer: OptimizerConfig::for_kind(crate::ledger::OptimizerKind::SgdMomentum, 0.01),
            clip_norm: None,
            schedule: None,
            scaler: GradScalerConfig::default(),
        }
    }
}
