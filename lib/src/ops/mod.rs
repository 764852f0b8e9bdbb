//! The tensor operations the zoo models are made of, with a backward for each:
//! convolution (dense and depthwise) and max-pooling.

use candle_core::{Result, Tensor};

/// Stride, zero padding (both sides) and groups of a square 2-D convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvParams {
    pub stride: usize,
    pub padding: usize,
    pub groups: usize,
}

/// `x` is `N x C x H x W`, `weight` is `O x C/groups x K x K`.
pub fn conv2d(x: &Tensor, weight: &Tensor, p: ConvParams) -> Result<Tensor> {
    x.conv2d(weight, p.padding, p.stride, 1, p.groups)
}

/// Max over `kernel x kernel` windows; padding pads with -inf.
pub fn max_pool2d(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    let padded = if padding == 0 {
        x.clone()
    } else {
        let fill = f64::NEG_INFINITY;
        let (n, c, h, w) = x.dims4()?;
        let row = Tensor::full(fill, (n, c, padding, w), x.device())?.to_dtype(x.dtype())?;
        let x = Tensor::cat(&[&row, x, &row], 2)?;
        let col = Tensor::full(fill, (n, c, h + 2 * padding, padding), x.device())?
            .to_dtype(x.dtype())?;
        Tensor::cat(&[&col, &x, &col], 3)?
    };
    padded.max_pool2d_with_stride(kernel, stride)
}
