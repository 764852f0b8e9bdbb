//! The device primitives on a card: cuDNN on a candle CUDA device, one
//! handle, one workspace and the plan caches per device, kept on the thread that uses them (a cuDNN handle is
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
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg, SyncOnDrop};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, DeviceId};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};

use super::super::OpError;
use super::algorithms::{ConvAlgorithm, WORKSPACE_BYTES};
use super::descriptors::{ConvDims, Element, PoolDims, TensorDims};
use super::passes;
use super::plan::{choose, Candidate, Choice, ConvKey, ConvPass, Math, PlanCache};
use super::primitives::{
    Arg, At, ConvCall, DeltaCall, DeviceActivation, GemmCall, Held, LayerNormGrads, Maps, NormCall, NormGrads, NormStatistics, PoolGrads,
    Primitives, RowsCall, SoftmaxCall,
};

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

/// What the device keeps for cuDNN: its handle on candle's stream, the
/// workspace (allocated whole on the first convolution) and the plans.
struct DeviceCudnn {
    handle: Handle,
    stream: Arc<CudaStream>,
    workspace: Option<CudaSlice<u8>>,
    convs: PlanCache<ConvKey, ConvPlan>,
    pools: PlanCache<(PoolDims, Element), PoolPlan>,
    tensors: PlanCache<(TensorDims, Element), TensorDesc>,
    activations: PlanCache<DeviceActivation, ActivationDesc>,
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

    fn activation(&mut self, act: DeviceActivation) -> Result<sys::cudnnActivationDescriptor_t> {
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
                        DeviceActivation::Relu => {
                            sys::cudnnSetActivationDescriptor(desc.0, sys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU, nan, 0.0)
                                .result()
                                .map_err(&err)?
                        }
                        DeviceActivation::Silu => {
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

/// The address of an operand's first element, and the guard that records
/// its use on the stream.
struct Operand<'a> {
    address: u64,
    _record: SyncOnDrop<'a>,
}

impl<'a> Operand<'a> {
    fn of(op: &'static str, at: At<'a, CudaStorage>, stream: &'a CudaStream) -> Result<Self> {
        let storage = at.buffer;
        let (address, record) = match &storage.slice {
            CudaStorageSlice::F32(s) => s.device_ptr(stream),
            CudaStorageSlice::F16(s) => s.device_ptr(stream),
            CudaStorageSlice::BF16(s) => s.device_ptr(stream),
            _ => Err(OpError::UnsupportedDType { op, dtype: storage.dtype() })?,
        };
        let offset = at.offset * storage.dtype().size_in_bytes();
        Ok(Operand { address: address + offset as u64, _record: record })
    }

    /// Every operand of a call, in order.
    fn all<const N: usize>(op: &'static str, at: [At<'a, CudaStorage>; N], stream: &'a CudaStream) -> Result<[Self; N]> {
        let operands = at.into_iter().map(|a| Operand::of(op, a, stream)).collect::<Result<Vec<_>>>()?;
        operands.try_into().map_err(|_| OpError::MissingOperand { op, what: "operand" }.into())
    }

    fn ptr(&self) -> *const c_void {
        self.address as *const c_void
    }

    fn mut_ptr(&self) -> *mut c_void {
        self.address as *mut c_void
    }
}

/// cuDNN, cuBLAS, our kernels and candle's allocator on one CUDA device.
pub struct Cudnn {
    dev: CudaDevice,
}

/// Our kernels for the transformer's GELU and layer-norm (`lib/kernels/transformer.cu`).
const TRANSFORMER_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/transformer.ptx"));
const TRANSFORMER: &str = "vramlab_transformer";
/// Threads a block of our kernels runs, a power of two (the row kernels' sums halve it).
const THREADS: u32 = 256;
/// Blocks an elementwise kernel runs at most; each thread strides over the rest.
const MOST_BLOCKS: u32 = 4096;

/// `root` for the element type, as the kernels are named (`gelu_f16`).
fn kernel_name(root: &str, e: Element) -> String {
    let suffix = match e {
        Element::F32 => "f32",
        Element::F16 => "f16",
        Element::Bf16 => "bf16",
    };
    format!("{root}_{suffix}")
}

fn u32_of(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| OpError::TooLargeForCudnn { op, dims: vec![v] }.into())
}

