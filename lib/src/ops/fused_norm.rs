//! Lean training ops: batch-norm fused with what reads its output, so that
//! the autograd graph keeps the batch-norm's input and nothing else.
//!
//! Candle keeps every tensor an op holds as an input until the loss is
//! dropped. A plain `conv -> bn -> relu -> conv` keeps three tensors (the
//! conv's output `z`, the batch-norm's output and the ReLU's output);
//! PyTorch keeps two (`z` for batch-norm, the ReLU's output for ReLU and
//! the next conv). These ops take `z` as their graph input and keep only
//! it, with the batch statistics (two floats per channel):
//!
//! - [`norm_act`] computes `then(act(bn(z)))`, where `then` is nothing, a
//!   convolution or a max-pool. Backward recomputes `pre = bn(z)` and
//!   `a = act(pre)` from `z` and the saved statistics (one elementwise pass),
//!   runs the consumer's backward on `a`, multiplies by `act'(pre)` and runs
//!   batch-norm's backward with `z`.
//! - [`norm_add_act`] computes a residual block's end, `act(bn(z) + s)`,
//!   where `s` is the block's input or a second batch-norm of the
//!   projection's output; backward recomputes the sum the same way.
//!
//! Why recompute rather than invert. In-Place ABN (Rota Bulo, Porzi and
//! Kontschieder, CVPR 2018) keeps only the output `y = act(gamma * xhat +
//! beta)` and inverts it: `xhat = (act^-1(y) - beta) / gamma`. That needs
//! an invertible activation (they use leaky ReLU): with ReLU every negative
//! `pre` reads back as 0, yet batch-norm's input gradient
//! `dz = gamma / sigma * (dpre - mean(dpre) - xhat * mean(dpre * xhat))`
//! needs `xhat` at every position, those included; SiLU is not monotonic,
//! so it has no inverse either. Inverting also divides by `gamma`, which
//! training can drive to or near zero, and in f16 `act^-1(y) - beta`
//! cancels digits. Keeping `z` instead costs the same memory (one tensor of
//! the same size), has no division and no cancellation, and gives the
//! gradients of the plain path: the recomputation repeats the forward's
//! arithmetic exactly, rounding to the compute dtype where the plain ops
//! store a half tensor.
//!
//! The one difference from PyTorch's own layers: ReLU's gradient at exactly
//! 0 passes (candle's rule, kept so the two paths agree); PyTorch's
//! `threshold_backward` stops it.
//!
//! On devices and dtypes without our kernels both ops run the plain
//! layers' ops, and keep what those keep.

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

pub use super::activation::Activation;
use super::conv_geometry::Geometry as ConvGeometry;
use super::cpu::conv::{convolve, convolve_grad_input, convolve_grad_weight};
use super::cpu::floats::{f32_view, par_chunks_from, par_filled, round_to, round_to_serial, storage_from_f32};
use super::cpu::{silu, CHUNK};
use super::cuda::{self, norm_act_backward, norm_add_act_backward, on_body, saved_statistics, Body, DeviceSaves};
use super::norm::{self, cpu_f32, BatchStatistics, Statistics};
use super::pool_geometry::Geometry as PoolGeometry;
use super::{checked_gradients, uses_own_kernels, ConvParams, OpError};

impl Activation {
    /// The activation of every element, in place.
    fn apply(self, values: &mut [f32]) {
        match self {
            Activation::Identity => {}
            Activation::Relu => values.iter_mut().for_each(|v| *v = v.max(0.0)),
            Activation::Silu => silu::silu_in_place(values),
        }
    }

    /// `grad *= d act / d pre` at every element, as candle's backward
    /// computes it: from `pre` and the activation as the plain layers
    /// stored it (rounded to `dtype`).
    fn backward(self, dtype: DType, grad: &mut [f32], pre: &[f32]) {
        match self {
            Activation::Identity => {}
            Activation::Relu => {
                for (d, &p) in grad.iter_mut().zip(pre) {
                    *d *= if p >= 0.0 { 1.0 } else { 0.0 };
                }
            }
            Activation::Silu => {
                let (mut exp_neg, mut out) = (vec![0.0; pre.len()], vec![0.0; pre.len()]);
                silu::silu_keeping_exp(pre, &mut exp_neg, &mut out);
                round_to_serial(dtype, &mut out);
                silu::silu_backward(grad, &exp_neg, &out);
            }
        }
    }
}

