//! Any candle model, measured: for a model known only by its forward pass
//! (a candle-nn `Module`, a closure, a zoo `Network`), real training steps at
//! a few small batches, each part of the step read with the step meter, what
//! forward keeps for backward read off the autograd graph, and each bill
//! fitted against the batch and extrapolated to the batch asked for.
//!
//! Nothing here predicts from a spec: the figures are measured, and those at
//! a batch that was not run are a straight line through measured ones (the
//! report says which is which). The ledger (`crate::ledger`) is the
//! prediction for models that have a spec.
//!
//! # The room
//!
//! Any candle model known only by its forward (a candle-nn `Module`, a closure, a `Network`): real
//! steps at batches 2, 4 and 8 (at batch 1 alone when that is the batch asked for) read part by
//! part with the step meter (`step.rs`; the updates run and the variables are put back), what
//! forward keeps read off the loss's autograd graph through the patched candle's public
//! `Tensor::op` (`graph.rs`: each storage once, under the op that made it, read by backward or only
//! held), each bill a straight line in the batch (`line.rs`), extrapolated to the batch asked for
//! and judged on a card with the fixes that need no spec (`module_report.rs`).

mod graph;
mod line;
mod module_report;
mod step;

pub use graph::{graph_variables, Kept, KeptByOp};
pub use line::Line;
pub use module_report::ModuleReport;
pub use step::{Forward, Loss, OptimizerReading, PartReading, StepPart, StepReading};

use serde::Serialize;

use crate::ledger::OptimizerKind;
use crate::memory::{BillBytes, MemoryError};
use crate::units::human;

/// The batches the steps run at, smallest first: three points for each line,
/// large enough that the CPU's convolutions already cut the batch into chunks
/// for every thread as they do for large batches.
pub const MEASURED_BATCHES: [usize; 3] = [2, 4, 8];

/// What stops a measurement: each names the problem in one line.
#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    #[error("the model's forward failed on a batch of shape {input}: {reason}")]
    Forward { input: String, reason: String, location: Option<candle_core::DeviceLocation> },
    #[error("the model's output depends on no variable (nothing for an optimizer to update): build its weights with a VarMap")]
    NoVariables,
    #[error("the model is on {location}, where vramlab cannot measure")]
    Device { location: String },
    #[error("measuring a step needs the allocation counters, which this process lacks: run in the vramlab kernel or the vramlab command")]
    NotCounting,
    #[error("{what} needs about {}, more than the {} this machine has available: ask for a smaller input", human(*needs), human(*available))]
    TooLarge { what: String, needs: u64, available: u64 },
    #[error("the model's backward failed on a batch of shape {input}: {reason}")]
    Backward { input: String, reason: String },
    #[error("a step failed: {}", candle_message(.0))]
    Candle(#[from] candle_core::Error),
    #[error("the optimizer failed: {0}")]
    Optimizer(#[from] crate::train::OptimError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Host(#[from] crate::gpus::GpuError),
}

/// A candle error's message without the backtrace candle captures when
/// `RUST_BACKTRACE` is set, its context before it on the same line.
pub fn candle_message(error: &candle_core::Error) -> String {
    match error {
        candle_core::Error::WithBacktrace { inner, .. } => candle_message(inner),
        candle_core::Error::Context { inner, context } => format!("{context}: {}", candle_message(inner)),
        candle_core::Error::WithPath { inner, path } => format!("{}: {}", path.display(), candle_message(inner)),
        other => other.to_string().lines().next().unwrap_or_default().trim().to_owned(),
    }
}

/// Steps measured at [`MEASURED_BATCHES`], for one sample shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measured {
    /// One sample's shape (the batch's without its first dimension).
    pub sample: Vec<usize>,
    pub device: String,
    pub measured_with: String,
    pub loss: Loss,
    pub optimizer: OptimizerKind,
    pub steps: Vec<StepReading>,
    /// Other optimizers' updates on the last step's gradients.
    pub other_optimizers: Vec<OptimizerReading>,
}

/// Measures steps of `forward` on random batches of `sample`-shaped inputs
/// with `optimizer`, at each of [`MEASURED_BATCHES`] after one unmeasured
/// step, and puts the variables' values back afterwards. Layers that update
/// state in their forward (candle-nn's batch-norm statistics) see the random
/// batches; a zoo network's forward can be told not to.
pub fn measure(forward: Forward<'_>, sample: &[usize], optimizer: OptimizerKind) -> Result<Measured, MeasureError> {
    measure_at(forward, sample, optimizer, &MEASURED_BATCHES)
}

