//! The memory ledger: the lesson's five bills for one training step, and the
//! peak found by walking the step phase by phase.

mod bill;
mod config;
mod estimate;
mod flags;
mod plan;
mod render;
mod timeline;
pub mod validation;

pub use bill::{Bill, BillKind, Line};
pub use config::{Checkpointing, Mode, OptimizerKind, StepConfig};
pub use estimate::{estimate, Ledger};
pub use flags::{measure_flags, oomcheck_flags};
pub use plan::{Segment, StepPhase, StepPlan};
pub use timeline::{Part, Peak, PeakLine, Phase};

use crate::models::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{what} must be at least 1")]
    Zero { what: &'static str },
    #[error("{what} {value} is over the largest vramlab costs, {max}")]
    TooLarge { what: &'static str, value: usize, max: usize },
    #[error("cannot checkpoint `{name}`: no such stage; stages: {valid}")]
    UnknownStage { name: String, valid: String },
}

#[cfg(test)]
mod tests;
