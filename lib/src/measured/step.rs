//! Real training steps of any model given as its forward pass, read part by
//! part with the step meter (the host's allocation counters, or the CUDA pool).

use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::backprop::GradStore;
use candle_core::{Device, DeviceLocation, Tensor, Var};
use serde::Serialize;

use super::graph::{graph_variables, Kept};
use super::{candle_message, MeasureError};
use crate::ledger::OptimizerKind;
use crate::memory::StepMeter;
use crate::train::{Optimizer, OptimizerConfig};

/// A model as its forward pass: a batch in, the output (logits) out.
pub type Forward<'a> = &'a dyn Fn(&Tensor) -> candle_core::Result<Tensor>;

/// The parts of a measured step, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepPart {
    BatchMade,
    Forward,
    Backward,
    GraphDropped,
    OptimizerStep,
}

impl StepPart {
    pub const ALL: [StepPart; 5] =
        [StepPart::BatchMade, StepPart::Forward, StepPart::Backward, StepPart::GraphDropped, StepPart::OptimizerStep];

    pub fn name(self) -> &'static str {
        match self {
            StepPart::BatchMade => "batch made",
            StepPart::Forward => "forward and loss",
            StepPart::Backward => "backward",
            StepPart::GraphDropped => "graph dropped",
            StepPart::OptimizerStep => "optimizer step",
        }
    }
}

/// One part as read: bytes in use at its end and the most in use during
/// it, both above what the process held besides the model and its optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PartReading {
    pub part: StepPart,
    pub in_use: u64,
    pub peak: u64,
    /// Bytes of the parameters' gradients held at its end.
    pub gradients: u64,
}

/// One measured step at one batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepReading {
    pub batch: usize,
    pub parts: Vec<PartReading>,
    /// The variables the loss depends on.
    pub parameters: u64,
    pub optimizer_state: u64,
    /// The batch and its labels.
    pub input: u64,
    /// What the graph holds, read off it.
    pub kept: Kept,
    /// What the counters saw forward add (in use after forward less after the batch).
    pub kept_by_counters: u64,
}

/// An optimizer's update measured on the gradients of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OptimizerReading {
    pub kind: OptimizerKind,
    /// State it holds after its first update.
    pub state: u64,
    /// The most the update held beyond the parameters, gradients and that state.
    pub update: u64,
}

/// The loss a step backpropagates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Loss {
    /// Over logits `batch x classes`, with labels cycling through the classes.
    CrossEntropy { classes: usize },
    /// The mean of any other output.
    Mean,
}

impl std::fmt::Display for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Loss::CrossEntropy { classes } => write!(f, "cross-entropy over {classes} classes"),
            Loss::Mean => f.write_str("the mean of the output"),
        }
    }
}

/// A model ready to be stepped: its device, variables and optimizer, and a
/// copy of the variables' values to put back once measured.
pub(super) struct Stepper<'a> {
    forward: Forward<'a>,
    sample: Vec<usize>,
    pub device: Device,
    pub meter: StepMeter,
    pub loss: Loss,
    vars: Vec<Var>,
    originals: Vec<Tensor>,
    optimizer: Box<dyn Optimizer>,
    pub kind: OptimizerKind,
}

/// The learning rate of the measured updates; the variables are restored after.
const LEARNING_RATE: f64 = 1e-3;

