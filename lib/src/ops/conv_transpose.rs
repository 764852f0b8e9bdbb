//! A U-Net's up-convolution, `ConvTranspose2d(C, O, kernel_size=k,
//! stride=k)` with a bias, as one op.
//!
//! With the stride equal to the kernel the windows do not overlap: each
//! input pixel alone makes a `k x k` block of the output, so the op is a
//! linear layer on every pixel (`C -> O k k`) followed by a pixel shuffle.
//! On the CPU each sample is one gemm, `Y' (O k k x H W) = W^T X_n`, the
//! weight read transposed in place through its strides, and `Y'` is then
//! shuffled into the sample's output with the bias; rayon's threads take
//! contiguous runs of samples, each with its own `Y'` and single-threaded
//! gemms (a U-Net's gemms are too small to share: one sample's spread over
//! two threads took longer than on one). candle's
//! `conv_transpose2d` followed by `broadcast_add` makes two tensors of the
//! output's size, and its autograd keeps both; this op makes one, and keeps
//! nothing else (its operands are alive anyway). Its backward makes each
//! gradient only for an operand that needs it, one sample at a time from
//! the output gradient gathered back into `G'_n`: `dx_n = W G'_n` and `dW =
//! sum_n X_n G'_n^T` by gemm (each thread summing its samples, the sums
//! then added), `db` as the sums of the gradient's planes.
//! On a device the op is the transpose of the convolution that takes its
//! output's shape to its input's (`cuda/passes.rs`): cuDNN's three passes of
//! that convolution and its bias calls, keeping the same as on the CPU.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use gemm::Parallelism;
use half::{bf16, f16};
use multiversion::multiversion;
use rayon::prelude::*;

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

#[cfg(feature = "cuda")]
use super::biased::CudaOperand;
use super::biased::{Biased, Operand, WithBias};
use super::conv_geometry::Geometry as ConvGeometry;
use super::cpu::floats::{f32_view, storage_from_f32, zeros};
use super::cpu::gemm::{matmul, parallelism, row_major, transposed};
use super::cpu::gemm_packing::{packing_bytes, Strides};
use super::cuda::{self, Reference};
use super::{uses_own_kernels, ConvParams, OpError};

const OP: &str = "conv_transpose2d";

/// `x` is `N x C x H x W`, `weight` is `C x O x k x k` (PyTorch's
/// layout), `bias` is `O` or `None`, and the stride is the kernel `k`
/// (no padding): returns `N x O x kH x kW` in `x`'s dtype, `out[n, o, i k +
/// a, j k + b] = bias[o] + sum_c x[n, c, i, j] weight[c, o, a, b]`.
///
/// On the CPU in f32, f16 and bf16 it is one op (computed in f32, stored in
/// `x`'s dtype) whose autograd keeps only its output, and so on CUDA in a
/// build with the cuda feature (through cuDNN). Elsewhere and in other
/// dtypes it is candle's `conv_transpose2d` and `broadcast_add`, whose
/// autograd keeps what candle's ops keep: both their outputs.
pub fn conv_transpose2d(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, kernel: usize) -> Result<Tensor> {
    let geometry = Geometry::of_dims(x.dims(), weight.dims(), bias.map(Tensor::dims), kernel)?;
    for other in std::iter::once(weight).chain(bias) {
        if other.dtype() != x.dtype() {
            Err(OpError::DTypeMismatch { op: OP, input: x.dtype(), other: other.dtype() })?
        }
    }
    if !uses_own_kernels(x) {
        return composed(x, weight, bias, &geometry);
    }
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    match bias {
        Some(bias) => x.apply_op3(&weight, &bias.contiguous()?, Biased(ConvTranspose2d(geometry))),
        None => x.apply_op2(&weight, Biased(ConvTranspose2d(geometry))),
    }
}

