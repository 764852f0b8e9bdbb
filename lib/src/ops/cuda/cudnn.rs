//! cuDNN on a candle CUDA device: one handle, one workspace and the plan
//! caches per device, kept on the thread that uses them (a cuDNN handle is
//! not thread-safe, and the training step runs on the thread its CUDA context
//! is current on). Every call is queued on candle's stream: nothing here
//! synchronises the device.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cudnn::{result, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, SyncOnDrop};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, DeviceId};
use candle_core::{CudaStorage, Layout, Result};

use super::super::OpError;
use super::plan::{choose, Candidate, Choice, ConvDims, ConvKey, ConvPass, Element, Math, NormDims, PlanCache, PoolDims, TensorDims};
use super::{ConvAlgorithm, WORKSPACE_BYTES};

fn cudnn_error(op: &'static str) -> impl Fn(result::CudnnError) -> candle_core::Error {
    move |e| OpError::Cudnn { op, status: format!("{:?}", e.0) }.into()
}

fn data_type(e: Element) -> sys::cudnnDataType_t {
    match e {
        Element::F32 => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        Element::F16 => sys::cudnnDataType_t::CUDNN_DATA_HALF,
        Element::Bf16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

/// A cuDNN object, destroyed with the value (a failure to destroy one
/// leaves nothing to recover).
macro_rules! owned {
    ($name:ident, $raw:ty, $destroy:path) => {
        struct $name($raw);

        impl Drop for $name {
            fn drop(&mut self) {
                let _ = unsafe { $destroy(self.0) };
            }
        }
    };
}

owned!(Handle, sys::cudnnHandle_t, result::destroy_handle);
owned!(TensorDesc, sys::cudnnTensorDescriptor_t, result::destroy_tensor_descriptor);
owned!(FilterDesc, sys::cudnnFilterDescriptor_t, result::destroy_filter_descriptor);
owned!(ConvDesc, sys::cudnnConvolutionDescriptor_t, result::destroy_convolution_descriptor);
owned!(PoolDesc, sys::cudnnPoolingDescriptor_t, sys::cudnnDestroyPoolingDescriptor);
owned!(ActivationDesc, sys::cudnnActivationDescriptor_t, sys::cudnnDestroyActivationDescriptor);

impl TensorDesc {
    fn new(op: &'static str, d: &TensorDims, e: Element) -> Result<Self> {
        let desc = TensorDesc(result::create_tensor_descriptor().map_err(cudnn_error(op))?);
        unsafe { result::set_tensor4d_descriptor_ex(desc.0, data_type(e), d.dims, d.strides) }.map_err(cudnn_error(op))?;
        Ok(desc)
    }
}

/// The algorithm of one convolution pass, with cuDNN's math type for it.
#[derive(Debug, Clone, Copy)]
enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    InputGradient(sys::cudnnConvolutionBwdDataAlgo_t),
    WeightGradient(sys::cudnnConvolutionBwdFilterAlgo_t),
}

/// One convolution pass at one shape: its descriptors and its algorithm.
struct ConvPlan {
    x: TensorDesc,
    filter: FilterDesc,
    conv: ConvDesc,
    y: TensorDesc,
    choice: Choice<(Algo, sys::cudnnMathType_t)>,
}

impl ConvPlan {
    fn new(handle: &Handle, key: &ConvKey) -> Result<Self> {
        let op = "conv2d";
        let err = cudnn_error(op);
        let (d, e) = (&key.dims, key.element);
        let x = TensorDesc::new(op, &d.x, e)?;
        let y = TensorDesc::new(op, &d.y, e)?;
        let filter = FilterDesc(result::create_filter_descriptor().map_err(&err)?);
        unsafe { result::set_filter4d_descriptor(filter.0, data_type(e), sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW, d.filter) }
            .map_err(&err)?;
        let conv = ConvDesc(result::create_convolution_descriptor().map_err(&err)?);
        unsafe {
            // f32 accumulation for every element type, as PyTorch configures cuDNN.
            result::set_convolution2d_descriptor(
                conv.0,
                d.padding[0],
                d.padding[1],
                d.stride[0],
                d.stride[1],
                d.dilation[0],
                d.dilation[1],
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
            .map_err(&err)?;
            result::set_convolution_group_count(conv.0, d.groups).map_err(&err)?;
            let math = match e.math() {
                Math::DefaultAllowingTf32 => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
                Math::TensorCores => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
            };
            result::set_convolution_math_type(conv.0, math).map_err(&err)?;
        }
        let candidates = unsafe { candidates(handle, key.pass, &x, &filter, &conv, &y) }.map_err(&err)?;
        let choice = choose(&candidates, WORKSPACE_BYTES).ok_or(OpError::NoCudnnAlgorithm {
            pass: key.pass.name(),
            dims: d.x.dims.to_vec(),
            filter: d.filter.to_vec(),
            workspace: WORKSPACE_BYTES,
        })?;
        unsafe { result::set_convolution_math_type(conv.0, choice.algo.1) }.map_err(&err)?;
        Ok(ConvPlan { x, filter, conv, y, choice })
    }
}

/// cuDNN's v7 heuristics for one pass, as candidates: `$get` fills up to
/// `$count` results of `$perf` (the three passes' structs differ in type
/// only), given the count, the returned count and the results' pointer.
macro_rules! ranked {
    ($perf:ty, $count:expr, $pass:path, |$asked:ident, $returned:ident, $results:ident| $get:expr) => {{
        const COUNT: usize = $count as usize;
        let mut perf = [MaybeUninit::<$perf>::zeroed().assume_init(); COUNT];
        let mut returned = 0;
        let ($asked, $returned, $results) = (COUNT as i32, &mut returned, perf.as_mut_ptr());
        $get?;
        let returned = (returned.max(0) as usize).min(COUNT);
        perf[..returned]
            .iter()
            .map(|p| Candidate {
                algo: ($pass(p.algo), p.mathType),
                supported: p.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS,
                workspace: p.memory as u64,
            })
            .collect()
    }};
}

/// cuDNN's heuristics for one pass, in their order.
///
/// # Safety
/// The descriptors must describe the pass's problem.
unsafe fn candidates(
    handle: &Handle,
    pass: ConvPass,
    x: &TensorDesc,
    filter: &FilterDesc,
    conv: &ConvDesc,
    y: &TensorDesc,
) -> std::result::Result<Vec<Candidate<(Algo, sys::cudnnMathType_t)>>, result::CudnnError> {
    use sys::{cudnnConvolutionBwdDataAlgo_t as Data, cudnnConvolutionBwdFilterAlgo_t as Filter, cudnnConvolutionFwdAlgo_t as Fwd};
    Ok(match pass {
        ConvPass::Forward => {
            ranked!(sys::cudnnConvolutionFwdAlgoPerf_t, Fwd::CUDNN_CONVOLUTION_FWD_ALGO_COUNT, Algo::Forward, |n, got, out| {
                result::get_convolution_forward_algorithm(handle.0, x.0, filter.0, conv.0, y.0, n, got, out)
            })
        }
        ConvPass::InputGradient => {
            ranked!(
                sys::cudnnConvolutionBwdDataAlgoPerf_t,
                Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                Algo::InputGradient,
                |n, got, out| { result::get_convolution_backward_data_algorithm(handle.0, filter.0, y.0, conv.0, x.0, n, got, out) }
            )
        }
        ConvPass::WeightGradient => ranked!(
            sys::cudnnConvolutionBwdFilterAlgoPerf_t,
            Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
            Algo::WeightGradient,
            |n, got, out| result::get_convolution_backward_filter_algorithm(handle.0, x.0, y.0, conv.0, filter.0, n, got, out)
        ),
    })
}

/// A pooling window's descriptors.
struct PoolPlan {
    x: TensorDesc,
    y: TensorDesc,
    pool: PoolDesc,
}

/// The activations cuDNN runs for our ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudnnActivation {
    Relu,
    Silu,
}

/// What the device keeps for cuDNN: its handle on candle's stream, the
/// workspace (allocated whole on the first convolution) and the plans.
struct DeviceCudnn {
    handle: Handle,
    stream: Arc<CudaStream>,
    workspace: Option<CudaSlice<u8>>,
    convs: PlanCache<ConvKey, ConvPlan>,
    pools: PlanCache<(PoolDims, Element), PoolPlan>,
    tensors: PlanCache<(TensorDims, Element), TensorDesc>,
    activations: PlanCache<CudnnActivation, ActivationDesc>,
}

thread_local! {
    static CUDNN: RefCell<HashMap<DeviceId, DeviceCudnn>> = RefCell::new(HashMap::new());
}

/// Runs `f` with the device's cuDNN state, made on first use.
fn with_cudnn<R>(dev: &CudaDevice, f: impl FnOnce(&mut DeviceCudnn) -> Result<R>) -> Result<R> {
    CUDNN.with(|all| {
        let mut all = all.borrow_mut();
        let state = match all.entry(dev.id()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let stream = dev.cuda_stream();
                // cuDNN makes its handle in the context current on this thread.
                stream.context().bind_to_thread()?;
                let handle = Handle(result::create_handle().map_err(cudnn_error("cudnn"))?);
                unsafe { result::set_stream(handle.0, stream.cu_stream() as sys::cudaStream_t) }.map_err(cudnn_error("cudnn"))?;
                v.insert(DeviceCudnn {
                    handle,
                    stream,
                    workspace: None,
                    convs: PlanCache::default(),
                    pools: PlanCache::default(),
                    tensors: PlanCache::default(),
                    activations: PlanCache::default(),
                })
            }
        };
        f(state)
    })
}

