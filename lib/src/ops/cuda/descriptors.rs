//! What the ops ask of the device, as plain data computed on the host:
//! each descriptor's dimensions and strides, the grouped filter, the pooling
//! window and batch-norm's per-channel shape. The cuDNN primitives turn
//! these into descriptors and calls, the reference reads them as cuDNN
//! does.

use candle_core::DType;

use super::super::conv_geometry::Geometry as ConvGeometry;
use super::super::pool_geometry::Geometry as PoolGeometry;
use super::super::OpError;

/// The element types our cuDNN calls take (f32 parameters and statistics
/// whatever the tensors' type, as cuDNN's batch-norm requires).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Element {
    F32,
    F16,
    Bf16,
}

impl Element {
    pub fn of(op: &'static str, dtype: DType) -> Result<Self, OpError> {
        match dtype {
            DType::F32 => Ok(Element::F32),
            DType::F16 => Ok(Element::F16),
            DType::BF16 => Ok(Element::Bf16),
            dtype => Err(OpError::UnsupportedDType { op, dtype }),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Element::F32 => 4,
            Element::F16 | Element::Bf16 => 2,
        }
    }
}

/// A 4-D tensor descriptor: `N x C x H x W` and its element strides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorDims {
    pub dims: [i32; 4],
    pub strides: [i32; 4],
}

impl TensorDims {
    /// A contiguous NCHW tensor; cuDNN takes `int` dimensions and strides, so
    /// a tensor of 2^31 elements or more is refused.
    pub fn packed(op: &'static str, [n, c, h, w]: [usize; 4]) -> Result<Self, OpError> {
        let elements = [n, c, h, w].iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let fits = |v: usize| i32::try_from(v).is_ok();
        match elements {
            Some(e) if fits(e) => {
                let i = |v: usize| v as i32;
                Ok(TensorDims { dims: [i(n), i(c), i(h), i(w)], strides: [i(c * h * w), i(h * w), i(w), 1] })
            }
            _ => Err(OpError::TooLargeForCudnn { op, dims: vec![n, c, h, w] }),
        }
    }

    /// One value per channel of a tensor of `channels` channels: batch-norm's
    /// scale, bias, mean and variance.
    pub fn per_channel(op: &'static str, channels: usize) -> Result<Self, OpError> {
        Self::packed(op, [1, channels, 1, 1])
    }

    pub fn elements(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }
}

/// A convolution's descriptors: input, grouped filter (`O x C/groups x K x
/// K`, so that a depthwise layer is one call), output, and the convolution's
/// padding, stride, dilation and group count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvDims {
    pub x: TensorDims,
    pub filter: [i32; 4],
    pub y: TensorDims,
    pub padding: [i32; 2],
    pub stride: [i32; 2],
    pub dilation: [i32; 2],
    pub groups: i32,
}

impl ConvDims {
    pub fn of(g: &ConvGeometry) -> Result<Self, OpError> {
        let op = "conv2d";
        let x = TensorDims::packed(op, [g.batch, g.channels, g.height, g.width])?;
        let y = TensorDims::packed(op, [g.batch, g.out_channels, g.out_h, g.out_w])?;
        let filter = TensorDims::packed(op, [g.out_channels, g.in_per_group(), g.kernel_h, g.kernel_w])?.dims;
        let (padding, stride) = (g.padding as i32, g.stride as i32);
        Ok(ConvDims { x, filter, y, padding: [padding; 2], stride: [stride; 2], dilation: [1, 1], groups: g.groups as i32 })
    }
}

/// A max-pool's descriptors: input, output, and the square window's size,
/// padding and stride.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolDims {
    pub x: TensorDims,
    pub y: TensorDims,
    pub window: [i32; 2],
    pub padding: [i32; 2],
    pub stride: [i32; 2],
}

impl PoolDims {
    pub fn of(g: &PoolGeometry) -> Result<Self, OpError> {
        let op = "max_pool2d";
        let x = TensorDims::packed(op, [g.batch, g.channels, g.height, g.width])?;
        let y = TensorDims::packed(op, [g.batch, g.channels, g.out_h, g.out_w])?;
        let (k, p, s) = (g.kernel as i32, g.padding as i32, g.stride as i32);
        Ok(PoolDims { x, y, window: [k; 2], padding: [p; 2], stride: [s; 2] })
    }
}

/// A spatial batch-norm's descriptors: the maps and the per-channel values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NormDims {
    pub x: TensorDims,
    pub per_channel: TensorDims,
}

impl NormDims {
    pub fn of(op: &'static str, [n, c, h, w]: [usize; 4]) -> Result<Self, OpError> {
        Ok(NormDims { x: TensorDims::packed(op, [n, c, h, w])?, per_channel: TensorDims::per_channel(op, c)? })
    }
}

/// cuDNN's running variance is the unbiased one (divided by `count - 1`,
/// `count` values per channel); this factor turns it into the biased
/// variance our statistics report.
pub fn biased_from_unbiased(count: usize) -> f64 {
    (count as f64 - 1.0) / count as f64
}
