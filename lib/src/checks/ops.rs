//! `vramlab check-ops`: every op of [`crate::ops`] at the zoo models' shapes,
//! forward and each gradient, against a reference, in f32 and f16.
//!
//! On the CPU the reference is candle's own composition of the same op,
//! computed in f32 from the same (rounded) inputs; on any other device it is
//! our CPU implementation on the same inputs in the same dtype. Both sides
//! run through [`evaluate`], so the CUDA check is the CPU check with another
//! device.
//!
//! A tensor's error is `max|a - b| / max(max|b|, tiny)` with `b` the
//! reference: rounding keeps it near the dtype's epsilon, and a wrong sign, a
//! missing term or a shifted window drives it to the order of 1.

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal, Uniform};
use serde::Serialize;

use crate::ops::composed::{self, Composed};
use crate::ops::{self, Activation, AttentionKeeps, ConvParams, Norm, OpError, OwnOps, PlainOps, Residual, Then};
use crate::render::{Bundle, Render, Table};

/// The smallest reference scale: a reference of zeros must be matched by zeros.
const TINY: f64 = f32::MIN_POSITIVE as f64;

/// Batch-norm's epsilon, as the zoo's layers use it.
const EPS: f64 = 1e-5;

/// Layer-norm's epsilon, as the zoo's vision transformers use it.
const LAYER_NORM_EPS: f64 = 1e-6;

/// Mixed into a case's seed for its `r`, apart from its operands' stream.
const R_STREAM: u64 = 0x9E37_79B9_7F4A_7C15;

/// What the error of a tensor is, for the report.
pub const ERROR: &str = "max|a - b| / max(max|b|, 1.2e-38) over the tensor, b the reference";

/// The dtypes the ops are checked in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckedDtype {
    F32,
    F16,
}

impl CheckedDtype {
    pub const ALL: [CheckedDtype; 2] = [CheckedDtype::F32, CheckedDtype::F16];

    pub fn dtype(self) -> DType {
        match self {
            CheckedDtype::F32 => DType::F32,
            CheckedDtype::F16 => DType::F16,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CheckedDtype::F32 => "f32",
            CheckedDtype::F16 => "f16",
        }
    }
}

/// Largest normalised error a check passes with. Measured at batch 2 to 8
/// of inputs of 96 to 224: in f32 up to 3e-5, from the reference's own f32
/// sums over a batch's maps (ours sum in f64), which grow with them;
/// Winograd's convolutions no worse than the others. In f16 up to 1.5e-3,
/// a few roundings to f16's 11 bits, whatever the size.
pub fn tolerance(dtype: CheckedDtype) -> f64 {
    match dtype {
        CheckedDtype::F32 => 1e-4,
        CheckedDtype::F16 => 5e-3,
    }
}

/// Whether cuDNN may run this process's f32 convolutions on TF32 tensor
/// cores: unless `NVIDIA_TF32_OVERRIDE=0` turns it off, as it does for
/// `scripts/gpu_check.sh`'s check-ops.
fn tf32_allowed() -> bool {
    std::env::var("NVIDIA_TF32_OVERRIDE").as_deref() != Ok("0")
}

/// Largest normalised error a check on CUDA passes with, against our CPU
/// ops, where f32 convolutions may run on TF32 tensor cores (as PyTorch's do
/// by default), which round their inputs to a 10-bit mantissa: products
/// differ from f32's by up to 2^-11 relative, so f32 checks allow 2e-3 there,
/// still an order of magnitude below what a wrong term costs (the tests
/// below). f16 keeps its tolerance; with TF32 off, f32 keeps its own.
fn tolerance_on_tf32(dtype: CheckedDtype) -> f64 {
    match dtype {
        CheckedDtype::F32 => 2e-3,
        CheckedDtype::F16 => tolerance(dtype),
    }
}

/// One tolerance of the report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Tolerance {
    pub dtype: CheckedDtype,
    pub tolerance: f64,
}

/// What a check compares: the forward output or the gradient of one operand
/// of `sum(y * r)`; batch-norm's weight and bias are one tensor, `[weight;
/// bias]`, as the lean ops take them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    Forward,
    GradInput,
    /// The convolution's weight.
    GradWeight,
    GradNorm,
    GradResidual,
    /// The projection's batch-norm.
    GradResidualNorm,
    /// A linear layer's bias.
    GradBias,
    /// The case itself, which failed before anything could be compared.
    Run,
    /// An optimizer's parameters after a few updates.
    Step,
}

impl Pass {
    const GRADIENTS: [Pass; 6] =
        [Pass::GradInput, Pass::GradWeight, Pass::GradNorm, Pass::GradResidual, Pass::GradResidualNorm, Pass::GradBias];

    pub fn as_str(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::GradInput => "grad input",
            Pass::GradWeight => "grad weight",
            Pass::GradNorm => "grad norm weight;bias",
            Pass::GradResidual => "grad residual",
            Pass::GradResidualNorm => "grad residual norm weight;bias",
            Pass::GradBias => "grad bias",
            Pass::Run => "run",
            Pass::Step => "parameters after the updates",
        }
    }
}

/// The sizes the zoo's shapes are checked at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOptions {
    pub batch: usize,
    /// The input side: a 224 input's spatial sizes scaled to it.
    pub res: usize,
    pub dtypes: Vec<CheckedDtype>,
}

impl CheckOptions {
    /// Batch-norm of the 1x1 maps that `MIN_RES` gives needs two images.
    pub const MIN_BATCH: usize = 2;
    /// The f16 weight gradients are sums over a batch's maps (`r`'s mean is
    /// 0.5), which grow with both: 8 images at 224 keep them well inside
    /// f16's range.
    pub const MAX_BATCH: usize = 8;
    /// The last stages' maps are 1x1 at 32.
    pub const MIN_RES: usize = 32;
    /// The zoo's own input.
    pub const MAX_RES: usize = 224;
    /// Two images at 96: the whole check in a few seconds on two cores,
    /// with the first stages' convolutions on Winograd.
    pub const DEFAULT_BATCH: usize = 2;
    pub const DEFAULT_RES: usize = 96;

    fn validate(&self) -> std::result::Result<(), CheckError> {
        let within = |what, value, least, most| {
            if (least..=most).contains(&value) {
                Ok(())
            } else {
                Err(CheckError::OutOfRange { what, value, least, most })
            }
        };
        within("--batch", self.batch, Self::MIN_BATCH, Self::MAX_BATCH)?;
        within("--res", self.res, Self::MIN_RES, Self::MAX_RES)
    }
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions { batch: Self::DEFAULT_BATCH, res: Self::DEFAULT_RES, dtypes: CheckedDtype::ALL.to_vec() }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    #[error("check-ops: {what} {value} is outside {least}..={most}")]
    OutOfRange { what: &'static str, value: usize, least: usize, most: usize },
    #[error("check-ops: no gradient reached the operand of `{pass}`")]
    NoGradient { pass: &'static str },
}

/// One comparison: a pass of a case in a dtype.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    pub op: &'static str,
    /// The zoo's layers whose shapes the case takes.
    pub case: String,
    pub shape: String,
    pub dtype: CheckedDtype,
    pub pass: Pass,
    /// The normalised error; `None` where it could not be computed (`failure` says why).
    pub error: Option<f64>,
    pub tolerance: f64,
    pub ok: bool,
    pub failure: Option<String>,
}

/// Every check of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpsReport {
    pub device: String,
    pub reference: String,
    pub batch: usize,
    pub res: usize,
    pub error: &'static str,
    pub tolerances: Vec<Tolerance>,
    pub checks: Vec<Check>,
    pub passed: usize,
    pub failed: usize,
    pub seconds: f64,
}

impl OpsReport {
    /// Adds checks made elsewhere (the optimizers' updates) to the report.
    pub fn add(&mut self, checks: Vec<Check>) {
        let passed = checks.iter().filter(|c| c.ok).count();
        self.passed += passed;
        self.failed += checks.len() - passed;
        self.checks.extend(checks);
    }

    pub fn all_passed(&self) -> bool {
        self.failed == 0
    }