/// Every convolution plan made so far on `dev` on this thread, with the
/// number of plans made: after the first training step it stays the same.
pub fn conv_algorithms(dev: &CudaDevice) -> Result<(Vec<ConvAlgorithm>, usize)> {
    with_cudnn(dev, |c| {
        let list = c
            .convs
            .plans()
            .map(|(key, plan)| ConvAlgorithm {
                pass: key.pass.name(),
                input: key.dims.x.dims,
                filter: key.dims.filter,
                groups: key.dims.groups,
                element: format!("{:?}", key.element),
                algorithm: match plan.choice.algo.0 {
                    Algo::Forward(a) => format!("{a:?}"),
                    Algo::InputGradient(a) => format!("{a:?}"),
                    Algo::WeightGradient(a) => format!("{a:?}"),
                },
                math: format!("{:?}", plan.choice.algo.1),
                rank: plan.choice.rank,
                workspace_bytes: plan.choice.workspace,
            })
            .collect();
        Ok((list, c.convs.made()))
    })
}

impl DeviceCudnn {
    fn workspace(&mut self, dev: &CudaDevice) -> Result<(u64, usize)> {
        if self.workspace.is_none() {
            self.workspace = Some(unsafe { dev.alloc::<u8>(WORKSPACE_BYTES as usize)? });
        }
        let ws = self.workspace.as_ref().ok_or(OpError::MissingOperand { op: "cudnn", what: "workspace" })?;
        let (ptr, _record) = ws.device_ptr(&self.stream);
        Ok((ptr, WORKSPACE_BYTES as usize))
    }