/// A training-mode batch-norm's affine parameters (f32, one per channel) and epsilon.
#[derive(Debug, Clone, Copy)]
pub struct Norm<'a> {
    pub weight: &'a Tensor,
    pub bias: &'a Tensor,
    pub eps: f64,
}

/// What reads the activation inside the same op.
#[derive(Debug, Clone, Copy)]
pub enum Then<'a> {
    Nothing,
    Conv { weight: &'a Tensor, params: ConvParams },
    MaxPool { kernel: usize, stride: usize, padding: usize },
}

/// What a residual block adds to its batch-normalised body.
#[derive(Debug, Clone, Copy)]
pub enum Residual<'a> {
    /// The block's input, unchanged.
    Identity(&'a Tensor),
    /// A projection's output, through its own batch-norm.
    Norm(&'a Tensor, Norm<'a>),
}

/// A lean op's output and the batch statistics of each batch-norm inside it, in order.
#[derive(Debug, Clone)]
pub struct Lean {
    pub y: Tensor,
    pub stats: Vec<BatchStatistics>,
}

/// `then(act(bn(z)))`, keeping only `z` for backward.
pub fn norm_act(z: &Tensor, norm: Norm<'_>, act: Activation, then: Then<'_>) -> Result<Lean> {
    let geometry = norm::Geometry::checked(OP, z, norm.weight, norm.bias)?;
    let sync = norm::synchronisation(OP, z)?;
    if !uses_own_kernels(z) {
        return plain_norm_act(&OwnOps, z, norm, act, then);
    }
    let consumer = match then {
        Then::Nothing => Consumer::Nothing,
        Then::Conv { weight, params } => {
            if weight.dtype() != z.dtype() {
                Err(OpError::DTypeMismatch { op: OP, input: z.dtype(), other: weight.dtype() })?
            }
            Consumer::Conv(ConvGeometry::new(z, weight, params)?)
        }
        Then::MaxPool { kernel, stride, padding } => Consumer::MaxPool(PoolGeometry::new(z, kernel, stride, padding)?),
    };
    let stats = Arc::new(OnceLock::new());
    let saves = DeviceSaves::default();
    let op =
        NormActOp { norm: geometry, eps: norm.eps, act, consumer, dtype: z.dtype(), stats: Arc::clone(&stats), saves: saves.clone(), sync };
    let z = z.contiguous()?;
    let params = Tensor::stack(&[norm.weight, norm.bias], 0)?;
    let y = match then {
        Then::Conv { weight, .. } => z.apply_op3(&params, &weight.contiguous()?, op)?,
        _ => z.apply_op2(&params, op)?,
    };
    if let Some(body) = Body::of(&z) {
        return Ok(Lean { y, stats: on_body!(body, saved_statistics(OP, &geometry, &z, &saves))? });
    }
    let stats = stats.get().ok_or(OpError::MissingStatistics)?;
    Ok(Lean { y, stats: vec![BatchStatistics::from_kernel(stats, &geometry, z.device())?] })
}

