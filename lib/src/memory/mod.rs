//! Probes of the live process: host allocator in use vs held, RSS, exact
//! peak; the CUDA pool; a simulated device budget for CPU-only machines;
//! empty_cache; and the snapshot a trainer registers for `%mem`.
//!
//! Exactness comes from [`install_allocation_counters!`](crate::install_allocation_counters):
//! a binary that invokes it (the kernel, whose cell process is the same
//! binary, and the `vramlab` command) counts every heap allocation of its
//! process, those of cell libraries included. Anywhere else the probes
//! sample glibc's statistics and say they are not exact.
//!
//! # The room
//!
//! Three rooms, each importing only the ones below it (`tests/python/test_layering.py`):
//!
//! - `probes/`, what this process and the kernel's cell process can measure: the exact allocation
//!   counters and the shared region they head (`counters.rs`, `region.rs`, installed with glibc
//!   told to serve every block from one heap shared by all threads and keep freed tensor buffers
//!   for the next step; the kernel process itself maps its large blocks as glibc does,
//!   `host.rs`), the heap and RSS (`host.rs`), the CUDA pool (`cuda.rs`), the memory thread's
//!   answers in the region's words (`answer.rs`), the kernel's probe of its cell process
//!   (`cell.rs`), the values every cell's copy of the crate shares (`shared.rs`), the published
//!   `%mem` snapshot, the other vramlab processes, and the meter a training step is measured
//!   with (`meter.rs`: the host's counters, or the CUDA pool after a synchronisation). A
//!   simulated card is only numbers here (`budget.rs`).
//! - `card/`, the simulated card: the budget's effect, an allocation past it failing the step as
//!   CUDA would (`simulate.rs`), the processes that share one card (`tenants.rs`: each writes what
//!   it holds to a file per pid and reads the others' at its budget checks; `vramlab hold` is
//!   such a process), a model of PyTorch's caching allocator (`pool.rs`), and the card this
//!   process simulates (`process_card.rs`).
//! - `mem_report.rs`, what `%mem` shows, read from the cell process, as tables and charts.
//!
//! [`install`] is the one place that knows all three: it starts the probes with the memory
//! thread emptying the simulated card's cache when asked.

mod card;
mod mem_report;
mod probes;

pub use card::pool;
pub use card::pool::{empty_cache_demo, fragmentation_demo, EmptyCacheDemo, FragmentationDemo, PoolOom, PoolStats, SimulatedCard};
pub use card::process_card::{
    card, card_allocate, card_allocate_outside, card_empty_cache, card_free, card_stats, install_card, remove_card, CardError,
};
pub(crate) use card::simulate::set_trial_budget;
pub use card::simulate::{budget, check_budget, cpu_with_budget, last_out_of_memory, set_budget, OutOfMemory};
pub use card::tenants::{tenants, Tenant};
pub use mem_report::{plot, timeline_chart, timeline_table, MemReport};
pub use probes::budget::Budget;
pub use probes::cell::{CellProbe, CellUsage, Mark};
#[cfg(feature = "cuda")]
pub use probes::cuda;
pub use probes::error::MemoryError;
pub use probes::host::{counters_address, host_total, loader_bytes, loader_held, map_large_blocks, EmptyCache, HostMemory};
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[doc(hidden)]
pub use probes::interpose;
pub use probes::meter::StepMeter;
pub use probes::processes::{processes, Processes, Role, VramlabProcess};
pub use probes::region::REGION_FD_ENV;
pub(crate) use probes::shared;
pub use probes::snapshot::{publish, published, BillBytes, MeasuredPhase, Measurement, PredictedPhase, Prediction, Snapshot};

/// Starts counting for this process. Call first thing in `main` of a binary
/// that invoked [`install_allocation_counters!`](crate::install_allocation_counters).
///
/// In a process started with `VRAMLAB_MEM_FD` (the kernel's cell process)
/// the counters move into the region behind that descriptor, and a thread
/// answers the kernel's requests for what only this process can measure
/// (glibc's statistics, `malloc_trim` and the simulated card's cache, and
/// with the `cuda` feature the device pool of the GPU the cells use).
/// Elsewhere they move into a private region, so that snapshots can be
/// published the same way.
pub fn install() {
    probes::host::install(|| {
        card_empty_cache();
    });
}

#[cfg(test)]
mod tests;
