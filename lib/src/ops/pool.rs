//! Max-pooling with -inf padding as candle ops: on the CPU our kernels
//! ([`super::cpu::pool`]), on a device body its passes ([`super::cuda`]).
//! Elsewhere: a maximum over the window's strided taps, whose backward
//! candle already has (ties share the gradient).

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor};

use super::cuda::{self, Reference};
pub(super) use super::pool_geometry::Geometry;
use super::{checked_gradients, OpError};

fn contiguous<'a, T>(data: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    let (start, end) = layout.contiguous_offsets().ok_or(OpError::NotContiguous { op: "max_pool2d" })?;
    Ok(&data[start..end])
}

pub(super) struct MaxPool2d(pub Geometry);

impl CustomOp1 for MaxPool2d {
    fn name(&self) -> &'static str {
        "max_pool2d"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() && !matches!(storage, CpuStorage::F64(_)) {
            return cuda::forward::<Reference, 1>(self.name(), [(storage, layout)], |p, [x]| cuda::max_pool_forward(p, &self.0, x));
        }
        let g = &self.0;
        let out = match storage {
            CpuStorage::F32(x) => CpuStorage::F32(g.forward(contiguous(x, layout)?)),
            CpuStorage::F16(x) => CpuStorage::F16(g.forward(contiguous(x, layout)?)),
            CpuStorage::BF16(x) => CpuStorage::BF16(g.forward(contiguous(x, layout)?)),
            CpuStorage::F64(x) => CpuStorage::F64(g.forward(contiguous(x, layout)?)),
            other => Err(OpError::UnsupportedDType { op: self.name(), dtype: other.dtype() })?,
        };
        Ok((out, g.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::forward::<cuda::Cudnn, 1>(self.name(), [(storage, layout)], |p, [x]| cuda::max_pool_forward(p, &self.0, x))
    }

    fn bwd(&self, x: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let dx = x.apply_op3_no_bwd(&out.contiguous()?, &grad.contiguous()?, &MaxPool2dGrad(self.0))?;
        let [dx] = checked_gradients(self.name(), [x], [Some(dx)])?;
        Ok(dx)
    }
}

/// `(x, out, grad_out) -> grad_x`. The CPU finds each window's first
/// maximum again in `x`; cuDNN reads the output as well.
struct MaxPool2dGrad(Geometry);

impl MaxPool2dGrad {
    fn on_device<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 3]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, 3>("max_pool2d-grad", operands, |p, [x, y, dy]| cuda::max_pool_backward(p, &self.0, x, y, dy))
    }
}

impl CustomOp3 for MaxPool2dGrad {
    fn name(&self) -> &'static str {
        "max_pool2d-grad"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2), (s3, l3)])
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        out: &CpuStorage,
        out_layout: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() && !matches!(s1, CpuStorage::F64(_)) {
            return self.on_device::<Reference>([(s1, l1), (out, out_layout), (s2, l2)]);
        }
        let g = &self.0;
        let dx = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(dy)) => CpuStorage::F32(g.grad_input(contiguous(x, l1)?, contiguous(dy, l2)?)),
            (CpuStorage::F16(x), CpuStorage::F16(dy)) => CpuStorage::F16(g.grad_input(contiguous(x, l1)?, contiguous(dy, l2)?)),
            (CpuStorage::BF16(x), CpuStorage::BF16(dy)) => CpuStorage::BF16(g.grad_input(contiguous(x, l1)?, contiguous(dy, l2)?)),
            (CpuStorage::F64(x), CpuStorage::F64(dy)) => CpuStorage::F64(g.grad_input(contiguous(x, l1)?, contiguous(dy, l2)?)),
            (x, dy) if x.dtype() != dy.dtype() => Err(OpError::DTypeMismatch { op: self.name(), input: x.dtype(), other: dy.dtype() })?,
            (x, _) => Err(OpError::UnsupportedDType { op: self.name(), dtype: x.dtype() })?,
        };
        Ok((dx, g.in_shape()))
    }
}

/// The same pooling from candle's operations, for devices without our kernel.
pub(super) fn max_pool2d_composed(x: &Tensor, g: Geometry) -> Result<Tensor> {
    let (k, s, p) = (g.kernel, g.stride, g.padding);
    // Every tap reads `out * stride` rows from its offset; pad up to that.
    let hp = (k - 1 + g.out_h * s).max(g.height + 2 * p);
    let wp = (k - 1 + g.out_w * s).max(g.width + 2 * p);
    let tall = pad_neg_inf(x, 2, p, hp - g.height - p)?;
    let padded = pad_neg_inf(&tall, 3, p, wp - g.width - p)?;
    let mut best: Option<Tensor> = None;
    for kh in 0..k {
        let rows = padded.narrow(2, kh, g.out_h * s)?.reshape((g.batch, g.channels, g.out_h, s, wp))?.narrow(3, 0, 1)?;
        for kw in 0..k {
            let tap = rows
                .narrow(4, kw, g.out_w * s)?
                .reshape((g.batch, g.channels, g.out_h, g.out_w, s))?
                .narrow(4, 0, 1)?
                .reshape((g.batch, g.channels, g.out_h, g.out_w))?;
            best = Some(match best {
                None => tap,
                Some(b) => b.maximum(&tap)?,
            });
        }
    }
    best.ok_or_else(|| OpError::Zero { op: "max_pool2d", what: "kernel size" }.into())
}

/// `t` with `before` and `after` slices of -inf added along `dim`.
pub(super) fn pad_neg_inf(t: &Tensor, dim: usize, before: usize, after: usize) -> Result<Tensor> {
    let fill = |size: usize| {
        let mut dims = t.dims().to_vec();
        dims[dim] = size;
        Tensor::full(f32::NEG_INFINITY, dims, t.device())?.to_dtype(t.dtype())
    };
    let mut parts = Vec::with_capacity(3);
    if before > 0 {
        parts.push(fill(before)?);
    }
    parts.push(t.clone());
    if after > 0 {
        parts.push(fill(after)?);
    }
    Tensor::cat(&parts, dim)
}
