//! What a trainer knew when its step ran out of memory: the failed
//! allocation, the phase, and enough of the trainer to run its step again,
//! kept for the diagnosis (`vramlab::diagnose`) until the next one.

use std::cell::RefCell;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use super::error::TrainError;
use super::train_config::TrainConfig;
use crate::ledger::{StepPhase, StepPlan};
use crate::memory::OutOfMemory;
use crate::models::{ModelSpec, Shape};

/// A training step that ran out of memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepOom {
    /// The error as it was raised.
    pub message: String,
    /// The simulated budget's error, which names the allocation; `None` for
    /// the device's own (CUDA's driver error does not say its size).
    pub simulated: Option<OutOfMemory>,
    /// The phase in progress: where the simulated budget was crossed, or the
    /// phase after the last one that completed.
    pub phase: StepPhase,
    pub phase_name: String,
    /// The model, its input and the micro-batch of the step.
    pub spec: ModelSpec,
    pub input: Shape,
    pub batch: usize,
    pub config: TrainConfig,
    /// The layers the network ran.
    pub layers: crate::models::Layers,
    /// The CUDA device's ordinal; `None` for the CPU.
    pub cuda: Option<usize>,
    /// Bytes in use when the step began that were neither the trainer's
    /// state nor its batch: what a new trainer in this process competes with.
    pub outside: u64,
}

const LAST: &str = "last_step_oom";

thread_local! {
    /// The budget error a step's checkpoint raised, in full, with its phase:
    /// candle's error carries only its text.
    static RAISED: RefCell<Option<(OutOfMemory, StepPhase)>> = const { RefCell::new(None) };
}

/// The last training step of this process that ran out of memory.
/// Kept where every cell's copy of the crate sees it.
pub fn last_step_oom() -> Option<StepOom> {
    crate::memory::shared::load(LAST)
}

/// Forgets the last out-of-memory step (once it has been dealt with).
pub fn clear_last_step_oom() {
    crate::memory::shared::store::<StepOom>(LAST, None);
}

pub(crate) fn remember(oom: &StepOom) {
    crate::memory::shared::store(LAST, Some(oom));
}

impl StepOom {
    /// The device the step ran on.
    pub fn device(&self) -> candle_core::Result<Device> {
        match self.cuda {
            Some(ordinal) => Device::new_cuda(ordinal),
            None => Ok(Device::Cpu),
        }
    }
}

/// Checks the simulated budget at the end of `phase`: an overrun becomes
/// candle's error, the full record kept for the trainer.
pub(crate) fn checkpoint(plan: &StepPlan, phase: StepPhase) -> candle_core::Result<()> {
    crate::memory::check_budget().map_err(|oom| {
        let oom = oom.during(plan.name(phase));
        RAISED.with(|raised| *raised.borrow_mut() = Some((oom.clone(), phase)));
        candle_core::Error::from(oom)
    })
}

/// Forgets a budget error raised before this step (and handled by its caller).
pub(crate) fn clear_raised() {
    RAISED.with(|raised| raised.borrow_mut().take());
}

/// The budget error behind `error`, with its phase, when the step's
/// checkpoint raised it.
pub(crate) fn raised(error: &TrainError) -> Option<(OutOfMemory, StepPhase)> {
    let pending = RAISED.with(|raised| raised.borrow_mut().take());
    match error {
        TrainError::OutOfMemory(_) | TrainError::Candle(_) => pending,
        _ => None,
    }
}

/// True when `message` is an out-of-memory error of the device (CUDA's
/// driver, cuBLAS, cuDNN) or of the simulated budget.
pub fn is_out_of_memory(message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    lower.contains("out of memory") || lower.contains("out_of_memory") || lower.contains("alloc_failed")
}