/// `act(bn(z) + residual)`, keeping only `z` and the residual's input for backward.
pub fn norm_add_act(z: &Tensor, norm: Norm<'_>, residual: Residual<'_>, act: Activation) -> Result<Lean> {
    let geometry = norm::Geometry::checked(MERGE, z, norm.weight, norm.bias)?;
    let other = match residual {
        Residual::Identity(x) | Residual::Norm(x, _) => x,
    };
    if other.dims() != z.dims() {
        Err(OpError::ResidualShape { body: z.dims().to_vec(), residual: other.dims().to_vec() })?
    }
    if other.dtype() != z.dtype() {
        Err(OpError::DTypeMismatch { op: MERGE, input: z.dtype(), other: other.dtype() })?
    }
    let sync = norm::synchronisation(MERGE, z)?;
    if !uses_own_kernels(z) {
        return plain_norm_add_act(&OwnOps, z, norm, residual, act);
    }
    let stats = Arc::new(OnceLock::new());
    let saves = DeviceSaves::default();
    let projected = matches!(residual, Residual::Norm(..));
    let op = NormAddActOp {
        norm: geometry,
        eps: norm.eps,
        act,
        projected,
        dtype: z.dtype(),
        stats: Arc::clone(&stats),
        saves: saves.clone(),
        sync,
    };
    let z = z.contiguous()?;
    let y = match residual {
        Residual::Identity(x) => z.apply_op3(&Tensor::stack(&[norm.weight, norm.bias], 0)?, &x.contiguous()?, op)?,
        Residual::Norm(x, side) => {
            norm::Geometry::checked(MERGE, x, side.weight, side.bias)?;
            let params = Tensor::stack(&[norm.weight, norm.bias, side.weight, side.bias], 0)?;
            z.apply_op3(&x.contiguous()?, &params, op)?
        }
    };
    if let Some(body) = Body::of(&z) {
        return Ok(Lean { y, stats: on_body!(body, saved_statistics(MERGE, &geometry, &z, &saves))? });
    }
    let stats = stats.get().ok_or(OpError::MissingStatistics)?;
    let stats = stats.iter().map(|s| BatchStatistics::from_kernel(s, &geometry, z.device())).collect::<Result<_>>()?;
    Ok(Lean { y, stats })
}

