//! The convolution as candle ops: the forward and its two gradients, each
//! on our CPU kernels ([`super::cpu::conv`]) or on a device body
//! ([`super::cuda`]).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::checked_gradients;
use super::conv_geometry::Geometry;
use super::cpu::conv::{convolve, convolve_grad_input, convolve_grad_weight};
use super::cpu::floats::{f32_view, storage_from_f32};
use super::cuda::{self, Primitives, Reference};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

/// The convolution as a candle op: `x` and `weight` in, output out, and a
/// backward made of the two ops below.
pub(super) struct Conv2d(pub Geometry);

impl CustomOp2 for Conv2d {
    fn name(&self) -> &'static str {
        "conv2d"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return cuda::forward::<Reference, 2>(self.name(), [(s1, l1), (s2, l2)], |p, [x, w]| cuda::conv_forward(p, &self.0, x, w));
        }
        let g = &self.0;
        let x = f32_view(self.name(), s1, l1)?;
        let w = f32_view(self.name(), s2, l2)?;
        let out = convolve(g, &x, &w);
        Ok((storage_from_f32(self.name(), out, s1.dtype())?, g.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::forward::<cuda::Cudnn, 2>(self.name(), [(s1, l1), (s2, l2)], |p, [x, w]| cuda::conv_forward(p, &self.0, x, w))
    }

    fn bwd(&self, x: &Tensor, weight: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let grad_x = if x.track_op() { Some(grad.apply_op2_no_bwd(weight, &Conv2dGradInput(self.0))?) } else { None };
        let grad_w = if weight.track_op() { Some(x.apply_op2_no_bwd(&grad, &Conv2dGradWeight(self.0))?) } else { None };
        let [grad_x, grad_w] = checked_gradients(self.name(), [x, weight], [grad_x, grad_w])?;
        Ok((grad_x, grad_w))
    }
}

/// `(grad_out, weight) -> grad_x`.
pub(super) struct Conv2dGradInput(pub Geometry);

impl Conv2dGradInput {
    fn on_device<P: Primitives>(&self, operands: [(&P::Storage, &Layout); 2]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, 2>("conv2d-grad-input", operands, |p, [dy, w]| cuda::conv_input_gradient(p, &self.0, dy, w))
    }
}

impl CustomOp2 for Conv2dGradInput {
    fn name(&self) -> &'static str {
        "conv2d-grad-input"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(s1, l1), (s2, l2)]);
        }
        let g = &self.0;
        let dy = f32_view(self.name(), s1, l1)?;
        let w = f32_view(self.name(), s2, l2)?;
        let dx = convolve_grad_input(g, &dy, &w);
        Ok((storage_from_f32(self.name(), dx, s1.dtype())?, g.in_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2)])
    }
}

/// `(x, grad_out) -> grad_weight`.
pub(super) struct Conv2dGradWeight(pub Geometry);

impl Conv2dGradWeight {
    fn on_device<P: Primitives>(&self, operands: [(&P::Storage, &Layout); 2]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, 2>("conv2d-grad-weight", operands, |p, [x, dy]| cuda::conv_weight_gradient(p, &self.0, x, dy))
    }
}

impl CustomOp2 for Conv2dGradWeight {
    fn name(&self) -> &'static str {
        "conv2d-grad-weight"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(s1, l1), (s2, l2)]);
        }
        let g = &self.0;
        let x = f32_view(self.name(), s1, l1)?;
        let dy = f32_view(self.name(), s2, l2)?;
        let dw = convolve_grad_weight(g, &x, &dy);
        Ok((storage_from_f32(self.name(), dw, s1.dtype())?, g.weight_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2)])
    }
}
