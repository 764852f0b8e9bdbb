//! A simulated device budget: on a machine without a GPU, allocations past
//! a card's memory fail the way CUDA's do, so every OOM lesson runs.
//!
//! A failing `malloc` would abort a Rust program, so the allocator never
//! fails: the counters record the first allocation that takes the bytes in
//! use past the budget, and [`check_budget`] turns that record into an
//! [`OutOfMemory`] error at the next checkpoint (after each layer's forward
//! and backward, the optimizer step, tensor creation). The error names the
//! allocation that would have failed on the card.
//!
//! A simulated card is the device `%oomcheck --gpu` judges: its usable
//! memory, of which its CUDA context (the catalogue's figure, or
//! [`GENERIC_CONTEXT_BYTES`](crate::gpus::GENERIC_CONTEXT_BYTES) for a bare
//! size) and cuDNN's workspace (which the card holds from its first
//! convolution, and the ledger counts for any model that convolves) are in
//! use before any tensor. So a configuration `%oomcheck` says fits on a card
//! fits under that card's budget, and the reverse.

use std::sync::atomic::Ordering::Relaxed;

use serde::{Deserialize, Serialize};

use crate::memory::probes::budget::Budget;
use crate::memory::probes::counters;
use crate::memory::probes::error::MemoryError;
use crate::memory::probes::host::HostMemory;
use crate::units::human;

/// The out-of-memory error of a simulated budget, shaped like CUDA's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub struct OutOfMemory {
    /// The allocation that crossed the budget.
    pub requested: u64,
    /// Heap bytes in use just before it (the context not included).
    pub in_use: u64,
    /// Bytes the host allocator holds now.
    pub held: u64,
    pub budget: Budget,
    /// What other processes on the same simulated card held (their contexts,
    /// workspaces and tensors).
    #[serde(default)]
    pub others: u64,
    /// The phase of a training step during which it happened, when a trainer knows it.
    pub phase: Option<String>,
}

impl OutOfMemory {
    /// What the card had left for the allocation that failed.
    pub fn free(&self) -> u64 {
        self.budget.room().saturating_sub(self.others + self.in_use)
    }

    /// The same error, placed in a phase of the step.
    pub fn during(self, phase: impl Into<String>) -> OutOfMemory {
        OutOfMemory { phase: Some(phase.into()), ..self }
    }
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "out of memory (simulated device budget, CPU): tried to allocate {}", human(self.requested))?;
        if let Some(phase) = &self.phase {
            write!(f, " during {phase}")?;
        }
        write!(
            f,
            "; budget {}, of which {} CUDA context, {} cuDNN workspace",
            human(self.budget.usable),
            human(self.budget.context),
            human(self.budget.workspace)
        )?;
        if self.others > 0 {
            write!(f, ", {} other processes on this card", human(self.others))?;
        }
        write!(f, " and {} in use; {} held by the host allocator", human(self.in_use), human(self.held))
    }
}

impl From<OutOfMemory> for candle_core::Error {
    /// Without a Rust backtrace, whatever `RUST_BACKTRACE` says: running out
    /// of memory is an expected condition, not a bug.
    fn from(oom: OutOfMemory) -> candle_core::Error {
        candle_core::Error::Wrapped(Box::new(oom))
    }
}

/// Kept where every cell's copy of the crate sees it: the last error the
/// budget raised.
const LAST_RAISED: &str = "budget_out_of_memory";

/// The last out-of-memory error the budget raised in this process.
pub fn last_out_of_memory() -> Option<OutOfMemory> {
    crate::memory::probes::shared::load(LAST_RAISED)
}

/// Sets (or with `None` clears) this process's simulated device budget.
pub fn set_budget(budget: Option<Budget>) -> Result<(), MemoryError> {
    let counters = counters::find().ok_or(MemoryError::NotCounting { what: "a simulated device budget" })?;
    let card = budget.map_or(0, |b| b.usable);
    let was = counters.card.swap(card, Relaxed);
    if was != 0 && was != card {
        super::tenants::leave(was);
        counters.others.store(0, Relaxed);
    }
    Budget::set_in(budget, counters);
    super::tenants::refresh(counters, true);
    Ok(())
}

/// A narrower budget on the same card, for the investigation's trials: the
/// card, and what its other processes hold, stay as they are.
pub(crate) fn set_trial_budget(budget: Option<Budget>) -> Result<(), MemoryError> {
    let counters = counters::find().ok_or(MemoryError::NotCounting { what: "a simulated device budget" })?;
    Budget::set_in(budget, counters);
    Ok(())
}

/// The CPU, with a simulated device budget of `budget` (`"8GiB"`, or a card
/// such as `"rtx4060-laptop"`): tensors live in host memory, and
/// [`check_budget`] fails once the process's heap would not fit on the card.
pub fn cpu_with_budget(budget: &str) -> Result<candle_core::Device, MemoryError> {
    set_budget(Some(Budget::parse(budget)?))?;
    Ok(candle_core::Device::Cpu)
}

/// The simulated budget now set, if any.
pub fn budget() -> Option<Budget> {
    counters::find().and_then(Budget::in_counters)
}

/// `Err` when an allocation since the last check took the process past its
/// simulated budget (the allocation that would have failed on the card), and
/// again at every check until the process is back under the budget; `Ok`
/// when no budget is set or everything fit. Allocations made while handling
/// the error (before memory is freed) are not new overruns.
pub fn check_budget() -> Result<(), OutOfMemory> {
    let Some(counters) = counters::find() else { return Ok(()) };
    super::tenants::refresh(counters, false);
    let (Some(budget), Some((requested, in_use))) = (budget(), counters.take_overrun()) else { return Ok(()) };
    let others = counters.others.load(Relaxed);
    let oom = OutOfMemory { requested, in_use, held: HostMemory::sample().held, budget, others, phase: None };
    crate::memory::probes::shared::store(LAST_RAISED, Some(&oom));
    Err(oom)
}