impl Cudnn {
    /// `f` with the operands' addresses on candle's stream.
    fn with_operands<const N: usize, R>(
        &self,
        op: &'static str,
        at: [At<'_, CudaStorage>; N],
        f: impl FnOnce(&mut DeviceCudnn, [&Operand<'_>; N]) -> Result<R>,
    ) -> Result<R> {
        let stream = self.dev.cuda_stream();
        let operands = Operand::all(op, at, &stream)?;
        let refs: [&Operand<'_>; N] = std::array::from_fn(|i| &operands[i]);
        with_cudnn(&self.dev, |c| f(c, refs))
    }
}

/// Launches our kernel `$root` for element `$e` on `$device` (loaded at its
/// first use) with `$config` and the arguments in order.
macro_rules! launch {
    ($device:expr, $op:expr, $root:expr, $e:expr, $config:expr, [$($arg:expr),* $(,)?]) => {{
        let func = $device.get_or_load_custom_func(&kernel_name($root, $e), TRANSFORMER, TRANSFORMER_PTX)?;
        let mut args = func.builder();
        $(args.arg($arg);)*
        launched($op, unsafe { args.launch($config) })
    }};
}

/// A launch's outcome as an op's error.
fn launched<T>(op: &'static str, outcome: std::result::Result<T, candle_core::cuda_backend::cudarc::driver::DriverError>) -> Result<()> {
    outcome.map(|_| ()).map_err(|e| OpError::Cudnn { op, status: format!("launch: {e:?}") }.into())
}

impl Cudnn {
    /// One thread an element, at most [`MOST_BLOCKS`] blocks.
    fn elementwise(op: &'static str, len: usize) -> Result<LaunchConfig> {
        let blocks = u32_of(op, len.div_ceil(THREADS as usize).max(1))?.min(MOST_BLOCKS);
        Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 })
    }

    /// One block a row, with a float of shared memory a thread.
    fn per_row(op: &'static str, rows: usize) -> Result<LaunchConfig> {
        Ok(LaunchConfig { grid_dim: (u32_of(op, rows.max(1))?, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: THREADS * 4 })
    }
}

impl Primitives for Cudnn {
    type Buffer = CudaStorage;
    type Storage = CudaStorage;

    fn of_storage(storage: &CudaStorage) -> Self {
        Cudnn { dev: storage.device.clone() }
    }

    fn dtype(buffer: &CudaStorage) -> DType {
        buffer.dtype()
    }

    fn alloc(&self, e: Element, len: usize) -> Result<CudaStorage> {
        let dev = &self.dev;
        Ok(unsafe {
            match e {
                Element::F32 => CudaStorage::wrap_cuda_slice(dev.alloc::<f32>(len)?, dev.clone()),
                Element::F16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::f16>(len)?, dev.clone()),
                Element::Bf16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::bf16>(len)?, dev.clone()),
            }
        })
    }

    fn zeros_f32(&self, len: usize) -> Result<CudaStorage> {
        Ok(CudaStorage::wrap_cuda_slice(self.dev.alloc_zeros::<f32>(len)?, self.dev.clone()))
    }

    fn copy(&self, buffer: &CudaStorage) -> Result<CudaStorage> {
        // candle's clone of a CUDA storage copies its whole slice on the device, whatever the layout.
        buffer.try_clone(&Layout::contiguous(1))
    }

    fn convolve(&self, dims: ConvDims, e: Element, call: ConvCall<'_, CudaStorage>) -> Result<()> {
        let (pass, operands) = match call {
            ConvCall::Forward { x, w, y } => (ConvPass::Forward, [x, w, y]),
            ConvCall::InputGradient { dy, w, dx } => (ConvPass::InputGradient, [dy, w, dx]),
            ConvCall::WeightGradient { x, dy, dw } => (ConvPass::WeightGradient, [x, dy, dw]),
        };
        let err = cudnn_error("conv2d");
        let dev = &self.dev;
        self.with_operands("conv2d", operands, |c, [a, b, out]| {
            let (workspace, workspace_bytes) = c.workspace(dev)?;
            let handle = &c.handle;
            let plan = c.convs.get_or_make(ConvKey { pass, dims, element: e }, |key| ConvPlan::new(handle, key))?;
            let ws = workspace as *mut c_void;
            unsafe {
                match plan.choice.algo.0 {
                    Algo::Forward(algo) => result::convolution_forward(
                        handle.0,
                        scalar(&ONE),
                        plan.x.0,
                        a.ptr(),
                        plan.filter.0,
                        b.ptr(),
                        plan.conv.0,
                        algo,
                        ws,
                        workspace_bytes,
                        scalar(&ZERO),
                        plan.y.0,
                        out.mut_ptr(),
                    ),
                    Algo::InputGradient(algo) => result::convolution_backward_data(
                        handle.0,
                        scalar(&ONE),
                        plan.filter.0,
                        b.ptr(),
                        plan.y.0,
                        a.ptr(),
                        plan.conv.0,
                        algo,
                        ws,
                        workspace_bytes,
                        scalar(&ZERO),
                        plan.x.0,
                        out.mut_ptr(),
                    ),
                    Algo::WeightGradient(algo) => result::convolution_backward_filter(
                        handle.0,
                        scalar(&ONE),
                        plan.x.0,
                        a.ptr(),
                        plan.y.0,
                        b.ptr(),
                        plan.conv.0,
                        algo,
                        ws,
                        workspace_bytes,
                        scalar(&ZERO),
                        plan.filter.0,
                        out.mut_ptr(),
                    ),
                }
            }
            .map_err(&err)
        })
    }

    fn max_pool(
        &self,
        dims: PoolDims,
        e: Element,
        x: At<'_, CudaStorage>,
        y: At<'_, CudaStorage>,
        grads: Option<PoolGrads<'_, CudaStorage>>,
    ) -> Result<()> {
        let err = cudnn_error("max_pool2d");
        // The forward has no gradients: its own operands stand in for them, unread.
        let (dy, dx, backward) = grads.map_or((y, x, false), |g| (g.dy, g.dx, true));
        self.with_operands("max_pool2d", [x, y, dy, dx], |c, [x, y, dy, dx]| {
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
                match backward {
                    false => sys::cudnnPoolingForward(
                        c.handle.0,
                        plan.pool.0,
                        scalar(&ONE),
                        plan.x.0,
                        x.ptr(),
                        scalar(&ZERO),
                        plan.y.0,
                        y.mut_ptr(),
                    ),
                    true => sys::cudnnPoolingBackward(
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

    fn activate(&self, act: DeviceActivation, maps: Maps, x: At<'_, CudaStorage>, y: At<'_, CudaStorage>) -> Result<()> {
        self.with_operands("activation", [x, y], |c, [x, y]| {
            let (desc, t) = (c.activation(act)?, c.tensor("activation", maps.dims, maps.element)?);
            unsafe { sys::cudnnActivationForward(c.handle.0, desc, scalar(&ONE), t, x.ptr(), scalar(&ZERO), t, y.mut_ptr()) }
                .result()
                .map_err(cudnn_error("activation"))
        })
    }

    fn activate_backward(
        &self,
        act: DeviceActivation,
        maps: Maps,
        x: At<'_, CudaStorage>,
        y: At<'_, CudaStorage>,
        dy: At<'_, CudaStorage>,
        dx: At<'_, CudaStorage>,
    ) -> Result<()> {
        self.with_operands("activation", [x, y, dy, dx], |c, [x, y, dy, dx]| {
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

    fn add_into(&self, maps: Maps, x: At<'_, CudaStorage>, y: At<'_, CudaStorage>) -> Result<()> {
        self.with_operands("add", [x, y], |c, [x, y]| {
            let t = c.tensor("add", maps.dims, maps.element)?;
            unsafe { sys::cudnnAddTensor(c.handle.0, scalar(&ONE), t, x.ptr(), scalar(&ONE), t, y.mut_ptr()) }
                .result()
                .map_err(cudnn_error("add"))
        })
    }

    fn batch_norm(
        &self,
        call: NormCall,
        x: At<'_, CudaStorage>,
        scale: At<'_, CudaStorage>,
        bias: At<'_, CudaStorage>,
        y: At<'_, CudaStorage>,
        keep: bool,
    ) -> Result<Option<NormStatistics<CudaStorage>>> {
        let NormCall { dims, element: e, eps } = call;
        let channels = dims.per_channel.elements();
        // The running outputs are read as well as written (`running * (1 -
        // factor) + batch * factor`, factor 1): they start as zeros, so that
        // whatever the memory held (a NaN) cannot leak in. cuDNN writes the
        // batch mean into the running mean too; it is the saved mean, so
        // that goes to scratch.
        let stats = if keep {
            Some((
                NormStatistics {
                    mean: self.alloc(Element::F32, channels)?,
                    inv_std: self.alloc(Element::F32, channels)?,
                    unbiased_var: self.zeros_f32(channels)?,
                },
                self.zeros_f32(channels)?,
            ))
        } else {
            None
        };
        let whole = |b| At { buffer: b, offset: 0 };
        let err = cudnn_error("batch_norm_train");
        let run = |c: &mut DeviceCudnn, [x, scale, bias, y]: [&Operand<'_>; 4], saved: Option<[&Operand<'_>; 4]>| -> Result<()> {
            let xt = c.tensor("batch_norm_train", dims.x, e)?;
            let pt = c.tensor("batch_norm_train", dims.per_channel, Element::F32)?;
            let out = |i: usize| saved.map_or(std::ptr::null_mut(), |s| s[i].mut_ptr());
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
                    out(3),
                    out(2),
                    eps,
                    out(0),
                    out(1),
                )
            }
            .result()
            .map_err(&err)
        };
        match &stats {
            Some((s, running_mean)) => {
                let at = [x, scale, bias, y, whole(&s.mean), whole(&s.inv_std), whole(&s.unbiased_var), whole(running_mean)];
                self.with_operands("batch_norm_train", at, |c, [x, scale, bias, y, mean, inv_std, var, running]| {
                    run(c, [x, scale, bias, y], Some([mean, inv_std, var, running]))
                })?
            }
            None => self.with_operands("batch_norm_train", [x, scale, bias, y], |c, operands| run(c, operands, None))?,
        }
        Ok(stats.map(|(s, _)| s))
    }

    fn batch_norm_backward(
        &self,
        call: NormCall,
        x: At<'_, CudaStorage>,
        dy: At<'_, CudaStorage>,
        scale: At<'_, CudaStorage>,
        stats: &NormStatistics<CudaStorage>,
        grads: NormGrads<'_, CudaStorage>,
    ) -> Result<()> {
        let NormCall { dims, element: e, eps } = call;
        let whole = |b| At { buffer: b, offset: 0 };
        let at = [x, dy, scale, grads.dx, grads.dscale, grads.dbias, whole(&stats.mean), whole(&stats.inv_std)];
        self.with_operands("batch_norm_train", at, |c, [x, dy, scale, dx, dscale, dbias, mean, inv_std]| {
            let xt = c.tensor("batch_norm_train", dims.x, e)?;
            let pt = c.tensor("batch_norm_train", dims.per_channel, Element::F32)?;
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
                    mean.ptr(),
                    inv_std.ptr(),
                )
            }
            .result()
            .map_err(cudnn_error("batch_norm_train"))
        })
    }

    fn gemm(&self, call: GemmCall, a: At<'_, CudaStorage>, b: At<'_, CudaStorage>, c: At<'_, CudaStorage>) -> Result<()> {
        use candle_core::cuda_backend::cudarc::cublas::{result as blas, sys as blas_sys};
        let op = "gemm";
        let int = |v: usize| i32::try_from(v).map_err(|_| OpError::TooLargeForCudnn { op, dims: vec![call.m, call.n, call.k] });
        let long = |v: usize| i64::try_from(v).map_err(|_| OpError::TooLargeForCudnn { op, dims: vec![v] });
        let data_type = |e: Element| match e {
            Element::F32 => blas_sys::cudaDataType::CUDA_R_32F,
            Element::F16 => blas_sys::cudaDataType::CUDA_R_16F,
            Element::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
        };
        let (data, c_data) = (data_type(call.element), data_type(call.c_element));
        let transpose = |t: bool| if t { blas_sys::cublasOperation_t::CUBLAS_OP_T } else { blas_sys::cublasOperation_t::CUBLAS_OP_N };
        let stream = self.dev.cuda_stream();
        let [a, b, c] = Operand::all(op, [a, b, c], &stream)?;
        let (alpha, beta) = (ONE, call.beta);
        let blas = self.dev.cublas_handle();
        // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T:
        // cuBLAS is given B first, each operand's row stride as its leading dimension.
        unsafe {
            blas::gemm_strided_batched_ex(
                *blas.handle(),
                transpose(call.b.transposed),
                transpose(call.a.transposed),
                int(call.n)?,
                int(call.m)?,
                int(call.k)?,
                scalar(&alpha),
                b.ptr(),
                data,
                int(call.b.ld)?,
                long(call.b.stride)?,
                a.ptr(),
                data,
                int(call.a.ld)?,
                long(call.a.stride)?,
                scalar(&beta),
                c.mut_ptr(),
                c_data,
                int(call.c.ld)?,
                long(call.c.stride)?,
                int(call.batch)?,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| OpError::Cudnn { op, status: format!("cuBLAS {e:?}") }.into())
    }

    fn add_bias(&self, maps: Maps, bias: At<'_, CudaStorage>, y: At<'_, CudaStorage>) -> Result<()> {
        let channels = maps.dims.dims[1].max(0) as usize;
        let per_channel = TensorDims::per_channel("add", channels)?;
        self.with_operands("add", [bias, y], |c, [bias, y]| {
            let (b, t) = (c.tensor("add", per_channel, maps.element)?, c.tensor("add", maps.dims, maps.element)?);
            unsafe { sys::cudnnAddTensor(c.handle.0, scalar(&ONE), b, bias.ptr(), scalar(&ONE), t, y.mut_ptr()) }
                .result()
                .map_err(cudnn_error("add"))
        })
    }

    fn bias_gradient(&self, maps: Maps, dy: At<'_, CudaStorage>, db: At<'_, CudaStorage>) -> Result<()> {
        let channels = maps.dims.dims[1].max(0) as usize;
        let per_channel = TensorDims::per_channel("bias gradient", channels)?;
        self.with_operands("bias gradient", [dy, db], |c, [dy, db]| {
            let (t, b) = (c.tensor("bias gradient", maps.dims, maps.element)?, c.tensor("bias gradient", per_channel, maps.element)?);
            unsafe { sys::cudnnConvolutionBackwardBias(c.handle.0, scalar(&ONE), t, dy.ptr(), scalar(&ZERO), b, db.mut_ptr()) }
                .result()
                .map_err(cudnn_error("bias gradient"))
        })
    }

    fn softmax_rows(&self, call: SoftmaxCall, s: At<'_, CudaStorage>, p: At<'_, CudaStorage>, lse: At<'_, CudaStorage>) -> Result<()> {
        let op = "attention";
        let stream = self.dev.cuda_stream();
        let [s, p, lse] = Operand::all(op, [s, p, lse], &stream)?;
        let (n, scale) = (u32_of(op, call.n)?, call.scale);
        launch!(
            self.dev,
            op,
            "softmax_rows",
            call.element,
            Self::per_row(op, call.rows)?,
            [&s.address, &p.address, &lse.address, &n, &scale]
        )
    }

    fn probabilities(&self, call: SoftmaxCall, s: At<'_, CudaStorage>, lse: At<'_, CudaStorage>, p: At<'_, CudaStorage>) -> Result<()> {
        let op = "attention";
        let stream = self.dev.cuda_stream();
        let [s, lse, p] = Operand::all(op, [s, lse, p], &stream)?;
        let (n, scale, total) = (u32_of(op, call.n)?, call.scale, (call.rows * call.n) as u64);
        let config = Self::elementwise(op, call.rows * call.n)?;
        launch!(self.dev, op, "probabilities", call.element, config, [&s.address, &lse.address, &p.address, &n, &scale, &total])
    }

    fn attention_delta(
        &self,
        call: DeltaCall,
        dout: At<'_, CudaStorage>,
        out: At<'_, CudaStorage>,
        delta: At<'_, CudaStorage>,
    ) -> Result<()> {
        let op = "attention";
        let stream = self.dev.cuda_stream();
        let [dout, out, delta] = Operand::all(op, [dout, out, delta], &stream)?;
        let (tokens, heads, dh) = (u32_of(op, call.tokens)?, u32_of(op, call.heads)?, u32_of(op, call.head_width)?);
        // One thread a row, every row (the kernel does not stride).
        let blocks = u32_of(op, (call.tokens * call.heads).div_ceil(THREADS as usize).max(1))?;
        let config = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        launch!(self.dev, op, "attention_delta", call.element, config, [&dout.address, &out.address, &delta.address, &tokens, &heads, &dh])
    }

    fn softmax_backward(
        &self,
        call: SoftmaxCall,
        p: At<'_, CudaStorage>,
        dp: At<'_, CudaStorage>,
        delta: At<'_, CudaStorage>,
        ds: At<'_, CudaStorage>,
    ) -> Result<()> {
        let op = "attention";
        let stream = self.dev.cuda_stream();
        let [p, dp, delta, ds] = Operand::all(op, [p, dp, delta, ds], &stream)?;
        let (n, scale, total) = (u32_of(op, call.n)?, call.scale, (call.rows * call.n) as u64);
        let config = Self::elementwise(op, call.rows * call.n)?;
        launch!(
            self.dev,
            op,
            "softmax_backward",
            call.element,
            config,
            [&p.address, &dp.address, &delta.address, &ds.address, &n, &scale, &total]
        )
    }

    fn gelu(&self, e: Element, len: usize, x: At<'_, CudaStorage>, y: At<'_, CudaStorage>) -> Result<()> {
        let config = Self::elementwise("gelu", len)?;
        let stream = self.dev.cuda_stream();
        let [x, y] = Operand::all("gelu", [x, y], &stream)?;
        let n = len as u64;
        launch!(self.dev, "gelu", "gelu", e, config, [&x.address, &y.address, &n])
    }

    fn gelu_backward(
        &self,
        e: Element,
        len: usize,
        x: At<'_, CudaStorage>,
        dy: At<'_, CudaStorage>,
        dx: At<'_, CudaStorage>,
    ) -> Result<()> {
        let config = Self::elementwise("gelu", len)?;
        let stream = self.dev.cuda_stream();
        let [x, dy, dx] = Operand::all("gelu", [x, dy, dx], &stream)?;
        let n = len as u64;
        launch!(self.dev, "gelu", "gelu_backward", e, config, [&x.address, &dy.address, &dx.address, &n])
    }

    fn layer_norm(
        &self,
        call: RowsCall,
        x: At<'_, CudaStorage>,
        w: At<'_, CudaStorage>,
        b: At<'_, CudaStorage>,
        y: At<'_, CudaStorage>,
    ) -> Result<()> {
        let op = "layer_norm";
        let config = Self::per_row(op, call.rows)?;
        let stream = self.dev.cuda_stream();
        let [x, w, b, y] = Operand::all(op, [x, w, b, y], &stream)?;
        let (d, eps) = (u32_of(op, call.features)?, call.eps);
        launch!(self.dev, op, "layer_norm", call.element, config, [&x.address, &w.address, &b.address, &y.address, &d, &eps])
    }

    fn layer_norm_backward(
        &self,
        call: RowsCall,
        x: At<'_, CudaStorage>,
        w: At<'_, CudaStorage>,
        dy: At<'_, CudaStorage>,
        grads: LayerNormGrads<'_, CudaStorage>,
    ) -> Result<()> {
        let op = "layer_norm";
        // Each row's mean and rstd, two f32, for the parameters' pass.
        let stats = self.alloc(Element::F32, 2 * call.rows.max(1))?;
        let stream = self.dev.cuda_stream();
        let at = [x, w, dy, grads.dx, grads.dweight, grads.dbias, At { buffer: &stats, offset: 0 }];
        let [x, w, dy, dx, dw, db, stats] = Operand::all(op, at, &stream)?;
        let (rows, d, eps) = (u32_of(op, call.rows)?, u32_of(op, call.features)?, call.eps);
        launch!(
            self.dev,
            op,
            "layer_norm_backward_input",
            call.element,
            Self::per_row(op, call.rows)?,
            [&x.address, &w.address, &dy.address, &dx.address, &stats.address, &d, &eps]
        )?;
        let columns = LaunchConfig { grid_dim: (d.div_ceil(THREADS).max(1), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        launch!(
            self.dev,
            op,
            "layer_norm_backward_params",
            call.element,
            columns,
            [&x.address, &dy.address, &stats.address, &dw.address, &db.address, &rows, &d]
        )
    }

    fn tensor(&self, buffer: CudaStorage, shape: Shape) -> Result<Tensor> {
        Ok(Tensor::from_storage(Storage::Cuda(buffer), shape, BackpropOp::none(), false))
    }

    fn into_storage(buffer: CudaStorage) -> Result<CudaStorage> {
        Ok(buffer)
    }

    fn hold<'a>(op: &'static str, storage: &'a CudaStorage, layout: &'a Layout) -> Result<Held<'a, CudaStorage>> {
        borrowed(op, storage, layout)
    }

    fn of_tensor(op: &'static str, t: &Tensor) -> Result<Self> {
        match t.device() {
            candle_core::Device::Cuda(dev) => Ok(Cudnn { dev: dev.clone() }),
            other => Err(OpError::NotOnCuda { op, device: format!("{:?}", other.location()) }.into()),
        }
    }

    fn with_tensor<R>(op: &'static str, t: &Tensor, f: impl FnOnce(Arg<'_, CudaStorage>) -> Result<R>) -> Result<R> {
        let (storage, layout) = t.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => f(borrowed(op, s, layout)?.arg()),
            other => Err(OpError::NotOnCuda { op, device: format!("{:?}", other.device().location()) })?,
        }
    }
}

/// A storage held in place, from its layout.
fn borrowed<'a>(op: &'static str, storage: &'a CudaStorage, layout: &'a Layout) -> Result<Held<'a, CudaStorage>> {
    passes::contiguous(op, layout)?;
    Ok(Held::Borrowed { buffer: storage, offset: layout.start_offset(), shape: layout.shape() })
}
