//! The ops' device passes, written once against [`Primitives`]: each keeps
//! for backward what its CPU pass keeps (the graph's inputs and, for
//! batch-norm, two f32 values per channel), and allocates only its output
//! and the transients its CPU pass has too. On a card they run on cuDNN; in
//! the test command they run on the reference (`check-ops --device
//! reference`), so that every decision made here is checked without one.

use std::any::Any;
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Layout, Result, Shape, Tensor};

use super::super::activation::Activation;
use super::super::conv_geometry::Geometry as ConvGeometry;
use super::super::norm_geometry::{BatchStatistics, Geometry as NormGeometry};
use super::super::pool_geometry::Geometry as PoolGeometry;
use super::super::OpError;
use super::descriptors::{biased_from_unbiased, ConvDims, Element, NormDims, PoolDims, TensorDims};
use super::primitives::{
    Arg, At, ConvCall, DeltaCall, DeviceActivation, GemmCall, LayerNormGrads, Made, Maps, Matrix, NormCall, NormGrads, NormStatistics,
    PoolGrads, Primitives, RowsCall, SoftmaxCall,
};

/// The statistics the batch-norms of one op saved on the device its forward
/// ran on, one entry per batch-norm, for its backward: set once, by the
/// forward, in that device's buffers.
#[derive(Default, Clone)]
pub struct DeviceSaves(Arc<OnceLock<Box<dyn Any + Send + Sync>>>);

impl DeviceSaves {
    fn set<V: Any + Send + Sync>(&self, op: &'static str, kept: V) -> Result<()> {
        self.0.set(Box::new(kept)).map_err(|_| OpError::StatisticsTwice { op }.into())
    }

    /// What the forward kept, where it ran on a device that keeps a `V`.
    fn get<V: Any>(&self, op: &'static str) -> Result<&V> {
        Ok(self.0.get().and_then(|s| s.downcast_ref::<V>()).ok_or(OpError::NothingKept { op })?)
    }

    /// The batch-norms' statistics, where the forward ran on a device of buffers `B`.
    fn statistics<B: 'static>(&self) -> Result<&[NormStatistics<B>]> {
        let stats = self.0.get().and_then(|s| s.downcast_ref::<Vec<NormStatistics<B>>>());
        Ok(stats.ok_or(OpError::MissingStatistics)?)
    }
}

