use std::fmt;

use serde::{Deserialize, Serialize};

use crate::models::{Layers, Precision, Shape, StageCost};

use super::LedgerError;

/// One training (or inference) step to be costed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepConfig {
    /// Samples that go through the device at once (the micro-batch when accumulating).
    pub batch: usize,
    /// One sample: channels x height x width.
    pub input: Shape,
    pub precision: Precision,
    pub optimizer: OptimizerKind,
    /// Micro-batches whose gradients are summed before one optimizer step.
    pub accumulation: usize,
    pub checkpointing: Checkpointing,
    pub mode: Mode,
    /// The layers the network is built from.
    pub layers: Layers,
}

impl StepConfig {
    /// Training with the lesson's defaults: f32, Adam, no accumulation, no checkpointing, RGB, lean layers.
    pub fn training(batch: usize, resolution: usize) -> Self {
        StepConfig {
            batch,
            input: Shape::map(3, resolution, resolution),
            precision: Precision::F32,
            optimizer: OptimizerKind::Adam,
            accumulation: 1,
            checkpointing: Checkpointing::None,
            mode: Mode::Training,
            layers: Layers::Lean,
        }
    }

    /// Samples per optimizer step.
    pub fn effective_batch(&self) -> usize {
        self.batch * self.accumulation
    }

    /// The square resolution, or the height of a non-square input.
    pub fn resolution(&self) -> usize {
        match self.input {
            Shape::Map { h, .. } => h,
            Shape::Flat { .. } | Shape::Tokens { .. } => 0,
        }
    }

    pub fn with_resolution(&self, resolution: usize) -> Self {
        let c = self.input.channels();
        StepConfig { input: Shape::map(c, resolution, resolution), ..self.clone() }
    }
}

/// `batch 32 at 3x224x224, f16 mixed precision, Adam, accumulation 2, checkpointing stages`:
/// what the step is, with only the levers that are pulled.
impl fmt::Display for StepConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "batch {} at {}, {}", self.batch, self.input, self.precision)?;
        if self.mode == Mode::Inference {
            return f.write_str(", inference");
        }
        write!(f, ", {}", self.optimizer)?;
        if self.accumulation > 1 {
            write!(f, ", accumulation {}", self.accumulation)?;
        }
        if self.checkpointing != Checkpointing::None {
            write!(f, ", checkpointing {}", self.checkpointing)?;
        }
        if self.layers != Layers::default() {
            write!(f, ", {}", self.layers)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Training,
    /// Forward only, no autograd graph, no gradients, no optimizer.
    Inference,
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
