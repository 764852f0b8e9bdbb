//! The shapes of one 2-D convolution, shared by the dense and the depthwise
//! kernels.

use candle_core::{Shape, Tensor};

use super::{dims4, window_count, ConvParams, OpError};

/// Shapes of one convolution, checked once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    pub batch: usize,
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub out_channels: usize,
    pub kernel_h: usize,
    pub kernel_w: usize,
    pub stride: usize,
    pub padding: usize,
    pub groups: usize,
    pub out_h: usize,
    pub out_w: usize,
}

impl Geometry {
    pub fn new(x: &Tensor, weight: &Tensor, p: ConvParams) -> std::result::Result<Self, OpError> {
        Self::of_dims(dims4("conv2d", "input", x)?, dims4("conv2d", "weight", weight)?, p)
    }

    /// The geometry of an input of `x` dims by a weight of `weight` dims.
    pub fn of_dims(x: [usize; 4], weight: [usize; 4], p: ConvParams) -> std::result::Result<Self, OpError> {
        let op = "conv2d";
        let [batch, channels, height, width] = x;
        let [out_channels, per_group, kernel_h, kernel_w] = weight;
        for (what, value) in [("stride", p.stride), ("groups", p.groups), ("kernel size", kernel_h.min(kernel_w))] {
            if value == 0 {
                return Err(OpError::Zero { op, what });
            }
        }
        for (what, count) in [("input", channels), ("output", out_channels)] {
            if count % p.groups != 0 {
                return Err(OpError::Groups { op, what, channels: count, groups: p.groups });
            }
        }
        if per_group != channels / p.groups {
            return Err(OpError::WeightChannels {
                input: x.to_vec(),
                weight: weight.to_vec(),
                groups: p.groups,
                expected: per_group,
                got: channels / p.groups,
            });
        }
        let too_large = || OpError::WindowTooLarge { op, kernel_h, kernel_w, height, width, padding: p.padding };
        let out_h = window_count(height, kernel_h, p.stride, p.padding).ok_or_else(too_large)?;
        let out_w = window_count(width, kernel_w, p.stride, p.padding).ok_or_else(too_large)?;
        Ok(Self {
            batch,
            channels,
            height,
            width,
            out_channels,
            kernel_h,
            kernel_w,
            stride: p.stride,
            padding: p.padding,
            groups: p.groups,
            out_h,
            out_w,
        })
    }

    pub fn in_per_group(&self) -> usize {
        self.channels / self.groups
    }

    pub fn out_per_group(&self) -> usize {
        self.out_channels / self.groups
    }

    /// Rows of the im2col matrix of one group: one per weight of an output channel.
    pub fn patch(&self) -> usize {
        self.in_per_group() * self.kernel_h * self.kernel_w
    }

    pub fn in_plane(&self) -> usize {
        self.height * self.width
    }

    pub fn out_plane(&self) -> usize {
        self.out_h * self.out_w
    }

    pub fn is_depthwise(&self) -> bool {
        self.groups > 1 && self.groups == self.channels
    }

    /// A 1x1, stride-1, unpadded convolution reads its input as the im2col matrix.
    pub fn is_pointwise(&self) -> bool {
        self.kernel_h == 1 && self.kernel_w == 1 && self.stride == 1 && self.padding == 0
    }

    pub fn out_shape(&self) -> Shape {
        (self.batch, self.out_channels, self.out_h, self.out_w).into()
    }

    pub fn in_shape(&self) -> Shape {
        (self.batch, self.channels, self.height, self.width).into()
    }

    pub fn weight_shape(&self) -> Shape {
        (self.out_channels, self.in_per_group(), self.kernel_h, self.kernel_w).into()
    }
}

/// Outputs `o` in `lo..hi` read inside the input along one axis (`0 <= o *
/// stride + offset - padding < size`); the others read padding.
pub(super) fn valid_outputs(offset: usize, size: usize, outputs: usize, padding: usize, stride: usize) -> (usize, usize) {
    let lo = padding.saturating_sub(offset).div_ceil(stride);
    let hi = match (size + padding).checked_sub(offset + 1) {
        Some(last) => (last / stride + 1).min(outputs),
        None => 0,
    };
    (lo.min(hi), hi)
}
