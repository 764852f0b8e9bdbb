//! The ops' CUDA passes on candle's storages and tensors: each keeps for
//! backward what its CPU pass keeps (the graph's inputs and, for
//! batch-norm, two f32 values per channel), and allocates only its output
//! and the transients its CPU pass has too.

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDevice;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, Layout, Result, Shape, Storage, Tensor};

use super::super::conv_geometry::Geometry as ConvGeometry;
use super::super::lean::Activation;
use super::super::norm::{BatchStatistics, Geometry as NormGeometry};
use super::super::pool::Geometry as PoolGeometry;
use super::super::OpError;
use super::device::{self, alloc, ConvCall, CudnnActivation, Maps, NormCall, NormGrads, NormStatistics, Operand};
use super::plan::{biased_from_unbiased, ConvDims, Element, NormDims, PoolDims, TensorDims};

type Stream = candle_core::cuda_backend::cudarc::driver::CudaStream;

/// The statistics a batch-norm's forward saved on the device, one entry per
/// batch-norm of the op, for its backward.
pub type Saved = Arc<OnceLock<Vec<NormStatistics>>>;

fn contiguous(op: &'static str, layout: &Layout) -> Result<()> {
    if layout.is_contiguous() {
        Ok(())
    } else {
        Err(OpError::NotContiguous { op }.into())
    }
}

/// An operand of a pass: a contiguous storage and where in it the tensor starts.
#[derive(Clone, Copy)]
pub struct Arg<'a> {
    pub storage: &'a CudaStorage,
    pub layout: &'a Layout,
}

impl<'a> Arg<'a> {
    pub fn new(op: &'static str, storage: &'a CudaStorage, layout: &'a Layout) -> Result<Self> {
        contiguous(op, layout)?;
        Ok(Arg { storage, layout })
    }

    fn operand(&self, op: &'static str, stream: &'a Stream) -> Result<Operand<'a>> {
        Operand::of(op, self.storage, self.layout, stream)
    }
}

/// A storage made by a pass, with the layout of its whole length.
struct Made {
    storage: CudaStorage,
    layout: Layout,
}

impl Made {
    fn new(dev: &CudaDevice, e: Element, shape: Shape) -> Result<Self> {
        Ok(Made { storage: alloc(dev, e, shape.elem_count())?, layout: Layout::contiguous(shape) })
    }

    fn arg(&self) -> Arg<'_> {
        Arg { storage: &self.storage, layout: &self.layout }
    }

    fn tensor(self) -> Tensor {
        Tensor::from_storage(Storage::Cuda(self.storage), self.layout.shape().clone(), BackpropOp::none(), false)
    }
}

impl From<(CudaStorage, Shape)> for Made {
    fn from((storage, shape): (CudaStorage, Shape)) -> Self {
        Made { storage, layout: Layout::contiguous(shape) }
    }
}

fn element_of(op: &'static str, args: &[Arg<'_>]) -> Result<Element> {
    let first = Element::of(op, args[0].storage.dtype())?;
    for a in &args[1..] {
        if a.storage.dtype() != args[0].storage.dtype() {
            Err(OpError::DTypeMismatch { op, input: args[0].storage.dtype(), other: a.storage.dtype() })?
        }
    }
    Ok(first)
}

/// A tensor's CUDA storage, for a backward that reads tensors.
pub fn with_cuda<R>(op: &'static str, t: &Tensor, f: impl FnOnce(Arg<'_>) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => f(Arg::new(op, s, layout)?),
        other => Err(OpError::NotOnCuda { op, device: format!("{:?}", other.device().location()) })?,
    }
}

fn cudnn_activation(act: Activation) -> Option<CudnnActivation> {
    match act {
        Activation::Identity => None,
        Activation::Relu => Some(CudnnActivation::Relu),
        Activation::Silu => Some(CudnnActivation::Silu),
    }
}