/// Bytes the CPU op allocates while each of its passes runs, beyond its
/// operands and result, with rayon's thread pool as it is now. The backward
/// runs the gradient passes one after the other (input, weight, bias), each
/// only for an operand that needs it: it holds at most the largest of them
/// beyond the gradients it returns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConvTransposeScratch {
    pub forward: u64,
    pub input_gradient: u64,
    pub weight_gradient: u64,
    pub bias_gradient: u64,
}

impl ConvTransposeScratch {
    /// The largest of the passes.
    pub fn most(&self) -> u64 {
        self.forward.max(self.input_gradient).max(self.weight_gradient).max(self.bias_gradient)
    }
}

/// [`ConvTransposeScratch`] of [`conv_transpose2d`] on an input of `x`
/// dims (`N x C x H x W`) to `out_channels` with a `kernel x kernel`
/// kernel, in `dtype` (f32, f16 or bf16), with or without a bias (the bias
/// adds none). In f32 the forward and the input and weight gradients each
/// hold one sample's `O k k x H W` f32 buffer (`Y'`, or `G'`) beside their
/// gemm's packing; the bias gradient holds nothing. A half-precision pass
/// also widens its operands to f32 (the forward x and W, the input gradient
/// the output gradient and W, the weight gradient the output gradient and
/// x, the bias gradient the output gradient) and computes an f32 result; it
/// then drops the copies and narrows the result into its own dtype, so that
/// the f32 result beside the narrowed one counts where it outweighs the
/// rest: `max(copies + f32 result + the f32 scratch - result, f32 result)`.
pub fn conv_transpose2d_scratch(
    x: [usize; 4],
    out_channels: usize,
    kernel: usize,
    dtype: DType,
) -> std::result::Result<ConvTransposeScratch, OpError> {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(OpError::UnsupportedDType { op: OP, dtype });
    }
    let [_, channels, ..] = x;
    let g = Geometry::of_dims(&x, &[channels, out_channels, kernel, kernel], None, kernel)?;
    let (c, rows, pixels) = (g.channels, g.rows(), g.pixels());
    let split = g.split();
    let packing = |dims, dst, lhs, rhs| packing_bytes(dims, dst, lhs, rhs, split.inner);
    let floats = |count: usize| (count * size_of::<f32>()) as u64;
    let (busy, shuffled) = (split.workers(g.batch) as u64, floats(g.sample_output()));
    let (by_pixel, by_row) = (Strides::row_major(pixels), Strides::row_major(rows));
    // What a pass holds beside its operands and the f32 result at its peak: each busy thread its
    // `Y'` and gemm's packing, and in the weight gradient every thread's sum but the one returned.
    let forward = busy * (shuffled + packing((rows, pixels, c), by_pixel, Strides::column_major(rows), by_pixel));
    let input_gradient = busy * (shuffled + packing((c, pixels, rows), by_pixel, by_row, by_pixel));
    let weight_gradient =
        busy * (shuffled + packing((c, rows, pixels), by_row, by_pixel, Strides::column_major(pixels))) + (busy - 1) * floats(c * rows);
    if dtype == DType::F32 {
        return Ok(ConvTransposeScratch { forward, input_gradient, weight_gradient, bias_gradient: 0 });
    }
    let half = |count: usize| (count * dtype.size_in_bytes()) as u64;
    let pass =
        |copies: usize, result: usize, beside: u64| (floats(copies + result) + beside).saturating_sub(half(result)).max(floats(result));
    let (input, output, weights) = (g.batch * g.sample_input(), g.batch * g.sample_output(), c * rows);
    Ok(ConvTransposeScratch {
        forward: pass(input + weights, output, forward),
        input_gradient: pass(output + weights, input, input_gradient),
        weight_gradient: pass(output + input, weights, weight_gradient),
        bias_gradient: pass(output, g.outputs, 0),
    })
}

