//! Multi-head self-attention as one op, `softmax(q k^T / sqrt(dh)) v` for
//! every head of an input that holds q, k and v side by side.
//!
//! On the CPU each batch element runs whole on one of rayon's threads: per
//! head gemm makes the scores from q and k read in place through the
//! input's strides, each row's softmax is taken in place, and gemm writes `P
//! v` straight into the head's columns of the output. The backward makes the
//! input's whole gradient in one pass, four products a head, each written
//! into its columns. What the forward keeps for it is the caller's choice
//! ([`AttentionKeeps`]): the probabilities, as an autograd of candle's ops
//! keeps them, or one log-sum-exp per row, from which the backward
//! recomputes them with one more product, as memory-efficient attention does.

use std::ops::Range;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;
use half::{bf16, f16};
use multiversion::multiversion;
use rayon::prelude::*;

use super::cpu::floats::{f32_view, storage_from_f32};
use super::cpu::gemm::{matmul, Mat, Plan};
use super::cpu::gemm_packing::{packing_bytes, Strides};
use super::cpu::silu::exp;
use super::cuda::{self, attention_backward, on_body, Body, DeviceSaves};
use super::{checked_gradients, uses_own_kernels, OpError};

const OP: &str = "attention";

/// What attention keeps for backward besides its input and output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKeeps {
    /// The softmax probabilities, B x H x N x N in the input's dtype, as an
    /// ordinary autograd keeps them (PyTorch's math attention).
    Probabilities,
    /// One f32 log-sum-exp per row (B x H x N); backward recomputes the
    /// probabilities from q and k, as memory-efficient/Flash attention does.
    RowStatistics,
}

impl AttentionKeeps {
    /// Bytes the CPU op keeps from its forward to its backward for an input
    /// of `batch x tokens x 3d` in `dtype` with `heads` heads, beyond the
    /// input and the output (which autograd keeps anyway): `batch * heads *
    /// tokens^2` elements of `dtype` for [`Probabilities`](Self::Probabilities),
    /// `batch * heads * tokens` f32 for [`RowStatistics`](Self::RowStatistics).
    /// The op keeps nothing for an input that needs no gradient.
    pub fn bytes(self, batch: usize, tokens: usize, heads: usize, dtype: DType) -> u64 {
        let rows = (batch * heads * tokens) as u64;
        match self {
            AttentionKeeps::Probabilities => rows * tokens as u64 * dtype.size_in_bytes() as u64,
            AttentionKeeps::RowStatistics => rows * size_of::<f32>() as u64,
        }
    }
}

/// `qkv` is B x N x 3d: q, k and v side by side in the last dimension (as
/// torchvision's `in_proj` gives them), each split into `heads` heads of
/// d/heads (head h of q is columns h*dh..(h+1)*dh, of k d + h*dh.., of v
/// 2d + h*dh..). Returns B x N x d, softmax(q k^T / sqrt(dh)) v with the
/// heads side by side again (ready for out_proj).
///
/// In f32, f16 and bf16 it is one op whose backward reads what `keeps` says
/// it keeps: on the CPU computed in f32 and stored in the input's dtype, on
/// CUDA cuBLAS's products over the heads and our kernels for the softmax and
/// its backward. Elsewhere and in other dtypes it is composed of candle's
/// operations, a plain autograd path that keeps what each of them keeps (the
/// probabilities among them) whatever `keeps` says.
pub fn attention(qkv: &Tensor, heads: usize, keeps: AttentionKeeps) -> Result<Tensor> {
    let geometry = Geometry::of_dims(qkv.dims(), heads)?;
    if geometry.is_empty() {
        // No row to take a softmax of: candle's reductions refuse empty tensors.
        return Tensor::zeros((geometry.batch, geometry.tokens, geometry.dim), qkv.dtype(), qkv.device());
    }
    if !uses_own_kernels(qkv) {
        return composed(qkv, &geometry);
    }
    let keeps = qkv.track_op().then_some(keeps);
    qkv.contiguous()?.apply_op1(Attention { geometry, keeps, saved: OnceLock::new(), on_device: DeviceSaves::default() })
}

/// Bytes the CPU op allocates while each of its passes runs, beyond its
/// operands, its result and what it keeps, with rayon's thread pool as it is
/// now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttentionScratch {
    pub forward: u64,
    pub backward: u64,
}

