//! The probes of this process and of the kernel's cell process: the
//! allocation counters and the shared region they head, the heap and RSS,
//! the CUDA pool, the values every cell's copy of the crate shares, and the
//! meter a step is measured with. They know no card: a simulated card's size
//! is only numbers here ([`budget`]), given its effect by the card room.

pub(crate) mod answer;
pub(crate) mod budget;
pub(crate) mod cell;
pub(crate) mod counters;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod error;
pub(crate) mod host;
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[doc(hidden)]
pub mod interpose;
pub(crate) mod meter;
pub(crate) mod processes;
pub(crate) mod region;
pub(crate) mod shared;
pub(crate) mod snapshot;