/// The same from candle's operations, differentiable by candle's autograd:
/// the transposed convolution and the sum are two tensors of the output's
/// size, both kept.
pub(super) fn composed(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, g: &Geometry) -> Result<Tensor> {
    let y = x.conv_transpose2d(weight, 0, 0, g.kernel, 1)?;
    match bias {
        Some(bias) => y.broadcast_add(&bias.reshape((1, g.outputs, 1, 1))?),
        None => Ok(y),
    }
}

/// The shapes of one up-convolution: `batch x channels x height x width`
/// in, `batch x outputs x kernel height x kernel width` out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    pub batch: usize,
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub outputs: usize,
    pub kernel: usize,
}

impl Geometry {
    pub fn of_dims(x: &[usize], weight: &[usize], bias: Option<&[usize]>, kernel: usize) -> std::result::Result<Self, OpError> {
        let &[batch, channels, height, width] = x else {
            return Err(OpError::NotFourDims { op: OP, what: "input", dims: x.to_vec() });
        };
        if kernel == 0 {
            return Err(OpError::Zero { op: OP, what: "kernel" });
        }
        let refused = || OpError::ConvTransposeWeight { input: x.to_vec(), weight: weight.to_vec(), channels, kernel };
        let &[weight_channels, outputs, kernel_h, kernel_w] = weight else {
            return Err(refused());
        };
        if weight_channels != channels || kernel_h != kernel || kernel_w != kernel {
            return Err(refused());
        }
        if let Some(bias) = bias.filter(|&bias| bias != [outputs]) {
            return Err(OpError::PerChannel { op: OP, what: "bias", channels: outputs, dims: bias.to_vec() });
        }
        Ok(Self { batch, channels, height, width, outputs, kernel })
    }

    /// The convolution whose transpose this is: from the output's shape to
    /// the input's, through the same weight, at stride `k`.
    fn inverse(&self) -> std::result::Result<ConvGeometry, OpError> {
        let k = self.kernel;
        let output = [self.batch, self.outputs, k * self.height, k * self.width];
        ConvGeometry::of_dims(output, [self.channels, self.outputs, k, k], ConvParams { stride: k, padding: 0, groups: 1 })
    }

    /// Input pixels of a channel, the columns of `Y'`.
    fn pixels(&self) -> usize {
        self.height * self.width
    }

    /// The rows of `Y'`, `(o, a, b)`: an input pixel's `O k k` outputs.
    fn rows(&self) -> usize {
        self.outputs * self.kernel * self.kernel
    }

    /// One output channel's plane, `kH x kW`, and its `k k` rows of `Y'`.
    fn plane(&self) -> usize {
        self.kernel * self.kernel * self.pixels()
    }

    fn sample_input(&self) -> usize {
        self.channels * self.pixels()
    }

    /// One sample's output, as many values as its `Y'`.
    fn sample_output(&self) -> usize {
        self.outputs * self.plane()
    }

    fn output_shape(&self) -> Shape {
        (self.batch, self.outputs, self.kernel * self.height, self.kernel * self.width).into()
    }

    /// `Y'` from one output channel's plane: row `a k + b` of the channel's
    /// `k k` rows holds, at column `i W + j`, the plane's value at `(i k + a,
    /// j k + b)`.
    fn unshuffle(&self, plane: &[f32], rows: &mut [f32]) {
        let (k, w, pixels) = (self.kernel, self.width, self.pixels());
        for (i, band) in plane.chunks_exact(k * k * w).enumerate() {
            for (a, line) in band.chunks_exact(k * w).enumerate() {
                for b in 0..k {
                    let row = &mut rows[(a * k + b) * pixels + i * w..][..w];
                    for (dst, src) in row.iter_mut().zip(line[b..].iter().step_by(k)) {
                        *dst = *src;
                    }
                }
            }
        }
    }

