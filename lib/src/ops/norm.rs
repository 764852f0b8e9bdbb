//! Training-mode batch-norm as one op. On the CPU the forward reads the input
//! twice (statistics, then the normalised output) and the backward twice
//! (per-channel sums, then the input gradient), where the same computation
//! from candle's elementwise ops makes about a dozen passes each way and keeps
//! their intermediates alive for backward.
//!
//! Inside [`synchronised`], the batch is spread over several processes and
//! batch-norm normalises by the statistics of all their batches
//! (PyTorch's `SyncBatchNorm`): the per-channel sums of the forward and of
//! the backward's input gradient are summed over the processes.

use std::cell::RefCell;
use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;

use super::cpu::floats::{f32_view, par_filled, storage_from_f32};
use super::cuda::{self, batch_norm_backward, on_body, saved_statistics, Body, DeviceSaves};
pub use super::norm_geometry::BatchStatistics;
pub(super) use super::norm_geometry::Geometry;
use super::{checked_gradients, uses_own_kernels, OpError};

const OP: &str = "batch_norm_train";

/// What a training-mode batch-norm computes: the output (differentiable with
/// respect to input, weight and bias) and the batch statistics.
#[derive(Debug, Clone)]
pub struct BatchNormTrain {
    pub y: Tensor,
    pub stats: BatchStatistics,
}

impl BatchStatistics {
    pub(super) fn from_kernel(stats: &Statistics, g: &Geometry, device: &candle_core::Device) -> Result<Self> {
        Ok(BatchStatistics {
            mean: Tensor::from_slice(&stats.mean, g.channels, device)?,
            var: Tensor::from_slice(&stats.var, g.channels, device)?,
            count: stats.count,
        })
    }
}

/// The element-wise sum of per-channel values over the processes one batch
/// is spread over, every process getting the sum.
pub trait ProcessSum: Send + Sync {
    fn sum(&self, values: Vec<f32>) -> Result<Vec<f32>>;
}

/// Where a batch-norm's sums come from: its own batch, or every process's.
pub(super) type Synchronisation = Option<Arc<dyn ProcessSum>>;

thread_local! {
    static SYNCHRONISED: RefCell<Synchronisation> = const { RefCell::new(None) };
}

