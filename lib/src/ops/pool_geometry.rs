//! The shapes of one max-pooling, shared by its CPU kernels and its device passes.

use candle_core::{Shape, Tensor};

use super::{dims4, window_count, OpError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    pub(super) batch: usize,
    pub(super) channels: usize,
    pub(super) height: usize,
    pub(super) width: usize,
    pub(super) kernel: usize,
    pub(super) stride: usize,
    pub(super) padding: usize,
    pub(super) out_h: usize,
    pub(super) out_w: usize,
}

impl Geometry {
    pub fn new(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> std::result::Result<Self, OpError> {
        let op = "max_pool2d";
        let [batch, channels, height, width] = dims4(op, "input", x)?;
        for (what, value) in [("kernel size", kernel), ("stride", stride)] {
            if value == 0 {
                return Err(OpError::Zero { op, what });
            }
        }
        if padding > kernel / 2 {
            return Err(OpError::PoolPadding { kernel, padding });
        }
        let too_large = || OpError::WindowTooLarge { op, kernel_h: kernel, kernel_w: kernel, height, width, padding };
        let out_h = window_count(height, kernel, stride, padding).ok_or_else(too_large)?;
        let out_w = window_count(width, kernel, stride, padding).ok_or_else(too_large)?;
        Ok(Self { batch, channels, height, width, kernel, stride, padding, out_h, out_w })
    }

    pub(super) fn in_plane(&self) -> usize {
        self.height * self.width
    }

    pub(super) fn out_plane(&self) -> usize {
        self.out_h * self.out_w
    }

    pub(super) fn in_shape(&self) -> Shape {
        (self.batch, self.channels, self.height, self.width).into()
    }

    pub(super) fn out_shape(&self) -> Shape {
        (self.batch, self.channels, self.out_h, self.out_w).into()
    }
}