    /// The inverse of [`unshuffle`](Self::unshuffle), adding `bias`.
    fn shuffle(&self, rows: &[f32], plane: &mut [f32], bias: f32) {
        let (k, w, pixels) = (self.kernel, self.width, self.pixels());
        for (i, band) in plane.chunks_exact_mut(k * k * w).enumerate() {
            for (a, line) in band.chunks_exact_mut(k * w).enumerate() {
                for b in 0..k {
                    let row = &rows[(a * k + b) * pixels + i * w..][..w];
                    for (dst, src) in line[b..].iter_mut().step_by(k).zip(row) {
                        *dst = src + bias;
                    }
                }
            }
        }
    }

    /// `Y'` (or `G'`) of sample `n` of an output (or its gradient), the
    /// output channels on rayon's threads when `inner` shares them.
    fn gather(&self, output: &[f32], n: usize, rows: &mut [f32], inner: Parallelism) {
        let sample = &output[n * self.sample_output()..][..self.sample_output()];
        // An empty plane has no chunks to take: `max(1)` keeps the chunk size legal.
        let plane = self.plane().max(1);
        let unshuffle = |(rows, plane)| self.unshuffle(plane, rows);
        match inner {
            Parallelism::None => rows.chunks_mut(plane).zip(sample.chunks(plane)).for_each(unshuffle),
            _ => rows.par_chunks_mut(plane).zip(sample.par_chunks(plane)).for_each(unshuffle),
        }
    }

    /// One sample's output from its `Y'` and the bias.
    fn scatter(&self, rows: &[f32], bias: Bias, sample: &mut [f32], inner: Parallelism) {
        let plane = self.plane().max(1);
        let shuffle = |(o, (plane, rows))| self.shuffle(rows, plane, bias.at(o));
        match inner {
            Parallelism::None => sample.chunks_mut(plane).zip(rows.chunks(plane)).enumerate().for_each(shuffle),
            _ => sample.par_chunks_mut(plane).zip(rows.par_chunks(plane)).enumerate().for_each(shuffle),
        }
    }

    /// How a pass shares rayon's threads: runs of whole samples, one per busy thread.
    fn split(&self) -> Split {
        let threads = rayon::current_num_threads().max(1);
        let per_worker = self.batch.div_ceil(threads).max(1);
        let inner = if per_worker >= self.batch { parallelism() } else { Parallelism::None };
        Split { per_worker, inner }
    }
}

/// Samples each busy thread takes, and the parallelism of its gemms and
/// shuffles: one busy thread (a sample alone, or one thread) shares them
/// out instead.
#[derive(Clone, Copy)]
struct Split {
    per_worker: usize,
    inner: Parallelism,
}

impl Split {
    fn workers(&self, batch: usize) -> usize {
        batch.div_ceil(self.per_worker).max(1)
    }
}

/// The bias as the forward reads it, one value per output channel where it
/// is added: a half-precision bias widened whole would be a copy the
/// scratch does not count.
#[derive(Clone, Copy)]
enum Bias<'a> {
    None,
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl<'a> Bias<'a> {
    fn of(operand: Option<Operand<'a>>) -> Result<Self> {
        let Some((storage, layout)) = operand else {
            return Ok(Bias::None);
        };
        let (start, end) = layout.contiguous_offsets().ok_or(OpError::NotContiguous { op: OP })?;
        Ok(match storage {
            CpuStorage::F32(v) => Bias::F32(&v[start..end]),
            CpuStorage::F16(v) => Bias::F16(&v[start..end]),
            CpuStorage::BF16(v) => Bias::BF16(&v[start..end]),
            other => Err(OpError::UnsupportedDType { op: OP, dtype: other.dtype() })?,
        })
    }

    fn at(self, o: usize) -> f32 {
        match self {
            Bias::None => 0.0,
            Bias::F32(v) => v[o],
            Bias::F16(v) => v[o].to_f32(),
            Bias::BF16(v) => v[o].to_f32(),
        }
    }
}

/// The up-convolution, a candle op through [`Biased`].
struct ConvTranspose2d(Geometry);