    pub fn summary(&self) -> String {
        format!("{} passed, {} failed", self.passed, self.failed)
    }

    pub fn table(&self) -> Table {
        let mut table = Table::new(["op", "case", "shape", "dtype", "pass", "error", "tolerance", "ok"])
            .title(format!(
                "vramlab check-ops on {} against {}: batch {}, sizes of a {}x{} input ({:.1} s)",
                self.device, self.reference, self.batch, self.res, self.res, self.seconds
            ))
            .right_align(&[5, 6]);
        for c in &self.checks {
            let error = match (&c.failure, c.error) {
                (Some(failure), _) => failure.clone(),
                (None, Some(error)) => format!("{error:.1e}"),
                (None, None) => String::new(),
            };
            let ok = if c.ok { "ok" } else { "FAIL" };
            table.push_row([
                c.op.to_owned(),
                c.case.clone(),
                c.shape.clone(),
                c.dtype.as_str().to_owned(),
                c.pass.as_str().to_owned(),
                error,
                format!("{:.0e}", c.tolerance),
                ok.to_owned(),
            ]);
        }
        let tolerances: Vec<String> = self.tolerances.iter().map(|t| format!("{} {:.0e}", t.dtype.as_str(), t.tolerance)).collect();
        table
            .note(format!("error: {}; tolerances: {}.", self.error, tolerances.join(", ")))
            .note("* the zoo's shapes with an activation, residual or grouping the zoo does not have there.")
            .note(self.summary())
    }
}

crate::render::shown_as_bundles!(OpsReport);

impl Render for OpsReport {
    fn bundle(&self) -> Bundle {
        self.table().bundle()
    }
}

/// Where `check-ops` runs the ops.
#[derive(Debug, Clone)]
pub enum CheckTarget {
    /// Our CPU kernels, against candle's composed ops.
    Cpu,
    /// The ops' device passes on the reference primitives over CPU tensors
    /// (cuDNN's calls computed on the host), against our CPU kernels.
    Reference,
    /// The ops' device passes on a device, against our CPU kernels.
    Device(Device),
}

impl CheckTarget {
    pub fn device(&self) -> &Device {
        match self {
            CheckTarget::Cpu | CheckTarget::Reference => &Device::Cpu,
            CheckTarget::Device(device) => device,
        }
    }

    fn describe(&self) -> String {
        match self {
            CheckTarget::Reference => "the CUDA passes on the reference primitives (the CPU)".to_owned(),
            other => device_name(other.device()),
        }
    }
}

/// Checks every op's case on `target` in each of `options.dtypes`; a case
/// that fails does not stop the others.
pub fn check_every_op(target: &CheckTarget, options: &CheckOptions) -> std::result::Result<OpsReport, CheckError> {
    options.validate()?;
    let started = Instant::now();
    let reference = Reference::of(target);
    let mut checks = Vec::new();
    for (index, case) in cases(options.batch, options.res).iter().enumerate() {
        for &dtype in &options.dtypes {
            checks.extend(check_case(case, index as u64, target, reference, dtype));
        }
    }
    let tolerances = options.dtypes.iter().map(|&dtype| Tolerance { dtype, tolerance: reference.tolerance(dtype) }).collect();
    let passed = checks.iter().filter(|c| c.ok).count();
    Ok(OpsReport {
        device: target.describe(),
        reference: reference.describe().to_owned(),
        batch: options.batch,
        res: options.res,
        error: ERROR,
        tolerances,
        failed: checks.len() - passed,
        passed,
        checks,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => format!("the CPU ({} threads)", rayon::current_num_threads()),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("CUDA device {gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("Metal device {gpu_id}"),
    }
}

/// What a target's results are compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reference {
    /// candle's composition of each op, in f32 from the inputs rounded to the checked dtype.
    Composed,
    /// Our ops on the CPU, on the same inputs in the same dtype, for results
    /// whose f32 convolutions may have run on TF32.
    OursOnCpu { tf32: bool },
}

impl Reference {
    fn of(target: &CheckTarget) -> Self {
        match target {
            CheckTarget::Cpu => Reference::Composed,
            CheckTarget::Reference => Reference::OursOnCpu { tf32: false },
            CheckTarget::Device(_) => Reference::OursOnCpu { tf32: tf32_allowed() },
        }
    }

    fn tolerance(self, dtype: CheckedDtype) -> f64 {
        match self {
            Reference::OursOnCpu { tf32: true } => tolerance_on_tf32(dtype),
            _ => tolerance(dtype),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Reference::Composed => "candle's composed ops in f32 on the same inputs",
            Reference::OursOnCpu { tf32: false } => "our CPU ops on the same inputs in the same dtype",
            Reference::OursOnCpu { tf32: true } => {
                "our CPU ops on the same inputs in the same dtype (f32 convolutions allowed TF32: NVIDIA_TF32_OVERRIDE=0 turns it off)"
            }
        }
    }

    fn run(self, dtype: DType) -> Run<'static> {
        match self {
            Reference::Composed => {
                Run { implementation: Implementation::Composed, device: &Device::Cpu, rounded: dtype, compute: DType::F32 }
            }
            Reference::OursOnCpu { .. } => {
                Run { implementation: Implementation::Ours, device: &Device::Cpu, rounded: dtype, compute: dtype }
            }
        }
    }
}

fn check_case(case: &Case, seed: u64, target: &CheckTarget, reference: Reference, dtype: CheckedDtype) -> Vec<Check> {
    let tolerance = reference.tolerance(dtype);
    let check = |pass, error: Option<f64>, failure: Option<String>| Check {
        op: case.op.name(),
        case: case.name.to_owned(),
        shape: case.shape(),
        dtype,
        pass,
        error,
        tolerance,
        ok: failure.is_none() && error.is_some_and(|e| e <= tolerance),
        failure,
    };
    let ours = Run { implementation: Implementation::Ours, device: target.device(), rounded: dtype.dtype(), compute: dtype.dtype() };
    let run_ours = |inputs: &Inputs| match target {
        CheckTarget::Reference => ops::on_reference(|| evaluate(case, inputs, ours)),
        _ => evaluate(case, inputs, ours),
    };
    let results =
        Inputs::new(case, seed).and_then(|inputs| Ok((run_ours(&inputs)?, evaluate(case, &inputs, reference.run(dtype.dtype()))?)));
    match results {
        Err(e) => vec![check(Pass::Run, None, Some(e.to_string().lines().next().unwrap_or_default().to_owned()))],
        Ok((ours, reference)) => ours
            .iter()
            .zip(&reference)
            .map(|((pass, a), (_, b))| match compare(a, b) {
                Ok(error) => check(*pass, Some(error), None),
                Err(failure) => check(*pass, None, Some(failure)),
            })
            .collect(),
    }
}

/// `max|a - b| / max(max|b|, TINY)` over the elements of `a` and `b`
/// (`b` the reference), NaN where either holds a NaN.
pub fn normalised_error(a: &[f32], b: &[f32]) -> f64 {
    let (mut diff, mut scale) = (0f64, 0f64);
    for (&a, &b) in a.iter().zip(b) {
        let d = (f64::from(a) - f64::from(b)).abs();
        if d.is_nan() {
            return f64::NAN;
        }
        diff = diff.max(d);
        scale = scale.max(f64::from(b).abs());
    }
    diff / scale.max(TINY)
}

/// The normalised error of two f32 CPU tensors, or why there is none.
fn compare(a: &Tensor, b: &Tensor) -> std::result::Result<f64, String> {
    if a.dims() != b.dims() {
        return Err(format!("shape {:?}, the reference's {:?}", a.dims(), b.dims()));
    }
    let values = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(|e| e.to_string());
    Ok(normalised_error(&values(a)?, &values(b)?))
}

/// A square convolution's weight and parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ConvShape {
    out: usize,
    kernel: usize,
    params: ConvParams,
}

impl ConvShape {
    fn dense(out: usize, kernel: usize, stride: usize, padding: usize) -> Self {
        ConvShape { out, kernel, params: ConvParams { stride, padding, groups: 1 } }
    }