/// A custom op's forward on device `P`: its operands held as [`Arg`]s,
/// `pass` run on them, its output handed back as a storage.
pub fn forward<P: Primitives, const N: usize>(
    op: &'static str,
    operands: [(&P::Storage, &Layout); N],
    pass: impl FnOnce(&P, [Arg<'_, P::Buffer>; N]) -> Result<Made<P::Buffer>>,
) -> Result<(P::Storage, Shape)> {
    let device = P::of_storage(operands[0].0);
    let held = operands.iter().map(|(s, l)| P::hold(op, s, l)).collect::<Result<Vec<_>>>()?;
    let args: [Arg<'_, P::Buffer>; N] = std::array::from_fn(|i| held[i].arg());
    let out = pass(&device, args)?;
    Ok((P::into_storage(out.buffer)?, out.shape))
}

/// [`forward`] of an op whose bias is optional: `pass` gets the bias where
/// there is one.
pub fn forward_with_bias<P: Primitives>(
    op: &'static str,
    x: (&P::Storage, &Layout),
    weight: (&P::Storage, &Layout),
    bias: Option<(&P::Storage, &Layout)>,
    pass: impl FnOnce(&P, Arg<'_, P::Buffer>, Arg<'_, P::Buffer>, Option<Arg<'_, P::Buffer>>) -> Result<Made<P::Buffer>>,
) -> Result<(P::Storage, Shape)> {
    match bias {
        Some(bias) => forward::<P, 3>(op, [x, weight, bias], |p, [x, w, b]| pass(p, x, w, Some(b))),
        None => forward::<P, 2>(op, [x, weight], |p, [x, w]| pass(p, x, w, None)),
    }
}

fn element_of<P: Primitives>(op: &'static str, args: &[Arg<'_, P::Buffer>]) -> Result<Element> {
    let dtype = P::dtype(args[0].at.buffer);
    for a in &args[1..] {
        if P::dtype(a.at.buffer) != dtype {
            Err(OpError::DTypeMismatch { op, input: dtype, other: P::dtype(a.at.buffer) })?
        }
    }
    Ok(Element::of(op, dtype)?)
}

/// `arg` has the shape the op's geometry expects of `what`.
fn expect_shape<B>(op: &'static str, what: &'static str, arg: Arg<'_, B>, shape: &Shape) -> Result<()> {
    if arg.shape == shape {
        Ok(())
    } else {
        Err(OpError::OperandShape { op, what, expected: shape.dims().to_vec(), got: arg.shape.dims().to_vec() }.into())
    }
}

fn made<P: Primitives>(p: &P, e: Element, shape: Shape) -> Result<Made<P::Buffer>> {
    Ok(Made { buffer: p.alloc(e, shape.elem_count())?, shape })
}

fn tensor<P: Primitives>(p: &P, made: Made<P::Buffer>) -> Result<Tensor> {
    p.tensor(made.buffer, made.shape)
}

fn device_activation(act: Activation) -> Option<DeviceActivation> {
    match act {
        Activation::Identity => None,
        Activation::Relu => Some(DeviceActivation::Relu),
        Activation::Silu => Some(DeviceActivation::Silu),
    }
}

/// `y = conv(x, w)`.
pub fn conv_forward<P: Primitives>(p: &P, g: &ConvGeometry, x: Arg<'_, P::Buffer>, w: Arg<'_, P::Buffer>) -> Result<Made<P::Buffer>> {
    let op = "conv2d";
    let e = element_of::<P>(op, &[x, w])?;
    expect_shape(op, "input", x, &g.in_shape())?;
    expect_shape(op, "weight", w, &g.weight_shape())?;
    let y = made(p, e, g.out_shape())?;
    p.convolve(ConvDims::of(g)?, e, ConvCall::Forward { x: x.at, w: w.at, y: y.arg().at })?;
    Ok(y)
}

/// `dx` from the output gradient and the weight.
pub fn conv_input_gradient<P: Primitives>(
    p: &P,
    g: &ConvGeometry,
    dy: Arg<'_, P::Buffer>,
    w: Arg<'_, P::Buffer>,
) -> Result<Made<P::Buffer>> {
    let op = "conv2d";
    let e = element_of::<P>(op, &[dy, w])?;
    expect_shape(op, "output gradient", dy, &g.out_shape())?;
    expect_shape(op, "weight", w, &g.weight_shape())?;
    let dx = made(p, e, g.in_shape())?;
    p.convolve(ConvDims::of(g)?, e, ConvCall::InputGradient { dy: dy.at, w: w.at, dx: dx.arg().at })?;
    Ok(dx)
}

/// `dw` from the input and the output gradient.
pub fn conv_weight_gradient<P: Primitives>(
    p: &P,
    g: &ConvGeometry,
    x: Arg<'_, P::Buffer>,
    dy: Arg<'_, P::Buffer>,
) -> Result<Made<P::Buffer>> {
    let op = "conv2d";
    let e = element_of::<P>(op, &[x, dy])?;
    expect_shape(op, "input", x, &g.in_shape())?;
    expect_shape(op, "output gradient", dy, &g.out_shape())?;
    let dw = made(p, e, g.weight_shape())?;
    p.convolve(ConvDims::of(g)?, e, ConvCall::WeightGradient { x: x.at, dy: dy.at, dw: dw.arg().at })?;
    Ok(dw)
}

/// An up-convolution (`conv_transpose2d`) as the transpose of the
/// convolution `inverse`, which takes the up-convolution's output shape to
/// its input's through the same weight (`C x O x k x k` is that
/// convolution's `K x C x R x S`): the forward is that convolution's input
/// gradient and the bias added per output channel.
pub fn conv_transpose_forward<P: Primitives>(
    p: &P,
    inverse: &ConvGeometry,
    x: Arg<'_, P::Buffer>,
    w: Arg<'_, P::Buffer>,
    bias: Option<Arg<'_, P::Buffer>>,
) -> Result<Made<P::Buffer>> {
    let op = "conv_transpose2d";
    let y = conv_input_gradient(p, inverse, x, w)?;
    if let Some(bias) = bias {
        let e = element_of::<P>(op, &[x, bias])?;
        expect_shape(op, "bias", bias, &Shape::from(inverse.in_shape().dims()[1]))?;
        p.add_bias(Maps::of(op, &y.shape, e)?, bias.at, y.arg().at)?;
    }
    Ok(y)
}

/// The up-convolution's input gradient: the forward of `inverse` on the
/// output gradient.
pub fn conv_transpose_input_gradient<P: Primitives>(
    p: &P,
    inverse: &ConvGeometry,
    dy: Arg<'_, P::Buffer>,
    w: Arg<'_, P::Buffer>,
) -> Result<Made<P::Buffer>> {
    conv_forward(p, inverse, dy, w)
}

/// The up-convolution's weight gradient: `inverse`'s, with the output
/// gradient as its input and the up-convolution's input as its output gradient.
pub fn conv_transpose_weight_gradient<P: Primitives>(
    p: &P,
    inverse: &ConvGeometry,
    dy: Arg<'_, P::Buffer>,
    x: Arg<'_, P::Buffer>,
) -> Result<Made<P::Buffer>> {
    conv_weight_gradient(p, inverse, dy, x)
}

/// The up-convolution's bias gradient: each output channel's sum of `dy`.
pub fn conv_transpose_bias_gradient<P: Primitives>(p: &P, dy: Arg<'_, P::Buffer>) -> Result<Made<P::Buffer>> {
    let op = "conv_transpose2d";
    let e = element_of::<P>(op, &[dy])?;
    let maps = Maps::of(op, dy.shape, e)?;
    let db = made(p, e, Shape::from(dy.shape.dims().get(1).copied().unwrap_or(1)))?;
    p.bias_gradient(maps, dy.at, db.arg().at)?;
    Ok(db)
}

/// `y = max_pool(x)`.
pub fn max_pool_forward<P: Primitives>(p: &P, g: &PoolGeometry, x: Arg<'_, P::Buffer>) -> Result<Made<P::Buffer>> {
    let op = "max_pool2d";
    let e = element_of::<P>(op, &[x])?;
    expect_shape(op, "input", x, &g.in_shape())?;
    let y = made(p, e, g.out_shape())?;
    p.max_pool(PoolDims::of(g)?, e, x.at, y.arg().at, None)?;
    Ok(y)
}

/// `dx` from the input, the output the forward computed from it, and the output gradient.
pub fn max_pool_backward<P: Primitives>(
    p: &P,
    g: &PoolGeometry,
    x: Arg<'_, P::Buffer>,
    y: Arg<'_, P::Buffer>,
    dy: Arg<'_, P::Buffer>,
) -> Result<Made<P::Buffer>> {
    let op = "max_pool2d";
    let e = element_of::<P>(op, &[x, y, dy])?;
    expect_shape(op, "input", x, &g.in_shape())?;
    expect_shape(op, "output", y, &g.out_shape())?;
    expect_shape(op, "output gradient", dy, &g.out_shape())?;
    let dx = made(p, e, g.in_shape())?;
    p.max_pool(PoolDims::of(g)?, e, x.at, y.at, Some(PoolGrads { dy: dy.at, dx: dx.arg().at }))?;
    Ok(dx)
}

/// `silu(x)`.
pub fn silu_forward<P: Primitives>(p: &P, x: Arg<'_, P::Buffer>) -> Result<Made<P::Buffer>> {
    let op = "silu";
    let e = element_of::<P>(op, &[x])?;
    let y = made(p, e, x.shape.clone())?;
    p.activate(DeviceActivation::Silu, Maps::of(op, x.shape, e)?, x.at, y.arg().at)?;
    Ok(y)
}

/// `dx = dy * silu'(x)`, from `x`, `y = silu(x)` and `dy`.
pub fn silu_backward<P: Primitives>(
    p: &P,
    x: Arg<'_, P::Buffer>,
    y: Arg<'_, P::Buffer>,
    dy: Arg<'_, P::Buffer>,
) -> Result<Made<P::Buffer>> {
    let op = "silu";
    let e = element_of::<P>(op, &[x, y, dy])?;
    expect_shape(op, "output", y, x.shape)?;
    expect_shape(op, "output gradient", dy, x.shape)?;
    let dx = made(p, e, x.shape.clone())?;
    p.activate_backward(DeviceActivation::Silu, Maps::of(op, x.shape, e)?, x.at, y.at, dy.at, dx.arg().at)?;
    Ok(dx)
}

/// A linear layer's sizes: `rows x inputs` in (the input's leading
/// dimensions flattened), `rows x outputs` out, the weight `outputs x inputs`.
#[derive(Debug, Clone, Copy)]
pub struct Linear {
    pub rows: usize,
    pub inputs: usize,
    pub outputs: usize,
}

impl Linear {
    const OP: &'static str = "linear";

    /// The product `c (m x n) = op(a) op(b)` of whole row-major matrices, `a`
    /// and `b` as stored `rows x cols` with `ld` their columns.
    fn product(e: Element, (m, n, k): (usize, usize, usize), (a_cols, a_t): (usize, bool), (b_cols, b_t): (usize, bool)) -> GemmCall {
        let whole = |ld: usize, transposed: bool| Matrix { transposed, ld, stride: 0 };
        GemmCall {
            element: e,
            c_element: e,
            m,
            n,
            k,
            a: whole(a_cols, a_t),
            b: whole(b_cols, b_t),
            c: whole(n, false),
            batch: 1,
            beta: 0.0,
        }
    }

    /// The output's rows as maps, one channel per output, for cuDNN's bias calls.
    fn maps(&self, e: Element) -> Result<Maps> {
        Ok(Maps { dims: TensorDims::packed(Self::OP, [self.rows, self.outputs, 1, 1])?, element: e })
    }
}

/// `dims` with its last dimension set to `last`.
fn with_last(shape: &Shape, last: usize) -> Shape {
    let mut dims = shape.dims().to_vec();
    if let Some(d) = dims.last_mut() {
        *d = last;
    }
    dims.into()
}

/// `y = x W^T (+ b)`: one product, and the bias added to every row.
pub fn linear_forward<P: Primitives>(
    p: &P,
    l: Linear,
    x: Arg<'_, P::Buffer>,
    w: Arg<'_, P::Buffer>,
    bias: Option<Arg<'_, P::Buffer>>,
) -> Result<Made<P::Buffer>> {
    let e = element_of::<P>(Linear::OP, &[&[x, w][..], bias.as_slice()].concat())?;
    expect_shape(Linear::OP, "weight", w, &Shape::from((l.outputs, l.inputs)))?;
    let y = made(p, e, with_last(x.shape, l.outputs))?;
    p.gemm(Linear::product(e, (l.rows, l.outputs, l.inputs), (l.inputs, false), (l.inputs, true)), x.at, w.at, y.arg().at)?;
    if let Some(bias) = bias {
        expect_shape(Linear::OP, "bias", bias, &Shape::from(l.outputs))?;
        p.add_bias(l.maps(e)?, bias.at, y.arg().at)?;
    }
    Ok(y)
}

/// `y = x W^T (+ b) (+ residual)`, or `gelu(x) W^T ...` with `gelu` (GELU
/// into a buffer of `x`'s size, then the product on it): [`linear_forward`],
/// then the residual added into the output.
pub fn linear_forward_fused<P: Primitives>(
    p: &P,
    l: Linear,
    gelu: bool,
    x: Arg<'_, P::Buffer>,
    w: Arg<'_, P::Buffer>,
    bias: Option<Arg<'_, P::Buffer>>,
    residual: Option<Arg<'_, P::Buffer>>,
) -> Result<Made<P::Buffer>> {
    let activated = if gelu { Some(gelu_forward(p, x)?) } else { None };
    let y = linear_forward(p, l, activated.as_ref().map_or(x, Made::arg), w, bias)?;
    drop(activated);
    if let Some(residual) = residual {
        expect_shape(Linear::OP, "residual", residual, &y.shape)?;
        p.add_into(l.maps(element_of::<P>(Linear::OP, &[residual])?)?, residual.at, y.arg().at)?;
    }
    Ok(y)
}

/// `dx = (dy W) * gelu'(x)`: two buffers of `x`'s size, the product's and its GELU backward.
pub fn gelu_linear_input_gradient<P: Primitives>(
    p: &P,
    l: Linear,
    dy: Arg<'_, P::Buffer>,
    w: Arg<'_, P::Buffer>,
    x: Arg<'_, P::Buffer>,
) -> Result<Made<P::Buffer>> {
    let da = linear_input_gradient(p, l, dy, w)?;
    gelu_backward(p, x, da.arg())
}

/// `dW = dy^T x`, or `dy^T gelu(x)` with `gelu` (GELU computed again into a buffer of `x`'s size).
pub fn linear_weight_gradient_fused<P: Primitives>(
    p: &P,
    l: Linear,
    gelu: bool,
    dy: Arg<'_, P::Buffer>,
    x: Arg<'_, P::Buffer>,
) -> Result<Made<P::Buffer>> {
    let activated = if gelu { Some(gelu_forward(p, x)?) } else { None };
    linear_weight_gradient(p, l, dy, activated.as_ref().map_or(x, Made::arg))
}

/// `dx = dy W`, in the input's shape.
pub fn linear_input_gradient<P: Primitives>(p: &P, l: Linear, dy: Arg<'_, P::Buffer>, w: Arg<'_, P::Buffer>) -> Result<Made<P::Buffer>> {
    let e = element_of::<P>(Linear::OP, &[dy, w])?;
    let dx = made(p, e, with_last(dy.shape, l.inputs))?;
    p.gemm(Linear::product(e, (l.rows, l.inputs, l.outputs), (l.outputs, false), (l.inputs, false)), dy.at, w.at, dx.arg().at)?;
    Ok(dx)
}

/// `dW = dy^T x`, `outputs x inputs`.
pub fn linear_weight_gradient<P: Primitives>(p: &P, l: Linear, dy: Arg<'_, P::Buffer>, x: Arg<'_, P::Buffer>) -> Result<Made<P::Buffer>> {
    let e = element_of::<P>(Linear::OP, &[dy, x])?;
    let dw = made(p, e, Shape::from((l.outputs, l.inputs)))?;
    p.gemm(Linear::product(e, (l.outputs, l.inputs, l.rows), (l.outputs, true), (l.inputs, false)), dy.at, x.at, dw.arg().at)?;
    Ok(dw)
}

/// `db`, the sum of `dy`'s rows.
pub fn linear_bias_gradient<P: Primitives>(p: &P, l: Linear, dy: Arg<'_, P::Buffer>) -> Result<Made<P::Buffer>> {
    let e = element_of::<P>(Linear::OP, &[dy])?;
    let db = made(p, e, Shape::from(l.outputs))?;
    p.bias_gradient(l.maps(e)?, dy.at, db.arg().at)?;
    Ok(db)
}

/// One attention: `batch x tokens x 3 dim` in (q, k and v side by side,
/// each `heads` heads of `dim / heads`), `batch x tokens x dim` out.
#[derive(Debug, Clone, Copy)]
pub struct Attention {
    pub batch: usize,
    pub tokens: usize,
    pub dim: usize,
    pub heads: usize,
}

/// What an attention's forward keeps on a device for its backward: every
/// batch element's probabilities in the input's type, or one f32
/// log-sum-exp per row.
pub enum AttentionKept<B> {
    Probabilities(B),
    RowStatistics(B),
}

/// Which of [`AttentionKept`] a forward keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKeeps {
    Probabilities,
    RowStatistics,
}

/// Where q, k and v start in a row of the input, in units of `dim`.
const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;

impl Attention {
    const OP: &'static str = "attention";

    fn head_width(&self) -> usize {
        self.dim / self.heads
    }

    fn scale(&self) -> f32 {
        (1.0 / (self.head_width() as f64).sqrt()) as f32
    }

    /// The probabilities of one batch element, every head's `N x N`.
    fn square(&self) -> usize {
        self.heads * self.tokens * self.tokens
    }

    /// Head `part` (q, k or v) of batch element `b` in the input, each head one matrix of the batch.
    fn part<'a, B>(&self, qkv: At<'a, B>, b: usize, part: usize, transposed: bool) -> (At<'a, B>, Matrix) {
        let at = At { buffer: qkv.buffer, offset: qkv.offset + b * self.tokens * 3 * self.dim + part * self.dim };
        (at, Matrix { transposed, ld: 3 * self.dim, stride: self.head_width() })
    }

    /// Batch element `b`'s rows of an output-shaped tensor (`N x dim`), each head one matrix.
    fn rows<'a, B>(&self, t: At<'a, B>, b: usize, transposed: bool) -> (At<'a, B>, Matrix) {
        (
            At { buffer: t.buffer, offset: t.offset + b * self.tokens * self.dim },
            Matrix { transposed, ld: self.dim, stride: self.head_width() },
        )
    }

    /// Every head's `N x N` square of one batch element, at `offset`.
    fn squares<'a, B>(&self, buffer: &'a B, offset: usize) -> (At<'a, B>, Matrix) {
        let n = self.tokens;
        (At { buffer, offset }, Matrix { transposed: false, ld: n, stride: n * n })
    }

    /// The heads' products of one batch element, `m x n` by a sum over `k`.
    fn product(&self, element: Element, c_element: Element, (m, n, k): (usize, usize, usize), a: Matrix, b: Matrix, c: Matrix) -> GemmCall {
        GemmCall { element, c_element, m, n, k, a, b, c, batch: self.heads, beta: 0.0 }
    }

    fn softmax(&self, element: Element) -> SoftmaxCall {
        SoftmaxCall { element, rows: self.heads * self.tokens, n: self.tokens, scale: self.scale() }
    }

    /// `S = q k^T` of every head of batch element `b`, f32, into `scores`.
    fn scores<P: Primitives>(&self, p: &P, e: Element, qkv: At<'_, P::Buffer>, b: usize, scores: &Made<P::Buffer>) -> Result<()> {
        let (n, dh) = (self.tokens, self.head_width());
        let ((q, qm), (k, km)) = (self.part(qkv, b, Q, false), self.part(qkv, b, K, true));
        let (s, sm) = self.squares(&scores.buffer, 0);
        p.gemm(self.product(e, Element::F32, (n, n, dh), qm, km, sm), q, k, s)
    }
}