impl ConvTranspose2d {
    /// The forward on a device body, with or without a bias.
    fn device_forward<P: cuda::Primitives>(
        &self,
        x: (&P::Storage, &Layout),
        weight: (&P::Storage, &Layout),
        bias: Option<(&P::Storage, &Layout)>,
    ) -> Result<(P::Storage, Shape)> {
        let inverse = self.0.inverse()?;
        cuda::forward_with_bias::<P>(OP, x, weight, bias, |p, x, w, b| cuda::conv_transpose_forward(p, &inverse, x, w, b))
    }
}

impl WithBias for ConvTranspose2d {
    const NAME: &'static str = OP;

    fn forward(&self, x: Operand, weight: Operand, bias: Option<Operand>) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.device_forward::<Reference>(x, weight, bias);
        }
        let g = &self.0;
        let y = {
            // Scoped, so that the f32 copies of half-precision operands and
            // the sample's buffer are freed before the result is narrowed.
            let (xs, w) = (f32_view(OP, x.0, x.1)?, f32_view(OP, weight.0, weight.1)?);
            let bias = Bias::of(bias)?;
            let mut y = zeros(g.batch * g.sample_output());
            let split = g.split();
            let dims = (g.rows(), g.pixels(), g.channels);
            y.par_chunks_mut((split.per_worker * g.sample_output()).max(1)).enumerate().for_each(|(t, part)| {
                let mut rows = zeros(g.sample_output());
                for (i, sample) in part.chunks_exact_mut(g.sample_output()).enumerate() {
                    let n = t * split.per_worker + i;
                    let x_n = row_major(&xs[n * g.sample_input()..][..g.sample_input()], g.pixels());
                    matmul(&mut rows, Strides::row_major(g.pixels()), dims, transposed(&w, g.rows()), x_n, false, split.inner);
                    g.scatter(&rows, bias, sample, split.inner);
                }
            });
            y
        };
        Ok((storage_from_f32(OP, y, x.0.dtype())?, g.output_shape()))
    }

    fn input_gradient(&self, grad: &Tensor, weight: &Tensor, _x: &Tensor) -> Result<Tensor> {
        grad.apply_op2_no_bwd(weight, &InputGradient(self.0))
    }

    fn weight_gradient(&self, grad: &Tensor, x: &Tensor) -> Result<Tensor> {
        grad.apply_op2_no_bwd(x, &WeightGradient(self.0))
    }

    fn bias_gradient(&self, grad: &Tensor) -> Result<Tensor> {
        grad.apply_op1_no_bwd(&BiasGradient(self.0))
    }

    #[cfg(feature = "cuda")]
    fn cuda_forward(&self, x: CudaOperand, weight: CudaOperand, bias: Option<CudaOperand>) -> Result<(CudaStorage, Shape)> {
        self.device_forward::<cuda::Cudnn>(x, weight, bias)
    }
}

/// `(grad_out, weight) -> grad_x`, per sample `W G'_n`, in `x`'s shape.
struct InputGradient(Geometry);

impl CustomOp2 for InputGradient {
    fn name(&self) -> &'static str {
        "conv_transpose2d-grad-input"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(s1, l1), (s2, l2)]);
        }
        let g = &self.0;
        let dx = {
            let (dy, w) = (f32_view(self.name(), s1, l1)?, f32_view(self.name(), s2, l2)?);
            let mut dx = zeros(g.batch * g.sample_input());
            let split = g.split();
            let dims = (g.channels, g.pixels(), g.rows());
            dx.par_chunks_mut((split.per_worker * g.sample_input()).max(1)).enumerate().for_each(|(t, part)| {
                let mut rows = zeros(g.sample_output());
                for (i, dx_n) in part.chunks_exact_mut(g.sample_input()).enumerate() {
                    g.gather(&dy, t * split.per_worker + i, &mut rows, split.inner);
                    let (w, rows) = (row_major(&w, g.rows()), row_major(&rows, g.pixels()));
                    matmul(dx_n, Strides::row_major(g.pixels()), dims, w, rows, false, split.inner);
                }
            });
            dx
        };
        Ok((storage_from_f32(self.name(), dx, s1.dtype())?, (g.batch, g.channels, g.height, g.width).into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2)])
    }
}