    fn grouped(out: usize, kernel: usize, stride: usize, padding: usize, groups: usize) -> Self {
        ConvShape { out, kernel, params: ConvParams { stride, padding, groups } }
    }

    /// EfficientNet's: one filter per channel, padded to keep the size at stride 1.
    fn depthwise(channels: usize, kernel: usize, stride: usize) -> Self {
        ConvShape { out: channels, kernel, params: ConvParams { stride, padding: (kernel - 1) / 2, groups: channels } }
    }

    fn weight(&self, channels: usize) -> [usize; 4] {
        [self.out, channels / self.params.groups, self.kernel, self.kernel]
    }

    fn describe(&self, input: [usize; 4]) -> String {
        let ConvParams { stride, padding, groups } = self.params;
        let grouping = match groups {
            1 => String::new(),
            g if g == input[1] => ", depthwise".to_owned(),
            g => format!(", {g} groups"),
        };
        let kernels = ops::cpu_conv_kernel(input, self.weight(input[1]), self.params).map(|k| format!(" [{k}]")).unwrap_or_default();
        let k = self.kernel;
        format!("{k}x{k}/{stride} p{padding} -> {}{grouping}{kernels}", self.out)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    kernel: usize,
    stride: usize,
    padding: usize,
}

/// ResNet's stem pool.
const STEM_POOL: Window = Window { kernel: 3, stride: 2, padding: 1 };

/// What reads a lean op's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Consumer {
    Nothing,
    Conv(ConvShape),
    MaxPool(Window),
}

/// What a residual block adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Identity,
    Projected,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Conv2d(ConvShape),
    BatchNorm,
    MaxPool(Window),
    Silu,
    NormAct(Activation, Consumer),
    NormAddAct(Activation, Side),
    /// Over tokens: `batch x tokens x features`.
    Gelu,
    LayerNorm,
    /// With a bias, to this many outputs.
    Linear(usize),
    /// A GELU, then a linear layer with a bias to this many outputs, as one op.
    GeluLinear(usize),
    /// A layer-norm, then a linear layer with a bias to this many outputs, as one op.
    NormLinear(usize),
    /// A linear layer with a bias to this many outputs adding a residual, through a GELU first with `true`.
    LinearResidual(usize, bool),
    /// Over `batch x tokens x 3 dim`, with this many heads.
    Attention(usize, AttentionKeeps),
    /// An up-convolution with a bias, to this many channels, its kernel and stride this size.
    ConvTranspose(usize, usize),
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Conv2d(_) => "conv2d",
            Op::BatchNorm => "batch_norm_train",
            Op::MaxPool(_) => "max_pool2d",
            Op::Silu => "silu",
            Op::Gelu => "gelu",
            Op::LayerNorm => "layer_norm",
            Op::Linear(_) => "linear",
            Op::GeluLinear(_) => "gelu_linear",
            Op::NormLinear(_) => "norm_linear",
            Op::LinearResidual(_, false) => "linear_residual",
            Op::LinearResidual(_, true) => "gelu_linear_residual",
            Op::ConvTranspose(..) => "conv_transpose2d",
            Op::Attention(..) => "attention",
            Op::NormAct(..) => "norm_act",
            Op::NormAddAct(..) => "norm_add_act",
        }
    }

    /// The output of the op on `operands` (as [`Case::operands`] lists them).
    fn forward(self, operands: &[Tensor], implementation: Implementation) -> Result<Tensor> {
        let ops: &dyn PlainOps = match implementation {
            Implementation::Ours => &OwnOps,
            Implementation::Composed => &Composed,
        };
        let norm = |weight, bias| Norm { weight, bias, eps: EPS };
        let missing = || -> candle_core::Error { OpError::MissingOperand { op: self.name(), what: "operand the check lists" }.into() };
        match (self, operands) {
            (Op::Conv2d(conv), [x, w]) => ops.conv2d(x, w, conv.params),
            (Op::BatchNorm, [x, g, b]) => Ok(ops.batch_norm(x, norm(g, b))?.y),
            (Op::MaxPool(p), [x]) => ops.max_pool2d(x, p.kernel, p.stride, p.padding),
            (Op::Silu, [x]) => ops.activation(Activation::Silu, x),
            (Op::Gelu, [x]) => match implementation {
                Implementation::Ours => ops::gelu(x),
                Implementation::Composed => composed::gelu(x),
            },
            (Op::Linear(_), [x, w, b]) => match implementation {
                Implementation::Ours => ops::linear(x, w, Some(b)),
                Implementation::Composed => composed::linear(x, w, Some(b)),
            },
            (Op::GeluLinear(_), [x, w, b]) => match implementation {
                Implementation::Ours => ops::gelu_linear(x, w, Some(b)),
                Implementation::Composed => composed::linear(&composed::gelu(x)?, w, Some(b)),
            },
            (Op::NormLinear(_), [x, g, beta, w, b]) => match implementation {
                Implementation::Ours => ops::norm_linear(x, g, beta, LAYER_NORM_EPS, w, Some(b)),
                Implementation::Composed => composed::linear(&composed::layer_norm(x, g, beta, LAYER_NORM_EPS)?, w, Some(b)),
            },
            (Op::LinearResidual(_, gelu), [x, w, b, residual]) => match (implementation, gelu) {
                (Implementation::Ours, false) => ops::linear_residual(x, w, Some(b), residual),
                (Implementation::Ours, true) => ops::gelu_linear_residual(x, w, Some(b), residual),
                (Implementation::Composed, false) => composed::linear(x, w, Some(b))? + residual,
                (Implementation::Composed, true) => composed::linear(&composed::gelu(x)?, w, Some(b))? + residual,
            },
            (Op::ConvTranspose(_, kernel), [x, w, b]) => match implementation {
                Implementation::Ours => ops::conv_transpose2d(x, w, Some(b), kernel),
                Implementation::Composed => composed::conv_transpose2d(x, w, Some(b), kernel),
            },
            (Op::Attention(heads, keeps), [qkv]) => match implementation {
                Implementation::Ours => ops::attention(qkv, heads, keeps),
                Implementation::Composed => composed::attention(qkv, heads),
            },
            (Op::LayerNorm, [x, w, b]) => match implementation {
                Implementation::Ours => ops::layer_norm(x, w, b, LAYER_NORM_EPS),
                Implementation::Composed => composed::layer_norm(x, w, b, LAYER_NORM_EPS),
            },
            (Op::NormAct(act, consumer), [z, g, b, rest @ ..]) => {
                let then = match (consumer, rest) {
                    (Consumer::Nothing, []) => Then::Nothing,
                    (Consumer::MaxPool(p), []) => Then::MaxPool { kernel: p.kernel, stride: p.stride, padding: p.padding },
                    (Consumer::Conv(conv), [w]) => Then::Conv { weight: w, params: conv.params },
                    _ => return Err(missing()),
                };
                let lean = match implementation {
                    Implementation::Ours => ops::norm_act(z, norm(g, b), act, then)?,
                    Implementation::Composed => composed::norm_act(z, norm(g, b), act, then)?,
                };
                Ok(lean.y)
            }
            (Op::NormAddAct(act, side), [z, g, b, x, rest @ ..]) => {
                let residual = match (side, rest) {
                    (Side::Identity, []) => Residual::Identity(x),
                    (Side::Projected, [side_g, side_b]) => Residual::Norm(x, norm(side_g, side_b)),
                    _ => return Err(missing()),
                };
                let lean = match implementation {
                    Implementation::Ours => ops::norm_add_act(z, norm(g, b), residual, act)?,
                    Implementation::Composed => composed::norm_add_act(z, norm(g, b), residual, act)?,
                };
                Ok(lean.y)
            }
            _ => Err(missing()),
        }
    }
}

fn activation_name(act: Activation) -> &'static str {
    match act {
        Activation::Identity => "identity",
        Activation::Relu => "relu",
        Activation::Silu => "silu",
    }
}

/// One op at one of the zoo's shapes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Case {
    /// The zoo's layers, marked `*` where the zoo has the shapes with another activation or grouping.
    name: &'static str,
    op: Op,
    input: [usize; 4],
}