/// The ops a lean op is made of, which the plain layers run one after
/// another: ours ([`OwnOps`]), or candle's own ([`super::composed::Composed`]).
pub trait PlainOps {
    fn batch_norm(&self, z: &Tensor, norm: Norm<'_>) -> Result<norm::BatchNormTrain>;
    fn activation(&self, act: Activation, x: &Tensor) -> Result<Tensor>;
    fn conv2d(&self, x: &Tensor, weight: &Tensor, params: ConvParams) -> Result<Tensor>;
    fn max_pool2d(&self, x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor>;
}

/// The public ops of `ops`, each on its own.
pub struct OwnOps;

impl PlainOps for OwnOps {
    fn batch_norm(&self, z: &Tensor, norm: Norm<'_>) -> Result<norm::BatchNormTrain> {
        norm::batch_norm_train(z, norm.weight, norm.bias, norm.eps)
    }

    fn activation(&self, act: Activation, x: &Tensor) -> Result<Tensor> {
        act.forward(x)
    }

    fn conv2d(&self, x: &Tensor, weight: &Tensor, params: ConvParams) -> Result<Tensor> {
        super::conv2d(x, weight, params)
    }

    fn max_pool2d(&self, x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
        super::max_pool2d(x, kernel, stride, padding)
    }
}

/// [`norm_act`] as the plain layers compute it, one op of `ops` after another.
pub(super) fn plain_norm_act(ops: &dyn PlainOps, z: &Tensor, norm: Norm<'_>, act: Activation, then: Then<'_>) -> Result<Lean> {
    let bn = ops.batch_norm(z, norm)?;
    let a = ops.activation(act, &bn.y)?;
    let y = match then {
        Then::Nothing => a,
        Then::Conv { weight, params } => ops.conv2d(&a, weight, params)?,
        Then::MaxPool { kernel, stride, padding } => ops.max_pool2d(&a, kernel, stride, padding)?,
    };
    Ok(Lean { y, stats: vec![bn.stats] })
}

/// [`norm_add_act`] as the plain layers compute it, one op of `ops` after another.
pub(super) fn plain_norm_add_act(ops: &dyn PlainOps, z: &Tensor, norm: Norm<'_>, residual: Residual<'_>, act: Activation) -> Result<Lean> {
    let bn = ops.batch_norm(z, norm)?;
    let (side, mut stats) = match residual {
        Residual::Identity(x) => (x.clone(), Vec::new()),
        Residual::Norm(x, n) => {
            let side = ops.batch_norm(x, n)?;
            (side.y, vec![side.stats])
        }
    };
    stats.insert(0, bn.stats);
    Ok(Lean { y: ops.activation(act, &(bn.y + side)?)?, stats })
}

const OP: &str = "norm_act";
const MERGE: &str = "norm_add_act";

/// `act(x * scale + shift)` per channel, rounded where the plain layers store.
fn normalise(g: &norm::Geometry, dtype: DType, x: &[f32], scale: &[f32], shift: &[f32], act: Activation) -> Vec<f32> {
    par_filled(x.len(), g.plane, 0.0, |i, plane| {
        normalise_plane(dtype, &x[i * g.plane..][..plane.len()], scale[i % g.channels], shift[i % g.channels], plane);
        activate_serial(dtype, plane, act);
    })
}

/// One plane of [`normalise`] before its activation: the passes of the plain
/// layers, a plane at a time while it is in the cache.
fn normalise_plane(dtype: DType, x: &[f32], scale: f32, shift: f32, out: &mut [f32]) {
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = v * scale + shift);
    round_to_serial(dtype, out);
}

/// [`activate`] on one thread.
fn activate_serial(dtype: DType, values: &mut [f32], act: Activation) {
    if act != Activation::Identity {
        act.apply(values);
        round_to_serial(dtype, values);
    }
}

fn activate(dtype: DType, values: &mut [f32], act: Activation) {
    if act != Activation::Identity {
        values.par_chunks_mut(CHUNK).for_each(|c| activate_serial(dtype, c, act));
    }
}

/// `grad *= act'(pre)`, rounded as the plain layers' gradient is.
fn through_activation(dtype: DType, grad: &mut [f32], pre: &[f32], act: Activation) {
    if act == Activation::Identity {
        return;
    }
    grad.par_chunks_mut(CHUNK).zip(pre.par_chunks(CHUNK)).for_each(|(grad, pre)| act.backward(dtype, grad, pre));
    round_to(dtype, grad);
}

fn per_channel(params: &[f32], index: usize, channels: usize) -> &[f32] {
    &params[index * channels..][..channels]
}

#[derive(Debug, Clone, Copy)]
enum Consumer {
    Nothing,
    Conv(ConvGeometry),
    MaxPool(PoolGeometry),
}

struct NormActOp {
    norm: norm::Geometry,
    eps: f64,
    act: Activation,
    consumer: Consumer,
    dtype: DType,
    stats: Arc<OnceLock<Statistics>>,
    saves: DeviceSaves,
    sync: norm::Synchronisation,
}

/// What [`NormActOp`]'s backward returns, each `None` where no gradient is wanted.
struct NormActGrads {
    z: Option<Vec<f32>>,
    params: Option<Vec<f32>>,
    weight: Option<Vec<f32>>,
}

impl NormActOp {
    fn scale_shift(&self, stats: &Statistics, params: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let c = self.norm.channels;
        norm::scale_shift(stats, per_channel(params, 0, c), per_channel(params, 1, c))
    }

    fn forward(&self, z: &[f32], params: &[f32], weight: Option<&[f32]>) -> Result<(Vec<f32>, Shape)> {
        let stats = norm::kept(&self.stats, || norm::statistics(&self.norm, z, self.eps, self.sync.as_deref()))?;
        let (scale, shift) = self.scale_shift(stats, params);
        let a = normalise(&self.norm, self.dtype, z, &scale, &shift, self.act);
        Ok(match (&self.consumer, weight) {
            (Consumer::Nothing, _) => (a, self.norm.shape()),
            (Consumer::Conv(g), Some(w)) => (convolve(g, &a, w), g.out_shape()),
            (Consumer::MaxPool(g), _) => (g.forward(&a), g.out_shape()),
            (Consumer::Conv(_), None) => Err(OpError::MissingOperand { op: OP, what: "convolution weight" })?,
        })
    }