/// Every element of a tensor of `shape`, as one row of maps for cuDNN's elementwise calls.
fn flat(op: &'static str, shape: &Shape, element: Element) -> Result<Maps> {
    Ok(Maps { dims: TensorDims::packed(op, [1, 1, 1, shape.elem_count()])?, element })
}

/// `y = conv(x, w)`.
pub fn conv_forward(g: &ConvGeometry, x: Arg<'_>, w: Arg<'_>) -> Result<(CudaStorage, Shape)> {
    let op = "conv2d";
    let (e, dev) = (element_of(op, &[x, w])?, &x.storage.device);
    let dims = ConvDims::of(g)?;
    let y = Made::new(dev, e, g.out_shape())?;
    let stream = dev.cuda_stream();
    let (xo, wo, yo) = (x.operand(op, &stream)?, w.operand(op, &stream)?, y.arg().operand(op, &stream)?);
    device::convolve(dev, dims, e, ConvCall::Forward { x: &xo, w: &wo, y: &yo })?;
    drop((xo, wo, yo));
    Ok((y.storage, g.out_shape()))
}

/// `dx` from the output gradient and the weight.
pub fn conv_input_gradient(g: &ConvGeometry, dy: Arg<'_>, w: Arg<'_>) -> Result<(CudaStorage, Shape)> {
    let op = "conv2d";
    let (e, dev) = (element_of(op, &[dy, w])?, &dy.storage.device);
    let dims = ConvDims::of(g)?;
    let dx = Made::new(dev, e, g.in_shape())?;
    let stream = dev.cuda_stream();
    let (dyo, wo, dxo) = (dy.operand(op, &stream)?, w.operand(op, &stream)?, dx.arg().operand(op, &stream)?);
    device::convolve(dev, dims, e, ConvCall::InputGradient { dy: &dyo, w: &wo, dx: &dxo })?;
    drop((dyo, wo, dxo));
    Ok((dx.storage, g.in_shape()))
}

/// `dw` from the input and the output gradient.
pub fn conv_weight_gradient(g: &ConvGeometry, x: Arg<'_>, dy: Arg<'_>) -> Result<(CudaStorage, Shape)> {
    let op = "conv2d";
    let (e, dev) = (element_of(op, &[x, dy])?, &x.storage.device);
    let dims = ConvDims::of(g)?;
    let dw = Made::new(dev, e, g.weight_shape())?;
    let stream = dev.cuda_stream();
    let (xo, dyo, dwo) = (x.operand(op, &stream)?, dy.operand(op, &stream)?, dw.arg().operand(op, &stream)?);
    device::convolve(dev, dims, e, ConvCall::WeightGradient { x: &xo, dy: &dyo, dw: &dwo })?;
    drop((xo, dyo, dwo));
    Ok((dw.storage, g.weight_shape()))
}

/// `y = max_pool(x)`.
pub fn max_pool_forward(g: &PoolGeometry, x: Arg<'_>) -> Result<(CudaStorage, Shape)> {
    let op = "max_pool2d";
    let (e, dev) = (element_of(op, &[x])?, &x.storage.device);
    let y = Made::new(dev, e, g.out_shape())?;
    let stream = dev.cuda_stream();
    let (xo, yo) = (x.operand(op, &stream)?, y.arg().operand(op, &stream)?);
    device::max_pool(dev, PoolDims::of(g)?, e, &xo, &yo, None)?;
    drop((xo, yo));
    Ok((y.storage, g.out_shape()))
}

/// `dx` from the input, the output and the output gradient.
pub fn max_pool_backward(g: &PoolGeometry, x: Arg<'_>, y: Arg<'_>, dy: Arg<'_>) -> Result<(CudaStorage, Shape)> {
    let op = "max_pool2d";
    let (e, dev) = (element_of(op, &[x, y, dy])?, &x.storage.device);
    let dx = Made::new(dev, e, g.in_shape())?;
    let stream = dev.cuda_stream();
    let (xo, yo, dyo, dxo) = (x.operand(op, &stream)?, y.operand(op, &stream)?, dy.operand(op, &stream)?, dx.arg().operand(op, &stream)?);
    device::max_pool(dev, PoolDims::of(g)?, e, &xo, &yo, Some((&dyo, &dxo)))?;
    drop((xo, yo, dyo, dxo));
    Ok((dx.storage, g.in_shape()))
}

