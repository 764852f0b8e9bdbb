//! The simulated card, above the probes: the budget's effect (an
//! allocation past it fails a step the way CUDA's would), the processes that
//! share one card, a model of PyTorch's caching allocator, and the card this
//! process simulates.

pub mod pool;
pub(crate) mod process_card;
pub(crate) mod simulate;
pub(crate) mod tenants;