    fn backward(&self, z: &[f32], params: &[f32], weight: Option<&[f32]>, dy: &[f32], want: [bool; 3]) -> Result<NormActGrads> {
        let stats = self.stats.get().ok_or(OpError::MissingStatistics)?;
        let (scale, shift) = self.scale_shift(stats, params);
        let mut pre = norm::affine(&self.norm, z, &scale, &shift, None);
        round_to(self.dtype, &mut pre);
        let activated = |pre: &[f32]| {
            let mut a = pre.to_vec();
            activate(self.dtype, &mut a, self.act);
            a
        };
        let (mut da, dweight) = match (&self.consumer, weight) {
            (Consumer::Nothing, _) => (dy.to_vec(), None),
            (Consumer::Conv(g), Some(w)) => {
                let dweight = want[2].then(|| convolve_grad_weight(g, &activated(&pre), dy));
                let mut da = convolve_grad_input(g, dy, w);
                round_to(self.dtype, &mut da);
                (da, dweight)
            }
            (Consumer::MaxPool(g), _) => {
                let mut da = g.grad_input(&activated(&pre), dy);
                round_to(self.dtype, &mut da);
                (da, None)
            }
            (Consumer::Conv(_), None) => Err(OpError::MissingOperand { op: OP, what: "convolution weight" })?,
        };
        through_activation(self.dtype, &mut da, &pre, self.act);
        drop(pre);
        let c = self.norm.channels;
        let grads = norm::backward(&self.norm, stats, z, &da, per_channel(params, 0, c), want[0], self.sync.as_deref())?;
        let params = want[1].then(|| [grads.dweight, grads.dbias].concat());
        Ok(NormActGrads { z: grads.dx, params, weight: dweight })
    }

    fn lean(&self) -> cuda::Lean<'_> {
        cuda::Lean { norm: cuda::BatchNorm { op: OP, geometry: &self.norm, eps: self.eps }, act: self.act }
    }

    fn on_device(&self) -> cuda::Consumer<'_> {
        match &self.consumer {
            Consumer::Nothing => cuda::Consumer::Nothing,
            Consumer::Conv(g) => cuda::Consumer::Conv(g),
            Consumer::MaxPool(g) => cuda::Consumer::MaxPool(g),
        }
    }

    /// The forward on a device body, from `z`, the packed parameters and the consumer's weight.
    fn device_forward<P: cuda::Primitives, const N: usize>(&self, operands: [(&P::Storage, &Layout); N]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, N>(OP, operands, |p, args| {
            let (z, params, weight) = match args.as_slice() {
                [z, params] => (*z, *params, None),
                [z, params, weight] => (*z, *params, Some(*weight)),
                _ => Err(OpError::MissingOperand { op: OP, what: "packed parameters" })?,
            };
            cuda::norm_act_forward(p, self.lean(), self.on_device(), [z, params], weight, &self.saves)
        })
    }

    /// The gradients from the op's inputs and the output's gradient.
    fn tensor_backward(&self, z: &Tensor, params: &Tensor, weight: Option<&Tensor>, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let grad = grad.contiguous()?;
        if let Some(body) = Body::of(z) {
            return on_body!(body, norm_act_backward(self.lean(), self.on_device(), [z, params], weight, &grad, &self.saves));
        }
        let want = [z.track_op(), params.track_op(), weight.is_some_and(|w| w.track_op())];
        let grads = {
            let (zs, zl) = z.storage_and_layout();
            let (ps, pl) = params.storage_and_layout();
            let (gs, gl) = grad.storage_and_layout();
            let (zv, pv, dy) = (cpu_f32(OP, &zs, zl)?, cpu_f32(OP, &ps, pl)?, cpu_f32(OP, &gs, gl)?);
            match weight {
                Some(w) => {
                    let (ws, wl) = w.storage_and_layout();
                    let wv = cpu_f32(OP, &ws, wl)?;
                    self.backward(&zv, &pv, Some(&wv), &dy, want)?
                }
                None => self.backward(&zv, &pv, None, &dy, want)?,
            }
        };
        Ok([
            tensor_like(grads.z, z)?,
            tensor_like(grads.params, params)?,
            match weight {
                Some(w) => tensor_like(grads.weight, w)?,
                None => None,
            },
        ])
    }
}

/// `values` as a tensor of `like`'s shape, dtype and device.
fn tensor_like(values: Option<Vec<f32>>, like: &Tensor) -> Result<Option<Tensor>> {
    values.map(|v| Tensor::from_vec(v, like.shape(), like.device())?.to_dtype(like.dtype())).transpose()
}