/// `silu(x)`.
pub fn silu_forward(x: Arg<'_>) -> Result<(CudaStorage, Shape)> {
    let op = "silu";
    let (e, dev) = (element_of(op, &[x])?, &x.storage.device);
    let shape = x.layout.shape().clone();
    let y = Made::new(dev, e, shape.clone())?;
    let stream = dev.cuda_stream();
    let (xo, yo) = (x.operand(op, &stream)?, y.arg().operand(op, &stream)?);
    device::activate(dev, CudnnActivation::Silu, flat(op, &shape, e)?, &xo, &yo)?;
    drop((xo, yo));
    Ok((y.storage, shape))
}

/// `dx = dy * silu'(x)`, from `x`, `y = silu(x)` and `dy`.
pub fn silu_backward(x: Arg<'_>, y: Arg<'_>, dy: Arg<'_>) -> Result<(CudaStorage, Shape)> {
    let op = "silu";
    let (e, dev) = (element_of(op, &[x, y, dy])?, &x.storage.device);
    let shape = x.layout.shape().clone();
    let dx = Made::new(dev, e, shape.clone())?;
    let stream = dev.cuda_stream();
    let (xo, yo, dyo, dxo) = (x.operand(op, &stream)?, y.operand(op, &stream)?, dy.operand(op, &stream)?, dx.arg().operand(op, &stream)?);
    device::activate_backward(dev, CudnnActivation::Silu, flat(op, &shape, e)?, &xo, &yo, &dyo, &dxo)?;
    drop((xo, yo, dyo, dxo));
    Ok((dx.storage, shape))
}

/// A batch-norm's f32 scale and bias inside a packed parameter tensor
/// (`[scale; bias]` or a pair of such), as operands.
struct Params<'a> {
    scale: Operand<'a>,
    bias: Operand<'a>,
}

/// Batch-norm's parameters are f32 whatever the maps' type, as cuDNN takes them.
fn require_f32(op: &'static str, a: Arg<'_>) -> Result<()> {
    match a.storage.dtype() {
        candle_core::DType::F32 => Ok(()),
        other => Err(OpError::DTypeMismatch { op, input: candle_core::DType::F32, other }.into()),
    }
}

fn f32_operand<'a>(op: &'static str, a: Arg<'a>, stream: &'a Stream) -> Result<Operand<'a>> {
    require_f32(op, a)?;
    a.operand(op, stream)
}