impl AttentionScratch {
    /// The larger of the two passes.
    pub fn most(&self) -> u64 {
        self.forward.max(self.backward)
    }
}

/// [`AttentionScratch`] of the attention of a `batch x tokens x 3 dim`
/// input in `dtype` (f32, f16 or bf16) with `heads` heads that needs
/// gradients and keeps what `keeps` says. Each busy thread holds an N x N
/// f32 buffer of scores (none where f32 probabilities are kept: they are
/// computed in place) and one f32 per row in the forward; in the backward an
/// N x N buffer of score gradients, and one of probabilities unless they
/// are kept in f32; and gemm's packing for the largest of its products.
/// Half-precision inputs add their f32 copies: the input and the result in
/// the forward, the input, output, output gradient and result in the
/// backward; the result in its own dtype is made from its copy after the
/// threads' buffers are freed, so that these count only where they
/// outweigh it. An input without gradients keeps nothing, and its forward
/// allocates what one keeping [`RowStatistics`](AttentionKeeps::RowStatistics) does.
pub fn attention_scratch(
    batch: usize,
    tokens: usize,
    dim: usize,
    heads: usize,
    dtype: DType,
    keeps: AttentionKeeps,
) -> std::result::Result<AttentionScratch, OpError> {
    let Some(g) = scratch_geometry(batch, tokens, dim, heads, dtype)? else {
        return Ok(AttentionScratch::default());
    };
    let plan = g.plan();
    let packing = |dims, dst, lhs, rhs| packing_bytes(dims, dst, lhs, rhs, plan.gemm_parallelism());
    let (n, d, dh) = (g.tokens, g.dim, g.head_width());
    let floats = |count: usize| (count * size_of::<f32>()) as u64;
    let (qkv_rows, out_rows, square) = (Strides::row_major(3 * d), Strides::row_major(d), Strides::row_major(n));
    // A head of k read as k^T, and a square buffer read transposed.
    let (k_transposed, square_transposed) = (Strides::column_major(3 * d), Strides::column_major(n));
    let scores = packing((n, n, dh), square, qkv_rows, k_transposed);
    let output = packing((n, dh, n), out_rows, square, qkv_rows);
    let value_gradient = packing((n, dh, n), qkv_rows, square_transposed, out_rows);
    let score_gradient = packing((n, n, dh), square, out_rows, k_transposed);
    let query_gradient = packing((n, dh, n), qkv_rows, square, qkv_rows);
    let key_gradient = packing((n, dh, n), qkv_rows, square_transposed, qkv_rows);
    let recomputes = keeps == AttentionKeeps::RowStatistics;
    let backward_packing =
        value_gradient.max(score_gradient).max(query_gradient).max(key_gradient).max(if recomputes { scores } else { 0 });
    let in_place = keeps == AttentionKeeps::Probabilities && dtype == DType::F32;
    let probabilities = if in_place { 0 } else { floats(n * n) };
    let busy = plan.workers() as u64;
    let forward = busy * (probabilities + floats(n) + scores.max(output));
    let backward = busy * (probabilities + floats(n * n) + backward_packing);
    if dtype == DType::F32 {
        return Ok(AttentionScratch { forward, backward });
    }
    // A half-precision result is narrowed from its f32 copy once the
    // threads' buffers are gone: they count only past the result's size.
    let (input, output_len) = (g.batch * g.qkv_len(), g.batch * g.out_len());
    let half = |count: usize| (count * dtype.size_in_bytes()) as u64;
    Ok(AttentionScratch {
        forward: floats(input + output_len) + forward.saturating_sub(half(output_len)),
        backward: floats(2 * input + 2 * output_len) + backward.saturating_sub(half(input)),
    })
}

/// The geometry a scratch is asked for, `None` for an empty one; a dtype
/// the op does not compute in is refused.
fn scratch_geometry(batch: usize, tokens: usize, dim: usize, heads: usize, dtype: DType) -> std::result::Result<Option<Geometry>, OpError> {
    let g = Geometry::of_dims(&[batch, tokens, 3 * dim], heads)?;
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(OpError::UnsupportedDType { op: OP, dtype });
    }
    Ok((!g.is_empty()).then_some(g))
}

