use std::fmt;

use serde::{Deserialize, Serialize};

use crate::models::{Layers, Shape};

use super::{Checkpointing, Levers};

/// One training (or inference) step to be costed: the batch, the input, and
/// the levers pulled.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepConfig {
    /// Samples that go through the device at once (the micro-batch when
    /// accumulating; each card's when the step is spread over several).
    pub batch: usize,
    /// One sample: channels x height x width.
    pub input: Shape,
    #[serde(flatten)]
    pub levers: Levers,
    pub mode: Mode,
}

impl StepConfig {
    /// Training with the lesson's levers ([`Levers::default`]) on RGB images.
    pub fn training(batch: usize, resolution: usize) -> Self {
        StepConfig { batch, input: Shape::map(3, resolution, resolution), levers: Levers::default(), mode: Mode::Training }
    }

    /// Samples per optimizer step, over all cards.
    pub fn effective_batch(&self) -> usize {
        self.batch * self.levers.accumulation * self.levers.cards.count
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

/// `batch 32 at 3x224x224, f16 mixed precision, Adam, accumulation 2, checkpointing stages, one of 4 cards, ZeRO-1`:
/// what the step is, with only the levers that are pulled.
impl fmt::Display for StepConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let levers = &self.levers;
        write!(f, "batch {} at {}, {}", self.batch, self.input, levers.precision)?;
        if self.mode == Mode::Inference {
            return f.write_str(", inference");
        }
        write!(f, ", {}", levers.optimizer)?;
        if levers.accumulation > 1 {
            write!(f, ", accumulation {}", levers.accumulation)?;
        }
        if levers.checkpointing != Checkpointing::None {
            write!(f, ", checkpointing {}", levers.checkpointing)?;
        }
        if levers.layers != Layers::default() {
            write!(f, ", {}", levers.layers)?;
        }
        if levers.cards.several() {
            write!(f, ", one of {} cards, {}", levers.cards.count, levers.cards.shard.name())?;
            if levers.cards.sync_batch_norm {
                write!(f, ", batch-norm synchronised")?;
            }
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