/// One spatial batch-norm on CUDA: its op's name, shapes and epsilon.
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
        flat(self.op, &self.shape(), element)
    }

    /// The `pair`-th `[scale; bias]` of a packed parameter tensor.
    fn params<'a>(&self, packed: Arg<'a>, pair: usize, stream: &'a Stream) -> Result<Params<'a>> {
        let channels = self.geometry.channels;
        require_f32(self.op, packed)?;
        let at = |index: usize| -> Result<Operand<'a>> {
            let layout = Layout::contiguous_with_offset(channels, packed.layout.start_offset() + index * channels);
            Operand::of(self.op, packed.storage, &layout, stream)
        };
        Ok(Params { scale: at(2 * pair)?, bias: at(2 * pair + 1)? })
    }

    /// `y = bn(x)` with this batch's statistics, appended to `saved`.
    fn keeping(&self, x: Arg<'_>, p: &Params<'_>, y: &Made, saved: &mut Vec<NormStatistics>) -> Result<()> {
        let stats = self.normalise(x, p, y, true)?;
        saved.push(stats.ok_or(OpError::MissingStatistics)?);
        Ok(())
    }

    /// `y = bn(x)` again, as the forward computed it.
    fn again(&self, x: Arg<'_>, p: &Params<'_>, y: &Made) -> Result<()> {
        self.normalise(x, p, y, false).map(|_| ())
    }

    fn normalise(&self, x: Arg<'_>, p: &Params<'_>, y: &Made, keep: bool) -> Result<Option<NormStatistics>> {
        let (e, dev) = (element_of(self.op, &[x])?, &x.storage.device);
        let stream = dev.cuda_stream();
        let (xo, yo) = (x.operand(self.op, &stream)?, y.arg().operand(self.op, &stream)?);
        device::batch_norm(dev, self.call(e)?, &xo, &p.scale, &p.bias, &yo, keep)
    }

    /// `dx`, and the f32 `[sum(dy * xhat); sum(dy)]` per channel (the
    /// weight's and the bias's gradients) in one tensor.
    fn backward(&self, x: Arg<'_>, dy: Arg<'_>, scale: &Operand<'_>, stats: &NormStatistics) -> Result<(Made, Made)> {
        let (op, channels) = (self.op, self.geometry.channels);
        let (e, dev) = (element_of(op, &[x, dy])?, &x.storage.device);
        let stream = dev.cuda_stream();
        let dx = Made::new(dev, e, self.shape())?;
        let dparams = Made::new(dev, Element::F32, Shape::from(2 * channels))?;
        {
            let (xo, dyo, dxo) = (x.operand(op, &stream)?, dy.operand(op, &stream)?, dx.arg().operand(op, &stream)?);
            let half = |i: usize| Operand::of(op, &dparams.storage, &Layout::contiguous_with_offset(channels, i * channels), &stream);
            let (dscale, dbias) = (half(0)?, half(1)?);
            device::batch_norm_backward(
                dev,
                self.call(e)?,
                &xo,
                &dyo,
                scale,
                stats,
                NormGrads { dx: &dxo, dscale: &dscale, dbias: &dbias },
            )?;
        }
        Ok((dx, dparams))
    }
}

/// The per-channel statistics a caller reads (mean and biased variance, f32
/// tensors on the device) from what cuDNN saved.
pub fn batch_statistics(g: &NormGeometry, stats: &NormStatistics, dev: &CudaDevice) -> Result<BatchStatistics> {
    let stream = dev.cuda_stream();
    let copy = |s: &candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>| -> Result<Tensor> {
        let storage = CudaStorage::wrap_cuda_slice(stream.clone_dtod(s).map_err(candle_core::Error::wrap)?, dev.clone());
        Ok(Tensor::from_storage(Storage::Cuda(storage), g.channels, BackpropOp::none(), false))
    };
    let count = g.count();
    Ok(BatchStatistics { mean: copy(&stats.mean)?, var: copy(&stats.unbiased_var)?.affine(biased_from_unbiased(count), 0.0)?, count })
}

/// Training-mode batch-norm forward: `y`, with the statistics saved in `saved`.
pub fn batch_norm_forward(bn: BatchNorm<'_>, x: Arg<'_>, weight: Arg<'_>, bias: Arg<'_>, saved: &Saved) -> Result<(CudaStorage, Shape)> {
    let (e, dev) = (element_of(bn.op, &[x])?, &x.storage.device);
    let stream = dev.cuda_stream();
    let p = Params { scale: f32_operand(bn.op, weight, &stream)?, bias: f32_operand(bn.op, bias, &stream)? };
    let y = Made::new(dev, e, bn.shape())?;
    let mut stats = Vec::with_capacity(1);
    bn.keeping(x, &p, &y, &mut stats)?;
    saved.set(stats).map_err(|_| OpError::StatisticsTwice { op: bn.op })?;
    Ok((y.storage, bn.shape()))
}

