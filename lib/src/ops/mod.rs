//! The tensor operations the zoo models are made of, with a backward for each:
//! convolution (dense, grouped and depthwise), max-pooling, training-mode
//! batch-norm, multi-head self-attention and the linear layer.
//!
//! On the CPU they are our own kernels (Winograd's F(2x2, 3x3) for dense 3x3
//! stride-1 convolutions with enough work, im2col + gemm for the other dense
//! ones, direct loops for depthwise ones, pooling and batch-norm), threaded over
//! the batch or the channels, for f32, f16 and bf16 (half-precision tensors
//! are computed in f32 and stored back in their own dtype). Elsewhere they
//! use candle's operations.
//!
//! # The room
//!
//! Convolution, pooling, batch-norm and SiLU with their own backward, deciding what they keep.
//! Three rooms, each importing only the one below: the ops themselves (`conv.rs`, `pool.rs`,
//! `norm.rs`, `silu.rs`, `fused_norm.rs`, ...: each a candle op that says what it keeps and picks its
//! body), above their CPU bodies (`cpu/`) and their device passes (`cuda/`), above the shapes both
//! read (`conv_geometry.rs`, `pool_geometry.rs`, `norm_geometry.rs`, `activation.rs`); no file of
//! `ops/` imports one that imports it back. `composed.rs` is candle's own composition of each op,
//! the second body every op is checked against. The CPU room holds the kernels and what they share
//! (dense convolutions as im2col + gemm, `cpu/im2col.rs`, or, 3x3 stride-1 with enough tiles per
//! thread, as Winograd's F(2x2, 3x3) forward and input gradient and F(3x3, 2x2) weight gradient,
//! `cpu/winograd.rs`; the weight gradient of small padded maps such as 2x2 and 4x4 tap by tap, one
//! gemm per kernel tap over the outputs it reads inside the input, the threads sharing the output
//! channels, `cpu/taps.rs`; the choice among them, `cpu/conv.rs`; max-pool's forward reducing each
//! window's rows over whole input rows first, `cpu/pool.rs`; SiLU's `e^x` vectorised, compiled per
//! instruction set and chosen at run time, which GELU and attention use too, `cpu/silu.rs`; the
//! depthwise convolution one multiply-add per tap over a whole padded plane, strided ones through
//! the plane's phases, `cpu/depthwise.rs`; the gemm plan and helpers every product shares,
//! `cpu/gemm.rs`, and the model of gemm's packing buffers, `cpu/gemm_packing.rs`); the lean ops
//! (`fused_norm.rs`): batch-norm fused with its activation and the conv or pool that reads it, and a
//! residual block's end, each keeping only the batch-norm's input and recomputing the rest in
//! backward. On CUDA (the `cuda` feature) every one of these ops, the lean ones included, runs its
//! device passes (`cuda/`) and keeps for backward exactly what it keeps on the CPU, so one rule in
//! `models/rules.rs` serves both: convolutions forward and both gradients with the group count set
//! (a depthwise layer is one call), batch-norm's training forward and backward, max-pool, ReLU and
//! SiLU, the residual add. `cuda/passes.rs` writes each op's passes once against the primitives of
//! `cuda/primitives.rs` (one trait: cuDNN's convolution, batch-norm, pooling, activation and add,
//! what each reads and writes, and the boundary with candle's storages), which have two
//! implementations: `cuda/cudnn.rs`, cuDNN on candle's stream (the cuda feature), and
//! `cuda/reference.rs`, each call computed on host memory as cuDNN documents it, strict where cuDNN
//! is (a descriptor past its buffer or whose output does not follow from its input, an epsilon
//! under cuDNN's least, unwritten memory reading as NaN). Inside `ops::on_reference` an op on CPU
//! tensors runs its device passes on the reference instead of its CPU kernels, so everything the
//! CUDA path decides (descriptors, shapes, packing, the recompute order, what is kept, which
//! gradient goes where) runs in the test command; a card only checks cuDNN's arithmetic.
//! `cuda/descriptors.rs` is the descriptors as plain data (dimensions and strides, grouped filters,
//! the pooling window, batch-norm's per-channel shape), `cuda/plan.rs` the plan cache keyed by
//! pass, shape and element type and the algorithm chosen among cuDNN's heuristics within one 64 MiB
//! workspace per device, which the ledger counts. Every backward returns each gradient in its
//! operand's shape and dtype or fails naming the op (`checked_gradients`). f64, and every dtype on
//! other devices, run candle's plain ops.
//!
//! The ops of a transformer are ours on the CPU too: `ops::linear` (the product and the bias as one
//! op keeping only its output, for every linear layer of every model), `ops::layer_norm` and
//! `ops::gelu` keep only their operands and compute what backward needs again; `ops::attention`
//! reads q, k and v in place from its input and keeps either its probabilities (the plain layers)
//! or one log-sum-exp per row (the lean layers, as memory-efficient attention does; backward
//! recomputes the probabilities, one product more). The lean transformer block reads what a
//! layer-norm or a GELU makes inside the linear layer after it (`ops::norm_linear`,
//! `ops::gelu_linear`: the op takes the layer-norm's or GELU's input, which the layer before keeps
//! anyway, and makes the normalised or activated tensor again in backward), and adds a residual
//! block's input inside the block's last linear layer (`ops::linear_residual`,
//! `ops::gelu_linear_residual`, four operands through candle's `CustomOp4`), so that neither the
//! layer's output nor the sum is kept beside the other: an encoder layer keeps its input, q, k and
//! v, the attention's output and log-sum-exps, the sum after attention and the MLP's hidden layer.
//! `norm_linear`'s backward runs the plain ops one after the other (the layer-norm again, the
//! product's gradients, the layer-norm's backward), on either device. Their scratch (gemm's packing, score buffers,
//! f32 copies of half operands) depends on the batch and the threads, so the analysis lists them
//! (`ModelCost::attentions`, `ModelCost::linears`) and the estimate asks `ops::attention_scratch`
//! and `ops::linear_scratch`, as it does for convolutions; `ops::conv_transpose2d` likewise (one
//! gemm per sample and a pixel shuffle, keeping only its output; `ModelCost::transposed_convs`,
//! `ops::conv_transpose2d_scratch`). The linear layer and the up-convolution are one candle op each
//! whether or not they have a bias, through `ops::biased::Biased` (the op without a bias, and with
//! one), which makes only the gradients their operands need. On CUDA `ops::layer_norm` and
//! `ops::gelu` run their device passes (our kernels in `lib/kernels/transformer.cu`, with twins on
//! the reference primitives), `ops::linear` its own (cuBLAS's product, cuDNN's broadcast add for
//! the bias and its bias gradient) and `ops::attention` its own (per batch element, cuBLAS's
//! products over the heads with q, k and v read in place, and our kernels for the softmax with its
//! log-sum-exp, the probabilities from it, each row's `sum dO * O` and the softmax backward), and
//! each keeps what it keeps on the CPU (attention its probabilities in the input's type, or one f32
//! log-sum-exp per row, as `keeps` says); the up-convolution runs as the transpose of the
//! convolution that takes its output's shape to its input's (cuDNN's three convolution passes with
//! the roles swapped, and its bias calls), keeping only its output as on the CPU. What each op
//! keeps is one rule for both devices; what it holds only while a pass runs differs, and
//! `models::Kernels` says whose transients the rules count: our CPU kernels' (f32 copies of half
//! operands, the lean ops' f32 maps, im2col columns) or the device passes' (half operands read as
//! they are, the lean ops' maps in their own type, a max-pool's output pooled again in its
//! backward, cuDNN's one workspace), with the attentions' buffers of one batch element from
//! `ops::attention_device_scratch`. The device rules are proven on the reference primitives, whose
//! buffers count what a card's allocator would be asked for (`ops::reference_allocations`): each
//! lean op and attention allocates exactly what its rule says, up to the batch-norms' parameter
//! gradients. cuBLAS's own workspace and the vendor's internal buffers are a card's to measure.
//!
//! On the CPU a convolution's scratch depends on the batch and the threads, not on one sample, so
//! the analysis also lists every conv with its shapes (`ModelCost::convs`), and the estimate asks
//! the kernel itself how much it allocates (`ops::conv2d_scratch`: the offset table, each busy
//! thread's im2col and stacking buffers, gemm's packing buffers as `ops/cpu/gemm_packing.rs`
//! mirrors gemm-common's choices, and the weight gradient's per-thread partial sums, with its
//! row-major copy where it accumulates column-major; for a Winograd convolution its transformed
//! kernels and each busy thread's transformed tiles, input and output side, and 16 sums per kernel
//! in the weight gradient; for a weight gradient taken tap by tap the input and output gradient in
//! positions layout and gemm's packing per busy thread). A batch is cut into chunks of images (a
//! multiple of the threads in number), and each thread takes a contiguous run of them with one set
//! of buffers, so the scratch is known before the pass runs. Each conv's backward is a moment of
//! the walk of its own: the weight gradient is summed in f32 beside the scratch (under mixed
//! precision then cast to half beside itself), and the patched candle's gradient store keeps an
//! op's first gradient for a tensor as it is, so nothing is added into zeros after the op
//! (`patches/README.md`). `lib/tests/memory.rs` holds the prediction to the counted allocator
//! (exact on one thread, an upper bound on two).