/// Runs `f` with every training-mode batch-norm made on this thread
/// normalising by the statistics of all the processes' batches, through
/// `sum`, in its forward and in its backward (whenever that runs). Every
/// process must make the same batch-norms in the same order, as processes
/// running one network do. Our host kernels only: a batch-norm on a card,
/// or in a dtype they do not take, is refused.
pub fn synchronised<R>(sum: Arc<dyn ProcessSum>, f: impl FnOnce() -> R) -> R {
    struct Restore(Synchronisation);
    impl Drop for Restore {
        fn drop(&mut self) {
            SYNCHRONISED.with(|s| *s.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(SYNCHRONISED.with(|s| s.borrow_mut().replace(sum)));
    f()
}

/// The synchronisation a batch-norm of `x` made now takes part in, refused
/// where only our host kernels could run it.
pub(super) fn synchronisation(op: &'static str, x: &Tensor) -> Result<Synchronisation> {
    let sync = SYNCHRONISED.with(|s| s.borrow().clone());
    if sync.is_some() && !(x.device().is_cpu() && uses_own_kernels(x) && !cuda::on_the_reference()) {
        let on = if x.device().is_cpu() { format!("{:?} on the host", x.dtype()) } else { format!("{:?}", x.device().location()) };
        Err(OpError::NotSynchronised { op, on })?
    }
    Ok(sync)
}

/// The statistics in `cell`, made by `make` the first time.
pub(super) fn kept<T>(cell: &OnceLock<T>, make: impl FnOnce() -> Result<T>) -> Result<&T> {
    if let Some(kept) = cell.get() {
        return Ok(kept);
    }
    let made = make()?;
    Ok(cell.get_or_init(|| made))
}

/// `y = (x - mean) / sqrt(var + eps) * weight + bias` with the statistics of
/// this batch per channel; `x` is `N x C x H x W`, `weight` and `bias` hold
/// `C` values. `y` has `x`'s dtype; the arithmetic is f32.
pub fn batch_norm_train(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<BatchNormTrain> {
    let geometry = Geometry::checked(OP, x, weight, bias)?;
    let sync = synchronisation(OP, x)?;
    if !uses_own_kernels(x) {
        return composed(x, weight, bias, eps, geometry.count());
    }
    let stats = Arc::new(OnceLock::new());
    let saves = DeviceSaves::default();
    let op = BatchNormOp { geometry, eps, stats: Arc::clone(&stats), saves: saves.clone(), sync };
    let y = x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)?;
    if let Some(body) = Body::of(x) {
        let saved = on_body!(body, saved_statistics(OP, &geometry, x, &saves))?;
        let stats = saved.into_iter().next().ok_or(OpError::MissingStatistics)?;
        return Ok(BatchNormTrain { y, stats });
    }
    let stats = stats.get().ok_or(OpError::MissingStatistics)?;
    Ok(BatchNormTrain { y, stats: BatchStatistics::from_kernel(stats, &geometry, x.device())? })
}

/// The same from candle's operations, for devices and dtypes without our kernel.
pub(super) fn composed(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64, count: usize) -> Result<BatchNormTrain> {
    let channels = weight.dim(0)?;
    let per_channel = |t: &Tensor| t.to_dtype(DType::F32)?.reshape((1, channels, 1, 1));
    let x32 = x.to_dtype(DType::F32)?;
    let mean = x32.mean_keepdim((0, 2, 3))?;
    let centred = x32.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim((0, 2, 3))?;
    let y = centred.broadcast_div(&(&var + eps)?.sqrt()?)?.broadcast_mul(&per_channel(weight)?)?.broadcast_add(&per_channel(bias)?)?;
    let stats = BatchStatistics { mean: mean.flatten_all()?.detach(), var: var.flatten_all()?.detach(), count };
    Ok(BatchNormTrain { y: y.to_dtype(x.dtype())?, stats })
}

#[derive(Debug)]
pub(super) struct Statistics {
    pub mean: Vec<f32>,
    pub var: Vec<f32>,
    pub inv_std: Vec<f32>,
    /// Values per channel they are of: this batch's, or every process's.
    pub count: usize,
}

const LANES: usize = 16;

/// `sum f(a[i], b[i])` in f32 lanes that vectorise, totalled in f64.
fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f64 {
    let mut lanes = [0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f64 = a_chunks.remainder().iter().zip(b_chunks.remainder()).map(|(&x, &y)| f(x, y) as f64).sum();
    for (ca, cb) in a_chunks.zip(b_chunks) {
        for i in 0..LANES {
            lanes[i] += f(ca[i], cb[i]);
        }
    }
    lanes.iter().map(|&v| v as f64).sum::<f64>() + tail
}

pub(super) fn statistics(g: &Geometry, x: &[f32], eps: f64, sync: Option<&dyn ProcessSum>) -> Result<Statistics> {
    let Some(sync) = sync else {
        let per_channel: Vec<(f32, f32)> = (0..g.channels)
            .into_par_iter()
            .map(|c| {
                let sum: f64 = g.planes(x, c).map(|p| lane_sum(p, p, |v, _| v)).sum();
                let mean = (sum / g.count() as f64) as f32;
                let squares: f64 = g.planes(x, c).map(|p| lane_sum(p, p, |v, _| (v - mean) * (v - mean))).sum();
                (mean, (squares / g.count() as f64) as f32)
            })
            .collect();
        let (mean, var): (Vec<f32>, Vec<f32>) = per_channel.into_iter().unzip();
        return Ok(Statistics::of(mean, var, eps, g.count()));
    };
    // The same two passes, each channel's sums added over the processes
    // between them: the mean of the whole batch, then the squares about it.
    let sums: Vec<f32> =
        (0..g.channels).into_par_iter().map(|c| g.planes(x, c).map(|p| lane_sum(p, p, |v, _| v)).sum::<f64>() as f32).collect();
    let mut totals = sync.sum([sums, vec![g.count() as f32]].concat())?;
    let count = totals.pop().unwrap_or_default().round() as usize;
    let mean: Vec<f32> = totals.iter().map(|&sum| (sum as f64 / count as f64) as f32).collect();
    let squares: Vec<f32> = (0..g.channels)
        .into_par_iter()
        .map(|c| g.planes(x, c).map(|p| lane_sum(p, p, |v, _| (v - mean[c]) * (v - mean[c]))).sum::<f64>() as f32)
        .collect();
    let var = sync.sum(squares)?.iter().map(|&squares| (squares as f64 / count as f64) as f32).collect();
    Ok(Statistics::of(mean, var, eps, count))
}

impl Statistics {
    fn of(mean: Vec<f32>, var: Vec<f32>, eps: f64, count: usize) -> Statistics {
        let inv_std = var.iter().map(|&v| (1.0 / (v as f64 + eps).sqrt()) as f32).collect();
        Statistics { mean, var, inv_std, count }
    }
}

/// `out[n, c, i] = x[n, c, i] * scale[c] + shift[c]`, and `+ dy * dy_scale[c]` when given.
pub(super) fn affine(g: &Geometry, x: &[f32], scale: &[f32], shift: &[f32], dy: Option<(&[f32], &[f32])>) -> Vec<f32> {
    par_filled(x.len(), g.plane, 0.0, |i, dst| {
        let c = i % g.channels;
        let src = &x[i * g.plane..][..g.plane];
        match dy {
            None => dst.iter_mut().zip(src).for_each(|(d, &v)| *d = v * scale[c] + shift[c]),
            Some((dy, dy_scale)) => {
                let dy = &dy[i * g.plane..][..g.plane];
                dst.iter_mut().zip(src).zip(dy).for_each(|((d, &v), &e)| *d = v * scale[c] + shift[c] + e * dy_scale[c])
            }
        }
    })
}

/// What batch-norm's backward gives for an output gradient `dy`.
pub(super) struct Gradients {
    /// `None` when the input needs no gradient.
    pub dx: Option<Vec<f32>>,
    /// `sum(dy * xhat)` per channel.
    pub dweight: Vec<f32>,
    /// `sum(dy)` per channel.
    pub dbias: Vec<f32>,
}

/// Batch-norm's backward from its input `x`, its statistics and the output
/// gradient `dy`: two passes, the per-channel sums, then the input gradient.
/// Synchronised, the input gradient takes the sums over every process; the
/// weight's and bias's stay this process's, for the gradients' own
/// reduction to add up.
pub(super) fn backward(
    g: &Geometry,
    stats: &Statistics,
    x: &[f32],
    dy: &[f32],
    weight: &[f32],
    want_dx: bool,
    sync: Option<&dyn ProcessSum>,
) -> Result<Gradients> {
    let sums: Vec<(f64, f64)> = (0..g.channels)
        .into_par_iter()
        .map(|c| {
            let mean = stats.mean[c];
            g.planes(x, c)
                .zip(g.planes(dy, c))
                .fold((0.0, 0.0), |(s, sx), (xp, dp)| (s + lane_sum(dp, dp, |d, _| d), sx + lane_sum(xp, dp, |v, d| (v - mean) * d)))
        })
        .collect();
    let dbias: Vec<f32> = sums.iter().map(|s| s.0 as f32).collect();
    let dweight: Vec<f32> = sums.iter().zip(&stats.inv_std).map(|(s, i)| (s.1 * *i as f64) as f32).collect();
    if !want_dx {
        return Ok(Gradients { dx: None, dweight, dbias });
    }
    let summed = match sync {
        None => None,
        Some(sync) => {
            let mut totals = sync.sum([dbias.clone(), sums.iter().map(|s| s.1 as f32).collect()].concat())?;
            let sum_dy_xmu = totals.split_off(g.channels);
            Some((totals, sum_dy_xmu.iter().zip(&stats.inv_std).map(|(&s, &i)| (s as f64 * i as f64) as f32).collect::<Vec<f32>>()))
        }
    };
    let (sum_dy, sum_dy_xhat) = summed.as_ref().map_or((&dbias, &dweight), |(dy, dy_xhat)| (dy, dy_xhat));
    // dx = k (dy - sum_dy / M - xhat * sum_dy_xhat / M) with k = weight * inv_std,
    // written as dx = x * scale + shift + dy * k.
    let m = stats.count as f32;
    let k: Vec<f32> = weight.iter().zip(&stats.inv_std).map(|(w, s)| w * s).collect();
    let scale: Vec<f32> = (0..g.channels).map(|c| -k[c] * stats.inv_std[c] * sum_dy_xhat[c] / m).collect();
    let shift: Vec<f32> = (0..g.channels).map(|c| -k[c] * sum_dy[c] / m - scale[c] * stats.mean[c]).collect();
    let dx = affine(g, x, &scale, &shift, Some((dy, &k)));
    Ok(Gradients { dx: Some(dx), dweight, dbias })
}

/// The per-channel `(scale, shift)` of the forward: `y = x * scale + shift`.
pub(super) fn scale_shift(stats: &Statistics, weight: &[f32], bias: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let scale: Vec<f32> = weight.iter().zip(&stats.inv_std).map(|(w, s)| w * s).collect();
    let shift: Vec<f32> = bias.iter().zip(&scale).zip(&stats.mean).map(|((b, s), m)| b - m * s).collect();
    (scale, shift)
}

struct BatchNormOp {
    geometry: Geometry,
    eps: f64,
    stats: Arc<OnceLock<Statistics>>,
    saves: DeviceSaves,
    sync: Synchronisation,
}

impl BatchNormOp {
    /// The gradients of input, weight and bias, each `None` where its operand needs none.
    fn gradients(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = &self.geometry;
        let grad = grad.contiguous()?;
        if let Some(body) = Body::of(x) {
            let [dx, dweight, dbias] = on_body!(body, batch_norm_backward(self.on_device(), x, weight, &grad, &self.saves))?;
            let wanted = |t: Tensor, like: &Tensor| like.track_op().then_some(t);
            return Ok((wanted(dx, x), wanted(dweight, weight), wanted(dbias, bias)));
        }
        let stats = self.stats.get().ok_or(OpError::MissingStatistics)?;
        let gradients = {
            let (xs, xl) = x.storage_and_layout();
            let (gs, gl) = grad.storage_and_layout();
            let (ws, wl) = weight.storage_and_layout();
            let (xv, dy, wv) = (cpu_f32(OP, &xs, xl)?, cpu_f32(OP, &gs, gl)?, cpu_f32(OP, &ws, wl)?);
            backward(g, stats, &xv, &dy, &wv, x.track_op(), self.sync.as_deref())?
        };
        let Gradients { dx, dweight: sum_dy_xhat, dbias: sum_dy } = gradients;
        let device = x.device();
        let grad_x = match dx {
            Some(dx) => Some(Tensor::from_vec(dx, x.shape(), device)?.to_dtype(x.dtype())?),
            None => None,
        };
        let per_channel = |values: Vec<f32>, like: &Tensor| -> Result<Option<Tensor>> {
            if !like.track_op() {
                return Ok(None);
            }
            Ok(Some(Tensor::from_vec(values, g.channels, device)?.to_dtype(like.dtype())?))
        };
        Ok((grad_x, per_channel(sum_dy_xhat, weight)?, per_channel(sum_dy, bias)?))
    }

    fn on_device(&self) -> cuda::BatchNorm<'_> {
        cuda::BatchNorm { op: OP, geometry: &self.geometry, eps: self.eps }
    }

    fn device_forward<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 3]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, 3>(OP, operands, |p, args| cuda::batch_norm_forward(p, self.on_device(), args, &self.saves))
    }
}

/// The elements of a tensor's storage as f32, for a backward that reads tensors.
pub(super) fn cpu_f32<'a>(op: &'static str, t: &'a Storage, layout: &Layout) -> Result<std::borrow::Cow<'a, [f32]>> {
    match t {
        Storage::Cpu(cpu) => f32_view(op, cpu, layout),
        other => Err(OpError::NotOnCpu { op, device: format!("{:?}", other.device().location()) })?,
    }
}

impl CustomOp3 for BatchNormOp {
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
            return self.device_forward::<cuda::Reference>([(s1, l1), (s2, l2), (s3, l3)]);
        }
        let g = &self.geometry;
        let x = f32_view(OP, s1, l1)?;
        let (weight, bias) = (f32_view(OP, s2, l2)?, f32_view(OP, s3, l3)?);
        let stats = kept(&self.stats, || statistics(g, &x, self.eps, self.sync.as_deref()))?;
        let (scale, shift) = scale_shift(stats, &weight, &bias);
        let y = affine(g, &x, &scale, &shift, None);
        Ok((storage_from_f32(OP, y, s1.dtype())?, g.shape()))
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
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dweight, dbias) = self.gradients(x, weight, bias, grad)?;
        let [dx, dweight, dbias] = checked_gradients(OP, [x, weight, bias], [dx, dweight, dbias])?;
        Ok((dx, dweight, dbias))
    }
}