    fn tensor(&mut self, op: &'static str, dims: TensorDims, e: Element) -> Result<sys::cudnnTensorDescriptor_t> {
        Ok(self.tensors.get_or_make((dims, e), |(d, e)| TensorDesc::new(op, d, *e))?.0)
    }

    fn activation(&mut self, act: CudnnActivation) -> Result<sys::cudnnActivationDescriptor_t> {
        let err = cudnn_error("activation");
        Ok(self
            .activations
            .get_or_make(act, |act| {
                let mut raw = MaybeUninit::uninit();
                unsafe { sys::cudnnCreateActivationDescriptor(raw.as_mut_ptr()) }.result().map_err(&err)?;
                let desc = ActivationDesc(unsafe { raw.assume_init() });
                let nan = sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN;
                unsafe {
                    match act {
                        CudnnActivation::Relu => {
                            sys::cudnnSetActivationDescriptor(desc.0, sys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU, nan, 0.0)
                                .result()
                                .map_err(&err)?
                        }
                        CudnnActivation::Silu => {
                            sys::cudnnSetActivationDescriptor(desc.0, sys::cudnnActivationMode_t::CUDNN_ACTIVATION_SWISH, nan, 0.0)
                                .result()
                                .map_err(&err)?;
                            sys::cudnnSetActivationDescriptorSwishBeta(desc.0, 1.0).result().map_err(&err)?;
                        }
                    }
                }
                Ok::<_, candle_core::Error>(desc)
            })?
            .0)
    }
}