mod activation;
mod attention;
mod biased;
pub mod composed;
mod conv;
mod conv_geometry;
mod conv_transpose;
mod cpu;
mod cuda;
mod fused_norm;
mod gelu;
mod layer_norm;
mod linear;
mod norm;
mod norm_geometry;
mod norm_linear;
mod pool;
mod pool_geometry;
mod silu;

#[cfg(test)]
mod attention_tests;
#[cfg(test)]
mod conv_transpose_tests;
#[cfg(test)]
mod fused_norm_tests;
#[cfg(test)]
mod linear_tests;
#[cfg(test)]
mod sync_norm_tests;
#[cfg(test)]
mod tests;

use candle_core::{DType, Result, Tensor};

pub use attention::{attention, attention_device_scratch, attention_scratch, AttentionKeeps, AttentionScratch};
pub use conv_transpose::{conv_transpose2d, conv_transpose2d_scratch, ConvTransposeScratch};
#[cfg(feature = "cuda")]
pub use cuda::conv_algorithms;
pub use cuda::{
    allocations as reference_allocations, on_reference, on_the_reference, Allocations, ConvAlgorithm, CudnnPlans,
    WORKSPACE_BYTES as CUDNN_WORKSPACE_BYTES,
};
pub use fused_norm::{norm_act, norm_add_act, Activation, Lean, Norm, OwnOps, PlainOps, Residual, Then};
pub use gelu::gelu;
pub use layer_norm::layer_norm;
pub use linear::{
    fused_linear_scratch, gelu_linear, gelu_linear_residual, linear, linear_residual, linear_scratch, Fused, LinearScratch, Reads,
};
pub use norm::{batch_norm_train, synchronised, BatchNormTrain, BatchStatistics, ProcessSum};
pub use norm_linear::norm_linear;