/// Values an operand is drawn from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fill {
    Normal {
        mean: f64,
        std: f64,
    },
    Uniform {
        low: f64,
        high: f64,
    },
    /// Steps of 1/64 in [-2, 2), every 16x16 square of a plane holding
    /// each step at most once, each value moved off its step by at most
    /// 1/256: no max-pool window holds a tie, even in f16 and after a
    /// batch-norm whose weight is 1/2 or more. Our pool sends a window's gradient
    /// to its first maximum, candle's composed maximum shares it between
    /// ties. (Values on the steps themselves repeat exactly, and candle's
    /// f32 sums of them, the reference's batch statistics, rounded the same
    /// way each time: 4e-5 off in the variance.) The steps' midpoints are
    /// holes for [`Fill::KinkBias`]: no value lies within 1/256 of one.
    Distinct,
    /// Normal, each value moved 1/16 further from `hole`: none lies within
    /// 1/16 of it, a hole for [`Fill::KinkBias`].
    Holed {
        mean: f64,
        std: f64,
        hole: f64,
    },
    /// Batch-norm's bias that puts its zero, ReLU's kink, at the input value
    /// `at` (a hole of the input, the case's first operand; the weight is the
    /// second), so that no normalised value lies near the kink: f16 rounds a
    /// value a hair below 0 to -0, where candle's ReLU passes the gradient
    /// that the f32 reference stops.
    KinkBias {
        at: f64,
    },
    /// A residual block's residual, `t - bn(z)` with the block's body `z`
    /// and its batch-norm (the case's first three operands) and `|t|` in
    /// [0.1, 2): the sum before the activation is `t`, too far from ReLU's
    /// kink for f16's rounding to make it 0, where candle's ReLU passes the
    /// gradient and an f32 sum a hair below would not.
    OffBody,
    /// Per channel the standard deviation, or the mean, of the residual (the
    /// fourth operand): the projection's batch-norm gives the residual back.
    ResidualStd,
    ResidualMean,
}

/// One differentiable operand of a case: its shape, its values, the pass
/// its gradient belongs to, and whether it is stored in the checked dtype
/// (batch-norm's weight and bias stay f32, as in the zoo's networks).
#[derive(Debug, Clone, PartialEq)]
struct Operand {
    dims: Vec<usize>,
    fill: Fill,
    grad: Pass,
    half: bool,
}

impl Operand {
    fn new(dims: &[usize], fill: Fill, grad: Pass) -> Self {
        Operand { dims: dims.to_vec(), fill, grad, half: true }
    }

    /// A batch-norm's weight and bias over `channels`, the bias drawn from `bias`.
    fn norm(channels: usize, grad: Pass, bias: Fill) -> [Operand; 2] {
        [Operand::per_channel(channels, Fill::Uniform { low: 0.5, high: 1.5 }, grad), Operand::per_channel(channels, bias, grad)]
    }

    fn per_channel(channels: usize, fill: Fill, grad: Pass) -> Operand {
        Operand { dims: vec![channels], fill, grad, half: false }
    }
}

const BIAS: Fill = Fill::Uniform { low: -0.5, high: 0.5 };

/// A hole of [`Fill::Distinct`], between its steps 1/2 and 33/64.
const DISTINCT_HOLE: f64 = 0.5 + 1.0 / 128.0;

/// Below every value of [`Fill::Distinct`]: with the kink there, every
/// normalised value is positive. SiLU has a minimum at -1.28, and two
/// values of a window on either side of it could round to one f16 value.
const BELOW_DISTINCT: f64 = -2.1;

/// A batch-norm's input: off-centre and wider than 1, so that normalising matters.
const PRE_NORM: Fill = Fill::Normal { mean: 0.5, std: 2.0 };

/// Where a lean op's input (otherwise [`PRE_NORM`]'s) has its hole and
/// batch-norm its zero: a quarter of a standard deviation above the mean,
/// a bias of about -0.25 times the weight.
const HOLE: f64 = 1.0;
const STANDARD: Fill = Fill::Normal { mean: 0.0, std: 1.0 };

impl Case {
    fn new(name: &'static str, op: Op, input: [usize; 4]) -> Self {
        Case { name, op, input }
    }

    /// A case over tokens, `batch x tokens x features` (held as the last dimension 1).
    fn tokens(name: &'static str, op: Op, [batch, tokens, features]: [usize; 3]) -> Self {
        Case { name, op, input: [batch, tokens, features, 1] }
    }

    /// The input's dimensions: three for an op over tokens, else four.
    fn dims(&self) -> Vec<usize> {
        match self.op {
            Op::Gelu
            | Op::LayerNorm
            | Op::Linear(_)
            | Op::GeluLinear(_)
            | Op::NormLinear(_)
            | Op::LinearResidual(..)
            | Op::Attention(..) => self.input[..3].to_vec(),
            _ => self.input.to_vec(),
        }
    }

    /// The operands in the order [`Op::forward`] takes them.
    fn operands(&self) -> Vec<Operand> {
        let input = &self.input;
        let conv_weight = |conv: &ConvShape| {
            let weight = conv.weight(input[1]);
            let fan_in = (weight[1] * weight[2] * weight[3]) as f64;
            Operand::new(&weight, Fill::Normal { mean: 0.0, std: fan_in.sqrt().recip() }, Pass::GradWeight)
        };
        let mut operands = Vec::new();
        match self.op {
            Op::Conv2d(conv) => operands.extend([Operand::new(input, STANDARD, Pass::GradInput), conv_weight(&conv)]),
            Op::BatchNorm => {
                operands.push(Operand::new(input, PRE_NORM, Pass::GradInput));
                operands.extend(Operand::norm(input[1], Pass::GradNorm, BIAS));
            }
            Op::MaxPool(_) => operands.push(Operand::new(input, Fill::Distinct, Pass::GradInput)),
            Op::Silu => operands.push(Operand::new(input, Fill::Normal { mean: 0.0, std: 3.0 }, Pass::GradInput)),
            Op::Gelu => operands.push(Operand::new(&self.dims(), Fill::Normal { mean: 0.0, std: 3.0 }, Pass::GradInput)),
            Op::Linear(outputs) | Op::GeluLinear(outputs) | Op::NormLinear(outputs) | Op::LinearResidual(outputs, _) => {
                let inputs = input[2];
                let norm = matches!(self.op, Op::NormLinear(_));
                operands.push(Operand::new(&self.dims(), if norm { PRE_NORM } else { STANDARD }, Pass::GradInput));
                if norm {
                    operands.extend(Operand::norm(inputs, Pass::GradNorm, BIAS));
                }
                operands.push(Operand::new(
                    &[outputs, inputs],
                    Fill::Normal { mean: 0.0, std: (inputs as f64).sqrt().recip() },
                    Pass::GradWeight,
                ));
                operands.push(Operand::new(&[outputs], BIAS, Pass::GradBias));
                if matches!(self.op, Op::LinearResidual(..)) {
                    operands.push(Operand::new(&[input[0], input[1], outputs], STANDARD, Pass::GradResidual));
                }
            }
            Op::Attention(..) => operands.push(Operand::new(&self.dims(), STANDARD, Pass::GradInput)),
            Op::ConvTranspose(outputs, kernel) => {
                let channels = input[1];
                operands.push(Operand::new(input, STANDARD, Pass::GradInput));
                operands.push(Operand::new(
                    &[channels, outputs, kernel, kernel],
                    Fill::Normal { mean: 0.0, std: (channels as f64).sqrt().recip() },
                    Pass::GradWeight,
                ));
                operands.push(Operand::new(&[outputs], BIAS, Pass::GradBias));
            }
            Op::LayerNorm => {
                operands.push(Operand::new(&self.dims(), PRE_NORM, Pass::GradInput));
                operands.extend(Operand::norm(input[2], Pass::GradNorm, BIAS));
            }
            Op::NormAct(act, consumer) => {
                let (fill, kink) = match (consumer, act) {
                    (Consumer::MaxPool(_), Activation::Silu) => (Fill::Distinct, BELOW_DISTINCT),
                    (Consumer::MaxPool(_), _) => (Fill::Distinct, DISTINCT_HOLE),
                    _ => (Fill::Holed { mean: 0.5, std: 2.0, hole: HOLE }, HOLE),
                };
                operands.push(Operand::new(input, fill, Pass::GradInput));
                operands.extend(Operand::norm(input[1], Pass::GradNorm, Fill::KinkBias { at: kink }));
                if let Consumer::Conv(conv) = consumer {
                    operands.push(conv_weight(&conv));
                }
            }
            Op::NormAddAct(_, side) => {
                operands.push(Operand::new(input, PRE_NORM, Pass::GradInput));
                operands.extend(Operand::norm(input[1], Pass::GradNorm, BIAS));
                operands.push(Operand::new(input, Fill::OffBody, Pass::GradResidual));
                if side == Side::Projected {
                    let per_channel = |fill| Operand::per_channel(input[1], fill, Pass::GradResidualNorm);
                    operands.extend([per_channel(Fill::ResidualStd), per_channel(Fill::ResidualMean)]);
                }
            }
        }
        operands
    }

