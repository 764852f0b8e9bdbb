//! The shapes of one training-mode batch-norm and the statistics it reports,
//! shared by its CPU kernels and its device passes.

use candle_core::{Shape, Tensor};

use super::{dims4, OpError};

/// A batch's statistics per channel (f32, detached), from which the caller
/// updates its running statistics.
#[derive(Debug, Clone)]
pub struct BatchStatistics {
    pub mean: Tensor,
    /// Biased (divided by the count): multiply by `count / (count - 1)` for the running variance.
    pub var: Tensor,
    /// Values per channel, `N * H * W`.
    pub count: usize,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Geometry {
    pub batch: usize,
    pub channels: usize,
    pub height: usize,
    pub plane: usize,
}

impl Geometry {
    /// The geometry of a batch-norm of `x` (`N x C x H x W`) by `weight` and
    /// `bias` (`C` values each), refused where it cannot normalise.
    pub fn checked(op: &'static str, x: &Tensor, weight: &Tensor, bias: &Tensor) -> std::result::Result<Self, OpError> {
        let [n, c, h, w] = dims4(op, "input", x)?;
        for (what, t) in [("weight", weight), ("bias", bias)] {
            if t.dims() != [c] {
                return Err(OpError::PerChannel { op, what, channels: c, dims: t.dims().to_vec() });
            }
        }
        if n * h * w < 2 {
            return Err(OpError::TooFewValues { op, dims: x.dims().to_vec() });
        }
        Ok(Geometry { batch: n, channels: c, height: h, plane: h * w })
    }

    pub fn shape(&self) -> Shape {
        (self.batch, self.channels, self.height, self.plane / self.height).into()
    }

    pub fn count(&self) -> usize {
        self.batch * self.plane
    }

    /// The planes of channel `c`, one per image.
    pub(super) fn planes<'a>(&self, data: &'a [f32], c: usize) -> impl Iterator<Item = &'a [f32]> + 'a {
        let (channels, plane) = (self.channels, self.plane);
        (0..self.batch).map(move |n| &data[(n * channels + c) * plane..][..plane])
    }
}