/// The attention's output, keeping in `saves` what `keeps` asks for (nothing
/// where the input needs no gradient).
pub fn attention_forward<P: Primitives>(
    p: &P,
    g: Attention,
    qkv: Arg<'_, P::Buffer>,
    keeps: Option<AttentionKeeps>,
    saves: &DeviceSaves,
) -> Result<Made<P::Buffer>> {
    let op = Attention::OP;
    let e = element_of::<P>(op, &[qkv])?;
    expect_shape(op, "qkv", qkv, &Shape::from((g.batch, g.tokens, 3 * g.dim)))?;
    let (n, dh, square) = (g.tokens, g.head_width(), g.square());
    let out = made(p, e, Shape::from((g.batch, n, g.dim)))?;
    let scores = made(p, Element::F32, Shape::from(square))?;
    let kept_probabilities = keeps == Some(AttentionKeeps::Probabilities);
    let probabilities = made(p, e, Shape::from(if kept_probabilities { g.batch * square } else { square }))?;
    let kept_lse = keeps == Some(AttentionKeeps::RowStatistics);
    let lse = made(p, Element::F32, Shape::from(if kept_lse { g.batch * g.heads * n } else { g.heads * n }))?;
    for b in 0..g.batch {
        g.scores(p, e, qkv.at, b, &scores)?;
        let (pb, pm) = g.squares(&probabilities.buffer, if kept_probabilities { b * square } else { 0 });
        let l = At { buffer: &lse.buffer, offset: if kept_lse { b * g.heads * n } else { 0 } };
        p.softmax_rows(g.softmax(e), scores.arg().at, pb, l)?;
        let ((v, vm), (o, om)) = (g.part(qkv.at, b, V, false), g.rows(out.arg().at, b, false));
        p.gemm(g.product(e, e, (n, dh, n), pm, vm, om), pb, v, o)?;
    }
    match keeps {
        Some(AttentionKeeps::Probabilities) => saves.set(op, AttentionKept::Probabilities(probabilities.buffer))?,
        Some(AttentionKeeps::RowStatistics) => saves.set(op, AttentionKept::RowStatistics(lse.buffer))?,
        None => {}
    }
    Ok(out)
}