    fn shape(&self) -> String {
        let input = self.input.map(|d| d.to_string()).join("x");
        let window = |p: Window| format!("max-pool {k}x{k}/{} p{}", p.stride, p.padding, k = p.kernel);
        match self.op {
            Op::Conv2d(conv) => format!("{input}, {}", conv.describe(self.input)),
            Op::BatchNorm | Op::Silu => input,
            Op::Gelu | Op::LayerNorm => self.dims().iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x"),
            Op::Linear(outputs) | Op::GeluLinear(outputs) | Op::NormLinear(outputs) | Op::LinearResidual(outputs, _) => {
                format!("{} -> {outputs}", self.dims().iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x"))
            }
            Op::Attention(heads, keeps) => {
                let kept = match keeps {
                    AttentionKeeps::Probabilities => "keeping probabilities",
                    AttentionKeeps::RowStatistics => "keeping row log-sum-exps",
                };
                format!("{}, {heads} heads, {kept}", self.dims().iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x"))
            }
            Op::MaxPool(p) => format!("{input}, {}", window(p)),
            Op::ConvTranspose(outputs, k) => format!("{input}, up {k}x{k}/{k} -> {outputs}"),
            Op::NormAct(act, consumer) => {
                let then = match consumer {
                    Consumer::Nothing => "nothing".to_owned(),
                    Consumer::Conv(conv) => conv.describe(self.input),
                    Consumer::MaxPool(p) => window(p),
                };
                format!("{input}, {}, then {then}", activation_name(act))
            }
            Op::NormAddAct(act, side) => {
                let side = match side {
                    Side::Identity => "identity",
                    Side::Projected => "projected",
                };
                format!("{input}, {side} residual, {}", activation_name(act))
            }
        }
    }
}

/// The cases at `batch` images of a `res x res` input: each layer's maps
/// are as many times smaller than `res` as the zoo's are than 224.
fn cases(batch: usize, res: usize) -> Vec<Case> {
    use Activation::{Identity, Relu, Silu};
    let at = |channels: usize, factor: usize| [batch, channels, res.div_ceil(factor), res.div_ceil(factor)];
    let dense = ConvShape::dense;
    let depthwise = ConvShape::depthwise;
    let conv = |name, shape, input| Case::new(name, Op::Conv2d(shape), input);
    let norm_act = |name, act, then, input| Case::new(name, Op::NormAct(act, then), input);
    let residual = |name, act, side, input| Case::new(name, Op::NormAddAct(act, side), input);
    let stem_pool = Consumer::MaxPool(STEM_POOL);
    let layer1_conv2 = Consumer::Conv(dense(64, 3, 1, 1));
    // A ViT's patch embedding gives one token per 16x16 patch and the class token.
    let tokens = (res / 16).pow(2) + 1;
    vec![
        conv("resnet conv1", dense(64, 7, 2, 3), at(3, 1)),
        conv("resnet18 layer1.0.conv1", dense(64, 3, 1, 1), at(64, 4)),
        conv("resnet18 layer2.0.conv1", dense(128, 3, 2, 1), at(64, 4)),
        conv("resnet18 layer2.0.downsample.0", dense(128, 1, 2, 0), at(64, 4)),
        conv("resnet18 layer3.1.conv1", dense(256, 3, 1, 1), at(256, 16)),
        conv("resnet18 layer4.1.conv1", dense(512, 3, 1, 1), at(512, 32)),
        conv("resnet50 layer1.0.conv3", dense(256, 1, 1, 0), at(64, 4)),
        conv("resnet50 layer1.0.conv2 *", ConvShape::grouped(64, 3, 1, 1, 32), at(64, 4)),
        conv("efficientnet-b0 features.0.0", dense(32, 3, 2, 1), at(3, 1)),
        conv("efficientnet-b0 features.1.0.depthwise", depthwise(32, 3, 1), at(32, 2)),
        conv("efficientnet-b0 features.2.0.expand", dense(96, 1, 1, 0), at(16, 2)),
        conv("efficientnet-b0 features.2.0.depthwise", depthwise(96, 3, 2), at(96, 2)),
        conv("efficientnet-b0 features.3.0.depthwise", depthwise(144, 5, 2), at(144, 4)),
        conv("efficientnet-b0 features.3.1.depthwise", depthwise(240, 5, 1), at(240, 8)),
        conv("efficientnet-b0 features.6.1.depthwise", depthwise(1152, 5, 1), at(1152, 32)),
        conv("efficientnet-b0 features.8.0", dense(1280, 1, 1, 0), at(320, 32)),
        Case::new("resnet bn1", Op::BatchNorm, at(64, 2)),
        Case::new("efficientnet-b0 features.2.0.expand_bn", Op::BatchNorm, at(96, 2)),
        Case::new("resnet18 layer4.1.bn2", Op::BatchNorm, at(512, 32)),
        Case::new("efficientnet-b0 features.6.1.expand_bn", Op::BatchNorm, at(1152, 32)),
        Case::new("resnet maxpool", Op::MaxPool(STEM_POOL), at(64, 2)),
        Case::new("efficientnet-b0 features.0.2", Op::Silu, at(32, 2)),
        Case::new("efficientnet-b0 features.6.1.depthwise_act", Op::Silu, at(1152, 32)),
        norm_act("resnet bn1, relu, maxpool", Relu, stem_pool, at(64, 2)),
        norm_act("resnet bn1, maxpool *", Identity, stem_pool, at(64, 2)),
        norm_act("resnet bn1, maxpool *", Silu, stem_pool, at(64, 2)),
        norm_act("resnet18 layer1.0 bn1, relu1, conv2", Relu, layer1_conv2, at(64, 4)),
        norm_act("resnet18 layer1.0 bn1, conv2 *", Identity, layer1_conv2, at(64, 4)),
        norm_act("resnet18 layer1.0 bn1, conv2 *", Silu, layer1_conv2, at(64, 4)),
        norm_act("resnet50 layer2.0 bn1, relu1, conv2", Relu, Consumer::Conv(dense(128, 3, 2, 1)), at(128, 4)),
        norm_act("resnet50 layer1.0 bn2, relu2, conv3", Relu, Consumer::Conv(dense(256, 1, 1, 0)), at(64, 4)),
        norm_act("efficientnet-b0 features.2.0 expand_bn, expand_act, depthwise", Silu, Consumer::Conv(depthwise(96, 3, 2)), at(96, 2)),
        norm_act("efficientnet-b0 features.3.1 expand_bn, expand_act, depthwise", Silu, Consumer::Conv(depthwise(240, 5, 1)), at(240, 8)),
        norm_act("efficientnet-b0 features.6.0 expand_bn, expand_act, depthwise", Silu, Consumer::Conv(depthwise(672, 5, 2)), at(672, 16)),
        norm_act("efficientnet-b0 features.8.1, features.8.2", Silu, Consumer::Nothing, at(1280, 32)),
        norm_act("efficientnet-b0 features.8.1 *", Relu, Consumer::Nothing, at(1280, 32)),
        norm_act("efficientnet-b0 features.8.1 *", Identity, Consumer::Nothing, at(1280, 32)),
        residual("resnet18 layer1.0 bn2 + x, relu", Relu, Side::Identity, at(64, 4)),
        residual("resnet18 layer2.0 bn2 + downsample, relu", Relu, Side::Projected, at(128, 8)),
        residual("resnet50 layer1.0 bn3 + downsample, relu", Relu, Side::Projected, at(256, 4)),
        residual("efficientnet-b0 features.3.1 project_bn + x", Identity, Side::Identity, at(40, 8)),
        residual("resnet18 layer1.0 bn2 + x *", Silu, Side::Identity, at(64, 4)),
        residual("resnet18 layer2.0 bn2 + downsample *", Silu, Side::Projected, at(128, 8)),
        Case::tokens("vit-tiny encoder layer ln_1", Op::LayerNorm, [batch, tokens, 192]),
        Case::tokens("vit-small encoder ln", Op::LayerNorm, [batch, tokens, 384]),
        Case::tokens("vit-tiny encoder layer mlp gelu", Op::Gelu, [batch, tokens, 768]),
        Case::tokens("vit-small encoder layer mlp gelu", Op::Gelu, [batch, tokens, 1536]),
        Case::tokens("vit-tiny encoder layer self_attention in_proj", Op::Linear(576), [batch, tokens, 192]),
        Case::tokens("vit-tiny encoder layer mlp.0", Op::Linear(768), [batch, tokens, 192]),
        Case::tokens("vit-tiny encoder layer mlp.3", Op::Linear(192), [batch, tokens, 768]),
        Case::tokens("vit-tiny encoder layer mlp.1, mlp.3", Op::GeluLinear(192), [batch, tokens, 768]),
        Case::tokens("vit-small encoder layer mlp.1, mlp.3", Op::GeluLinear(384), [batch, tokens, 1536]),
        Case::tokens("vit-tiny encoder layer ln_1, in_proj", Op::NormLinear(576), [batch, tokens, 192]),
        Case::tokens("vit-small encoder layer ln_2, mlp.0", Op::NormLinear(1536), [batch, tokens, 384]),
        Case::tokens("vit-tiny encoder layer out_proj + x", Op::LinearResidual(192, false), [batch, tokens, 192]),
        Case::tokens("vit-tiny encoder layer mlp.1, mlp.3 + x", Op::LinearResidual(192, true), [batch, tokens, 768]),
        Case::tokens("resnet18 fc", Op::Linear(10), [batch, 1, 512]),
        Case::tokens("vit-tiny encoder layer self_attention", Op::Attention(3, AttentionKeeps::RowStatistics), [batch, tokens, 576]),
        Case::tokens(
            "vit-tiny encoder layer self_attention (plain)",
            Op::Attention(3, AttentionKeeps::Probabilities),
            [batch, tokens, 576],
        ),
        Case::tokens("vit-small encoder layer self_attention", Op::Attention(6, AttentionKeeps::RowStatistics), [batch, tokens, 1152]),
        Case::new("unet down1.up", Op::ConvTranspose(16, 2), at(32, 2)),
        Case::new("unet down1.down2.down3.up", Op::ConvTranspose(64, 2), at(128, 8)),
    ]
}

/// A case's operands (f32, on the CPU), drawn from a generator seeded by
/// the case, and the seed of its `r`.
struct Inputs {
    operands: Vec<(Operand, Tensor)>,
    seed: u64,
}

impl Inputs {
    fn new(case: &Case, seed: u64) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (mut operands, mut drawn) = (Vec::new(), Vec::new());
        for operand in case.operands() {
            drawn.push(draw(operand.fill, &operand.dims, &mut rng, &drawn)?);
            operands.push(operand);
        }
        Ok(Inputs { operands: operands.into_iter().zip(drawn).collect(), seed })
    }

    /// The loss's weights for an output of `dims`: `sum(y * r)`'s gradient
    /// with respect to `y`. Their mean of 0.5 keeps batch-norm's mean terms
    /// in backward as large as the rest, where a zero mean would leave a
    /// missing term within f16's tolerance.
    fn r(&self, dims: &[usize]) -> Result<Tensor> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ R_STREAM);
        draw(Fill::Normal { mean: 0.5, std: 1.0 }, dims, &mut rng, &[])
    }
}

