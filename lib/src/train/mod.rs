//! Training: optimizers, mixed precision, accumulation, checkpointing, clipping, schedules and the Trainer.