/// [`measure`] at `batches` (ascending, at least one) instead.
pub fn measure_at(forward: Forward<'_>, sample: &[usize], optimizer: OptimizerKind, batches: &[usize]) -> Result<Measured, MeasureError> {
    // The batches are made on the host first (a GPU model's too, to find its
    // device): a step takes a few times its batch, which must fit the host.
    let largest = batches.iter().copied().max().unwrap_or(1) as u64;
    let batch_bytes = sample.iter().try_fold(largest * 4, |bytes, &d| bytes.checked_mul(d as u64)).unwrap_or(u64::MAX);
    let available = crate::gpus::Card::host()?.usable_bytes;
    if batch_bytes.saturating_mul(4) > available {
        let what = format!("a step at batch {largest} (its batch alone {})", human(batch_bytes));
        return Err(MeasureError::TooLarge { what, needs: batch_bytes.saturating_mul(4), available });
    }
    let smallest = batches.iter().copied().min().unwrap_or(1);
    let mut stepper = step::Stepper::new(forward, sample, smallest, optimizer)?;
    let measured = measure_with(&mut stepper, sample, batches);
    stepper.restore()?;
    measured
}

fn measure_with(stepper: &mut step::Stepper<'_>, sample: &[usize], batches: &[usize]) -> Result<Measured, MeasureError> {
    let available = room(&stepper.device)?;
    stepper.warm_up(batches.first().copied().unwrap_or(1))?;
    let others: Vec<OptimizerKind> = [OptimizerKind::Sgd, OptimizerKind::Adam8bit].into_iter().filter(|&k| k != stepper.kind).collect();
    let mut steps: Vec<StepReading> = Vec::new();
    let mut other_optimizers = Vec::new();
    for (i, &batch) in batches.iter().enumerate() {
        // Each step's peak grows with the batch: the next must fit the machine.
        if let (Some(available), Some(last)) = (available, steps.last()) {
            let needs = peak_of(last) * batch as u64 / last.batch as u64;
            if needs > available / 10 * 9 {
                return Err(MeasureError::TooLarge { what: format!("a step at batch {batch}"), needs, available });
            }
        }
        let last = i + 1 == batches.len();
        let (reading, updates) = stepper.step(batch, if last { &others } else { &[] })?;
        steps.push(reading);
        other_optimizers = updates;
    }
    Ok(Measured {
        sample: sample.to_vec(),
        device: match stepper.device.location() {
            candle_core::DeviceLocation::Cpu => "the CPU".to_owned(),
            candle_core::DeviceLocation::Cuda { gpu_id } => format!("CUDA device {gpu_id}"),
            candle_core::DeviceLocation::Metal { gpu_id } => format!("Metal device {gpu_id}"),
        },
        measured_with: stepper.meter.source().to_owned(),
        loss: stepper.loss,
        optimizer: stepper.kind,
        steps,
        other_optimizers,
    })
}

fn peak_of(step: &StepReading) -> u64 {
    step.parts.iter().map(|p| p.peak).max().unwrap_or(0)
}

/// The memory a measured step may take on `device`: what the host has
/// available for the CPU; unbounded elsewhere (a GPU's own out-of-memory
/// error stops the step).
fn room(device: &candle_core::Device) -> Result<Option<u64>, MeasureError> {
    if !device.is_cpu() {
        return Ok(None);
    }
    Ok(Some(crate::gpus::Card::host()?.usable_bytes))
}

/// How a projection differs from the measured step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Scenario<'a> {
    /// Another optimizer's measured state and update in place of the step's.
    pub optimizer: Option<&'a OptimizerReading>,
    /// Under f16 mixed precision (estimated): activations and transients
    /// halve, and an f16 copy of the weights joins the parameters.
    pub half_precision: bool,
    /// Micro-batches accumulated per update: from the second on, backward
    /// makes its gradients beside the ones accumulated.
    pub accumulation: usize,
}

/// A step's bills at one part, at one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PartBills {
    pub part: StepPart,
    pub bills: BillBytes,
}

impl Measured {
    /// The step at `batch` when it was measured.
    pub fn step_at(&self, batch: usize) -> Option<&StepReading> {
        self.steps.iter().find(|s| s.batch == batch)
    }