/// An operand of `dims` filled by `fill` (f32, on the CPU), after the
/// case's operands `drawn` so far.
fn draw(fill: Fill, dims: &[usize], rng: &mut ChaCha8Rng, drawn: &[Tensor]) -> Result<Tensor> {
    let count = dims.iter().product();
    let values = |values: Vec<f32>| Tensor::from_vec(values, dims, &Device::Cpu);
    let uniform = |low: f64, high: f64| Uniform::new(low, high).map_err(candle_core::Error::wrap);
    let earlier = |index: usize, what| drawn.get(index).ok_or(OpError::MissingOperand { op: "check", what });
    match fill {
        Fill::Normal { mean, std } => {
            let normal = Normal::new(mean, std).map_err(candle_core::Error::wrap)?;
            values((0..count).map(|_| normal.sample(rng) as f32).collect())
        }
        Fill::Uniform { low, high } => {
            let uniform = uniform(low, high)?;
            values((0..count).map(|_| uniform.sample(rng) as f32).collect())
        }
        Fill::Distinct => {
            const SIDE: usize = 16;
            let [.., height, width] = *dims else { Err(OpError::NotFourDims { op: "check", what: "input", dims: dims.to_vec() })? };
            let jitter = uniform(-1.0 / 256.0, 1.0 / 256.0)?;
            let mut steps: Vec<f32> = (0..SIDE * SIDE).map(|k| (k as f32 - 128.0) / 64.0).collect();
            let mut out = Vec::with_capacity(count);
            for _ in 0..count / (height * width) {
                steps.shuffle(rng);
                for h in 0..height {
                    out.extend((0..width).map(|w| steps[(h % SIDE) * SIDE + w % SIDE] + jitter.sample(rng) as f32));
                }
            }
            values(out)
        }
        Fill::Holed { mean, std, hole } => {
            let normal = Normal::new(mean, std).map_err(candle_core::Error::wrap)?;
            let away = |v: f64| if v < hole { v - 1.0 / 16.0 } else { v + 1.0 / 16.0 };
            values((0..count).map(|_| away(normal.sample(rng)) as f32).collect())
        }
        Fill::KinkBias { at } => {
            let (z, weight) = (earlier(0, "batch-norm's input")?, earlier(1, "batch-norm's weight")?);
            let (mean, var) = channel_moments(z)?;
            let zero_at = ((mean - at)? / (var + EPS)?.sqrt()?)?.flatten_all()?;
            (zero_at * weight.to_dtype(DType::F64)?)?.to_dtype(DType::F32)
        }
        Fill::OffBody => {
            let (z, weight, bias) = (earlier(0, "residual block's body")?, earlier(1, "body's weight")?, earlier(2, "body's bias")?);
            let (mean, var) = channel_moments(z)?;
            let per_channel = |t: &Tensor| t.to_dtype(DType::F64)?.reshape(mean.shape());
            let body = z.to_dtype(DType::F64)?.broadcast_sub(&mean)?.broadcast_div(&(var + EPS)?.sqrt()?)?;
            let body = body.broadcast_mul(&per_channel(weight)?)?.broadcast_add(&per_channel(bias)?)?;
            let magnitude = uniform(0.1, 2.0)?;
            let t = values((0..count).map(|_| if rng.random() { 1.0 } else { -1.0 } * magnitude.sample(rng) as f32).collect())?;
            (t.to_dtype(DType::F64)? - body)?.to_dtype(DType::F32)
        }
        Fill::ResidualStd => channel_moments(earlier(3, "residual")?)?.1.sqrt()?.flatten_all()?.to_dtype(DType::F32),
        Fill::ResidualMean => channel_moments(earlier(3, "residual")?)?.0.flatten_all()?.to_dtype(DType::F32),
    }
}