impl InputGradient {
    fn on_device<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 2]) -> Result<(P::Storage, Shape)> {
        let inverse = self.0.inverse()?;
        cuda::forward::<P, 2>(self.name(), operands, |p, [dy, w]| cuda::conv_transpose_input_gradient(p, &inverse, dy, w))
    }
}

/// `(grad_out, x) -> grad_weight = sum_n X_n G'_n^T`, `C x O x k x k`.
struct WeightGradient(Geometry);

impl CustomOp2 for WeightGradient {
    fn name(&self) -> &'static str {
        "conv_transpose2d-grad-weight"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(s1, l1), (s2, l2)]);
        }
        let g = &self.0;
        let dw = {
            let (dy, xs) = (f32_view(self.name(), s1, l1)?, f32_view(self.name(), s2, l2)?);
            let split = g.split();
            let dims = (g.channels, g.rows(), g.pixels());
            let sums: Vec<Vec<f32>> = (0..split.workers(g.batch))
                .into_par_iter()
                .map(|t| {
                    let mut dw = zeros(g.channels * g.rows());
                    let mut rows = zeros(g.sample_output());
                    for n in t * split.per_worker..g.batch.min((t + 1) * split.per_worker) {
                        g.gather(&dy, n, &mut rows, split.inner);
                        let x_n = row_major(&xs[n * g.sample_input()..][..g.sample_input()], g.pixels());
                        matmul(&mut dw, Strides::row_major(g.rows()), dims, x_n, transposed(&rows, g.pixels()), true, split.inner);
                    }
                    dw
                })
                .collect();
            let mut sums = sums.into_iter();
            let mut dw = sums.next().unwrap_or_else(|| zeros(g.channels * g.rows()));
            for other in sums {
                dw.iter_mut().zip(&other).for_each(|(sum, v)| *sum += v);
            }
            dw
        };
        Ok((storage_from_f32(self.name(), dw, s1.dtype())?, (g.channels, g.outputs, g.kernel, g.kernel).into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2)])
    }
}

impl WeightGradient {
    fn on_device<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 2]) -> Result<(P::Storage, Shape)> {
        let inverse = self.0.inverse()?;
        cuda::forward::<P, 2>(self.name(), operands, |p, [dy, x]| cuda::conv_transpose_weight_gradient(p, &inverse, dy, x))
    }
}

/// `grad_out -> grad_bias`, the sum of each output channel's planes.
struct BiasGradient(Geometry);

impl CustomOp1 for BiasGradient {
    fn name(&self) -> &'static str {
        "conv_transpose2d-grad-bias"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(storage, layout)]);
        }
        let g = &self.0;
        let dy = f32_view(self.name(), storage, layout)?;
        let mut db = vec![0f32; g.outputs];
        db.par_iter_mut().enumerate().for_each(|(o, db)| {
            *db = (0..g.batch).map(|n| sum(&dy[(n * g.outputs + o) * g.plane()..][..g.plane()])).sum();
        });
        Ok((storage_from_f32(self.name(), db, storage.dtype())?, g.outputs.into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(storage, layout)])
    }
}

impl BiasGradient {
    fn on_device<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 1]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, 1>(self.name(), operands, |p, [dy]| cuda::conv_transpose_bias_gradient(p, dy))
    }
}

/// Running sums a plane's sum keeps: float additions stay in the order
/// written, so one running sum would not vectorise; sixteen fill one
/// AVX-512 vector or two of AVX2.
const LANES: usize = 16;

/// The sum of `values`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn sum(values: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let chunks = values.chunks_exact(LANES);
    let rest: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            *lane += v;
        }
    }
    lanes.iter().sum::<f32>() + rest
}
