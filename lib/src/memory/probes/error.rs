//! What can go wrong reading this process's memory, or another's.

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