/// [`AttentionScratch`] of the device passes (`cuda/passes.rs`) for the
/// same attention, which walk the batch one element at a time: in the
/// forward one element's f32 scores, and its probabilities or its f32
/// log-sum-exps, whichever is not kept; in the backward one element's f32
/// probability gradient, score gradient in `dtype` and f32 `sum dO * O` per
/// row, and, where only the statistics were kept, its scores and
/// probabilities made again. Half inputs are read as they are (no f32
/// copies). On a card, cuBLAS's own workspace comes on top.
pub fn attention_device_scratch(
    batch: usize,
    tokens: usize,
    dim: usize,
    heads: usize,
    dtype: DType,
    keeps: AttentionKeeps,
) -> std::result::Result<AttentionScratch, OpError> {
    let Some(g) = scratch_geometry(batch, tokens, dim, heads, dtype)? else {
        return Ok(AttentionScratch::default());
    };
    let (square, rows) = ((g.heads * g.tokens * g.tokens) as u64, (g.heads * g.tokens) as u64);
    let (f, e) = (size_of::<f32>() as u64, dtype.size_in_bytes() as u64);
    let (forward, again) = match keeps {
        AttentionKeeps::Probabilities => (square * f + rows * f, 0),
        AttentionKeeps::RowStatistics => (square * f + square * e, square * (f + e)),
    };
    Ok(AttentionScratch { forward, backward: square * f + square * e + rows * f + again })
}

/// The same from candle's operations, differentiable by candle's autograd.
pub(super) fn composed(qkv: &Tensor, g: &Geometry) -> Result<Tensor> {
    let (b, n, dh) = (g.batch, g.tokens, g.head_width());
    // 3 x B x H x N x dh: q, k and v, each head's rows together.
    let parts = qkv.reshape((b, n, 3, g.heads, dh))?.permute((2, 0, 3, 1, 4))?;
    let part = |i: usize| parts.get(i)?.contiguous();
    let (q, k, v) = (part(0)?, part(1)?, part(2)?);
    let scores = (q.matmul(&k.t()?)? * g.scale() as f64)?;
    // Subtracting any constant per row leaves the softmax and its gradient
    // as they are: the maximum needs no backward of its own.
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let exp = scores.broadcast_sub(&max)?.exp()?;
    let probabilities = exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)?;
    probabilities.matmul(&v)?.transpose(1, 2)?.reshape((b, n, g.dim))
}

/// The shapes of one attention: `batch x tokens x 3 dim` in, `batch x
/// tokens x dim` out, `heads` heads of `dim / heads`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    pub batch: usize,
    pub tokens: usize,
    pub dim: usize,
    pub heads: usize,
}

/// Where q, k and v start in a row of the input, in units of `dim`.
const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;

impl Geometry {
    pub fn of_dims(dims: &[usize], heads: usize) -> std::result::Result<Self, OpError> {
        let &[batch, tokens, width] = dims else {
            return Err(OpError::NotThreeDims { op: OP, what: "qkv", dims: dims.to_vec() });
        };
        if heads == 0 {
            return Err(OpError::Zero { op: OP, what: "heads" });
        }
        if width == 0 || width % (3 * heads) != 0 {
            return Err(OpError::Heads { op: OP, dims: dims.to_vec(), heads });
        }
        Ok(Self { batch, tokens, dim: width / 3, heads })
    }

    fn is_empty(&self) -> bool {
        self.batch * self.tokens == 0
    }

    pub fn head_width(&self) -> usize {
        self.dim / self.heads
    }

    pub fn scale(&self) -> f32 {
        (1.0 / (self.head_width() as f64).sqrt()) as f32
    }

    /// Elements of one batch element's input.
    fn qkv_len(&self) -> usize {
        self.tokens * 3 * self.dim
    }

    /// Elements of one batch element's output.
    fn out_len(&self) -> usize {
        self.tokens * self.dim
    }

    /// Probabilities of one batch element, every head's `N x N`.
    fn probabilities_len(&self) -> usize {
        self.heads * self.tokens * self.tokens
    }

    /// Rows of one batch element, every head's `N`.
    fn rows(&self) -> usize {
        self.heads * self.tokens
    }

    /// One batch element to a chunk: the threads take runs of whole
    /// elements, or, with fewer elements than threads, share each product.
    fn plan(&self) -> Plan {
        Plan::aiming(self.batch, 1, 1)
    }