/// f32 scaling factors, which cuDNN takes for f32, f16 and bf16 data alike.
const ONE: f32 = 1.0;
const ZERO: f32 = 0.0;

fn scalar(v: &f32) -> *const c_void {
    v as *const f32 as *const c_void
}

/// The address of an operand's first element (its layout's offset applied),
/// and the guard that records its use on the stream.
pub struct Operand<'a> {
    address: u64,
    _record: SyncOnDrop<'a>,
}

impl<'a> Operand<'a> {
    pub fn of(op: &'static str, storage: &'a CudaStorage, layout: &Layout, stream: &'a CudaStream) -> Result<Self> {
        let (address, record) = match &storage.slice {
            CudaStorageSlice::F32(s) => s.device_ptr(stream),
            CudaStorageSlice::F16(s) => s.device_ptr(stream),
            CudaStorageSlice::BF16(s) => s.device_ptr(stream),
            _ => Err(OpError::UnsupportedDType { op, dtype: storage.dtype() })?,
        };
        let offset = layout.start_offset() * storage.dtype().size_in_bytes();
        Ok(Operand { address: address + offset as u64, _record: record })
    }

    fn ptr(&self) -> *const c_void {
        self.address as *const c_void
    }

    fn mut_ptr(&self) -> *mut c_void {
        self.address as *mut c_void
    }
}

/// A new, uninitialised tensor storage of `len` elements on `dev`.
pub fn alloc(dev: &CudaDevice, e: Element, len: usize) -> Result<CudaStorage> {
    Ok(unsafe {
        match e {
            Element::F32 => CudaStorage::wrap_cuda_slice(dev.alloc::<f32>(len)?, dev.clone()),
            Element::F16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::f16>(len)?, dev.clone()),
            Element::Bf16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::bf16>(len)?, dev.clone()),
        }
    })
}

/// Which of a convolution's three passes runs, on which operands.
pub enum ConvCall<'a> {
    /// `y = conv(x, w)`.
    Forward { x: &'a Operand<'a>, w: &'a Operand<'a>, y: &'a Operand<'a> },
    /// `dx = conv_transpose(dy, w)`.
    InputGradient { dy: &'a Operand<'a>, w: &'a Operand<'a>, dx: &'a Operand<'a> },
    /// `dw = correlate(x, dy)`.
    WeightGradient { x: &'a Operand<'a>, dy: &'a Operand<'a>, dw: &'a Operand<'a> },
}

