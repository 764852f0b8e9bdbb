//! Training: optimizers, mixed precision, accumulation, checkpointing, clipping, schedules and the Trainer.
//!
//! # The room
//!
//! The `Trainer` and its levers (mixed precision with a loss scaler, accumulation, checkpointing in
//! `step.rs`, clipping, schedules, optimizers; a step runs on a thread of rayon's pool, so that its
//! parallel ops start inside it), events and their live views (a progress bar, loss and accuracy
//! curves redrawn each epoch), `measure` (a real step phase by phase, beside the ledger), a step
//! spread over processes through a `dist::Collective` (`data_parallel.rs`); on CUDA,
//! SGD and Adam/AdamW update every parameter in one kernel launch (`optim/multi.rs` lays out the
//! table of tensors that the hand-written kernels of `lib/kernels/optim.cu` read, compiled to PTX
//! by `lib/build.rs` under the `cuda` feature as candle compiles its own; their arithmetic is the
//! CPU's fused updates', which check-ops compares; `optim/multi/` holds the one launch written once
//! for two launchers, our kernels on a card and their twins on host memory, which read the same
//! table of addresses inside `ops::on_reference`).

pub mod amp;
mod bench;
pub mod clip;
mod compare;
mod data_parallel;
mod error;
mod events;
mod oom;
pub mod optim;
pub mod schedule;
mod step;
mod task;
mod train_config;
mod trainer;

pub use amp::{GradScaler, GradScalerConfig};
pub use bench::{bench_train, bench_train_over, measure_train, measure_train_over, BenchReport, BenchSpec, Spread};
pub use clip::{clip_grad_norm, grad_norm};
pub use compare::{Comparison, MeasuredStep, PhaseSample};
pub use error::TrainError;
pub use events::{EpochReport, EvalReport, History, LiveCurves, MemorySample, ProgressView, StepReport, TrainEvent};
pub(crate) use oom::remember as remember_step_oom;
pub use oom::{clear_last_step_oom, is_out_of_memory, last_step_oom, StepOom};
pub use optim::{Adam, Adam8bit, Adam8bitConfig, AdamConfig, AdamW, AdamWConfig, OptimError, Optimizer, OptimizerConfig, Sgd, SgdConfig};
pub use schedule::Schedule;
pub use step::{accumulate, cross_entropy, forward_backward, Gradients, StepWatcher};
pub use task::Stripes;
pub use train_config::TrainConfig;
pub use trainer::{BatchSource, InMemory, Trainer};

#[cfg(test)]
mod tests;