    /// Each bill at part `part` of every measured step, as (batch, bytes)
    /// points: parameters with the gradients then held, the optimizer's
    /// state, the batch, activations (the rest of what was in use), and the
    /// part's transients (its peak above its end).
    fn bills(step: &StepReading, part: usize) -> BillBytes {
        let p = &step.parts[part];
        let parameters = step.parameters + p.gradients;
        BillBytes {
            parameters,
            optimizer_state: step.optimizer_state,
            activations: p.in_use.saturating_sub(parameters + step.optimizer_state + step.input),
            input_batch: step.input,
            context_and_workspace: p.peak.saturating_sub(p.in_use),
        }
    }

    /// Each part's bills fitted against the batch.
    pub fn lines(&self) -> Vec<(StepPart, [Line; 5])> {
        StepPart::ALL
            .iter()
            .enumerate()
            .map(|(i, &part)| {
                let points = |kind| self.steps.iter().map(|s| (s.batch as f64, Self::bills(s, i).get(kind) as f64)).collect::<Vec<_>>();
                (part, crate::ledger::BillKind::ALL.map(|kind| Line::least_squares(&points(kind))))
            })
            .collect()
    }

    /// The bills of every part at `batch`: measured where a step ran at it,
    /// otherwise from the lines, changed as `scenario` says.
    pub fn parts_at(&self, batch: usize, scenario: Scenario<'_>) -> Vec<PartBills> {
        let measured = self.step_at(batch);
        let lines = self.lines();
        lines
            .iter()
            .enumerate()
            .map(|(i, (part, lines))| {
                let mut bills = match measured {
                    Some(step) => Self::bills(step, i),
                    None => {
                        let mut bills = BillBytes::default();
                        for (kind, line) in crate::ledger::BillKind::ALL.iter().zip(lines) {
                            bills.set(*kind, line.at(batch));
                        }
                        bills
                    }
                };
                self.apply(&mut bills, *part, scenario);
                PartBills { part: *part, bills }
            })
            .collect()
    }

    fn apply(&self, bills: &mut BillBytes, part: StepPart, scenario: Scenario<'_>) {
        let parameters = self.steps[0].parameters;
        if let Some(other) = scenario.optimizer {
            bills.optimizer_state = other.state;
            if part == StepPart::OptimizerStep {
                bills.context_and_workspace = other.update;
            }
        }
        if scenario.accumulation > 1 && part == StepPart::Backward {
            bills.context_and_workspace += bills.parameters.saturating_sub(parameters);
        }
        if scenario.half_precision {
            bills.activations /= 2;
            bills.context_and_workspace /= 2;
            bills.parameters += parameters / 2;
        }
    }

    /// The part with the highest peak at `batch`, and its bills.
    pub fn peak_at(&self, batch: usize, scenario: Scenario<'_>) -> PartBills {
        self.parts_at(batch, scenario)
            .into_iter()
            .max_by_key(|p| p.bills.total())
            .unwrap_or(PartBills { part: StepPart::BatchMade, bills: BillBytes::default() })
    }

    /// The graph's holdings by op at `batch`: read off the graph where a
    /// step ran at it, otherwise each op's bytes fitted against the batch.
    pub fn kept_at(&self, batch: usize) -> Kept {
        if let Some(step) = self.step_at(batch) {
            return step.kept.clone();
        }
        let last = &self.steps[self.steps.len() - 1].kept;
        let mut by_op: Vec<KeptByOp> = last
            .by_op
            .iter()
            .map(|row| {
                let points = |of: fn(&KeptByOp) -> u64| -> Vec<(f64, f64)> {
                    self.steps.iter().map(|s| (s.batch as f64, s.kept.by_op.iter().find(|k| k.op == row.op).map_or(0, of) as f64)).collect()
                };
                KeptByOp {
                    op: row.op.clone(),
                    storages: row.storages,
                    read: Line::least_squares(&points(|k| k.read)).at(batch),
                    held: Line::least_squares(&points(|k| k.held)).at(batch),
                }
            })
            .collect();
        by_op.sort_by(|a, b| (b.read, b.held, &a.op).cmp(&(a.read, a.held, &b.op)));
        Kept { by_op }
    }

    /// The measured batches, in words.
    pub fn batches(&self) -> String {
        self.steps.iter().map(|s| s.batch.to_string()).collect::<Vec<_>>().join(", ")
    }

    /// Whether `batch` is one of the measured ones.
    pub fn was_measured(&self, batch: usize) -> bool {
        self.step_at(batch).is_some()
    }
}

#[cfg(test)]
mod tests;