/// Runs one convolution pass with its cached plan.
pub fn convolve(dev: &CudaDevice, dims: ConvDims, e: Element, call: ConvCall<'_>) -> Result<()> {
    let pass = match call {
        ConvCall::Forward { .. } => ConvPass::Forward,
        ConvCall::InputGradient { .. } => ConvPass::InputGradient,
        ConvCall::WeightGradient { .. } => ConvPass::WeightGradient,
    };
    let err = cudnn_error("conv2d");
    with_cudnn(dev, |c| {
        let (workspace, workspace_bytes) = c.workspace(dev)?;
        let handle = &c.handle;
        let plan = c.convs.get_or_make(ConvKey { pass, dims, element: e }, |key| ConvPlan::new(handle, key))?;
        let ws = workspace as *mut c_void;
        unsafe {
            match (call, plan.choice.algo.0) {
                (ConvCall::Forward { x, w, y }, Algo::Forward(algo)) => result::convolution_forward(
                    handle.0,
                    scalar(&ONE),
                    plan.x.0,
                    x.ptr(),
                    plan.filter.0,
                    w.ptr(),
                    plan.conv.0,
                    algo,
                    ws,
                    workspace_bytes,
                    scalar(&ZERO),
                    plan.y.0,
                    y.mut_ptr(),
                ),
                (ConvCall::InputGradient { dy, w, dx }, Algo::InputGradient(algo)) => result::convolution_backward_data(
                    handle.0,
                    scalar(&ONE),
                    plan.filter.0,
                    w.ptr(),
                    plan.y.0,
                    dy.ptr(),
                    plan.conv.0,
                    algo,
                    ws,
                    workspace_bytes,
                    scalar(&ZERO),
                    plan.x.0,
                    dx.mut_ptr(),
                ),
                (ConvCall::WeightGradient { x, dy, dw }, Algo::WeightGradient(algo)) => result::convolution_backward_filter(
                    handle.0,
                    scalar(&ONE),
                    plan.x.0,
                    x.ptr(),
                    plan.y.0,
                    dy.ptr(),
                    plan.conv.0,
                    algo,
                    ws,
                    workspace_bytes,
                    scalar(&ZERO),
                    plan.filter.0,
                    dw.mut_ptr(),
                ),
                _ => return Err(OpError::MissingOperand { op: "conv2d", what: "plan of this pass" }.into()),
            }
        }
        .map_err(&err)
    })
}

/// Max-pooling forward, `y = pool(x)`, or backward, `dx = pool'(x, y, dy)`
/// (each output's gradient to its window's maximum).
pub fn max_pool(
    dev: &CudaDevice,
    dims: PoolDims,
    e: Element,
    x: &Operand<'_>,
    y: &Operand<'_>,
    grads: Option<(&Operand<'_>, &Operand<'_>)>,
) -> Result<()> {
    let err = cudnn_error("max_pool2d");
    with_cudnn(dev, |c| {
        let plan = c.pools.get_or_make((dims, e), |(d, e)| {
            let mut raw = MaybeUninit::uninit();
            unsafe { sys::cudnnCreatePoolingDescriptor(raw.as_mut_ptr()) }.result().map_err(&err)?;
            let pool = PoolDesc(unsafe { raw.assume_init() });
            unsafe {
                sys::cudnnSetPooling2dDescriptor(
                    pool.0,
                    sys::cudnnPoolingMode_t::CUDNN_POOLING_MAX_DETERMINISTIC,
                    sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                    d.window[0],
                    d.window[1],
                    d.padding[0],
                    d.padding[1],
                    d.stride[0],
                    d.stride[1],
                )
            }
            .result()
            .map_err(&err)?;
            Ok::<_, candle_core::Error>(PoolPlan {
                x: TensorDesc::new("max_pool2d", &d.x, *e)?,
                y: TensorDesc::new("max_pool2d", &d.y, *e)?,
                pool,
            })
        })?;
        unsafe {
            match grads {
                None => {
                    sys::cudnnPoolingForward(c.handle.0, plan.pool.0, scalar(&ONE), plan.x.0, x.ptr(), scalar(&ZERO), plan.y.0, y.mut_ptr())
                }
                Some((dy, dx)) => sys::cudnnPoolingBackward(
                    c.handle.0,
                    plan.pool.0,
                    scalar(&ONE),
                    plan.y.0,
                    y.ptr(),
                    plan.y.0,
                    dy.ptr(),
                    plan.x.0,
                    x.ptr(),
                    scalar(&ZERO),
                    plan.x.0,
                    dx.mut_ptr(),
                ),
            }
        }
        .result()
        .map_err(&err)
    })
}