/// Gradients of a plain batch-norm: input, weight, bias.
pub fn batch_norm_backward(bn: BatchNorm<'_>, x: &Tensor, weight: &Tensor, dy: &Tensor, saved: &Saved) -> Result<[Tensor; 3]> {
    let stats = saved.get().and_then(|s| s.first()).ok_or(OpError::MissingStatistics)?;
    let (dx, dparams) = with_cuda(bn.op, x, |x| {
        with_cuda(bn.op, dy, |dy| {
            with_cuda(bn.op, weight, |w| {
                let stream = x.storage.device.cuda_stream();
                let scale = f32_operand(bn.op, w, &stream)?;
                let grads = bn.backward(x, dy, &scale, stats);
                drop(scale);
                grads
            })
        })
    })?;
    let (channels, dparams) = (bn.geometry.channels, dparams.tensor());
    Ok([dx.tensor(), dparams.narrow(0, 0, channels)?, dparams.narrow(0, channels, channels)?])
}

/// What reads a lean op's activation, on CUDA.
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
pub fn norm_act_forward(
    lean: Lean<'_>,
    consumer: Consumer<'_>,
    [z, packed]: [Arg<'_>; 2],
    weight: Option<Arg<'_>>,
    saved: &Saved,
) -> Result<(CudaStorage, Shape)> {
    let (bn, op) = (lean.norm, lean.norm.op);
    let (e, dev) = (element_of(op, &[z])?, &z.storage.device);
    let stream = dev.cuda_stream();
    let a = Made::new(dev, e, bn.shape())?;
    let mut stats = Vec::with_capacity(1);
    bn.keeping(z, &bn.params(packed, 0, &stream)?, &a, &mut stats)?;
    saved.set(stats).map_err(|_| OpError::StatisticsTwice { op })?;
    if let Some(act) = cudnn_activation(lean.act) {
        let ao = a.arg().operand(op, &stream)?;
        device::activate(dev, act, bn.maps(e)?, &ao, &ao)?;
    }
    match (consumer, weight) {
        (Consumer::Nothing, _) => Ok((a.storage, bn.shape())),
        (Consumer::Conv(c), Some(w)) => conv_forward(c, a.arg(), w),
        (Consumer::MaxPool(p), _) => max_pool_forward(p, a.arg()),
        (Consumer::Conv(_), None) => Err(OpError::MissingOperand { op, what: "convolution weight" }.into()),
    }
}

/// The gradients of `norm_act` from its inputs `z` and the packed
/// parameters, the consumer's weight, and its output `y` and gradient `dy`:
/// `z`'s, the parameters' and the weight's, each `None` where the input
/// needs none.
pub fn norm_act_backward(
    lean: Lean<'_>,
    consumer: Consumer<'_>,
    [z, packed]: [&Tensor; 2],
    weight: Option<&Tensor>,
    [y, dy]: [&Tensor; 2],
    saved: &Saved,
) -> Result<[Option<Tensor>; 3]> {
    let (bn, op) = (lean.norm, lean.norm.op);
    let stats = saved.get().and_then(|s| s.first()).ok_or(OpError::MissingStatistics)?;
    let want_weight = weight.is_some_and(|w| w.track_op());
    let [dz, dparams, dweight] = with_cuda(op, z, |z| {
        with_cuda(op, packed, |packed| {
            with_cuda(op, dy, |dy| {
                let (e, dev) = (element_of(op, &[z, dy])?, &z.storage.device);
                let stream = dev.cuda_stream();
                let maps = bn.maps(e)?;
                let p = bn.params(packed, 0, &stream)?;
                let pre = Made::new(dev, e, bn.shape())?;
                bn.again(z, &p, &pre)?;
                let act = cudnn_activation(lean.act);
                let activated = match act {
                    Some(act) => {
                        let a = Made::new(dev, e, bn.shape())?;
                        let (po, ao) = (pre.arg().operand(op, &stream)?, a.arg().operand(op, &stream)?);
                        device::activate(dev, act, maps, &po, &ao)?;
                        drop((po, ao));
                        Some(a)
                    }
                    None => None,
                };
                let a = activated.as_ref().unwrap_or(&pre).arg();
                let (da, dweight) = match (consumer, weight) {
                    (Consumer::Nothing, _) => (None, None),
                    (Consumer::Conv(c), Some(w)) => with_cuda(op, w, |w| {
                        let dweight = if want_weight { Some(Made::from(conv_weight_gradient(c, a, dy)?)) } else { None };
                        Ok((Some(Made::from(conv_input_gradient(c, dy, w)?)), dweight))
                    })?,
                    (Consumer::MaxPool(pool), _) => with_cuda(op, y, |y| Ok((Some(Made::from(max_pool_backward(pool, a, y, dy)?)), None)))?,
                    (Consumer::Conv(_), None) => Err(OpError::MissingOperand { op, what: "convolution weight" })?,
                };
                // The gradient before the activation: in place in the
                // consumer's input gradient, or a new map where `dy` itself
                // is the activation's gradient.
                let dpre = match (act, &activated) {
                    (Some(act), Some(activated)) => {
                        let target = match da {
                            Some(da) => da,
                            None => Made::new(dev, e, bn.shape())?,
                        };
                        let (po, ao, to) =
                            (pre.arg().operand(op, &stream)?, activated.arg().operand(op, &stream)?, target.arg().operand(op, &stream)?);
                        let incoming = if matches!(consumer, Consumer::Nothing) {
                            dy.operand(op, &stream)?
                        } else {
                            target.arg().operand(op, &stream)?
                        };
                        device::activate_backward(dev, act, maps, &po, &ao, &incoming, &to)?;
                        drop((po, ao, to, incoming));
                        Some(target)
                    }
                    _ => da,
                };
                drop(activated);
                drop(pre);
                let (dz, dparams) = bn.backward(z, dpre.as_ref().map_or(dy, |d| d.arg()), &p.scale, stats)?;
                Ok([Some(dz.tensor()), Some(dparams.tensor()), dweight.map(Made::tensor)])
            })
        })
    })?;
    // The parameters' gradient comes out flat, `[2C]`; the operand is the
    // stacked `(2, C)`, and candle refuses a gradient of another shape.
    let dparams = dparams.filter(|_| packed.track_op()).map(|d| d.reshape(packed.shape())).transpose()?;
    Ok([dz.filter(|_| z.track_op()), dparams, dweight])
}

/// `act(bn(z) + residual)`, the residual `x` or `bn'(x)` where `projected`.
pub fn norm_add_act_forward(lean: Lean<'_>, projected: bool, [z, x, packed]: [Arg<'_>; 3], saved: &Saved) -> Result<(CudaStorage, Shape)> {
    let (bn, op) = (lean.norm, lean.norm.op);
    let (e, dev) = (element_of(op, &[z, x])?, &z.storage.device);
    let s = sum(bn, projected, [z, x, packed], Some(saved))?;
    if let Some(act) = cudnn_activation(lean.act) {
        let stream = dev.cuda_stream();
        let so = s.arg().operand(op, &stream)?;
        device::activate(dev, act, bn.maps(e)?, &so, &so)?;
    }
    Ok((s.storage, bn.shape()))
}

