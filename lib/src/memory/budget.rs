//! A simulated device budget: on a machine without a GPU, allocations past
//! a card's memory fail the way CUDA's do, so every OOM lesson runs.
//!
//! A failing `malloc` would abort a Rust program, so the allocator never
//! fails: the counters record the first allocation that takes the bytes in
//! use past the budget, and [`check_budget`] turns that record into an
//! [`OutOfMemory`] error at the next checkpoint (after each layer's forward
//! and backward, the optimizer step, tensor creation). The error names the
//! allocation that would have failed on the card.

use serde::Serialize;

use super::counters;
use super::host::HostMemory;
use super::MemoryError;
use crate::gpus::{Device, DeviceKind};
use crate::ledger::units::human;

/// The out-of-memory error of a simulated budget, shaped like CUDA's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error(
    "out of memory (simulated device budget, CPU): tried to allocate {}; {} in use; {} held; budget {}",
    human(*.requested), human(*.in_use), human(*.held), human(*.budget)
)]
pub struct OutOfMemory {
    /// The allocation that crossed the budget.
    pub requested: u64,
    /// Bytes in use just before it.
    pub in_use: u64,
    /// Bytes the allocator holds now.
    pub held: u64,
    pub budget: u64,
}

impl From<OutOfMemory> for candle_core::Error {
    fn from(oom: OutOfMemory) -> candle_core::Error {
        candle_core::Error::wrap(oom)
    }
}

/// A memory budget in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Budget(pub u64);

impl Budget {
    /// A size (`8GiB`, `12GB`, `7.5 GiB`) or a catalogue card (`rtx4060-laptop`,
    /// whose usable memory becomes the budget).
    pub fn parse(text: &str) -> Result<Budget, MemoryError> {
        let device = Device::parse(text).map_err(|e| MemoryError::BadBudget { text: text.to_owned(), reason: e.to_string() })?;
        if device.kind == DeviceKind::Cpu {
            return Err(MemoryError::BadBudget {
                text: text.to_owned(),
                reason: "the host has no budget to simulate; give a size such as 8GiB or a card".to_owned(),
            });
        }
        Ok(Budget(device.usable_bytes))
    }
}

/// Sets (or with `None` clears) this process's simulated device budget.
pub fn set_budget(budget: Option<Budget>) -> Result<(), MemoryError> {
    let counters = counters::find().ok_or(MemoryError::NotCounting { what: "a simulated device budget" })?;
    counters.set_budget(budget.map(|b| b.0));
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
    counters::find().and_then(|c| c.budget()).map(Budget)
}

/// `Err` when an allocation since the last check took the process past its
/// simulated budget (the allocation that would have failed on the card), and
/// again at every check until the process is back under the budget; `Ok`
/// when no budget is set or everything fit. Allocations made while handling
/// the error (before memory is freed) are not new overruns.
pub fn check_budget() -> Result<(), OutOfMemory> {
    let Some(counters) = counters::find() else { return Ok(()) };
    let (Some(budget), Some((requested, in_use))) = (counters.budget(), counters.take_overrun()) else { return Ok(()) };
    Err(OutOfMemory { requested, in_use, held: HostMemory::sample().held, budget })
}
