//! Training: optimizers, mixed precision, accumulation, checkpointing, clipping, schedules and the Trainer.

pub mod amp;
pub mod clip;
pub mod optim;
pub mod schedule;

pub use amp::{GradScaler, GradScalerConfig};
pub use clip::{clip_grad_norm, grad_norm};
pub use optim::{
    Adam, Adam8bit, Adam8bitConfig, AdamConfig, AdamW, AdamWConfig, OptimError, Optimizer,
    OptimizerConfig, Sgd, SgdConfig,
};
pub use schedule::Schedule;
