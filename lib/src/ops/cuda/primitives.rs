//! The device primitives the ops' device passes are written against: cuDNN's
//! convolution, batch-norm, pooling, activation and add, as one trait with
//! two implementations, cuDNN on a card ([`super::cudnn`], the cuda feature)
//! and a reference on host memory ([`super::reference`]) that computes what
//! each call is documented to compute. Every method says which buffers the
//! call reads and writes, and with which scaling: `passes.rs` relies on
//! exactly that and nothing more.

use candle_core::{DType, Layout, Result, Shape, Tensor};

use super::super::OpError;
use super::descriptors::{ConvDims, Element, NormDims, PoolDims, TensorDims};

/// Where an operand starts in a buffer, in elements.
pub struct At<'a, B> {
    pub buffer: &'a B,
    pub offset: usize,
}

impl<B> Clone for At<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for At<'_, B> {}

/// An operand of a pass: where it is and its shape.
pub struct Arg<'a, B> {
    pub at: At<'a, B>,
    pub shape: &'a Shape,
}

impl<B> Clone for Arg<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Arg<'_, B> {}

/// A buffer made by a pass, with the shape of its whole length.
pub struct Made<B> {
    pub buffer: B,
    pub shape: Shape,
}

/// An operand of a custom op: the storage itself, or a copy of it where
/// the device cannot read the storage in place (the reference reads host
/// storages into buffers of its own).
pub enum Held<'a, B> {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Borrowed {
        buffer: &'a B,
        offset: usize,
        shape: &'a Shape,
    },
    Owned(Made<B>),
}

impl<B> Held<'_, B> {
    pub fn arg(&self) -> Arg<'_, B> {
        match self {
            Held::Borrowed { buffer, offset, shape } => Arg { at: At { buffer, offset: *offset }, shape },
            Held::Owned(made) => made.arg(),
        }
    }
}

impl<B> Made<B> {
    pub fn arg(&self) -> Arg<'_, B> {
        Arg { at: At { buffer: &self.buffer, offset: 0 }, shape: &self.shape }
    }
}

/// Which of a convolution's three passes runs, on which operands; each
/// writes its output with scaling 1 and does not read it (beta 0).
pub enum ConvCall<'a, B> {
    /// `y = conv(x, w)`, a cross-correlation with the descriptor's padding, stride, dilation and groups.
    Forward { x: At<'a, B>, w: At<'a, B>, y: At<'a, B> },
    /// `dx = conv_transpose(dy, w)`.
    InputGradient { dy: At<'a, B>, w: At<'a, B>, dx: At<'a, B> },
    /// `dw = correlate(x, dy)`, summed over the batch.
    WeightGradient { x: At<'a, B>, dy: At<'a, B>, dw: At<'a, B> },
}

/// Where max-pooling's backward reads the output gradient and writes the input's.
pub struct PoolGrads<'a, B> {
    pub dy: At<'a, B>,
    pub dx: At<'a, B>,
}

/// The activations the device runs for our ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceActivation {
    Relu,
    /// `x * sigmoid(x)`, cuDNN's swish with beta 1.
    Silu,
}

/// Maps of one shape and element type, as the elementwise calls take them.
#[derive(Debug, Clone, Copy)]
pub struct Maps {
    pub dims: TensorDims,
    pub element: Element,
}

impl Maps {
    /// A tensor of `shape` as cuDNN's 4-D descriptors take it: its own `N x
    /// C x H x W` where it has four dimensions, else its rows as `N` and its
    /// last dimension as `C`.
    pub fn of(op: &'static str, shape: &Shape, element: Element) -> std::result::Result<Self, OpError> {
        let dims = match *shape.dims() {
            [n, c, h, w] => [n, c, h, w],
            [] => [1, 1, 1, 1],
            [.., last] => [shape.elem_count() / last.max(1), last, 1, 1],
        };
        Ok(Maps { dims: TensorDims::packed(op, dims)?, element })
    }
}

