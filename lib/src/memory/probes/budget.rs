//! A simulated card's size, as the counters hold it: the bytes it gives
//! this process and the shares its CUDA context and cuDNN's workspace take
//! of them before any tensor. The card room gives it its effect
//! (`card/simulate.rs`); the probes read it.

use serde::{Deserialize, Serialize};

use super::counters::Counters;
use super::error::MemoryError;
use super::shared;
use crate::gpus::{Card, CardKind};
use crate::ops::CUDNN_WORKSPACE_BYTES;
use crate::units::human;

/// Kept where every cell's copy of the crate sees it: how the budget was
/// last written.
const NAMED: &str = "budget_name";

/// A simulated card: the bytes it gives this process and the shares its
/// CUDA context and cuDNN's workspace take of them before any tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    pub usable: u64,
    pub context: u64,
    pub workspace: u64,
}

impl Budget {
    /// A size (`8GiB`, `12GB`, `7.5 GiB`) or a catalogue card (`rtx4060-laptop`),
    /// exactly as `%oomcheck --gpu` reads it.
    pub fn parse(text: &str) -> Result<Budget, MemoryError> {
        let bad = |reason: String| MemoryError::BadBudget { text: text.to_owned(), reason };
        let device = Card::parse(text).map_err(|e| bad(e.to_string()))?;
        if device.kind == CardKind::Cpu {
            return Err(bad("the host has no budget to simulate; give a size such as 8GiB or a card".to_owned()));
        }
        let budget = Budget::of(&device).map_err(bad)?;
        shared::store(NAMED, Some(&(budget, text.trim().to_owned())));
        Ok(budget)
    }

    /// How this budget was last written (`rtx4060-laptop`, `1GiB`), for a
    /// command line that sets it again.
    pub fn name(&self) -> String {
        match shared::load::<(Budget, String)>(NAMED) {
            Some((named, text)) if named == *self => text,
            _ => format!("{}MiB", self.usable.div_ceil(1 << 20)),
        }
    }

    /// The card this budget simulates, as the ledger judges it: the card's
    /// size and context, with the step on our CPU kernels and their
    /// transients. On the CPU without bf16: mixed precision there means f16.
    pub fn device(&self) -> Card {
        Card {
            name: format!("simulated {}", self.name()),
            kind: CardKind::Simulated,
            total_bytes: self.usable,
            usable_bytes: self.usable,
            context_bytes: self.context,
            bf16: false,
            tensor_cores: false,
        }
    }

    /// The budget of a device of the catalogue or of a size.
    pub fn of(device: &Card) -> Result<Budget, String> {
        let held = device.context_bytes + CUDNN_WORKSPACE_BYTES;
        if held >= device.usable_bytes {
            return Err(format!(
                "a card of {} holds its {} CUDA context and {} cuDNN workspace before any tensor and leaves nothing for training; \
                 give more than {}",
                human(device.usable_bytes),
                human(device.context_bytes),
                human(CUDNN_WORKSPACE_BYTES),
                human(held)
            ));
        }
        Ok(Budget { usable: device.usable_bytes, context: device.context_bytes, workspace: CUDNN_WORKSPACE_BYTES })
    }

    /// The budget `counters` hold, if one is set.
    pub(crate) fn in_counters(counters: &Counters) -> Option<Budget> {
        let [usable, context, workspace] = counters.budget_words();
        (usable != 0).then_some(Budget { usable, context, workspace })
    }

    /// Sets `budget` (or with `None` clears it) in `counters`.
    pub(crate) fn set_in(budget: Option<Budget>, counters: &Counters) {
        counters.set_budget_words(budget.map_or([0; 3], |b| [b.usable, b.context, b.workspace]));
    }

    /// What the card holds before any tensor: its context and cuDNN's workspace.
    pub fn held_by_card(&self) -> u64 {
        self.context + self.workspace
    }

    /// Bytes left for the heap once the context and the workspace are in.
    pub fn room(&self) -> u64 {
        self.usable.saturating_sub(self.held_by_card())
    }
}
