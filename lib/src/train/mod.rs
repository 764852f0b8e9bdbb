//! Training: optimizers, mixed precision, accumulation, checkpointing, clipping, schedules and the Trainer.

pub mod amp;
mod bench;
pub mod clip;
mod config;
mod error;
mod events;
mod measure;
mod oom;
pub mod optim;
pub mod schedule;
mod step;
mod task;
mod trainer;

pub use amp::{GradScaler, GradScalerConfig};
pub use bench::{bench_train, measure_train, BenchReport, BenchSpec};
pub use clip::{clip_grad_norm, grad_norm};
pub use config::TrainConfig;
pub use error::TrainError;
pub use events::{EpochReport, EvalReport, History, LiveCurves, MemorySample, ProgressView, StepReport, TrainEvent};
pub use measure::{Comparison, MeasuredStep, PhaseSample};
pub(crate) use oom::remember as remember_step_oom;
pub use oom::{clear_last_step_oom, is_out_of_memory, last_step_oom, StepOom};
pub use optim::{Adam, Adam8bit, Adam8bitConfig, AdamConfig, AdamW, AdamWConfig, OptimError, Optimizer, OptimizerConfig, Sgd, SgdConfig};
pub use schedule::Schedule;
pub use step::{accumulate, cross_entropy, forward_backward, forward_backward_watched, Gradients};
pub use task::Stripes;
pub use trainer::{BatchSource, InMemory, Trainer};

#[cfg(test)]
mod tests;