/// `bn(z) + residual`, saving the statistics when `saved` is given, else as
/// the forward computed it.
fn sum(bn: BatchNorm<'_>, projected: bool, [z, x, packed]: [Arg<'_>; 3], saved: Option<&Saved>) -> Result<Made> {
    let op = bn.op;
    let (e, dev) = (element_of(op, &[z, x])?, &z.storage.device);
    let stream = dev.cuda_stream();
    let s = Made::new(dev, e, bn.shape())?;
    let mut stats = Vec::with_capacity(2);
    let normalise = |x: Arg<'_>, p: &Params<'_>, y: &Made, stats: &mut Vec<NormStatistics>| match saved {
        Some(_) => bn.keeping(x, p, y, stats),
        None => bn.again(x, p, y),
    };
    normalise(z, &bn.params(packed, 0, &stream)?, &s, &mut stats)?;
    let side = if projected {
        let side = Made::new(dev, e, bn.shape())?;
        normalise(x, &bn.params(packed, 1, &stream)?, &side, &mut stats)?;
        Some(side)
    } else {
        None
    };
    {
        let residual = match &side {
            Some(side) => side.arg().operand(op, &stream)?,
            None => x.operand(op, &stream)?,
        };
        let so = s.arg().operand(op, &stream)?;
        device::add_into(dev, bn.maps(e)?, &residual, &so)?;
    }
    if let Some(saved) = saved {
        saved.set(stats).map_err(|_| OpError::StatisticsTwice { op })?;
    }
    Ok(s)
}