/// Stride, zero padding (both sides) and groups of a square 2-D convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvParams {
    pub stride: usize,
    pub padding: usize,
    pub groups: usize,
}

/// Shapes and parameters an operation refuses, named with the operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    #[error("{op}: {what} must have 4 dimensions (N x C x H x W), got {dims:?}")]
    NotFourDims { op: &'static str, what: &'static str, dims: Vec<usize> },
    #[error("{op}: {what} must have 3 dimensions (batch x tokens x channels), got {dims:?}")]
    NotThreeDims { op: &'static str, what: &'static str, dims: Vec<usize> },
    #[error(
        "{op}: the last dimension of {dims:?} is not a positive multiple of 3 x {heads} heads (q, k and v of every head side by side)"
    )]
    Heads { op: &'static str, dims: Vec<usize>, heads: usize },
    #[error("{op}: {what} must be at least 1")]
    Zero { op: &'static str, what: &'static str },
    #[error("{op}: {channels} {what} channels are not divisible by {groups} groups")]
    Groups { op: &'static str, what: &'static str, channels: usize, groups: usize },
    #[error("conv2d: weight {weight:?} expects {expected} input channels per group, input {input:?} with {groups} groups gives {got}")]
    WeightChannels { input: Vec<usize>, weight: Vec<usize>, groups: usize, expected: usize, got: usize },
    #[error("{op}: a {kernel_h}x{kernel_w} window does not fit the {height}x{width} input padded by {padding}")]
    WindowTooLarge { op: &'static str, kernel_h: usize, kernel_w: usize, height: usize, width: usize, padding: usize },
    #[error("max_pool2d: padding {padding} exceeds half the kernel {kernel}: some windows would hold only padding")]
    PoolPadding { kernel: usize, padding: usize },
    #[error("{op}: input is {input:?} but the other operand is {other:?}")]
    DTypeMismatch { op: &'static str, input: DType, other: DType },
    #[error("{op}: dtype {dtype:?} is not supported on the CPU (f32, f16 and bf16 are)")]
    UnsupportedDType { op: &'static str, dtype: DType },
    #[error("{op}: operand is not contiguous")]
    NotContiguous { op: &'static str },
    #[error("{op}: {what} must hold one value per channel ({channels}), got shape {dims:?}")]
    PerChannel { op: &'static str, what: &'static str, channels: usize, dims: Vec<usize> },
    #[error("layer_norm: {what} must hold one value per feature ({features}), got shape {dims:?}")]
    PerFeature { what: &'static str, features: usize, dims: Vec<usize> },
    #[error("{op}: input {dims:?} has fewer than 2 values per channel")]
    TooFewValues { op: &'static str, dims: Vec<usize> },
    #[error("{op}: expected CPU tensors, got one on {device}")]
    NotOnCpu { op: &'static str, device: String },
    #[error("{op}: expected CUDA tensors, got one on {device}")]
    NotOnCuda { op: &'static str, device: String },
    #[error("batch-norm: the forward did not record its batch statistics")]
    MissingStatistics,
    #[error("{op}: the forward ran twice on one op and would overwrite its saved statistics")]
    StatisticsTwice { op: &'static str },
    #[error("{op}: the forward kept nothing for the backward")]
    NothingKept { op: &'static str },
    #[error("{op}: a tensor of {dims:?} has 2^31 elements or more, more than cuDNN's int dimensions take")]
    TooLargeForCudnn { op: &'static str, dims: Vec<usize> },
    #[error("{op}: the {what} is {got:?}, where the op's geometry gives {expected:?}")]
    OperandShape { op: &'static str, what: &'static str, expected: Vec<usize>, got: Vec<usize> },
    #[error("{op}: a descriptor reaches element {end} of a buffer of {len}")]
    PastBuffer { op: &'static str, end: usize, len: usize },
    #[error("{op}: a descriptor cuDNN would refuse: {why}")]
    Descriptor { op: &'static str, why: String },
    #[error("{op}: the backward made a {got_dtype:?} gradient of {got:?} for operand {operand}, a {dtype:?} tensor of {dims:?}")]
    GradientMismatch { op: &'static str, operand: usize, dims: Vec<usize>, dtype: DType, got: Vec<usize>, got_dtype: DType },
    #[error("{op}: cuDNN failed with {status}")]
    Cudnn { op: &'static str, status: String },
    #[error("conv2d: no cuDNN algorithm for the {pass} of input {dims:?} by filter {filter:?} fits the {workspace}-byte workspace")]
    NoCudnnAlgorithm { pass: &'static str, dims: Vec<i32>, filter: Vec<i32>, workspace: u64 },
    #[error("{op}: synchronised batch-norm (--sync-bn) runs on our host kernels in f32, f16 and bf16, and this one is {on}")]
    NotSynchronised { op: &'static str, on: String },
    #[error("{op}: no {what} was given")]
    MissingOperand { op: &'static str, what: &'static str },
    #[error("norm_add_act: the residual {residual:?} does not match the block's output {body:?}")]
    ResidualShape { body: Vec<usize>, residual: Vec<usize> },
    #[error("linear: input {dims:?} must have 2 dimensions or more (rows x in features)")]
    LinearInput { dims: Vec<usize> },
    #[error("linear: weight {weight:?} is not out x {features} (PyTorch's out x in) for input {input:?}")]
    LinearWeight { input: Vec<usize>, weight: Vec<usize>, features: usize },
    #[error("linear: bias {bias:?} does not hold one value per output of weight {weight:?}")]
    LinearBias { weight: Vec<usize>, bias: Vec<usize> },
    #[error(
        "conv_transpose2d: weight {weight:?} is not {channels} x out x {kernel} x {kernel} (PyTorch's in x out x k x k) for input {input:?} and kernel {kernel}"
    )]
    ConvTransposeWeight { input: Vec<usize>, weight: Vec<usize>, channels: usize, kernel: usize },
}

impl From<OpError> for candle_core::Error {
    fn from(e: OpError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// The gradients a backward returns, each refused unless it has its
/// operand's shape and dtype. candle adds them into the operands'
/// gradients; a body that makes one in another layout (a device pass
/// writing a flat per-channel buffer) fails here by the op's name, on every
/// device alike.
fn checked_gradients<const N: usize>(op: &'static str, operands: [&Tensor; N], grads: [Option<Tensor>; N]) -> Result<[Option<Tensor>; N]> {
    for (operand, (t, grad)) in operands.iter().zip(&grads).enumerate() {
        if let Some(g) = grad {
            if g.dims() != t.dims() || g.dtype() != t.dtype() {
                Err(OpError::GradientMismatch {
                    op,
                    operand,
                    dims: t.dims().to_vec(),
                    dtype: t.dtype(),
                    got: g.dims().to_vec(),
                    got_dtype: g.dtype(),
                })?
            }
        }
    }
    Ok(grads)
}

/// Output size of a window of `kernel` sliding with `stride` over `size`
/// padded by `padding` on both sides; `None` when it does not fit once.
fn window_count(size: usize, kernel: usize, stride: usize, padding: usize) -> Option<usize> {
    let padded = size + 2 * padding;
    (padded >= kernel).then(|| (padded - kernel) / stride + 1)
}

fn dims4(op: &'static str, what: &'static str, t: &Tensor) -> std::result::Result<[usize; 4], OpError> {
    match *t.dims() {
        [a, b, c, d] => Ok([a, b, c, d]),
        _ => Err(OpError::NotFourDims { op, what, dims: t.dims().to_vec() }),
    }
}

/// Whether `x` runs through our ops: on the CPU, and on CUDA in a build with
/// the cuda feature (through cuDNN), in f32, f16 and bf16.
fn uses_own_kernels(x: &Tensor) -> bool {
    let device = x.device().is_cpu() || (cfg!(feature = "cuda") && x.device().is_cuda());
    device && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

/// `x` is `N x C x H x W`, `weight` is `O x C/groups x K x K`.
///
/// Dense 3x3 stride-1 convolutions with at least 16 channels either side
/// and enough tiles per thread run through Winograd's transforms, other
/// dense and grouped ones as im2col + gemm, depthwise ones (`groups == C`)
/// as a direct loop. Each has a backward for the input and the weight. f64 on the CPU and every dtype on other devices use candle's
/// `conv2d`.
pub fn conv2d(x: &Tensor, weight: &Tensor, p: ConvParams) -> Result<Tensor> {
    let geometry = conv_geometry::Geometry::new(x, weight, p)?;
    if !uses_own_kernels(x) {
        return x.conv2d(weight, p.padding, p.stride, 1, p.groups);
    }
    if x.dtype() != weight.dtype() {
        Err(OpError::DTypeMismatch { op: "conv2d", input: x.dtype(), other: weight.dtype() })?
    }
    x.contiguous()?.apply_op2(&weight.contiguous()?, conv::Conv2d(geometry))
}

/// Bytes our CPU convolution allocates while each of its passes runs,
/// beyond its operands and result, with rayon's thread pool as it is now:
/// per busy thread the im2col and stacking buffers (or Winograd's
/// transformed tiles) and gemm's packing buffer, Winograd's transformed
/// kernels, and the weight gradient's per-thread partial sums. The ledger
/// counts the largest as the host's conv workspace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConvScratch {
    pub forward: u64,
    pub input_gradient: u64,
    pub weight_gradient: u64,
}

impl ConvScratch {
    /// The largest of the three passes.
    pub fn most(&self) -> u64 {
        self.forward.max(self.input_gradient).max(self.weight_gradient)
    }
}

/// [`ConvScratch`] of the convolution of an input of `x` dims (`N x C x H x
/// W`) by a weight of `weight` dims.
pub fn conv2d_scratch(x: [usize; 4], weight: [usize; 4], p: ConvParams) -> std::result::Result<ConvScratch, OpError> {
    Ok(cpu::conv::scratch(&conv_geometry::Geometry::of_dims(x, weight, p)?))
}

/// The CPU kernel a convolution of an `x` of these dims by a `weight` of
/// these takes where it is not im2col + gemm throughout: Winograd's, or the
/// weight gradient tap by tap.
pub fn cpu_conv_kernel(x: [usize; 4], weight: [usize; 4], p: ConvParams) -> Option<&'static str> {
    let g = conv_geometry::Geometry::of_dims(x, weight, p).ok()?;
    if cpu::winograd::applies(&g) {
        Some("winograd")
    } else if cpu::taps::applies(&g) {
        Some("weight grad tap by tap")
    } else {
        None
    }
}

/// SiLU, `x / (1 + e^-x)`. On the CPU in f32, f16 and bf16 it is our op
/// (vectorised, computed in f32 and rounded once, the lean layers'
/// arithmetic); elsewhere candle's `silu`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    if !uses_own_kernels(x) {
        return x.silu();
    }
    x.contiguous()?.apply_op1(silu::Silu)
}

/// Max over `kernel x kernel` windows; padding pads with -inf (at most half
/// the kernel, as in PyTorch). The backward sends each output's gradient to
/// the first maximum of its window, so overlapping windows (3x3 stride 2)
/// train.
pub fn max_pool2d(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    let geometry = pool::Geometry::new(x, kernel, stride, padding)?;
    if x.device().is_cpu() || uses_own_kernels(x) {
        return x.contiguous()?.apply_op1(pool::MaxPool2d(geometry));
    }
    pool::max_pool2d_composed(x, geometry)
}