/// A spatial batch-norm's shapes, element type and epsilon.
#[derive(Debug, Clone, Copy)]
pub struct NormCall {
    pub dims: NormDims,
    pub element: Element,
    pub eps: f64,
}

/// cuDNN's smallest batch-norm epsilon (`CUDNN_BN_MIN_EPSILON`): it refuses a smaller one.
pub const MIN_NORM_EPS: f64 = 1e-5;

/// A batch's per-channel statistics as the device's batch-norm saves them
/// (f32): the mean and `1 / sqrt(var + eps)` its backward reads, and the
/// unbiased variance it writes as the running variance.
pub struct NormStatistics<B> {
    pub mean: B,
    pub inv_std: B,
    pub unbiased_var: B,
}

/// Where batch-norm's backward writes: the input's gradient, and the f32
/// per-channel gradients of the scale and the bias.
pub struct NormGrads<'a, B> {
    pub dx: At<'a, B>,
    pub dscale: At<'a, B>,
    pub dbias: At<'a, B>,
}

/// One operand of a product: whether it is read transposed, and its row
/// stride (row-major, the leading dimension) and the stride between the
/// batch's matrices, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matrix {
    pub transposed: bool,
    pub ld: usize,
    pub stride: usize,
}

/// A row-major product, batched: for each of `batch` matrices, `c = op(a)
/// op(b) + beta c` with `c` `m x n` and the sum over `k`, `a` and `b` in
/// `element`, `c` in `c_element`, accumulated in f32 (cuBLAS's
/// strided-batched gemm).
#[derive(Debug, Clone, Copy)]
pub struct GemmCall {
    pub element: Element,
    pub c_element: Element,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Matrix,
    pub b: Matrix,
    pub c: Matrix,
    pub batch: usize,
    pub beta: f32,
}

/// Rows of `n` attention scores (f32) and their probabilities (in `element`), scaled by `scale`.
#[derive(Debug, Clone, Copy)]
pub struct SoftmaxCall {
    pub element: Element,
    pub rows: usize,
    pub n: usize,
    pub scale: f32,
}

/// One batch element's attention output, `tokens x heads head_width` in `element`.
#[derive(Debug, Clone, Copy)]
pub struct DeltaCall {
    pub element: Element,
    pub tokens: usize,
    pub heads: usize,
    pub head_width: usize,
}

/// Rows of `features` values, as layer-norm normalises them (its epsilon).
#[derive(Debug, Clone, Copy)]
pub struct RowsCall {
    pub element: Element,
    pub rows: usize,
    pub features: usize,
    pub eps: f32,
}

/// Where layer-norm's backward writes: the input's gradient (in the maps'
/// element type), and the f32 gradients of the weight and the bias.
pub struct LayerNormGrads<'a, B> {
    pub dx: At<'a, B>,
    pub dweight: At<'a, B>,
    pub dbias: At<'a, B>,
}

/// The device primitives, and the boundary between their buffers and
/// candle's storages and tensors.
pub trait Primitives: Sized {
    /// A buffer of elements of one type: device memory, or host memory for the reference.
    type Buffer: Send + Sync + 'static;
    /// The candle storage a tensor on this device has.
    type Storage;

    /// The device of a storage.
    fn of_storage(storage: &Self::Storage) -> Self;

    /// A buffer's element type.
    fn dtype(buffer: &Self::Buffer) -> DType;

    /// A new buffer of `len` elements whose values are undefined until written.
    fn alloc(&self, element: Element, len: usize) -> Result<Self::Buffer>;

    /// A new f32 buffer of `len` zeros.
    fn zeros_f32(&self, len: usize) -> Result<Self::Buffer>;

    /// A copy of a whole buffer.
    fn copy(&self, buffer: &Self::Buffer) -> Result<Self::Buffer>;