/// Where attention's backward reads each batch element's probabilities: what
/// the forward kept, or its scores and probabilities made again from q, k
/// and the kept log-sum-exps, one batch element at a time.
enum Probabilities<'a, B> {
    Kept(&'a B),
    Again { lse: &'a B, scores: Made<B>, recomputed: Made<B> },
}

/// The input's gradient (`batch x tokens x 3 dim`) from the input, the output,
/// the output's gradient and what the forward kept.
pub fn attention_backward<P: Primitives>(g: Attention, [qkv, out, dout]: [&Tensor; 3], saves: &DeviceSaves) -> Result<Tensor> {
    let op = Attention::OP;
    let kept = saves.get::<AttentionKept<P::Buffer>>(op)?;
    let p = P::of_tensor(op, qkv)?;
    let p = &p;
    let dqkv = P::with_tensor(op, qkv, |qkv| {
        P::with_tensor(op, out, |out| {
            P::with_tensor(op, dout, |dout| {
                let e = element_of::<P>(op, &[qkv, out, dout])?;
                let (n, dh, square) = (g.tokens, g.head_width(), g.square());
                let dqkv = made(p, e, qkv.shape.clone())?;
                let (dp, ds) = (made(p, Element::F32, Shape::from(square))?, made(p, e, Shape::from(square))?);
                let delta = made(p, Element::F32, Shape::from(g.heads * n))?;
                let source = match kept {
                    AttentionKept::Probabilities(kept) => Probabilities::Kept(kept),
                    AttentionKept::RowStatistics(lse) => Probabilities::Again {
                        lse,
                        scores: made(p, Element::F32, Shape::from(square))?,
                        recomputed: made(p, e, Shape::from(square))?,
                    },
                };
                for b in 0..g.batch {
                    let (pb, pm) = match &source {
                        Probabilities::Kept(kept) => g.squares(*kept, b * square),
                        Probabilities::Again { lse, scores, recomputed } => {
                            g.scores(p, e, qkv.at, b, scores)?;
                            let l = At { buffer: *lse, offset: b * g.heads * n };
                            p.probabilities(g.softmax(e), scores.arg().at, l, recomputed.arg().at)?;
                            g.squares(&recomputed.buffer, 0)
                        }
                    };
                    let (pt, ptm) = (pb, Matrix { transposed: true, ..pm });
                    let ((go, gom), (o, _)) = (g.rows(dout.at, b, false), g.rows(out.at, b, false));
                    // dV = P^T dO.
                    let (dv, dvm) = g.part(dqkv.arg().at, b, V, false);
                    p.gemm(g.product(e, e, (n, dh, n), ptm, gom, dvm), pt, go, dv)?;
                    // dP = dO V^T, then dS = P (dP - delta) scale.
                    let ((v, vm), (dps, dpm)) = (g.part(qkv.at, b, V, true), g.squares(&dp.buffer, 0));
                    p.gemm(g.product(e, Element::F32, (n, n, dh), gom, vm, dpm), go, v, dps)?;
                    let call = DeltaCall { element: e, tokens: n, heads: g.heads, head_width: dh };
                    p.attention_delta(call, go, o, delta.arg().at)?;
                    p.softmax_backward(g.softmax(e), pb, dps, delta.arg().at, ds.arg().at)?;
                    // dQ = dS K, dK = dS^T Q.
                    let ((k, km), (q, qm)) = (g.part(qkv.at, b, K, false), g.part(qkv.at, b, Q, false));
                    let ((dq, dqm), (dk, dkm)) = (g.part(dqkv.arg().at, b, Q, false), g.part(dqkv.arg().at, b, K, false));
                    let (dsa, dsm) = g.squares(&ds.buffer, 0);
                    p.gemm(g.product(e, e, (n, dh, n), dsm, km, dqm), dsa, k, dq)?;
                    p.gemm(g.product(e, e, (n, dh, n), Matrix { transposed: true, ..dsm }, qm, dkm), dsa, q, dk)?;
                }
                Ok(dqkv)
            })
        })
    })?;
    tensor(p, dqkv)
}

/// `gelu(x)`.
pub fn gelu_forward<P: Primitives>(p: &P, x: Arg<'_, P::Buffer>) -> Result<Made<P::Buffer>> {
    let e = element_of::<P>("gelu", &[x])?;
    let y = made(p, e, x.shape.clone())?;
    p.gelu(e, x.shape.elem_count(), x.at, y.arg().at)?;
    Ok(y)
}

/// `dx = dy * gelu'(x)`, from `x` alone (GELU keeps its input, not its output).
pub fn gelu_backward<P: Primitives>(p: &P, x: Arg<'_, P::Buffer>, dy: Arg<'_, P::Buffer>) -> Result<Made<P::Buffer>> {
    let op = "gelu";
    let e = element_of::<P>(op, &[x, dy])?;
    expect_shape(op, "output gradient", dy, x.shape)?;
    let dx = made(p, e, x.shape.clone())?;
    p.gelu_backward(e, x.shape.elem_count(), x.at, dy.at, dx.arg().at)?;
    Ok(dx)
}

/// A layer-norm over the last dimension of its input: its features and epsilon.
#[derive(Debug, Clone, Copy)]
pub struct LayerNorm {
    pub features: usize,
    pub eps: f32,
}

impl LayerNorm {
    const OP: &'static str = "layer_norm";

    fn call<P: Primitives>(&self, x: Arg<'_, P::Buffer>, others: &[Arg<'_, P::Buffer>]) -> Result<RowsCall> {
        let element = element_of::<P>(Self::OP, &[&[x], others].concat())?;
        if x.shape.dims().last() != Some(&self.features) || self.features == 0 {
            Err(OpError::PerFeature { what: "input", features: self.features, dims: x.shape.dims().to_vec() })?
        }
        Ok(RowsCall { element, rows: x.shape.elem_count() / self.features, features: self.features, eps: self.eps })
    }

    /// The weight or bias, f32 with one value per feature, as the kernels take them.
    fn per_feature<P: Primitives>(&self, what: &'static str, a: Arg<'_, P::Buffer>) -> Result<()> {
        require_f32::<P>(Self::OP, a)?;
        if a.shape.dims() != [self.features] {
            Err(OpError::PerFeature { what, features: self.features, dims: a.shape.dims().to_vec() })?
        }
        Ok(())
    }
}

