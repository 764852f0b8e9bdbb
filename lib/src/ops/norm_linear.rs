//! A layer-norm and the linear layer that reads it, as one op: the
//! transformer's pre-norm before attention's input projection and before
//! the MLP. The two ops one after the other keep the layer-norm's output
//! for the linear layer's weight gradient; this op keeps the layer-norm's
//! input (the residual stream, which the block's residual add reads
//! anyway), and backward normalises it again. Forward and backward repeat
//! the plain ops' arithmetic, rounding the normalised tensor to the input's
//! dtype where the plain layer-norm stores it, so the two give the same
//! values.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp4, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

use super::cpu::floats::{f32_view, round_to, storage_from_f32};
use super::cuda::{self, Reference};
use super::layer_norm::{normalise_row, LayerNorm, ROWS};
use super::linear::{with_last, Geometry};
use super::{checked_gradients, uses_own_kernels, OpError};

const OP: &str = "norm_linear";

/// `linear(layer_norm(x, norm_weight, norm_bias, eps), weight, bias)` over
/// `x`'s last dimension, keeping `x` and not the normalised tensor. The
/// layer-norm's weight and bias are f32 (one value per feature), the
/// linear layer's in `x`'s dtype. Where the layer-norm is candle's
/// operations ([`super::layer_norm`]), it is that and [`super::linear`].
pub fn norm_linear(
    x: &Tensor,
    norm_weight: &Tensor,
    norm_bias: &Tensor,
    eps: f64,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let features = x.dim(candle_core::D::Minus1)?;
    for (what, t) in [("weight", norm_weight), ("bias", norm_bias)] {
        if t.dims() != [features] {
            Err(OpError::PerFeature { what, features, dims: t.dims().to_vec() })?
        }
    }
    if features == 0 {
        Err(OpError::Zero { op: OP, what: "the last dimension" })?
    }
    let geometry = Geometry::of_dims(x.dims(), weight.dims(), bias.map(Tensor::dims))?;
    if !uses_own_kernels(x) {
        return super::linear(&super::layer_norm(x, norm_weight, norm_bias, eps)?, weight, bias);
    }
    for other in std::iter::once(weight).chain(bias) {
        if other.dtype() != x.dtype() {
            Err(OpError::DTypeMismatch { op: OP, input: x.dtype(), other: other.dtype() })?
        }
    }
    let params = Tensor::stack(&[norm_weight.to_dtype(DType::F32)?, norm_bias.to_dtype(DType::F32)?], 0)?;
    let bias = match bias {
        Some(bias) => bias.contiguous()?,
        None => Tensor::zeros(geometry.outputs, x.dtype(), x.device())?,
    };
    let op = NormLinear { norm: LayerNorm::new(features, eps), eps: eps as f32, geometry };
    x.contiguous()?.apply_op4(&params, &weight.contiguous()?, &bias, op)
}

/// What the lean layers compose in its place where it is candle's operations.
#[cfg(test)]
pub(super) fn plain(
    x: &Tensor,
    norm_weight: &Tensor,
    norm_bias: &Tensor,
    eps: f64,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let g = Geometry::of_dims(x.dims(), weight.dims(), bias.map(Tensor::dims))?;
    super::linear::composed(&super::layer_norm::composed(x, norm_weight, norm_bias, eps)?, weight, bias, &g)
}

struct NormLinear {
    norm: LayerNorm,
    eps: f32,
    geometry: Geometry,
}

impl NormLinear {
    fn device_forward<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 4]) -> Result<(P::Storage, Shape)> {
        let (ln, l) = (self.norm.on_device(), self.geometry.on_device());
        cuda::forward::<P, 4>(OP, operands, |p, args| cuda::norm_linear_forward(p, ln, l, args))
    }
}

impl CustomOp4 for NormLinear {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
        s4: &CpuStorage,
        l4: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.device_forward::<Reference>([(s1, l1), (s2, l2), (s3, l3), (s4, l4)]);
        }
        let g = &self.geometry;
        let y = {
            // The input's f32 copy normalised in place (a copy of its own in
            // f32), rounded to its dtype as the plain layer-norm's output is;
            // scoped, so that the copies are freed before the result is narrowed.
            let mut normalised = f32_view(OP, s1, l1)?.into_owned();
            let params = f32_view(OP, s2, l2)?;
            let d = g.inputs;
            let (weight, bias) = params.split_at(d);
            normalised.par_chunks_mut(d * ROWS).for_each(|rows| {
                let mut row = vec![0f32; d];
                for x in rows.chunks_mut(d) {
                    normalise_row(x, weight, bias, self.eps, &mut row);
                    x.copy_from_slice(&row);
                }
            });
            round_to(s1.dtype(), &mut normalised);
            let w = f32_view(OP, s3, l3)?;
            g.product(&normalised, &w, Some((s4, l4)), None)?
        };
        Ok((storage_from_f32(OP, y, s1.dtype())?, with_last(l1.dims(), g.outputs)))
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
        s4: &CudaStorage,
        l4: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.device_forward::<cuda::Cudnn>([(s1, l1), (s2, l2), (s3, l3), (s4, l4)])
    }

    /// The plain ops' backward, one after the other, on the input's body:
    /// the layer-norm again for the weight gradient (then dropped), the bias
    /// gradient, the product's input gradient and the layer-norm's backward
    /// from it.
    fn bwd(
        &self,
        x: &Tensor,
        params: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let g = &self.geometry;
        let (norm_weight, norm_bias) = (params.get(0)?, params.get(1)?);
        let weight_grad = match weight.track_op() {
            true => Some(g.weight_gradient_of(&grad, &self.norm.normalised(x, &norm_weight, &norm_bias)?)?),
            false => None,
        };
        let bias_grad = if bias.track_op() { Some(g.bias_gradient_of(&grad)?) } else { None };
        let (input_grad, params_grad) = if x.track_op() || params.track_op() {
            let normalised_grad = g.input_gradient_of(&grad, weight)?;
            let [dx, dweight, dbias] = self.norm.gradients(x, &norm_weight, &normalised_grad)?;
            drop(normalised_grad);
            (x.track_op().then_some(dx), if params.track_op() { Some(Tensor::stack(&[dweight, dbias], 0)?) } else { None })
        } else {
            (None, None)
        };
        let [dx, dparams, dweight, dbias] =
            checked_gradients(OP, [x, params, weight, bias], [input_grad, params_grad, weight_grad, bias_grad])?;
        Ok((dx, dparams, dweight, dbias))
    }
}