/// The gradients of `norm_add_act` from its inputs `z`, the residual's
/// input `x` and the packed parameters, and its output `y` and gradient
/// `dy`: `z`'s, `x`'s and the parameters'.
pub fn norm_add_act_backward(
    lean: Lean<'_>,
    projected: bool,
    [z, x, packed]: [&Tensor; 3],
    [y, dy]: [&Tensor; 2],
    saved: &Saved,
) -> Result<[Tensor; 3]> {
    let (bn, op) = (lean.norm, lean.norm.op);
    let stats = saved.get().ok_or(OpError::MissingStatistics)?;
    let body_stats = stats.first().ok_or(OpError::MissingStatistics)?;
    let (dz, dx, dparams) = with_cuda(op, z, |z| {
        with_cuda(op, x, |x| {
            with_cuda(op, packed, |packed| {
                with_cuda(op, dy, |dy| {
                    let (e, dev) = (element_of(op, &[z, x, dy])?, &z.storage.device);
                    let stream = dev.cuda_stream();
                    // The gradient of the sum: through the activation, from
                    // the sum recomputed and the op's output, or `dy` itself.
                    let ds = match cudnn_activation(lean.act) {
                        Some(act) => with_cuda(op, y, |y| {
                            let s = sum(bn, projected, [z, x, packed], None)?;
                            let ds = Made::new(dev, e, bn.shape())?;
                            let (so, yo, dyo, dso) = (
                                s.arg().operand(op, &stream)?,
                                y.operand(op, &stream)?,
                                dy.operand(op, &stream)?,
                                ds.arg().operand(op, &stream)?,
                            );
                            device::activate_backward(dev, act, bn.maps(e)?, &so, &yo, &dyo, &dso)?;
                            drop((so, yo, dyo, dso));
                            Ok(Some(ds))
                        })?,
                        None => None,
                    };
                    let ds_arg = ds.as_ref().map_or(dy, |d| d.arg());
                    let (dz, dbody) = bn.backward(z, ds_arg, &bn.params(packed, 0, &stream)?.scale, body_stats)?;
                    let (dx, dparams) = match (projected, stats.get(1)) {
                        (true, Some(side)) => {
                            let (dx, dside) = bn.backward(x, ds_arg, &bn.params(packed, 1, &stream)?.scale, side)?;
                            (Some(dx.tensor()), Tensor::cat(&[dbody.tensor(), dside.tensor()], 0)?)
                        }
                        (true, None) => Err(OpError::MissingStatistics)?,
                        (false, _) => (ds.map(Made::tensor), dbody.tensor()),
                    };
                    Ok((dz.tensor(), dx, dparams))
                })
            })
        })
    })?;
    // Flat, `[2C]` or `[4C]`, as cuDNN wrote it; the operand is the stacked `(2, C)` or `(4, C)`.
    Ok([dz, dx.unwrap_or_else(|| dy.clone()), dparams.reshape(packed.shape())?])
}