impl CustomOp2 for NormActOp {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.device_forward::<cuda::Reference, 2>([(s1, l1), (s2, l2)]);
        }
        let (out, shape) = self.forward(&f32_view(OP, s1, l1)?, &f32_view(OP, s2, l2)?, None)?;
        Ok((storage_from_f32(OP, out, s1.dtype())?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.device_forward::<cuda::Cudnn, 2>([(s1, l1), (s2, l2)])
    }

    fn bwd(&self, z: &Tensor, params: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let [dz, dparams, _] = self.tensor_backward(z, params, None, grad)?;
        let [dz, dparams] = checked_gradients(OP, [z, params], [dz, dparams])?;
        Ok((dz, dparams))
    }
}

impl CustomOp3 for NormActOp {
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
    ) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.device_forward::<cuda::Reference, 3>([(s1, l1), (s2, l2), (s3, l3)]);
        }
        let weight = f32_view(OP, s3, l3)?;
        let (out, shape) = self.forward(&f32_view(OP, s1, l1)?, &f32_view(OP, s2, l2)?, Some(&weight))?;
        Ok((storage_from_f32(OP, out, s1.dtype())?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.device_forward::<cuda::Cudnn, 3>([(s1, l1), (s2, l2), (s3, l3)])
    }

    fn bwd(
        &self,
        z: &Tensor,
        params: &Tensor,
        weight: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dz, dparams, dweight] = self.tensor_backward(z, params, Some(weight), grad)?;
        let [dz, dparams, dweight] = checked_gradients(OP, [z, params, weight], [dz, dparams, dweight])?;
        Ok((dz, dparams, dweight))
    }
}

/// `act(bn(z) + residual)`. Inputs `(z, params, x)` with `params = [weight; bias]`
/// for an identity residual; `(z, x, params)` with `params = [weight; bias;
/// weight'; bias']` for a projected one, normalised by the second pair.
struct NormAddActOp {
    norm: norm::Geometry,
    eps: f64,
    act: Activation,
    projected: bool,
    dtype: DType,
    stats: Arc<OnceLock<Vec<Statistics>>>,
    sync: norm::Synchronisation,
    saves: DeviceSaves,
}

impl NormAddActOp {
    /// `act(bn(z) + residual)`, rounded as the plain layers' sum and
    /// activation, a plane at a time.
    fn sum(&self, stats: &[Statistics], z: &[f32], x: &[f32], params: &[f32], act: Activation) -> Vec<f32> {
        let (g, c, dtype) = (&self.norm, self.norm.channels, self.dtype);
        let (scale, shift) = norm::scale_shift(&stats[0], per_channel(params, 0, c), per_channel(params, 1, c));
        let side = stats.get(1).map(|side| norm::scale_shift(side, per_channel(params, 2, c), per_channel(params, 3, c)));
        par_chunks_from(z.len(), g.plane, 0.0, Vec::new, |residual: &mut Vec<f32>, i, plane| {
            let (channel, at) = (i % c, i * g.plane..i * g.plane + plane.len());
            normalise_plane(dtype, &z[at.clone()], scale[channel], shift[channel], plane);
            let residual = match &side {
                Some((scale, shift)) => {
                    residual.resize(plane.len(), 0.0);
                    normalise_plane(dtype, &x[at], scale[channel], shift[channel], residual);
                    &residual[..]
                }
                None => &x[at],
            };
            plane.iter_mut().zip(residual).for_each(|(s, r)| *s += r);
            round_to_serial(dtype, plane);
            activate_serial(dtype, plane, act);
        })
    }

    fn forward(&self, z: &[f32], x: &[f32], params: &[f32]) -> Result<Vec<f32>> {
        let stats = norm::kept(&self.stats, || {
            let sync = self.sync.as_deref();
            let mut stats = vec![norm::statistics(&self.norm, z, self.eps, sync)?];
            if self.projected {
                stats.push(norm::statistics(&self.norm, x, self.eps, sync)?);
            }
            Ok(stats)
        })?;
        Ok(self.sum(stats, z, x, params, self.act))
    }