    /// One convolution pass; see [`ConvCall`].
    fn convolve(&self, dims: ConvDims, element: Element, call: ConvCall<'_, Self::Buffer>) -> Result<()>;

    /// Max-pooling forward, `y = max over each window of x` (padding never
    /// the maximum), or with `grads` its backward: `dx` is zero
    /// but where a window's gradient goes, the first position of the window
    /// whose `x` equals its `y` (so `y` must be exactly what the forward
    /// computed from this `x`). Forward reads `x`; backward reads `x`, `y` and `dy`.
    fn max_pool(
        &self,
        dims: PoolDims,
        element: Element,
        x: At<'_, Self::Buffer>,
        y: At<'_, Self::Buffer>,
        grads: Option<PoolGrads<'_, Self::Buffer>>,
    ) -> Result<()>;

    /// `y = act(x)` over `maps`; `y` may be `x`.
    fn activate(&self, act: DeviceActivation, maps: Maps, x: At<'_, Self::Buffer>, y: At<'_, Self::Buffer>) -> Result<()>;

    /// `dx = dy * act'(x)`, reading `x`, `y = act(x)` and `dy`; `dx` may be `dy`.
    #[allow(clippy::too_many_arguments)]
    fn activate_backward(
        &self,
        act: DeviceActivation,
        maps: Maps,
        x: At<'_, Self::Buffer>,
        y: At<'_, Self::Buffer>,
        dy: At<'_, Self::Buffer>,
        dx: At<'_, Self::Buffer>,
    ) -> Result<()>;

    /// `y = x + y` over `maps` (reads both).
    fn add_into(&self, maps: Maps, x: At<'_, Self::Buffer>, y: At<'_, Self::Buffer>) -> Result<()>;

    /// Training-mode batch-norm forward, `y = (x - mean) * inv_std * scale +
    /// bias` with this batch's statistics per channel (f32 `scale` and
    /// `bias`). With `keep` it returns the statistics (the running mean and
    /// variance written with an averaging factor of 1, each read before it
    /// is written); without, it writes `y` alone.
    fn batch_norm(
        &self,
        call: NormCall,
        x: At<'_, Self::Buffer>,
        scale: At<'_, Self::Buffer>,
        bias: At<'_, Self::Buffer>,
        y: At<'_, Self::Buffer>,
        keep: bool,
    ) -> Result<Option<NormStatistics<Self::Buffer>>>;

    /// Training-mode batch-norm backward from the input `x`, the output
    /// gradient `dy`, the scale and the forward's saved statistics: `dx`, and
    /// the f32 per-channel `sum(dy * xhat)` (the scale's gradient) and
    /// `sum(dy)` (the bias's), none of them read.
    fn batch_norm_backward(
        &self,
        call: NormCall,
        x: At<'_, Self::Buffer>,
        dy: At<'_, Self::Buffer>,
        scale: At<'_, Self::Buffer>,
        stats: &NormStatistics<Self::Buffer>,
        grads: NormGrads<'_, Self::Buffer>,
    ) -> Result<()>;

    /// cuBLAS's product; see [`GemmCall`]. Reads `a` and `b`, and `c` where `beta` is not 0.
    fn gemm(&self, call: GemmCall, a: At<'_, Self::Buffer>, b: At<'_, Self::Buffer>, c: At<'_, Self::Buffer>) -> Result<()>;

    /// `y[n, c, h, w] += bias[c]` over `maps` (cuDNN's add, the bias a `1 x C x 1 x 1` tensor of the maps' type).
    fn add_bias(&self, maps: Maps, bias: At<'_, Self::Buffer>, y: At<'_, Self::Buffer>) -> Result<()>;

    /// `db[c] = sum of dy[n, c, h, w]` over `maps` (cuDNN's convolution bias gradient); `db` is not read.
    fn bias_gradient(&self, maps: Maps, dy: At<'_, Self::Buffer>, db: At<'_, Self::Buffer>) -> Result<()>;

    /// Our kernel: each row's `p = e^(scale s - lse)` with `lse = log sum
    /// e^(scale s)`, reading the f32 scores `s`, writing `p` and the f32 `lse`.
    fn softmax_rows(&self, call: SoftmaxCall, s: At<'_, Self::Buffer>, p: At<'_, Self::Buffer>, lse: At<'_, Self::Buffer>) -> Result<()>;

    /// Our kernel: `p = e^(scale s - lse)` per row, from the scores and a kept log-sum-exp.
    fn probabilities(&self, call: SoftmaxCall, s: At<'_, Self::Buffer>, lse: At<'_, Self::Buffer>, p: At<'_, Self::Buffer>) -> Result<()>;

    /// Our kernel: the f32 `delta[h N + i] = sum_c dout[i, h dh + c] out[i, h dh + c]`.
    fn attention_delta(
        &self,
        call: DeltaCall,
        dout: At<'_, Self::Buffer>,
        out: At<'_, Self::Buffer>,
        delta: At<'_, Self::Buffer>,
    ) -> Result<()>;

    /// Our kernel: `ds = p (dp - delta[row]) scale`, from the probabilities,
    /// the f32 gradient of the probabilities and the f32 `delta` of each row.
    fn softmax_backward(
        &self,
        call: SoftmaxCall,
        p: At<'_, Self::Buffer>,
        dp: At<'_, Self::Buffer>,
        delta: At<'_, Self::Buffer>,
        ds: At<'_, Self::Buffer>,
    ) -> Result<()>;

    /// Our kernel: `y = x/2 (1 + erf(x / sqrt 2))` over `len` elements of `x`.
    fn gelu(&self, element: Element, len: usize, x: At<'_, Self::Buffer>, y: At<'_, Self::Buffer>) -> Result<()>;

    /// Our kernel: `dx = dy (Phi(x) + x phi(x))`, GELU's derivative, reading
    /// `x` and `dy`; `dx` may be `dy`.
    fn gelu_backward(
        &self,
        element: Element,
        len: usize,
        x: At<'_, Self::Buffer>,
        dy: At<'_, Self::Buffer>,
        dx: At<'_, Self::Buffer>,
    ) -> Result<()>;

    /// Our kernel: layer-norm over each row, `y = (x - mean) rstd w + b`
    /// with the row's mean and `1 / sqrt(var + eps)` (f32 `w` and `b`, one
    /// per feature); reads `x`, `w` and `b`.
    fn layer_norm(
        &self,
        call: RowsCall,
        x: At<'_, Self::Buffer>,
        w: At<'_, Self::Buffer>,
        b: At<'_, Self::Buffer>,
        y: At<'_, Self::Buffer>,
    ) -> Result<()>;

    /// Our kernels: layer-norm's backward from `x` (each row's statistics
    /// computed again), `w` and `dy`: `dx = rstd (g - mean(g) - xhat
    /// mean(g xhat))` with `g = dy w`, and the f32 `sum(dy xhat)` and
    /// `sum(dy)` over the rows; none of them read.
    fn layer_norm_backward(
        &self,
        call: RowsCall,
        x: At<'_, Self::Buffer>,
        w: At<'_, Self::Buffer>,
        dy: At<'_, Self::Buffer>,
        grads: LayerNormGrads<'_, Self::Buffer>,
    ) -> Result<()>;

    /// A tensor without a gradient, of `shape`, over a whole buffer.
    fn tensor(&self, buffer: Self::Buffer, shape: Shape) -> Result<Tensor>;

    /// A buffer as the storage of a custom op's output.
    fn into_storage(buffer: Self::Buffer) -> Result<Self::Storage>;

    /// A custom op's operand (it must be contiguous), held for its [`Arg`].
    fn hold<'a>(op: &'static str, storage: &'a Self::Storage, layout: &'a Layout) -> Result<Held<'a, Self::Buffer>>;

    /// The device a tensor is on.
    fn of_tensor(op: &'static str, t: &Tensor) -> Result<Self>;

    /// `f` with a tensor on this device as an [`Arg`] (it must be contiguous), for a backward.
    fn with_tensor<R>(op: &'static str, t: &Tensor, f: impl FnOnce(Arg<'_, Self::Buffer>) -> Result<R>) -> Result<R>;
}