/// The mean and biased variance of each channel of `x` (`N x C x H x W`),
/// in f64, as `1 x C x 1 x 1`.
fn channel_moments(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let x = x.to_dtype(DType::F64)?;
    let mean = x.mean_keepdim((0, 2, 3))?;
    let var = x.broadcast_sub(&mean)?.sqr()?.mean_keepdim((0, 2, 3))?;
    Ok((mean, var))
}

/// How a case's op is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Implementation {
    /// The public ops of this module.
    Ours,
    /// candle's composition of each ([`Composed`]).
    Composed,
}

/// Where and how one side of a comparison runs: the operands rounded to
/// `rounded`, then computed in `compute` on `device`.
#[derive(Debug, Clone, Copy)]
struct Run<'a> {
    implementation: Implementation,
    device: &'a Device,
    rounded: DType,
    compute: DType,
}

/// The forward output and the gradient of each operand's pass of
/// `sum(y * r)`, copied to the CPU in f32.
fn evaluate(case: &Case, inputs: &Inputs, run: Run<'_>) -> Result<Vec<(Pass, Tensor)>> {
    let place = |t: &Tensor, half: bool| -> Result<Tensor> {
        let t = if half { t.to_dtype(run.rounded)?.to_dtype(run.compute)? } else { t.clone() };
        t.to_device(run.device)
    };
    let vars = inputs.operands.iter().map(|(operand, t)| Var::from_tensor(&place(t, operand.half)?)).collect::<Result<Vec<_>>>()?;
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = case.op.forward(&tensors, run.implementation)?;
    let r = place(&inputs.r(y.dims())?, true)?;
    let grads = (&y * &r)?.sum_all()?.backward()?;
    let on_cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
    let mut results = vec![(Pass::Forward, on_cpu(&y)?)];
    for pass in Pass::GRADIENTS {
        let parts = inputs
            .operands
            .iter()
            .zip(&vars)
            .filter(|((operand, _), _)| operand.grad == pass)
            .map(|(_, var)| {
                let grad =
                    grads.get(var.as_tensor()).ok_or_else(|| candle_core::Error::wrap(CheckError::NoGradient { pass: pass.as_str() }))?;
                on_cpu(grad)
            })
            .collect::<Result<Vec<_>>>()?;
        match parts.as_slice() {
            [] => {}
            [one] => results.push((pass, one.clone())),
            packed => results.push((pass, Tensor::cat(&packed.iter().map(|t| t.flatten_all()).collect::<Result<Vec<_>>>()?, 0)?)),
        }
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drawn(fill: Fill, dims: &[usize], seed: u64) -> Tensor {
        draw(fill, dims, &mut ChaCha8Rng::seed_from_u64(seed), &[]).unwrap()
    }

    fn normal(dims: &[usize], mean: f64, std: f64, seed: u64) -> Tensor {
        drawn(Fill::Normal { mean, std }, dims, seed)
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap()
    }

    fn error(a: &Tensor, b: &Tensor) -> f64 {
        compare(a, b).unwrap()
    }

    /// The gradient of `sum(f(x) * r)` with respect to `x`.
    fn gradient(x: &Tensor, r: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> Tensor {
        let x = Var::from_tensor(x).unwrap();
        let grads = (f(x.as_tensor()) * r).unwrap().sum_all().unwrap().backward().unwrap();
        grads.get(x.as_tensor()).unwrap().clone()
    }

    const F16: f64 = 5e-3;

    /// Our op matches the reference within f32's tolerance, and the result
    /// of a mistake misses it by more than the loosest tolerance.
    fn assert_caught(what: &str, ours: &Tensor, wrong: &Tensor, reference: &Tensor) {
        assert_eq!(tolerance(CheckedDtype::F16), F16, "the loosest tolerance");
        assert!(tolerance_on_tf32(CheckedDtype::F32) <= F16 && tolerance_on_tf32(CheckedDtype::F16) == F16);
        let (ours, wrong) = (error(ours, reference), error(wrong, reference));
        assert!(ours <= tolerance(CheckedDtype::F32), "{what}: our op is {ours:.1e} off");
        assert!(wrong > 10.0 * F16, "{what}: the mistake is only {wrong:.1e} off");
    }

    #[test]
    fn the_error_is_the_largest_difference_over_the_largest_reference_value() {
        assert_eq!(normalised_error(&[1.0, 2.0, 3.0], &[1.0, 2.5, -4.0]), 7.0 / 4.0);
        assert_eq!(normalised_error(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
        assert!(normalised_error(&[1e-20, 0.0], &[0.0, 0.0]) > 1e17, "a reference of zeros is matched by zeros only");
        assert!(normalised_error(&[f32::NAN, 1.0], &[1.0, 1.0]).is_nan());
        assert!(normalised_error(&[1.0], &[f32::NAN]).is_nan());
        assert!(normalised_error(&[f32::INFINITY], &[f32::INFINITY]).is_nan());
        let text = compare(&normal(&[2, 3], 0.0, 1.0, 0), &normal(&[3, 2], 0.0, 1.0, 0)).unwrap_err();
        assert_eq!(text, "shape [2, 3], the reference's [3, 2]");
    }

    #[test]
    fn a_wrong_sign_in_silus_derivative_is_caught() {
        let (x, r) = (normal(&[2, 4, 9, 9], 0.0, 3.0, 1), normal(&[2, 4, 9, 9], 0.5, 1.0, 2));
        let reference = gradient(&x, &r, |x| Composed.activation(Activation::Silu, x).unwrap());
        let ours = gradient(&x, &r, |x| ops::silu(x).unwrap());
        // silu'(x) = s (1 + x (1 - s)) with s the sigmoid, written with a minus.
        let s = (x.neg().unwrap().exp().unwrap() + 1.0).unwrap().recip().unwrap();
        let inner = (&x * s.affine(-1.0, 1.0).unwrap()).unwrap().affine(-1.0, 1.0).unwrap();
        let wrong = ((s * inner).unwrap() * &r).unwrap();
        assert_caught("silu' with -x (1 - s)", &ours, &wrong, &reference);
    }

    #[test]
    fn batch_norms_gradient_without_its_statistics_terms_is_caught() {
        let dims = [2, 8, 6, 6];
        let (x, r) = (normal(&dims, 0.5, 2.0, 3), normal(&dims, 0.5, 1.0, 4));
        let (weight, bias) = (drawn(Fill::Uniform { low: 0.5, high: 1.5 }, &[8], 5), drawn(BIAS, &[8], 6));
        let norm = Norm { weight: &weight, bias: &bias, eps: EPS };
        let reference = gradient(&x, &r, |x| Composed.batch_norm(x, norm).unwrap().y);
        let ours = gradient(&x, &r, |x| ops::batch_norm_train(x, &weight, &bias, EPS).unwrap().y);
        // The batch's mean and variance taken as constants: dx = weight / std * dy.
        let mean = x.mean_keepdim((0, 2, 3)).unwrap();
        let std = (x.broadcast_sub(&mean).unwrap().sqr().unwrap().mean_keepdim((0, 2, 3)).unwrap() + EPS).unwrap().sqrt().unwrap();
        let wrong = gradient(&x, &r, |x| {
            let per_channel = |t: &Tensor| t.reshape((1, 8, 1, 1)).unwrap();
            let xhat = x.broadcast_sub(&mean).unwrap().broadcast_div(&std).unwrap();
            xhat.broadcast_mul(&per_channel(&weight)).unwrap().broadcast_add(&per_channel(&bias)).unwrap()
        });
        assert_caught("batch-norm's dx without the mean terms", &ours, &wrong, &reference);
        let no_bias = (Composed.batch_norm(&x, norm).unwrap().y.broadcast_sub(&bias.reshape((1, 8, 1, 1)).unwrap())).unwrap();
        let forward = ops::batch_norm_train(&x, &weight, &bias, EPS).unwrap().y;
        assert_caught("batch-norm without its bias", &forward, &no_bias, &Composed.batch_norm(&x, norm).unwrap().y);
    }

    /// `x` moved left by one column, `fill` coming in on the right: its
    /// windows are the original's one column further right.
    fn shifted(x: &Tensor, fill: f32) -> Tensor {
        let width = x.dim(3).unwrap();
        let mut dims = x.dims().to_vec();
        dims[3] = 1;
        let column = Tensor::full(fill, dims, x.device()).unwrap();
        Tensor::cat(&[x.narrow(3, 1, width - 1).unwrap(), column], 3).unwrap()
    }

    #[test]
    fn windows_shifted_by_one_column_are_caught() {
        let x = drawn(Fill::Distinct, &[2, 4, 12, 12], 7);
        let reference = Composed.max_pool2d(&x, 3, 2, 1).unwrap();
        let ours = ops::max_pool2d(&x, 3, 2, 1).unwrap();
        let wrong = Composed.max_pool2d(&shifted(&x, f32::NEG_INFINITY), 3, 2, 1).unwrap();
        assert_caught("max-pool one column off", &ours, &wrong, &reference);

        let w = normal(&[6, 4, 3, 3], 0.0, 0.3, 8);
        let p = ConvParams { stride: 2, padding: 1, groups: 1 };
        let reference = Composed.conv2d(&x, &w, p).unwrap();
        let ours = ops::conv2d(&x, &w, p).unwrap();
        let wrong = Composed.conv2d(&shifted(&x, 0.0), &w, p).unwrap();
        assert_caught("convolution one column off", &ours, &wrong, &reference);
    }

    #[test]
    fn every_op_and_pass_is_checked_and_passes_here() {
        let options = CheckOptions { batch: 2, res: CheckOptions::MIN_RES, dtypes: CheckedDtype::ALL.to_vec() };
        let report = check_every_op(&CheckTarget::Cpu, &options).unwrap();
        let failed: Vec<&Check> = report.checks.iter().filter(|c| !c.ok).collect();
        assert!(failed.is_empty(), "{failed:#?}");
        assert_eq!((report.passed, report.failed), (report.checks.len(), 0));
        for op in [
            "conv2d",
            "batch_norm_train",
            "max_pool2d",
            "silu",
            "norm_act",
            "norm_add_act",
            "gelu",
            "layer_norm",
            "linear",
            "gelu_linear",
            "norm_linear",
            "linear_residual",
            "gelu_linear_residual",
            "attention",
            "conv_transpose2d",
        ] {
            for dtype in CheckedDtype::ALL {
                assert!(report.checks.iter().any(|c| c.op == op && c.dtype == dtype), "no {op} in {dtype:?}");
            }
        }
        for pass in
            [Pass::Forward, Pass::GradInput, Pass::GradWeight, Pass::GradNorm, Pass::GradResidual, Pass::GradResidualNorm, Pass::GradBias]
        {
            assert!(report.checks.iter().any(|c| c.pass == pass), "no {pass:?}");
        }
        assert!(report.table().to_string().ends_with(&format!("{} passed, 0 failed\n", report.passed)));
    }

    /// The CUDA passes, run on the reference primitives, against our CPU
    /// ops: every op and pass, every gradient in its operand's shape.
    #[test]
    fn every_op_and_pass_is_checked_on_the_reference_primitives_and_passes() {
        let options = CheckOptions { batch: 2, res: CheckOptions::MIN_RES, dtypes: CheckedDtype::ALL.to_vec() };
        let report = check_every_op(&CheckTarget::Reference, &options).unwrap();
        let failed: Vec<&Check> = report.checks.iter().filter(|c| !c.ok).collect();
        assert!(failed.is_empty(), "{failed:#?}");
        let on_cpu = check_every_op(&CheckTarget::Cpu, &options).unwrap();
        assert_eq!(report.checks.len(), on_cpu.checks.len(), "the same cases and passes as on the CPU");
        assert!(report.checks.iter().all(|c| c.tolerance == tolerance(c.dtype)), "no TF32 on the reference");
        assert!(
            report.device.contains("reference") && report.reference.starts_with("our CPU ops"),
            "{} / {}",
            report.device,
            report.reference
        );
        assert!(report.checks.iter().any(|c| c.error.is_some_and(|e| e > 0.0)), "the passes computed apart from the CPU kernels");
    }

    #[test]
    fn a_failed_check_is_marked_in_the_table_and_the_summary() {
        let check = |ok, error: f64| Check {
            op: "conv2d",
            case: "resnet conv1".into(),
            shape: "2x3x96x96".into(),
            dtype: CheckedDtype::F16,
            pass: Pass::GradWeight,
            error: Some(error),
            tolerance: F16,
            ok,
            failure: None,
        };
        let report = OpsReport {
            device: "the CPU".into(),
            reference: Reference::Composed.describe().into(),
            batch: 2,
            res: 96,
            error: ERROR,
            tolerances: vec![Tolerance { dtype: CheckedDtype::F16, tolerance: F16 }],
            checks: vec![check(true, 1e-3), check(false, 0.5)],
            passed: 1,
            failed: 1,
            seconds: 1.0,
        };
        let text = report.table().to_string();
        assert!(!report.all_passed());
        assert!(text.lines().any(|l| l.contains("5.0e-1") && l.trim_end().ends_with("FAIL")), "{text}");
        assert!(text.contains("tolerances: f16 5e-3"), "{text}");
        assert!(text.ends_with("1 passed, 1 failed\n"), "{text}");
    }

    #[test]
    fn sizes_outside_the_checked_range_are_refused() {
        for (batch, res) in [(1, 96), (9, 96), (2, 31), (2, 225)] {
            let options = CheckOptions { batch, res, ..CheckOptions::default() };
            let err = check_every_op(&CheckTarget::Cpu, &options).unwrap_err();
            assert!(matches!(err, CheckError::OutOfRange { .. }), "{batch} {res}: {err}");
        }
    }

    #[test]
    fn distinct_values_never_tie_in_a_window_even_in_f16() {
        let x = drawn(Fill::Distinct, &[2, 3, 37, 37], 9).to_dtype(DType::F16).unwrap();
        let planes = values(&x);
        for plane in planes.chunks_exact(37 * 37) {
            for (top, left) in (0..35).flat_map(|t| (0..35).map(move |l| (t, l))) {
                let mut window: Vec<f32> = (0..9).map(|i| plane[(top + i / 3) * 37 + left + i % 3]).collect();
                window.sort_by(f32::total_cmp);
                assert!(window.windows(2).all(|pair| pair[0] < pair[1]), "{window:?}");
            }
        }
        let hole = values(&x).iter().map(|&v| (f64::from(v) - DISTINCT_HOLE).abs()).fold(f64::INFINITY, f64::min);
        assert!(hole > 1.0 / 512.0, "a value {hole} from the hole");
    }

    /// What each lean case's activation reads: batch-norm's output, or the
    /// residual sum, from the inputs as each dtype rounds them.
    #[test]
    fn no_lean_case_puts_a_value_near_relus_kink() {
        for (index, case) in cases(2, 64).iter().enumerate() {
            let (pre, operands) = match case.op {
                Op::NormAct(..) => (Op::NormAct(Activation::Identity, Consumer::Nothing), 3),
                Op::NormAddAct(_, side) => (Op::NormAddAct(Activation::Identity, side), usize::MAX),
                _ => continue,
            };
            let inputs = Inputs::new(case, index as u64).unwrap();
            for dtype in CheckedDtype::ALL {
                let rounded = |(operand, t): &(Operand, Tensor)| match operand.half {
                    true => t.to_dtype(dtype.dtype()).unwrap().to_dtype(DType::F32).unwrap(),
                    false => t.clone(),
                };
                let tensors: Vec<Tensor> = inputs.operands.iter().take(operands).map(rounded).collect();
                let closest =
                    values(&pre.forward(&tensors, Implementation::Composed).unwrap()).iter().fold(f32::INFINITY, |m, v| m.min(v.abs()));
                assert!(closest > 1e-3, "{} {dtype:?}: a value {closest} from 0", case.name);
            }
        }
    }
}