/// `layer_norm(x, w, b)`, keeping nothing but its operands.
pub fn layer_norm_forward<P: Primitives>(p: &P, ln: LayerNorm, [x, w, b]: [Arg<'_, P::Buffer>; 3]) -> Result<Made<P::Buffer>> {
    ln.per_feature::<P>("weight", w)?;
    ln.per_feature::<P>("bias", b)?;
    let call = ln.call::<P>(x, &[])?;
    let y = made(p, call.element, x.shape.clone())?;
    p.layer_norm(call, x.at, w.at, b.at, y.arg().at)?;
    Ok(y)
}

/// `y = layer_norm(x) W^T + b`, the layer-norm's f32 weight and bias the two
/// rows of `params`: the layer-norm into a buffer of `x`'s size, then
/// [`linear_forward`] on it.
pub fn norm_linear_forward<P: Primitives>(
    p: &P,
    ln: LayerNorm,
    l: Linear,
    [x, params, w, b]: [Arg<'_, P::Buffer>; 4],
) -> Result<Made<P::Buffer>> {
    if params.shape.elem_count() != 2 * ln.features {
        Err(OpError::PerFeature { what: "packed layer-norm weight and bias", features: ln.features, dims: params.shape.dims().to_vec() })?
    }
    let per_feature = Shape::from(ln.features);
    let row =
        |index: usize| Arg { at: At { buffer: params.at.buffer, offset: params.at.offset + index * ln.features }, shape: &per_feature };
    let normalised = layer_norm_forward(p, ln, [x, row(0), row(1)])?;
    linear_forward(p, l, normalised.arg(), w, Some(b))
}

/// Layer-norm's gradients of input, weight and bias, each row's statistics
/// computed again from the input.
pub fn layer_norm_backward<P: Primitives>(ln: LayerNorm, x: &Tensor, w: &Tensor, dy: &Tensor) -> Result<[Tensor; 3]> {
    let op = LayerNorm::OP;
    let p = P::of_tensor(op, x)?;
    let (dx, dw, db) = P::with_tensor(op, x, |x| {
        P::with_tensor(op, w, |w| {
            P::with_tensor(op, dy, |dy| {
                ln.per_feature::<P>("weight", w)?;
                expect_shape(op, "output gradient", dy, x.shape)?;
                let call = ln.call::<P>(x, &[dy])?;
                let dx = made(&p, call.element, x.shape.clone())?;
                let (dw, db) = (made(&p, Element::F32, w.shape.clone())?, made(&p, Element::F32, w.shape.clone())?);
                let grads = LayerNormGrads { dx: dx.arg().at, dweight: dw.arg().at, dbias: db.arg().at };
                p.layer_norm_backward(call, x.at, w.at, dy.at, grads)?;
                Ok((dx, dw, db))
            })
        })
    })?;
    Ok([tensor(&p, dx)?, tensor(&p, dw)?, tensor(&p, db)?])
}

/// Batch-norm's parameters are f32 whatever the maps' type, as cuDNN takes them.
fn require_f32<P: Primitives>(op: &'static str, a: Arg<'_, P::Buffer>) -> Result<()> {
    match P::dtype(a.at.buffer) {
        DType::F32 => Ok(()),
        other => Err(OpError::DTypeMismatch { op, input: DType::F32, other }.into()),
    }
}

/// A batch-norm's f32 scale and bias.
struct Params<'a, B> {
    scale: At<'a, B>,
    bias: At<'a, B>,
}

/// One spatial batch-norm on a device: its op's name, shapes and epsilon.
#[derive(Clone, Copy)]
pub struct BatchNorm<'a> {
    pub op: &'static str,
    pub geometry: &'a NormGeometry,
    pub eps: f64,
}