    /// Head `h` of q, k or v (`part`) in one batch element's input, `N x dh`.
    fn head<'a>(&self, qkv: &'a [f32], part: usize, h: usize) -> Mat<'a> {
        Mat { data: &qkv[part * self.dim + h * self.head_width()..], row_stride: 3 * self.dim, col_stride: 1 }
    }

    /// `scores = q k^T` of head `h` of one batch element's input.
    fn scores(&self, qkv: &[f32], h: usize, scores: &mut [f32], parallelism: gemm::Parallelism) {
        let (n, dh) = (self.tokens, self.head_width());
        matmul(scores, Strides::row_major(n), (n, n, dh), self.head(qkv, Q, h), transposed(self.head(qkv, K, h)), false, parallelism);
    }
}

fn transposed(m: Mat) -> Mat {
    Mat { data: m.data, row_stride: m.col_stride, col_stride: m.row_stride }
}

fn square(data: &[f32], n: usize) -> Mat<'_> {
    Mat { data, row_stride: n, col_stride: 1 }
}

/// The batch elements worker `t` of `plan` takes.
fn elements(plan: &Plan, t: usize, batch: usize) -> Range<usize> {
    let chunks = plan.chunks_of(t);
    (chunks.start * plan.images).min(batch)..(chunks.end * plan.images).min(batch)
}

/// `data`, `per_element` values a batch element, cut into the runs of
/// elements the workers of `plan` take.
fn worker_parts<'a, T>(plan: &Plan, batch: usize, data: &'a mut [T], per_element: usize) -> Vec<&'a mut [T]> {
    let mut rest = data;
    (0..plan.workers())
        .map(|t| {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(elements(plan, t, batch).len() * per_element);
            rest = tail;
            part
        })
        .collect()
}

/// `run(t, work[t])` for each worker, on rayon's threads when there are several.
fn run_workers<W: Send>(work: Vec<W>, run: impl Fn(usize, W) + Sync + Send) {
    match <[W; 1]>::try_from(work) {
        Ok([only]) => run(0, only),
        Err(work) => work.into_par_iter().enumerate().for_each(|(t, w)| run(t, w)),
    }
}

/// An element type the probabilities are kept in: the input's dtype.
trait Kept: Copy + Send + Sync {
    /// Whether the kernels compute and read the kept probabilities in place
    /// (f32), rather than through an f32 buffer.
    const IN_PLACE: bool;

    fn zeroed(len: usize) -> Vec<Self>;

    /// Where the forward computes a head's probabilities that go to `kept`.
    fn computed_in<'a>(kept: &'a mut [Self], buffer: &'a mut [f32]) -> &'a mut [f32];

    /// Stores what [`computed_in`](Self::computed_in) gave the forward.
    fn store(buffer: &[f32], kept: &mut [Self]);

    /// A head's kept probabilities as f32.
    fn read<'a>(kept: &'a [Self], buffer: &'a mut [f32]) -> &'a [f32];
}

impl Kept for f32 {
    const IN_PLACE: bool = true;

    fn zeroed(len: usize) -> Vec<Self> {
        vec![0.0; len]
    }

    fn computed_in<'a>(kept: &'a mut [Self], _: &'a mut [f32]) -> &'a mut [f32] {
        kept
    }

    fn store(_: &[f32], _: &mut [Self]) {}

    fn read<'a>(kept: &'a [Self], _: &'a mut [f32]) -> &'a [f32] {
        kept
    }
}

macro_rules! kept_in_half {
    ($half:ty) => {
        impl Kept for $half {
            const IN_PLACE: bool = false;

            fn zeroed(len: usize) -> Vec<Self> {
                // Zeroed bits allocate zeroed pages; a fill would be one more pass.
                vec![0u16; len].reinterpret_into()
            }

            fn computed_in<'a>(_: &'a mut [Self], buffer: &'a mut [f32]) -> &'a mut [f32] {
                buffer
            }

            fn store(buffer: &[f32], kept: &mut [Self]) {
                kept.convert_from_f32_slice(buffer);
            }

            fn read<'a>(kept: &'a [Self], buffer: &'a mut [f32]) -> &'a [f32] {
                kept.convert_to_f32_slice(buffer);
                buffer
            }
        }
    };
}

kept_in_half!(f16);
kept_in_half!(bf16);

