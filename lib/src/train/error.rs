//! Why a trainer could not step.

use super::optim::OptimError;
use crate::ledger::LedgerError;
use crate::models::Precision;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("training step failed: {0}")]
    Candle(Box<candle_core::Error>),
    #[error(transparent)]
    Optimizer(#[from] OptimError),
    #[error(transparent)]
    Checkpointing(#[from] LedgerError),
    #[error(transparent)]
    Model(#[from] crate::models::ModelError),
    #[error("accumulation must be at least 1 micro-batch per step, got {0}")]
    Accumulation(usize),
    #[error("{precision} cannot run on {device}: {reason}")]
    Precision { precision: Precision, device: String, reason: String },
    #[error("a step needs {expected} micro-batches (accumulation), got {got}")]
    MicroBatches { expected: usize, got: usize },
    #[error("the batch source gave no batches")]
    Empty,
    #[error(
        "measuring a step needs the allocation counters, which this process lacks: run it in the vramlab kernel or the vramlab command"
    )]
    NotCounting,
    #[error(transparent)]
    Device(#[from] crate::gpus::GpuError),
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
    #[error("memory probe: {0}")]
    Memory(#[from] crate::memory::MemoryError),
    #[error(transparent)]
    OutOfMemory(#[from] crate::memory::OutOfMemory),
    #[error(
        "this step is predicted to need {} and the host has {} available: lower the batch or the resolution",
        crate::units::human(*predicted),
        crate::units::human(*available)
    )]
    HostTooSmall { predicted: u64, available: u64 },
}

// Boxed: candle's error would make every training result several times larger.
impl From<candle_core::Error> for TrainError {
    fn from(error: candle_core::Error) -> Self {
        TrainError::Candle(Box::new(error))
    }
}
