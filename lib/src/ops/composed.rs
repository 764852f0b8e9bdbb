//! candle's own composition of each op: its convolution, batch-norm from
//! elementwise ops and reductions, max-pool as a maximum over strided views,
//! its activations, and the transformer ops from matmuls and softmax. The
//! second body each op is checked against (`vramlab check-ops` on the CPU).

use candle_core::{Result, Tensor};

use super::fused_norm::{plain_norm_act, plain_norm_add_act, PlainOps};
use super::norm::{self, BatchNormTrain};
use super::{attention as attention_op, conv_transpose, dims4, layer_norm as layer_norm_op, linear as linear_op, pool};
use super::{Activation, ConvParams, Lean, Norm, Residual, Then};

/// The plain ops a lean op is made of, as candle composes them.
pub struct Composed;

impl PlainOps for Composed {
    fn batch_norm(&self, z: &Tensor, norm: Norm<'_>) -> Result<BatchNormTrain> {
        let [n, _, h, w] = dims4("batch_norm_train", "input", z)?;
        norm::composed(z, norm.weight, norm.bias, norm.eps, n * h * w)
    }

    fn activation(&self, act: Activation, x: &Tensor) -> Result<Tensor> {
        match act {
            Activation::Identity => Ok(x.clone()),
            Activation::Relu => x.relu(),
            Activation::Silu => x.silu(),
        }
    }

    fn conv2d(&self, x: &Tensor, weight: &Tensor, p: ConvParams) -> Result<Tensor> {
        x.conv2d(weight, p.padding, p.stride, 1, p.groups)
    }

    fn max_pool2d(&self, x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
        pool::max_pool2d_composed(x, pool::Geometry::new(x, kernel, stride, padding)?)
    }
}

/// GELU with the exact erf.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    x.gelu_erf()
}

pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let geometry = linear_op::Geometry::of_dims(x.dims(), weight.dims(), bias.map(Tensor::dims))?;
    linear_op::composed(x, weight, bias, &geometry)
}

/// candle's `conv_transpose2d` and `broadcast_add`.
pub fn conv_transpose2d(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, kernel: usize) -> Result<Tensor> {
    let geometry = conv_transpose::Geometry::of_dims(x.dims(), weight.dims(), bias.map(Tensor::dims), kernel)?;
    conv_transpose::composed(x, weight, bias, &geometry)
}

pub fn attention(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    attention_op::composed(qkv, &attention_op::Geometry::of_dims(qkv.dims(), heads)?)
}

pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    layer_norm_op::composed(x, weight, bias, eps)
}

/// [`super::norm_act`] as the plain layers would compute it, in candle's ops.
pub fn norm_act(z: &Tensor, norm: Norm<'_>, act: Activation, then: Then<'_>) -> Result<Lean> {
    plain_norm_act(&Composed, z, norm, act, then)
}

/// [`super::norm_add_act`] as the plain layers would compute it, in candle's ops.
pub fn norm_add_act(z: &Tensor, norm: Norm<'_>, residual: Residual<'_>, act: Activation) -> Result<Lean> {
    plain_norm_add_act(&Composed, z, norm, residual, act)
}