/// What the forward writes for the backward, cut to a worker's batch
/// elements (or all of them).
enum Keeping<'a, T> {
    Nothing,
    Probabilities(&'a mut [T]),
    RowStatistics(&'a mut [f32]),
}

impl<T> Keeping<'_, T> {
    fn for_workers(self, g: &Geometry, plan: &Plan) -> Vec<Self> {
        match self {
            Keeping::Nothing => (0..plan.workers()).map(|_| Keeping::Nothing).collect(),
            Keeping::Probabilities(p) => {
                worker_parts(plan, g.batch, p, g.probabilities_len()).into_iter().map(Keeping::Probabilities).collect()
            }
            Keeping::RowStatistics(s) => worker_parts(plan, g.batch, s, g.rows()).into_iter().map(Keeping::RowStatistics).collect(),
        }
    }
}

/// Where the backward finds the probabilities, for all batch elements.
enum Source<'a, T> {
    Kept(&'a [T]),
    /// Recomputed from the log-sum-exp of each row.
    Recomputed(&'a [f32]),
}

/// The output (`B x N x d`) of the attention of `qkv`, writing what `keeping` asks for.
fn forward<T: Kept>(g: &Geometry, qkv: &[f32], keeping: Keeping<T>) -> Vec<f32> {
    let plan = g.plan();
    let parallelism = plan.gemm_parallelism();
    let (n, dh, scale) = (g.tokens, g.head_width(), g.scale());
    let nn = n * n;
    let in_place = T::IN_PLACE && matches!(keeping, Keeping::Probabilities(_));
    let mut out = vec![0f32; g.batch * g.out_len()];
    let work: Vec<_> = worker_parts(&plan, g.batch, &mut out, g.out_len()).into_iter().zip(keeping.for_workers(g, &plan)).collect();
    run_workers(work, |t, (out, mut keeping)| {
        let mut buffer = vec![0f32; if in_place { 0 } else { nn }];
        let mut lse = vec![0f32; n];
        for (i, b) in elements(&plan, t, g.batch).enumerate() {
            let qkv = &qkv[b * g.qkv_len()..][..g.qkv_len()];
            let out = &mut out[i * g.out_len()..][..g.out_len()];
            for h in 0..g.heads {
                let head = i * g.heads + h;
                let probabilities = match &mut keeping {
                    Keeping::Probabilities(kept) => T::computed_in(&mut kept[head * nn..][..nn], &mut buffer),
                    _ => &mut buffer[..],
                };
                g.scores(qkv, h, probabilities, parallelism);
                for (row, lse) in probabilities.chunks_exact_mut(n).zip(&mut lse) {
                    *lse = softmax_in_place(row, scale);
                }
                let values = g.head(qkv, V, h);
                matmul(&mut out[h * dh..], Strides::row_major(g.dim), (n, dh, n), square(probabilities, n), values, false, parallelism);
                match &mut keeping {
                    Keeping::Probabilities(kept) => T::store(&buffer, &mut kept[head * nn..][..nn]),
                    Keeping::RowStatistics(kept) => kept[head * n..][..n].copy_from_slice(&lse),
                    Keeping::Nothing => {}
                }
            }
        }
    });
    out
}

/// The gradient of the input (`B x N x 3d`) from the input, the output, the
/// output's gradient and the probabilities.
fn backward<T: Kept>(g: &Geometry, qkv: &[f32], out: &[f32], grad_out: &[f32], source: Source<T>) -> Vec<f32> {
    let plan = g.plan();
    let parallelism = plan.gemm_parallelism();
    let (n, d, dh, scale) = (g.tokens, g.dim, g.head_width(), g.scale());
    let nn = n * n;
    let reads_in_place = T::IN_PLACE && matches!(source, Source::Kept(_));
    let qkv_rows = Strides::row_major(3 * d);
    let mut grad = vec![0f32; g.batch * g.qkv_len()];
    run_workers(worker_parts(&plan, g.batch, &mut grad, g.qkv_len()), |t, grad| {
        let mut buffer = vec![0f32; if reads_in_place { 0 } else { nn }];
        let mut score_grad = vec![0f32; nn];
        for (i, b) in elements(&plan, t, g.batch).enumerate() {
            let qkv = &qkv[b * g.qkv_len()..][..g.qkv_len()];
            let (out, grad_out) = (&out[b * g.out_len()..][..g.out_len()], &grad_out[b * g.out_len()..][..g.out_len()]);
            let grad = &mut grad[i * g.qkv_len()..][..g.qkv_len()];
            for h in 0..g.heads {
                let head = b * g.heads + h;
                let probabilities = match source {
                    Source::Kept(kept) => T::read(&kept[head * nn..][..nn], &mut buffer),
                    Source::Recomputed(lse) => {
                        g.scores(qkv, h, &mut buffer, parallelism);
                        for (row, &lse) in buffer.chunks_exact_mut(n).zip(&lse[head * n..][..n]) {
                            exp_shifted(row, scale, lse);
                        }
                        &buffer[..]
                    }
                };
                let (queries, keys, values) = (g.head(qkv, Q, h), g.head(qkv, K, h), g.head(qkv, V, h));
                let grad_head = Mat { data: &grad_out[h * dh..], row_stride: d, col_stride: 1 };
                let probabilities_t = transposed(square(probabilities, n));
                matmul(&mut grad[2 * d + h * dh..], qkv_rows, (n, dh, n), probabilities_t, grad_head, false, parallelism);
                matmul(&mut score_grad, Strides::row_major(n), (n, n, dh), grad_head, transposed(values), false, parallelism);
                for (r, (grad_row, p_row)) in score_grad.chunks_exact_mut(n).zip(probabilities.chunks_exact(n)).enumerate() {
                    // sum_j P_rj dP_rj, read from the output as sum_c dO_rc O_rc.
                    let row = r * d + h * dh..r * d + (h + 1) * dh;
                    let delta = grad_out[row.clone()].iter().zip(&out[row]).map(|(a, b)| a * b).sum();
                    softmax_backward(grad_row, p_row, delta, scale);
                }
                let grad_scores = square(&score_grad, n);
                matmul(&mut grad[h * dh..], qkv_rows, (n, dh, n), grad_scores, keys, false, parallelism);
                matmul(&mut grad[d + h * dh..], qkv_rows, (n, dh, n), transposed(grad_scores), queries, false, parallelism);
            }
        }
    });
    grad
}

const LANES: usize = 16;

/// The largest value of `row`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = m.max(v);
        }
    }
    lanes.iter().fold(tail, |m, &v| m.max(v))
}