/// Maps of one shape and element type, as the elementwise calls take them.
#[derive(Debug, Clone, Copy)]
pub struct Maps {
    pub dims: TensorDims,
    pub element: Element,
}

/// `y = act(x)` over `maps` (in place when `y` is `x`).
pub fn activate(dev: &CudaDevice, act: CudnnActivation, maps: Maps, x: &Operand<'_>, y: &Operand<'_>) -> Result<()> {
    with_cudnn(dev, |c| {
        let (desc, t) = (c.activation(act)?, c.tensor("activation", maps.dims, maps.element)?);
        unsafe { sys::cudnnActivationForward(c.handle.0, desc, scalar(&ONE), t, x.ptr(), scalar(&ZERO), t, y.mut_ptr()) }
            .result()
            .map_err(cudnn_error("activation"))
    })
}

/// `dx = dy * act'(x)`, from the activation's input `x` and output `y` (in
/// place when `dx` is `dy`).
pub fn activate_backward(
    dev: &CudaDevice,
    act: CudnnActivation,
    maps: Maps,
    x: &Operand<'_>,
    y: &Operand<'_>,
    dy: &Operand<'_>,
    dx: &Operand<'_>,
) -> Result<()> {
    with_cudnn(dev, |c| {
        let (desc, t) = (c.activation(act)?, c.tensor("activation", maps.dims, maps.element)?);
        unsafe {
            sys::cudnnActivationBackward(
                c.handle.0,
                desc,
                scalar(&ONE),
                t,
                y.ptr(),
                t,
                dy.ptr(),
                t,
                x.ptr(),
                scalar(&ZERO),
                t,
                dx.mut_ptr(),
            )
        }
        .result()
        .map_err(cudnn_error("activation"))
    })
}

/// `y += x` over `maps`.
pub fn add_into(dev: &CudaDevice, maps: Maps, x: &Operand<'_>, y: &Operand<'_>) -> Result<()> {
    with_cudnn(dev, |c| {
        let t = c.tensor("add", maps.dims, maps.element)?;
        unsafe { sys::cudnnAddTensor(c.handle.0, scalar(&ONE), t, x.ptr(), scalar(&ONE), t, y.mut_ptr()) }
            .result()
            .map_err(cudnn_error("add"))
    })
}

/// A batch's per-channel statistics as cuDNN's batch-norm gives them (f32,
/// on the device): the mean and `1 / sqrt(var + eps)` that its backward
/// reads, and the unbiased variance.
pub struct NormStatistics {
    pub mean: CudaSlice<f32>,
    pub inv_std: CudaSlice<f32>,
    pub unbiased_var: CudaSlice<f32>,
}

/// A spatial batch-norm's shapes, element type and epsilon.
#[derive(Debug, Clone, Copy)]
pub struct NormCall {
    pub dims: NormDims,
    pub element: Element,
    pub eps: f64,
}