impl BatchNorm<'_> {
    fn shape(&self) -> Shape {
        self.geometry.shape()
    }

    fn call(&self, element: Element) -> Result<NormCall> {
        let shape = self.shape();
        let [n, c, h, w] = shape.dims() else {
            return Err(OpError::NotFourDims { op: self.op, what: "input", dims: shape.dims().to_vec() }.into());
        };
        Ok(NormCall { dims: NormDims::of(self.op, [*n, *c, *h, *w])?, element, eps: self.eps })
    }

    fn maps(&self, element: Element) -> Result<Maps> {
        Ok(Maps::of(self.op, &self.shape(), element)?)
    }

    /// The `pair`-th `[scale; bias]` of a packed parameter tensor, `(2k, C)`.
    fn params<'a, P: Primitives>(&self, packed: Arg<'a, P::Buffer>, pair: usize) -> Result<Params<'a, P::Buffer>> {
        let channels = self.geometry.channels;
        require_f32::<P>(self.op, packed)?;
        if packed.shape.elem_count() < (2 * pair + 2) * channels {
            Err(OpError::PerChannel { op: self.op, what: "packed parameters", channels, dims: packed.shape.dims().to_vec() })?
        }
        let at = |index: usize| At { buffer: packed.at.buffer, offset: packed.at.offset + index * channels };
        Ok(Params { scale: at(2 * pair), bias: at(2 * pair + 1) })
    }

    /// `y = bn(x)` with this batch's statistics, appended to `saved`.
    fn keeping<P: Primitives>(
        &self,
        p: &P,
        x: Arg<'_, P::Buffer>,
        params: &Params<'_, P::Buffer>,
        y: At<'_, P::Buffer>,
        saved: &mut Vec<NormStatistics<P::Buffer>>,
    ) -> Result<()> {
        let stats = self.normalise(p, x, params, y, true)?;
        saved.push(stats.ok_or(OpError::MissingStatistics)?);
        Ok(())
    }

    /// `y = bn(x)` again, as the forward computed it.
    fn again<P: Primitives>(&self, p: &P, x: Arg<'_, P::Buffer>, params: &Params<'_, P::Buffer>, y: At<'_, P::Buffer>) -> Result<()> {
        self.normalise(p, x, params, y, false).map(|_| ())
    }

    fn normalise<P: Primitives>(
        &self,
        p: &P,
        x: Arg<'_, P::Buffer>,
        params: &Params<'_, P::Buffer>,
        y: At<'_, P::Buffer>,
        keep: bool,
    ) -> Result<Option<NormStatistics<P::Buffer>>> {
        let e = element_of::<P>(self.op, &[x])?;
        expect_shape(self.op, "input", x, &self.shape())?;
        p.batch_norm(self.call(e)?, x.at, params.scale, params.bias, y, keep)
    }

    /// `dx`, and into `dparams` the f32 `[sum(dy * xhat); sum(dy)]` per
    /// channel (the scale's and the bias's gradients).
    fn backward<P: Primitives>(
        &self,
        p: &P,
        x: Arg<'_, P::Buffer>,
        dy: Arg<'_, P::Buffer>,
        scale: At<'_, P::Buffer>,
        stats: &NormStatistics<P::Buffer>,
        dparams: At<'_, P::Buffer>,
    ) -> Result<Made<P::Buffer>> {
        let channels = self.geometry.channels;
        let e = element_of::<P>(self.op, &[x, dy])?;
        expect_shape(self.op, "output gradient", dy, &self.shape())?;
        let dx = made(p, e, self.shape())?;
        let dbias = At { buffer: dparams.buffer, offset: dparams.offset + channels };
        let grads = NormGrads { dx: dx.arg().at, dscale: dparams, dbias };
        p.batch_norm_backward(self.call(e)?, x.at, dy.at, scale, stats, grads)?;
        Ok(dx)
    }

    /// The f32 parameter gradients of `norms` batch-norms, `(2 norms, C)`,
    /// their operand's shape.
    fn parameter_gradients<P: Primitives>(&self, p: &P, norms: usize) -> Result<Made<P::Buffer>> {
        made(p, Element::F32, Shape::from((2 * norms, self.geometry.channels)))
    }
}

/// The per-channel statistics a caller reads (mean and biased variance, f32
/// tensors on the device) from what the device saved.
pub fn batch_statistics<P: Primitives>(p: &P, g: &NormGeometry, stats: &NormStatistics<P::Buffer>) -> Result<BatchStatistics> {
    let count = g.count();
    let copy = |b: &P::Buffer| -> Result<Tensor> { p.tensor(p.copy(b)?, Shape::from(g.channels)) };
    Ok(BatchStatistics { mean: copy(&stats.mean)?, var: copy(&stats.unbiased_var)?.affine(biased_from_unbiased(count), 0.0)?, count })
}