/// `sum_j e^(scale * row[j] - shift)`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn exp_sum(row: &[f32], scale: f32, shift: f32) -> f32 {
    let mut lanes = [0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|&v| exp(scale * v - shift)).sum();
    for chunk in chunks {
        for (s, &v) in lanes.iter_mut().zip(chunk) {
            *s += exp(scale * v - shift);
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `row[j] = e^(scale * row[j] - shift)`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn exp_shifted(row: &mut [f32], scale: f32, shift: f32) {
    for v in row {
        *v = exp(scale * *v - shift);
    }
}

/// Turns a row of scores `s` into `softmax(scale * s)` and returns its
/// log-sum-exp. The probabilities are written as `e^(scale * s - lse)`,
/// the form the backward recomputes from the log-sum-exp, so that both
/// [`AttentionKeeps`] give the same bits.
fn softmax_in_place(row: &mut [f32], scale: f32) -> f32 {
    let shift = scale * row_max(row);
    let lse = shift + exp_sum(row, scale, shift).ln();
    exp_shifted(row, scale, lse);
    lse
}

/// `grad[j] = p[j] * (grad[j] - delta) * scale`: from the gradient of a row
/// of probabilities to that of its scores before scaling, with `delta =
/// sum_j p[j] grad[j]`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn softmax_backward(grad: &mut [f32], p: &[f32], delta: f32, scale: f32) {
    for (g, &p) in grad.iter_mut().zip(p) {
        *g = p * (*g - delta) * scale;
    }
}

/// The probabilities as kept, in the input's dtype.
enum Probabilities {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// What the forward kept for the backward.
enum Saved {
    Probabilities(Probabilities),
    RowStatistics(Vec<f32>),
}

/// The output and the probabilities kept in `T`.
fn keeping_probabilities<T: Kept>(g: &Geometry, qkv: &[f32]) -> (Vec<f32>, Vec<T>) {
    let mut kept = T::zeroed(g.batch * g.probabilities_len());
    let out = forward(g, qkv, Keeping::Probabilities(&mut kept));
    (out, kept)
}

/// Attention as a candle op on the CPU; `keeps` is `None` for an input that
/// needs no gradient.
struct Attention {
    geometry: Geometry,
    keeps: Option<AttentionKeeps>,
    saved: OnceLock<Saved>,
    on_device: DeviceSaves,
}

impl Geometry {
    fn on_device(&self) -> cuda::Attention {
        cuda::Attention { batch: self.batch, tokens: self.tokens, dim: self.dim, heads: self.heads }
    }
}

impl Attention {
    fn device_forward<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 1]) -> Result<(P::Storage, Shape)> {
        let keeps = self.keeps.map(|keeps| match keeps {
            AttentionKeeps::Probabilities => cuda::KeepsOnDevice::Probabilities,
            AttentionKeeps::RowStatistics => cuda::KeepsOnDevice::RowStatistics,
        });
        let g = self.geometry.on_device();
        cuda::forward::<P, 1>(OP, operands, |p, [qkv]| cuda::attention_forward(p, g, qkv, keeps, &self.on_device))
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.device_forward::<cuda::Reference>([(storage, layout)]);
        }
        let g = &self.geometry;
        let qkv = f32_view(OP, storage, layout)?;
        let (out, saved) = match self.keeps {
            None => (forward::<f32>(g, &qkv, Keeping::Nothing), None),
            Some(AttentionKeeps::RowStatistics) => {
                let mut lse = vec![0f32; g.batch * g.rows()];
                (forward::<f32>(g, &qkv, Keeping::RowStatistics(&mut lse)), Some(Saved::RowStatistics(lse)))
            }
            Some(AttentionKeeps::Probabilities) => {
                let (out, kept) = match storage.dtype() {
                    DType::F32 => {
                        let (out, kept) = keeping_probabilities(g, &qkv);
                        (out, Probabilities::F32(kept))
                    }
                    DType::F16 => {
                        let (out, kept) = keeping_probabilities(g, &qkv);
                        (out, Probabilities::F16(kept))
                    }
                    DType::BF16 => {
                        let (out, kept) = keeping_probabilities(g, &qkv);
                        (out, Probabilities::BF16(kept))
                    }
                    dtype => Err(OpError::UnsupportedDType { op: OP, dtype })?,
                };
                (out, Some(Saved::Probabilities(kept)))
            }
        };
        if let Some(saved) = saved {
            self.saved.set(saved).map_err(|_| OpError::StatisticsTwice { op: OP })?;
        }
        Ok((storage_from_f32(OP, out, storage.dtype())?, (g.batch, g.tokens, g.dim).into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &candle_core::CudaStorage, layout: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        self.device_forward::<cuda::Cudnn>([(storage, layout)])
    }

    fn bwd(&self, qkv: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if let Some(body) = Body::of(qkv) {
            let (g, grad) = (self.geometry.on_device(), grad.contiguous()?);
            let dqkv = on_body!(body, attention_backward(g, [qkv, out, &grad], &self.on_device))?;
            let [dqkv] = checked_gradients(OP, [qkv], [Some(dqkv)])?;
            return Ok(dqkv);
        }
        let saved = self.saved.get().ok_or(OpError::NothingKept { op: OP })?;
        let grad_op = AttentionGrad { geometry: self.geometry, saved };
        let [dqkv] = checked_gradients(OP, [qkv], [Some(qkv.apply_op3_no_bwd(out, &grad.contiguous()?, &grad_op)?)])?;
        Ok(dqkv)
    }
}

/// `(qkv, out, grad_out) -> grad_qkv` from what the forward kept.
struct AttentionGrad<'a> {
    geometry: Geometry,
    saved: &'a Saved,
}

impl CustomOp3 for AttentionGrad<'_> {
    fn name(&self) -> &'static str {
        "attention-grad"
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
        for other in [s2, s3] {
            if other.dtype() != s1.dtype() {
                Err(OpError::DTypeMismatch { op: self.name(), input: s1.dtype(), other: other.dtype() })?
            }
        }
        let g = &self.geometry;
        let (qkv, out, grad_out) = (f32_view(self.name(), s1, l1)?, f32_view(self.name(), s2, l2)?, f32_view(self.name(), s3, l3)?);
        let grad = match self.saved {
            Saved::RowStatistics(lse) => backward::<f32>(g, &qkv, &out, &grad_out, Source::Recomputed(lse)),
            Saved::Probabilities(Probabilities::F32(kept)) => backward(g, &qkv, &out, &grad_out, Source::Kept(kept)),
            Saved::Probabilities(Probabilities::F16(kept)) => backward(g, &qkv, &out, &grad_out, Source::Kept(kept)),
            Saved::Probabilities(Probabilities::BF16(kept)) => backward(g, &qkv, &out, &grad_out, Source::Kept(kept)),
        };
        Ok((storage_from_f32(self.name(), grad, s1.dtype())?, l1.shape().clone()))
    }
}
