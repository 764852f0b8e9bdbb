//! The process's simulated card: a [`SimulatedCard`] that every cell's copy
//! of the crate, and `%mem` in the kernel, see as one. It lives as JSON where
//! the shared values do (`probes/shared.rs`), so a tensor allocated on
//! it in one cell is freed in the next, `%mem` shows its pool beside the heap,
//! and `%mem --empty-cache` empties it.

use super::pool::{BlockId, PoolError, PoolOom, PoolStats, SimulatedCard};

/// What a card operation could not do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CardError {
    #[error("no simulated card in this process: install one with vramlab::memory::install_card(SimulatedCard::new(bytes))")]
    NoCard,
    #[error(transparent)]
    OutOfMemory(#[from] PoolOom),
    #[error(transparent)]
    Pool(#[from] PoolError),
}
use crate::memory::probes::shared;

const CARD: &str = "simulated_card";

/// Makes `card` this process's simulated card (replacing any before it).
pub fn install_card(card: SimulatedCard) -> PoolStats {
    let stats = card.stats();
    shared::store(CARD, Some(&card));
    stats
}

/// This process's simulated card, as it is now.
pub fn card() -> Option<SimulatedCard> {
    shared::load(CARD)
}

/// Removes the process's simulated card.
pub fn remove_card() {
    shared::store::<SimulatedCard>(CARD, None);
}

fn with_card<T>(change: impl FnOnce(&mut SimulatedCard) -> T) -> Result<T, CardError> {
    let mut card = card().ok_or(CardError::NoCard)?;
    let result = change(&mut card);
    shared::store(CARD, Some(&card));
    Ok(result)
}

/// A tensor's worth of bytes through the card's caching allocator.
pub fn card_allocate(bytes: u64) -> Result<BlockId, CardError> {
    Ok(with_card(|card| card.allocate(bytes))??)
}

/// Bytes taken from the card around its cache: another process, or a library's own `cudaMalloc`.
pub fn card_allocate_outside(bytes: u64) -> Result<BlockId, CardError> {
    Ok(with_card(|card| card.allocate_outside(bytes))??)
}

pub fn card_free(id: BlockId) -> Result<(), CardError> {
    Ok(with_card(|card| card.free(id))??)
}

/// `torch.cuda.empty_cache()` on the process's card: the bytes released; 0 without a card.
pub fn card_empty_cache() -> u64 {
    with_card(SimulatedCard::empty_cache).unwrap_or(0)
}

/// The pool's numbers; `None` without a card.
pub fn card_stats() -> Option<PoolStats> {
    card().map(|card| card.stats())
}

/// The card's stats read from a region of another process (`%mem` in the kernel).
pub(crate) fn card_stats_in(counters: &crate::memory::probes::counters::Counters) -> Option<PoolStats> {
    shared::load_in::<SimulatedCard>(counters, CARD).map(|card| card.stats())
}

impl PoolStats {
    /// `torch.cuda.memory_summary()`'s first lines, for the simulated card.
    pub fn table(&self) -> crate::render::Table {
        use crate::units::human;
        crate::render::Table::new(["simulated card (caching allocator)", "bytes"])
            .right_align(&[1])
            .row(["allocated: live tensors (memory_allocated)".to_owned(), human(self.allocated)])
            .row(["reserved by the cache (memory_reserved)".to_owned(), human(self.reserved)])
            .row(["reserved but unallocated".to_owned(), human(self.cached_free)])
            .row(["largest free block in the cache".to_owned(), human(self.largest_free_block)])
            .row(["outside the cache (other processes, libraries)".to_owned(), human(self.outside)])
            .row(["free on the device".to_owned(), human(self.device_free)])
            .footer(["capacity".to_owned(), human(self.capacity)])
            .note(format!(
                "{} segments; peak allocated {}, peak reserved {}; out-of-memory errors: {} in the cache, {} outside it; \
                 {} retries after releasing cached segments",
                self.segments,
                human(self.peak_allocated),
                human(self.peak_reserved),
                self.num_ooms,
                self.num_outside_ooms,
                self.num_alloc_retries
            ))
    }

    pub fn evcxr_display(&self) {
        self.table().evcxr_display();
    }
}

/// The card after each step of a story, one row per step.
fn steps_table(title: String, steps: &[(String, PoolStats)]) -> crate::render::Table {
    use crate::units::human;
    let mut table = crate::render::Table::new(["step", "allocated", "reserved", "largest free block", "free on the device"])
        .title(title)
        .right_align(&[1, 2, 3, 4]);
    for (label, stats) in steps {
        table.push_row([
            label.clone(),
            human(stats.allocated),
            human(stats.reserved),
            human(stats.largest_free_block),
            human(stats.device_free),
        ]);
    }
    table
}

impl super::pool::FragmentationDemo {
    pub fn table(&self) -> crate::render::Table {
        use crate::units::human;
        let table = steps_table(format!("Fragmentation on a simulated {} card", human(self.capacity)), &self.steps);
        let failed = self.oom.as_ref().map_or("the large tensor fit".to_owned(), |oom| oom.to_string());
        table.note(format!(
            "{failed} empty_cache() then released {}; {}; {}.",
            human(self.released_by_empty_cache),
            if self.oom_after_empty_cache.is_some() { "the same request failed again" } else { "the request then fit" },
            if self.fits_after_freeing_tensors {
                "freeing the tensors that pinned the segments made it fit"
            } else {
                "freeing the pinning tensors did not make it fit"
            }
        ))
    }

    pub fn evcxr_display(&self) {
        self.table().evcxr_display();
    }
}

impl super::pool::EmptyCacheDemo {
    pub fn table(&self) -> crate::render::Table {
        use crate::units::human;
        let table = steps_table(format!("empty_cache() on a simulated {} card", human(self.capacity)), &self.steps);
        let failed = self.oom.as_ref().map_or("the outside allocation fit".to_owned(), |oom| oom.to_string());
        table.note(format!(
            "{failed} empty_cache() released {} (reserved {} -> {}); the same allocation then {}.",
            human(self.released),
            human(self.before_empty_cache.reserved),
            human(self.after_empty_cache.reserved),
            if self.fits_after_empty_cache { "fit" } else { "failed again" }
        ))
    }

    pub fn evcxr_display(&self) {
        self.table().evcxr_display();
    }
}