/// The statistics of each batch-norm of an op that ran on device `P`, read from `saved`.
pub fn saved_statistics<P: Primitives>(
    op: &'static str,
    g: &NormGeometry,
    on: &Tensor,
    saves: &DeviceSaves,
) -> Result<Vec<BatchStatistics>> {
    let p = P::of_tensor(op, on)?;
    saves.statistics::<P::Buffer>()?.iter().map(|s| batch_statistics(&p, g, s)).collect()
}

/// Training-mode batch-norm forward: `y`, with the statistics saved in `saved`.
pub fn batch_norm_forward<P: Primitives>(
    p: &P,
    bn: BatchNorm<'_>,
    [x, weight, bias]: [Arg<'_, P::Buffer>; 3],
    saves: &DeviceSaves,
) -> Result<Made<P::Buffer>> {
    let e = element_of::<P>(bn.op, &[x])?;
    require_f32::<P>(bn.op, weight)?;
    require_f32::<P>(bn.op, bias)?;
    let params = Params { scale: weight.at, bias: bias.at };
    let y = made(p, e, bn.shape())?;
    let mut stats = Vec::with_capacity(1);
    bn.keeping(p, x, &params, y.arg().at, &mut stats)?;
    saves.set(bn.op, stats)?;
    Ok(y)
}

/// Gradients of a plain batch-norm: input, weight, bias.
pub fn batch_norm_backward<P: Primitives>(
    bn: BatchNorm<'_>,
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    saves: &DeviceSaves,
) -> Result<[Tensor; 3]> {
    let stats = saves.statistics::<P::Buffer>()?.first().ok_or(OpError::MissingStatistics)?;
    let p = P::of_tensor(bn.op, x)?;
    let (dx, dparams) = P::with_tensor(bn.op, x, |x| {
        P::with_tensor(bn.op, dy, |dy| {
            P::with_tensor(bn.op, weight, |w| {
                require_f32::<P>(bn.op, w)?;
                let dparams = bn.parameter_gradients(&p, 1)?;
                let dx = bn.backward(&p, x, dy, w.at, stats, dparams.arg().at)?;
                Ok((dx, dparams))
            })
        })
    })?;
    let dparams = tensor(&p, dparams)?;
    Ok([tensor(&p, dx)?, dparams.get(0)?, dparams.get(1)?])
}

/// What reads a lean op's activation, on a device.
#[derive(Debug, Clone, Copy)]
pub enum Consumer<'a> {
    Nothing,
    Conv(&'a ConvGeometry),
    MaxPool(&'a PoolGeometry),
}

/// A lean op's batch-norm and the activation after it.
#[derive(Clone, Copy)]
pub struct Lean<'a> {
    pub norm: BatchNorm<'a>,
    pub act: Activation,
}

/// `then(act(bn(z)))`: the activation is a transient of the forward.
pub fn norm_act_forward<P: Primitives>(
    p: &P,
    lean: Lean<'_>,
    consumer: Consumer<'_>,
    [z, packed]: [Arg<'_, P::Buffer>; 2],
    weight: Option<Arg<'_, P::Buffer>>,
    saves: &DeviceSaves,
) -> Result<Made<P::Buffer>> {
    let (bn, op) = (lean.norm, lean.norm.op);
    let e = element_of::<P>(op, &[z])?;
    let a = made(p, e, bn.shape())?;
    let mut stats = Vec::with_capacity(1);
    bn.keeping(p, z, &bn.params::<P>(packed, 0)?, a.arg().at, &mut stats)?;
    saves.set(op, stats)?;
    if let Some(act) = device_activation(lean.act) {
        p.activate(act, bn.maps(e)?, a.arg().at, a.arg().at)?;
    }
    match (consumer, weight) {
        (Consumer::Nothing, _) => Ok(a),
        (Consumer::Conv(c), Some(w)) => conv_forward(p, c, a.arg(), w),
        (Consumer::MaxPool(pool), _) => max_pool_forward(p, pool, a.arg()),
        (Consumer::Conv(_), None) => Err(OpError::MissingOperand { op, what: "convolution weight" }.into()),
    }
}

/// The gradients of `norm_act` from its inputs `z` and the packed
/// parameters, the consumer's weight, and its output gradient `dy`: `z`'s,
/// the parameters' and the weight's, each `None` where the input needs none.
pub fn norm_act_backward<P: Primitives>(
    lean: Lean<'_>,
    consumer: Consumer<'_>,
    [z, packed]: [&Tensor; 2],
    weight: Option<&Tensor>,
    dy: &Tensor,
    saves: &DeviceSaves,
) -> Result<[Option<Tensor>; 3]> {
    let (bn, op) = (lean.norm, lean.norm.op);
    let stats = saves.statistics::<P::Buffer>()?.first().ok_or(OpError::MissingStatistics)?;
    let want_weight = weight.is_some_and(|w| w.track_op());
    let p = P::of_tensor(op, z)?;
    let p = &p;
    let [dz, dparams, dweight] = P::with_tensor(op, z, |z| {
        P::with_tensor(op, packed, |packed| {
            P::with_tensor(op, dy, |dy| {
                let e = element_of::<P>(op, &[z, dy])?;
                let maps = bn.maps(e)?;
                let params = bn.params::<P>(packed, 0)?;
                let pre = made(p, e, bn.shape())?;
                bn.again(p, z, &params, pre.arg().at)?;
                let act = device_activation(lean.act);
                let activated = match act {
                    Some(act) => {
                        let a = made(p, e, bn.shape())?;
                        p.activate(act, maps, pre.arg().at, a.arg().at)?;
                        Some(a)
                    }
                    None => None,
                };
                let a = activated.as_ref().unwrap_or(&pre).arg();
                let (da, dweight) = match (consumer, weight) {
                    (Consumer::Nothing, _) => (None, None),
                    (Consumer::Conv(c), Some(w)) => P::with_tensor(op, w, |w| {
                        let dweight = if want_weight { Some(conv_weight_gradient(p, c, a, dy)?) } else { None };
                        Ok((Some(conv_input_gradient(p, c, dy, w)?), dweight))
                    })?,
                    // The pooling backward finds each window's maximum by
                    // comparing `x` with `y`: `y` is pooled again from the
                    // recomputed map, so that it is exactly the maximum of
                    // these values even where the recompute differs from the
                    // forward by a rounding.
                    (Consumer::MaxPool(pool), _) => {
                        let y = max_pool_forward(p, pool, a)?;
                        (Some(max_pool_backward(p, pool, a, y.arg(), dy)?), None)
                    }
                    (Consumer::Conv(_), None) => Err(OpError::MissingOperand { op, what: "convolution weight" })?,
                };
                // The gradient before the activation: in place in the
                // consumer's input gradient, or a new map where `dy` itself
                // is the activation's gradient.
                let dpre = match (act, &activated) {
                    (Some(act), Some(activated)) => {
                        let target = match da {
                            Some(da) => da,
                            None => made(p, e, bn.shape())?,
                        };
                        let incoming = if matches!(consumer, Consumer::Nothing) { dy.at } else { target.arg().at };
                        p.activate_backward(act, maps, pre.arg().at, activated.arg().at, incoming, target.arg().at)?;
                        Some(target)
                    }
                    _ => da,
                };
                drop(activated);
                drop(pre);
                let dparams = bn.parameter_gradients(p, 1)?;
                let dz = bn.backward(p, z, dpre.as_ref().map_or(dy, |d| d.arg()), params.scale, stats, dparams.arg().at)?;
                Ok([Some(tensor(p, dz)?), Some(tensor(p, dparams)?), dweight.map(|d| tensor(p, d)).transpose()?])
            })
        })
    })?;
    Ok([dz.filter(|_| z.track_op()), dparams.filter(|_| packed.track_op()), dweight])
}

/// `act(bn(z) + residual)`, the residual `x` or `bn'(x)` where `projected`.
pub fn norm_add_act_forward<P: Primitives>(
    p: &P,
    lean: Lean<'_>,
    projected: bool,
    [z, x, packed]: [Arg<'_, P::Buffer>; 3],
    saves: &DeviceSaves,
) -> Result<Made<P::Buffer>> {
    let bn = lean.norm;
    let e = element_of::<P>(bn.op, &[z, x])?;
    let s = sum(p, bn, projected, [z, x, packed], Some(saves))?;
    if let Some(act) = device_activation(lean.act) {
        p.activate(act, bn.maps(e)?, s.arg().at, s.arg().at)?;
    }
    Ok(s)
}

/// `bn(z) + residual`, saving the statistics when `saved` is given, else as
/// the forward computed it.
fn sum<P: Primitives>(
    p: &P,
    bn: BatchNorm<'_>,
    projected: bool,
    [z, x, packed]: [Arg<'_, P::Buffer>; 3],
    saved: Option<&DeviceSaves>,
) -> Result<Made<P::Buffer>> {
    let op = bn.op;
    let e = element_of::<P>(op, &[z, x])?;
    expect_shape(op, "residual", x, &bn.shape())?;
    let s = made(p, e, bn.shape())?;
    let mut stats = Vec::with_capacity(2);
    let normalise = |x: Arg<'_, P::Buffer>, params: &Params<'_, P::Buffer>, y: At<'_, P::Buffer>, stats: &mut Vec<_>| match saved {
        Some(_) => bn.keeping(p, x, params, y, stats),
        None => bn.again(p, x, params, y),
    };
    normalise(z, &bn.params::<P>(packed, 0)?, s.arg().at, &mut stats)?;
    let side = if projected {
        let side = made(p, e, bn.shape())?;
        normalise(x, &bn.params::<P>(packed, 1)?, side.arg().at, &mut stats)?;
        Some(side)
    } else {
        None
    };
    let residual = side.as_ref().map_or(x.at, |side| side.arg().at);
    p.add_into(bn.maps(e)?, residual, s.arg().at)?;
    if let Some(saved) = saved {
        saved.set(op, stats)?;
    }
    Ok(s)
}

/// The gradients of `norm_add_act` from its inputs `z`, the residual's
/// input `x` and the packed parameters, and its output `y` and gradient
/// `dy`: `z`'s, `x`'s and the parameters'.
pub fn norm_add_act_backward<P: Primitives>(
    lean: Lean<'_>,
    projected: bool,
    [z, x, packed]: [&Tensor; 3],
    [y, dy]: [&Tensor; 2],
    saves: &DeviceSaves,
) -> Result<[Tensor; 3]> {
    let (bn, op) = (lean.norm, lean.norm.op);
    let stats = saves.statistics::<P::Buffer>()?;
    let body_stats = stats.first().ok_or(OpError::MissingStatistics)?;
    let p = P::of_tensor(op, z)?;
    let p = &p;
    let (dz, dx, dparams) = P::with_tensor(op, z, |z| {
        P::with_tensor(op, x, |x| {
            P::with_tensor(op, packed, |packed| {
                P::with_tensor(op, dy, |dy| {
                    let e = element_of::<P>(op, &[z, x, dy])?;
                    // The gradient of the sum: through the activation, from
                    // the sum recomputed and the op's output, or `dy` itself.
                    let ds = match device_activation(lean.act) {
                        Some(act) => P::with_tensor(op, y, |y| {
                            let s = sum(p, bn, projected, [z, x, packed], None)?;
                            let ds = made(p, e, bn.shape())?;
                            p.activate_backward(act, bn.maps(e)?, s.arg().at, y.at, dy.at, ds.arg().at)?;
                            Ok(Some(ds))
                        })?,
                        None => None,
                    };
                    let ds_arg = ds.as_ref().map_or(dy, |d| d.arg());
                    let norms = if projected { 2 } else { 1 };
                    let dparams = bn.parameter_gradients(p, norms)?;
                    let pair = |index: usize| At { buffer: &dparams.buffer, offset: index * 2 * bn.geometry.channels };
                    let dz = bn.backward(p, z, ds_arg, bn.params::<P>(packed, 0)?.scale, body_stats, pair(0))?;
                    let dx = match (projected, stats.get(1)) {
                        (true, Some(side)) => Some(bn.backward(p, x, ds_arg, bn.params::<P>(packed, 1)?.scale, side, pair(1))?),
                        (true, None) => Err(OpError::MissingStatistics)?,
                        (false, _) => ds,
                    };
                    Ok((tensor(p, dz)?, dx.map(|dx| tensor(p, dx)).transpose()?, tensor(p, dparams)?))
                })
            })
        })
    })?;
    Ok([dz, dx.unwrap_or_else(|| dy.clone()), dparams])
}

/// A held operand's layout checked contiguous.
pub fn contiguous(op: &'static str, layout: &Layout) -> Result<()> {
    if layout.is_contiguous() {
        Ok(())
    } else {
        Err(OpError::NotContiguous { op }.into())
    }
}