/// Training-mode batch-norm forward, `y = (x - mean) * inv_std * scale +
/// bias` with this batch's statistics (f32 `scale` and `bias`, one per
/// channel). With `keep` it returns the statistics; without, it only
/// recomputes `y` (a lean op's backward), exactly as the forward did.
pub fn batch_norm(
    dev: &CudaDevice,
    call: NormCall,
    x: &Operand<'_>,
    scale: &Operand<'_>,
    bias: &Operand<'_>,
    y: &Operand<'_>,
    keep: bool,
) -> Result<Option<NormStatistics>> {
    let NormCall { dims, element: e, eps } = call;
    let channels = dims.per_channel.elements();
    // The running outputs are read as well as written (`running * (1 -
    // factor) + batch * factor`, factor 1): they start as zeros, so that
    // whatever the memory held (a NaN) cannot leak in.
    let stats = if keep {
        Some(NormStatistics {
            mean: unsafe { dev.alloc::<f32>(channels)? },
            inv_std: unsafe { dev.alloc::<f32>(channels)? },
            unbiased_var: dev.alloc_zeros::<f32>(channels)?,
        })
    } else {
        None
    };
    with_cudnn(dev, |c| {
        let xt = c.tensor("batch_norm_train", dims.x, e)?;
        let pt = c.tensor("batch_norm_train", dims.per_channel, Element::F32)?;
        let stream = c.stream.clone();
        // cuDNN writes the batch mean into the running mean with an averaging
        // factor of 1; it is the same as the saved mean, so it goes to scratch.
        let running_mean = match &stats {
            Some(_) => Some(dev.alloc_zeros::<f32>(channels)?),
            None => None,
        };
        let out = |s| optional_address(s, &stream);
        let (mean, inv_std, var, run) = (
            out(stats.as_ref().map(|s| &s.mean)),
            out(stats.as_ref().map(|s| &s.inv_std)),
            out(stats.as_ref().map(|s| &s.unbiased_var)),
            out(running_mean.as_ref()),
        );
        let ptr = |p: &Option<(u64, SyncOnDrop<'_>)>| p.as_ref().map_or(std::ptr::null_mut(), |(a, _)| *a as *mut c_void);
        unsafe {
            sys::cudnnBatchNormalizationForwardTraining(
                c.handle.0,
                sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL,
                scalar(&ONE),
                scalar(&ZERO),
                xt,
                x.ptr(),
                xt,
                y.mut_ptr(),
                pt,
                scale.ptr(),
                bias.ptr(),
                1.0,
                ptr(&run),
                ptr(&var),
                eps,
                ptr(&mean),
                ptr(&inv_std),
            )
        }
        .result()
        .map_err(cudnn_error("batch_norm_train"))
    })?;
    Ok(stats)
}

/// The address of an optional per-channel output, and its guard.
fn optional_address<'a>(slice: Option<&'a CudaSlice<f32>>, stream: &'a CudaStream) -> Option<(u64, SyncOnDrop<'a>)> {
    slice.map(|s| s.device_ptr(stream))
}

/// Where batch-norm's backward writes: the input's gradient, and the f32
/// per-channel gradients of the scale and the bias.
pub struct NormGrads<'a> {
    pub dx: &'a Operand<'a>,
    pub dscale: &'a Operand<'a>,
    pub dbias: &'a Operand<'a>,
}

/// Training-mode batch-norm backward from the input `x`, the output gradient
/// `dy` and the forward's saved statistics: `dx`, and the f32 per-channel
/// `sum(dy * xhat)` (the scale's gradient) and `sum(dy)` (the bias's).
pub fn batch_norm_backward(
    dev: &CudaDevice,
    call: NormCall,
    x: &Operand<'_>,
    dy: &Operand<'_>,
    scale: &Operand<'_>,
    stats: &NormStatistics,
    grads: NormGrads<'_>,
) -> Result<()> {
    let NormCall { dims, element: e, eps } = call;
    let NormGrads { dx, dscale, dbias } = grads;
    with_cudnn(dev, |c| {
        let xt = c.tensor("batch_norm_train", dims.x, e)?;
        let pt = c.tensor("batch_norm_train", dims.per_channel, Element::F32)?;
        let stream = c.stream.clone();
        let (mean, _m) = stats.mean.device_ptr(&stream);
        let (inv_std, _i) = stats.inv_std.device_ptr(&stream);
        unsafe {
            sys::cudnnBatchNormalizationBackward(
                c.handle.0,
                sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL,
                scalar(&ONE),
                scalar(&ZERO),
                scalar(&ONE),
                scalar(&ZERO),
                xt,
                x.ptr(),
                xt,
                dy.ptr(),
                xt,
                dx.mut_ptr(),
                pt,
                scale.ptr(),
                dscale.mut_ptr(),
                dbias.mut_ptr(),
                eps,
                mean as *const c_void,
                inv_std as *const c_void,
            )
        }
        .result()
        .map_err(cudnn_error("batch_norm_train"))
    })
}
