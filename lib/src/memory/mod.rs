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
//! Probes of the live process: exact allocation counters (installed with glibc told to serve every
//! block from one heap shared by all threads and keep freed tensor buffers for the next step; the
//! kernel process itself maps its large blocks as glibc does, `host.rs`), RSS, the CUDA pool, a
//! simulated device budget (a card and its context, as `%oomcheck --gpu` counts it) shared by every
//! process that simulates a card of that size (`tenants.rs`: each writes what it holds to a file
//! per pid and reads the others' at its budget checks, as processes on one GPU share it; `vramlab
//! hold` is such a process), the other vramlab processes, a model of PyTorch's caching allocator
//! (`pool.rs`), the process's simulated card, and the meter a training step is measured with
//! (`meter.rs`: the host's counters, or the CUDA pool after a synchronisation); values every cell's
//! copy of the crate shares (`shared.rs`).

mod answer;
mod budget;
mod card;
mod counters;
mod host;
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[doc(hidden)]
pub mod interpose;
mod mem_report;
mod meter;
pub mod pool;
mod probe;
mod processes;
mod region;
pub(crate) mod shared;
mod snapshot;
mod tenants;

#[cfg(feature = "cuda")]
pub mod cuda;

pub(crate) use budget::set_trial_budget;
pub use budget::{budget, check_budget, cpu_with_budget, last_out_of_memory, set_budget, Budget, OutOfMemory};
pub use card::{card, card_allocate, card_allocate_outside, card_empty_cache, card_free, card_stats, install_card, remove_card, CardError};
pub use host::{counters_address, host_total, install, loader_bytes, loader_held, map_large_blocks, EmptyCache, HostMemory};
pub use mem_report::{plot, timeline_chart, timeline_table, MemReport};
pub use meter::StepMeter;
pub use pool::{empty_cache_demo, fragmentation_demo, EmptyCacheDemo, FragmentationDemo, PoolOom, PoolStats, SimulatedCard};
pub use probe::{CellProbe, CellUsage, Mark};
pub use processes::{processes, Processes, Role, VramlabProcess};
pub use region::REGION_FD_ENV;
pub use snapshot::{publish, published, BillBytes, MeasuredPhase, Measurement, PredictedPhase, Prediction, Snapshot};
pub use tenants::{tenants, Tenant};

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("memory probe: {what} failed: {reason}")]
    Region { what: &'static str, reason: String },
    #[error("{what} needs the allocation counters, which this process lacks: run in the vramlab kernel or the vramlab command")]
    NotCounting { what: &'static str },
    #[error("the allocation counters of this process have no shared region: call vramlab::memory::install() at the start of main")]
    NoRegion,
    #[error("snapshot of {bytes} bytes does not fit the {capacity}-byte region")]
    SnapshotTooLarge { bytes: usize, capacity: usize },
    #[error("snapshot: {reason}")]
    Snapshot { reason: String },
    #[error("budget `{text}`: {reason}")]
    BadBudget { text: String, reason: String },
    #[error("the cell process has not started yet; run a cell first")]
    NotStarted,
    #[error("the cell process (pid {pid}) did not answer; it may have died: run a cell to start a new one")]
    NoAnswer { pid: u32 },
    #[cfg(feature = "cuda")]
    #[error("CUDA memory probe: {what} failed: {reason}")]
    Cuda { what: &'static str, reason: String },
}

#[cfg(test)]
mod tests;
