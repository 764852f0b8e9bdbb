//! The memory ledger: the lesson's five bills for one training step, and the
//! peak found by walking the step phase by phase.
//!
//! # The room
//!
//! `StepConfig` (batch, input, mode, and the `Levers` pulled), the levers declared once with the
//! one clap group that reads them and the flags that write them (`levers.rs`), the `StepPlan` of a
//! step's phases (`plan.rs`), `estimate`: the five bills and the peak of one step, found by walking
//! the plan, and a configuration written back as `oomcheck`'s or `measure`'s flags (`flags.rs`).

mod bill;
mod estimate;
mod flags;
mod levers;
mod plan;
mod render;
mod step_config;
mod timeline;
pub mod validation;

pub use bill::{Bill, BillKind, Line};
pub use estimate::{estimate, Ledger};
pub use flags::{measure_flags, oomcheck_flags};
pub use levers::{Cards, CardsFlags, Checkpointing, LayersFlag, LeverFlags, Levers, OptimizerFlag, OptimizerKind, Shard, DDP_BUCKET_BYTES};
pub use plan::{Segment, StepPhase, StepPlan};
pub use step_config::{Mode, StepConfig};
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
    #[error("--shard {0} divides among several cards: add --cards 2 or more")]
    ShardOnOneCard(&'static str),
    #[error("--sync-bn sums batch-norm's statistics over several cards: add --cards 2 or more")]
    SyncOnOneCard,
    #[error(
        "--cards costs a training step spread over several cards; for inference each card runs its own copy: cost one card with its batch"
    )]
    CardsInInference,
    #[error("cannot checkpoint `{name}`: no such stage; stages: {valid}")]
    UnknownStage { name: String, valid: String },
}

#[cfg(test)]
mod tests;
