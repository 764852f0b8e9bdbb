//! The largest configuration vramlab costs or builds. Each is far beyond any
//! card (a batch of 65,536 ResNet-50 images at 224 px needs terabytes), yet
//! small enough that every byte count stays exact in a `u64` and that a
//! request such as `--batch 4294967296 --res 65535` is refused at once
//! instead of running for a minute and exhausting the host.

use super::{ModelError, Shape};

/// Samples in one pass.
pub const MAX_BATCH: usize = 1 << 16;
/// Height or width of an input, in pixels.
pub const MAX_SIDE: usize = 1 << 14;
/// Channels of an input image.
pub const MAX_CHANNELS: usize = 1 << 12;
/// Outputs of a classifier.
pub const MAX_CLASSES: usize = 1 << 20;

pub(crate) fn check(model: &str, what: &'static str, value: usize, max: usize) -> Result<(), ModelError> {
    if value > max {
        return Err(ModelError::TooLarge { model: model.to_owned(), what, value, max });
    }
    Ok(())
}

pub(crate) fn check_input(model: &str, input: Shape) -> Result<(), ModelError> {
    match input {
        Shape::Map { c, h, w } => {
            check(model, "input channels", c, MAX_CHANNELS)?;
            check(model, "input height", h, MAX_SIDE)?;
            check(model, "input width", w, MAX_SIDE)
        }
        Shape::Flat { features } => check(model, "input features", features, MAX_SIDE * MAX_SIDE),
        Shape::Tokens { n, d } => {
            check(model, "input tokens", n, MAX_SIDE * MAX_SIDE)?;
            check(model, "input features", d, MAX_SIDE * MAX_SIDE)
        }
    }
}