impl<'a> Stepper<'a> {
    /// Runs the forward once on `batch` samples to find the model's device (a
    /// batch made on the CPU for a model on a GPU fails with the GPU's
    /// location), its output, and the variables its loss depends on.
    pub fn new(forward: Forward<'a>, sample: &[usize], batch: usize, kind: OptimizerKind) -> Result<Stepper<'a>, MeasureError> {
        let mut device = Device::Cpu;
        let output = match run_forward(forward, &batch_of(batch, sample, &device)?) {
            Err(MeasureError::Forward { location: Some(location), .. }) => {
                device = device_at(location)?;
                run_forward(forward, &batch_of(batch, sample, &device)?)?
            }
            result => result?,
        };
        let loss = match output.dims() {
            &[rows, classes] if rows == batch => Loss::CrossEntropy { classes },
            _ => Loss::Mean,
        };
        let vars = graph_variables(&loss_of(&output, loss, batch, &device)?);
        drop(output);
        if vars.is_empty() {
            return Err(MeasureError::NoVariables);
        }
        let meter = StepMeter::for_device(&device)?;
        if !meter.exact() {
            return Err(MeasureError::NotCounting);
        }
        let originals = vars.iter().map(|v| v.as_tensor().copy()).collect::<candle_core::Result<_>>()?;
        let optimizer = OptimizerConfig::for_kind(kind, LEARNING_RATE).build(vars.clone())?;
        Ok(Stepper { forward, sample: sample.to_vec(), device, meter, loss, vars, originals, optimizer, kind })
    }

    pub fn parameters(&self) -> u64 {
        self.vars.iter().map(|v| bytes(v.as_tensor())).sum()
    }

    /// One step, unmeasured: the optimizer's state and every buffer a first
    /// step allocates for good are in place before the measured ones.
    pub fn warm_up(&mut self, batch: usize) -> Result<(), MeasureError> {
        self.step(batch, &[]).map(drop)
    }

    /// One measured step at `batch`; with `others`, each of those optimizers'
    /// first update on the step's gradients is measured too.
    pub fn step(&mut self, batch: usize, others: &[OptimizerKind]) -> Result<(StepReading, Vec<OptimizerReading>), MeasureError> {
        let meter = self.meter.clone();
        let parameters = self.parameters();
        let optimizer_state = self.optimizer.state_bytes() as u64;
        let outside = meter.in_use()?.saturating_sub(parameters + optimizer_state);
        let mut parts = Vec::with_capacity(StepPart::ALL.len());
        let mut read = |part: StepPart, gradients: u64, transient: bool| -> Result<(), MeasureError> {
            let in_use = meter.in_use()?;
            // Dropping frees only: the window's peak is where the part started.
            let peak = if transient { meter.window_peak()?.unwrap_or(in_use).max(in_use) } else { in_use };
            meter.open_window()?;
            parts.push(PartReading { part, in_use: in_use.saturating_sub(outside), peak: peak.saturating_sub(outside), gradients });
            Ok(())
        };
        meter.open_window()?;
        let x = batch_of(batch, &self.sample, &self.device)?;
        let labels = labels_of(self.loss, batch, &self.device)?;
        let input = bytes(&x) + labels.as_ref().map_or(0, bytes);
        read(StepPart::BatchMade, 0, true)?;
        let output = run_forward(self.forward, &x)?;
        let loss = match &labels {
            Some(labels) => candle_nn::loss::cross_entropy(&output, labels)?,
            None => output.mean_all()?,
        };
        read(StepPart::Forward, 0, true)?;
        let kept = Kept::of(&loss, &x);
        meter.open_window()?;
        let grads = loss.backward().map_err(|error| MeasureError::Backward { input: shape_of(&x), reason: candle_message(&error) })?;
        let gradients = self.gradient_bytes(&grads);
        read(StepPart::Backward, gradients, true)?;
        drop((loss, output));
        read(StepPart::GraphDropped, gradients, false)?;
        self.optimizer.step(&grads)?;
        read(StepPart::OptimizerStep, gradients, true)?;
        let others = others.iter().map(|&kind| self.other_update(kind, &grads)).collect::<Result<_, _>>()?;
        drop((grads, x, labels));
        let kept_by_counters = parts[1].in_use.saturating_sub(parts[0].in_use);
        let reading = StepReading { batch, parts, parameters, optimizer_state, input, kept, kept_by_counters };
        Ok((reading, others))
    }

    /// The first update of another optimizer on `grads`.
    fn other_update(&self, kind: OptimizerKind, grads: &GradStore) -> Result<OptimizerReading, MeasureError> {
        let before = self.meter.in_use()?;
        self.meter.open_window()?;
        let mut optimizer = OptimizerConfig::for_kind(kind, LEARNING_RATE).build(self.vars.clone())?;
        optimizer.step(grads)?;
        let after = self.meter.in_use()?;
        let peak = self.meter.window_peak()?.unwrap_or(after).max(after);
        let state = optimizer.state_bytes() as u64;
        Ok(OptimizerReading { kind, state, update: peak.saturating_sub(before + state) })
    }

    fn gradient_bytes(&self, grads: &GradStore) -> u64 {
        self.vars.iter().filter_map(|v| grads.get(v.as_tensor())).map(bytes).sum()
    }

    /// Puts the variables back as they were before the first step.
    pub fn restore(&self) -> Result<(), MeasureError> {
        for (var, original) in self.vars.iter().zip(&self.originals) {
            var.set(original)?;
        }
        Ok(())
    }
}

fn bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// A random batch of `batch` samples of `sample`'s shape.
fn batch_of(batch: usize, sample: &[usize], device: &Device) -> Result<Tensor, MeasureError> {
    let dims: Vec<usize> = std::iter::once(batch).chain(sample.iter().copied()).collect();
    Ok(Tensor::randn(0f32, 1.0, dims, device)?)
}

fn labels_of(loss: Loss, batch: usize, device: &Device) -> Result<Option<Tensor>, MeasureError> {
    match loss {
        Loss::CrossEntropy { classes } => {
            let labels: Vec<u32> = (0..batch).map(|i| (i % classes) as u32).collect();
            Ok(Some(Tensor::from_vec(labels, batch, device)?))
        }
        Loss::Mean => Ok(None),
    }
}

fn loss_of(output: &Tensor, loss: Loss, batch: usize, device: &Device) -> Result<Tensor, MeasureError> {
    Ok(match labels_of(loss, batch, device)? {
        Some(labels) => candle_nn::loss::cross_entropy(output, &labels)?,
        None => output.mean_all()?,
    })
}

/// The forward on `x`; an error or a panic in it names the batch's shape.
fn run_forward(forward: Forward<'_>, x: &Tensor) -> Result<Tensor, MeasureError> {
    let input = shape_of(x);
    match catch_unwind(AssertUnwindSafe(|| forward(x))) {
        Ok(Ok(output)) if output.dtype().is_float() => Ok(output),
        Ok(Ok(output)) => Err(MeasureError::Forward {
            input,
            reason: format!("its output is {:?}, not a float tensor a loss can be taken of", output.dtype()),
            location: None,
        }),
        Ok(Err(error)) => Err(MeasureError::Forward { input, location: other_device(&error), reason: candle_message(&error) }),
        Err(panic) => {
            let message = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
            Err(MeasureError::Forward {
                input,
                reason: format!("it panicked: {}", first_line(&message.unwrap_or_default())),
                location: None,
            })
        }
    }
}

fn shape_of(x: &Tensor) -> String {
    x.dims().iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().trim().to_owned()
}

/// The device other than the CPU that a device-mismatch error names.
fn other_device(error: &candle_core::Error) -> Option<DeviceLocation> {
    match error {
        candle_core::Error::DeviceMismatchBinaryOp { lhs, rhs, .. } => {
            [*lhs, *rhs].into_iter().find(|location| !matches!(location, DeviceLocation::Cpu))
        }
        candle_core::Error::WithBacktrace { inner, .. } | candle_core::Error::Context { inner, .. } => other_device(inner),
        _ => None,
    }
}

/// A handle on the device at `location`: on CUDA any handle on the same GPU
/// computes with the model's tensors.
fn device_at(location: DeviceLocation) -> Result<Device, MeasureError> {
    match location {
        DeviceLocation::Cuda { gpu_id } => Ok(Device::new_cuda(gpu_id)?),
        other => Err(MeasureError::Device { location: format!("{other:?}") }),
    }
}