    /// Gradients of `z`, `x` and the packed parameters.
    fn backward(&self, z: &[f32], x: &[f32], params: &[f32], dy: &[f32], want: [bool; 3]) -> Result<[Option<Vec<f32>>; 3]> {
        let stats = self.stats.get().ok_or(OpError::MissingStatistics)?;
        let sum = self.sum(stats, z, x, params, Activation::Identity);
        let mut ds = dy.to_vec();
        through_activation(self.dtype, &mut ds, &sum, self.act);
        drop(sum);
        let c = self.norm.channels;
        let sync = self.sync.as_deref();
        let body = norm::backward(&self.norm, &stats[0], z, &ds, per_channel(params, 0, c), want[0], sync)?;
        let mut dparams = [body.dweight, body.dbias].concat();
        let dx = match stats.get(1) {
            Some(side) => {
                let side = norm::backward(&self.norm, side, x, &ds, per_channel(params, 2, c), want[1], sync)?;
                dparams.extend(side.dweight.into_iter().chain(side.dbias));
                side.dx
            }
            None => want[1].then_some(ds),
        };
        Ok([body.dx, dx, want[2].then_some(dparams)])
    }
}

impl NormAddActOp {
    fn lean(&self) -> cuda::Lean<'_> {
        cuda::Lean { norm: cuda::BatchNorm { op: MERGE, geometry: &self.norm, eps: self.eps }, act: self.act }
    }

    /// The forward on a device body, from the op's three inputs in its order.
    fn device_forward<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 3]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, 3>(MERGE, operands, |p, [z, second, third]| {
            let (x, params) = if self.projected { (second, third) } else { (third, second) };
            cuda::norm_add_act_forward(p, self.lean(), self.projected, [z, x, params], &self.saves)
        })
    }
}

impl CustomOp3 for NormAddActOp {
    fn name(&self) -> &'static str {
        MERGE
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.device_forward::<cuda::Reference>([(s1, l1), (s2, l2), (s3, l3)]);
        }
        let z = f32_view(MERGE, s1, l1)?;
        let ((x, xl), (params, pl)) = if self.projected { ((s2, l2), (s3, l3)) } else { ((s3, l3), (s2, l2)) };
        let out = self.forward(&z, &f32_view(MERGE, x, xl)?, &f32_view(MERGE, params, pl)?)?;
        Ok((storage_from_f32(MERGE, out, s1.dtype())?, self.norm.shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.device_forward::<cuda::Cudnn>([(s1, l1), (s2, l2), (s3, l3)])
    }

    fn bwd(
        &self,
        z: &Tensor,
        second: &Tensor,
        third: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (x, params) = if self.projected { (second, third) } else { (third, second) };
        let [dz, dx, dparams] = checked_gradients(MERGE, [z, x, params], self.gradients([z, x, params], y, grad)?)?;
        Ok(if self.projected { (dz, dx, dparams) } else { (dz, dparams, dx) })
    }
}

impl NormAddActOp {
    /// The gradients of `z`, the residual's input `x` and the packed
    /// parameters, each `None` where its operand needs none.
    fn gradients(&self, [z, x, params]: [&Tensor; 3], y: &Tensor, grad: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let grad = grad.contiguous()?;
        if let Some(body) = Body::of(z) {
            let [dz, dx, dparams] =
                on_body!(body, norm_add_act_backward(self.lean(), self.projected, [z, x, params], [y, &grad], &self.saves))?;
            return Ok([z.track_op().then_some(dz), x.track_op().then_some(dx), params.track_op().then_some(dparams)]);
        }
        let [dz, dx, dparams] = {
            let (zs, zl) = z.storage_and_layout();
            let (xs, xl) = x.storage_and_layout();
            let (ps, pl) = params.storage_and_layout();
            let (gs, gl) = grad.storage_and_layout();
            let want = [z.track_op(), x.track_op(), params.track_op()];
            self.backward(&cpu_f32(MERGE, &zs, zl)?, &cpu_f32(MERGE, &xs, xl)?, &cpu_f32(MERGE, &ps, pl)?, &cpu_f32(MERGE, &gs, gl)?, want)?
        };
        Ok([tensor_like(dz, z)?, tensor_like(dx, x)?, tensor_like(dparams, params)?])
    }
}
