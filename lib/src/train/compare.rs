//! A training step measured by bill, beside the ledger's prediction.
//!
//! The allocation counters give bytes in use after every phase and the exact
//! peak during it. The bills are the peak's composition, split the way the
//! ledger splits its predicted peak: at the end of the phase that held the
//! peak, parameters (weights, running statistics, the gradients then held),
//! optimizer state and the batch are read off the tensors themselves;
//! activations are everything else then in use; context and workspace is
//! what the peak held beyond that, the phase's transients.

use candle_core::Tensor;
use serde::Serialize;

use super::error::TrainError;
use super::events::StepReport;
use super::trainer::{tensor_bytes, Trainer};
use crate::ledger::{estimate, BillKind, Ledger, Levers, StepConfig, StepPhase};
use crate::memory::{BillBytes, MeasuredPhase, Measurement, Prediction, Snapshot};

/// One phase as measured: bytes in use after it (above what was there before
/// the model), and the most in use during it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PhaseSample {
    pub phase: StepPhase,
    pub name: String,
    pub in_use: u64,
    pub peak: u64,
    /// Bytes of the parameters' gradients held after it.
    pub gradients: u64,
}

/// A measured step: bills, peak and phases, all in bytes attributable to
/// training (what the process held before the model existed is left out).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MeasuredStep {
    /// The peak's composition: they sum to `peak`.
    pub bills: BillBytes,
    /// Gradients held at the peak (they are part of the parameters bill).
    pub gradients: u64,
    pub peak: u64,
    /// The phase during which the peak happened, and its name.
    pub peak_during: StepPhase,
    pub peak_phase: String,
    /// What forward added and kept until backward (the lesson's activations
    /// bill, whenever the peak happens): in use after the last forward phase
    /// less in use once the batch was copied.
    pub kept_by_forward: u64,
    pub phases: Vec<PhaseSample>,
    pub report: StepReport,
}

/// Predicted against measured, bill by bill.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub label: String,
    pub predicted: BillBytes,
    pub measured: BillBytes,
    pub predicted_peak: u64,
    pub measured_peak: u64,
    pub predicted_peak_phase: String,
    pub measured_peak_phase: String,
    pub predicted_kept_by_forward: u64,
    pub measured_kept_by_forward: u64,
    pub measured_gradients: u64,
    /// Both timelines, phase by phase, for `--json` readers.
    pub predicted_phases: Vec<crate::ledger::Phase>,
    pub measured_phases: Vec<PhaseSample>,
    /// The device the ledger predicted for, and how the measurement was read.
    pub device: String,
    pub measured_with: String,
    /// The fingerprint of the rules the prediction followed (`ledger::validation`), which a
    /// GPU run records beside its errors.
    pub device_rules: &'static str,
}

impl Comparison {
    /// `(measured - predicted) / predicted`, in percent; `None` when nothing was predicted.
    pub fn error_percent(predicted: u64, measured: u64) -> Option<f64> {
        (predicted > 0).then(|| (measured as f64 - predicted as f64) / predicted as f64 * 100.0)
    }

    pub fn peak_error_percent(&self) -> Option<f64> {
        Self::error_percent(self.predicted_peak, self.measured_peak)
    }

    /// Each bill's difference in percent of its prediction (`None` where
    /// nothing was predicted).
    pub fn bill_errors(&self) -> Vec<(BillKind, Option<f64>)> {
        BillKind::ALL.iter().map(|&kind| (kind, Self::error_percent(self.predicted.get(kind), self.measured.get(kind)))).collect()
    }

    pub fn table(&self) -> crate::render::Table {
        use crate::units::human;
        let pct = |p: Option<f64>| p.map_or("-".to_owned(), |p| format!("{p:+.1}%"));
        let mut table = crate::render::Table::new(["bill, at the peak", "predicted", "measured", "difference"])
            .title(format!("Predicted vs measured: {}", self.label))
            .right_align(&[1, 2, 3]);
        for kind in BillKind::ALL {
            let (p, m) = (self.predicted.get(kind), self.measured.get(kind));
            table.push_row([kind.to_string(), human(p), human(m), pct(Self::error_percent(p, m))]);
        }
        table.footer(["peak".to_owned(), human(self.predicted_peak), human(self.measured_peak), pct(self.peak_error_percent())]).note(
            format!(
                "Peak during \"{}\" (predicted: \"{}\"); gradients then held: {} (inside parameters); \
             workspace is what the peak's phase held only briefly. Predicted for {}; measured with {}.",
                self.measured_peak_phase,
                self.predicted_peak_phase,
                human(self.measured_gradients),
                self.device,
                self.measured_with,
            ),
        )
    }
}

impl Trainer {
    /// The levers this trainer pulls: its configuration's, on its network's layers.
    pub fn levers(&self) -> Levers {
        Levers { cards: self.cards(), ..self.config().levers(self.net().layers()) }
    }

    /// The ledger's prediction for this trainer's step at `batch` samples per micro-batch.
    pub fn predict(&self, batch: usize) -> Result<Ledger, TrainError> {
        let config = StepConfig { batch, input: self.net().input(), levers: self.levers(), mode: crate::ledger::Mode::Training };
        let device = crate::gpus::Card::for_device(self.net().device())?;
        Ok(estimate(self.net().spec(), &config, &device)?)
    }

    /// One optimizer step on `micro_batches`, measured phase by phase with the
    /// allocation counters. Fails when the process does not count allocations.
    pub fn measure_step(&mut self, micro_batches: &[(Tensor, Tensor)], epoch: usize) -> Result<MeasuredStep, TrainError> {
        let meter = self.meter().clone();
        if !meter.exact() {
            return Err(TrainError::NotCounting);
        }
        // Everything in use now besides the model and the batch (the notebook's
        // data, the runtime) is not the step's.
        let input: u64 = micro_batches.iter().map(|(x, y)| tensor_bytes(x) + tensor_bytes(y)).sum();
        let outside = self.outside(meter.in_use()?, micro_batches);
        let mut phases: Vec<PhaseSample> = Vec::new();
        let mut unread = None;
        let plan = self.plan().clone();
        let mut read_phase = |phase, gradients| {
            let read = || -> Result<(u64, Option<u64>), crate::memory::MemoryError> {
                let in_use = meter.in_use()?;
                let peak = meter.window_peak()?;
                meter.open_window()?;
                Ok((in_use, peak))
            };
            match read() {
                Ok((in_use, peak)) => phases.push(PhaseSample {
                    phase,
                    name: plan.name(phase),
                    in_use: in_use.saturating_sub(outside),
                    peak: peak.unwrap_or(in_use).saturating_sub(outside),
                    gradients,
                }),
                Err(error) => {
                    unread.get_or_insert(error);
                }
            }
        };
        let report = self.step_watched(micro_batches, epoch, &mut [&mut read_phase])?;
        if let Some(error) = unread {
            return Err(error.into());
        }
        let highest = phases.iter().max_by_key(|p| p.peak.max(p.in_use)).cloned().expect("every step reports its input phase");
        // On a GPU the device also holds the context, kernels and cuBLAS's
        // workspace outside the pool: part of the peak, as the ledger counts it.
        let beyond_pool = meter.outside_pool()?;
        let peak = highest.peak.max(highest.in_use) + beyond_pool;
        let model = self.net().param_bytes() + self.net().buffer_bytes();
        let optimizer_state = self.optimizer().state_bytes() as u64;
        let parameters = model + highest.gradients;
        let activations = highest.in_use.saturating_sub(parameters + optimizer_state + input);
        let bills = BillBytes {
            parameters,
            optimizer_state,
            activations,
            input_batch: input,
            context_and_workspace: peak.saturating_sub(parameters + optimizer_state + input + activations),
        };
        let gradients = highest.gradients;
        let after = |of: &dyn Fn(StepPhase) -> bool| phases.iter().rfind(|p| of(p.phase)).map_or(0, |p| p.in_use);
        let kept_by_forward = after(&StepPhase::is_forward).saturating_sub(after(&|p| p == StepPhase::InputCopied));
        Ok(MeasuredStep { bills, gradients, peak, peak_during: highest.phase, peak_phase: highest.name, kept_by_forward, phases, report })
    }

    /// Measures one step, compares it with the prediction, and publishes both
    /// for `%mem` (the prediction, the measurement and the step's timeline).
    pub fn measure_and_compare(&mut self, micro_batches: &[(Tensor, Tensor)]) -> Result<(MeasuredStep, Comparison), TrainError> {
        let batch = micro_batches.first().map_or(0, |(x, _)| x.dim(0).unwrap_or(0));
        let ledger = self.predict(batch)?;
        let measured = self.measure_step(micro_batches, 0)?;
        let label = format!("{}, {}", self.net().spec().name, ledger.config);
        let comparison = Comparison {
            label: label.clone(),
            predicted: Prediction::from_ledger(&ledger).bills,
            measured: measured.bills,
            predicted_peak: ledger.peak.bytes,
            measured_peak: measured.peak,
            predicted_peak_phase: ledger.peak.phase.clone(),
            measured_peak_phase: measured.peak_phase.clone(),
            predicted_kept_by_forward: ledger.kept_by_forward(),
            measured_kept_by_forward: measured.kept_by_forward,
            measured_gradients: measured.gradients,
            predicted_phases: ledger.timeline.clone(),
            measured_phases: measured.phases.clone(),
            device: ledger.device.name.clone(),
            measured_with: self.meter().source().to_owned(),
            device_rules: crate::ledger::validation::device_rules(),
        };
        let snapshot = Snapshot {
            label,
            predicted: Some(Prediction::from_ledger(&ledger)),
            measured: Some(Measurement {
                bills: measured.bills,
                peak: measured.peak,
                phases: measured.phases.iter().map(|p| MeasuredPhase { name: p.name.clone(), bills: phase_bills(p, &measured) }).collect(),
            }),
        };
        crate::memory::publish(&snapshot)?;
        Ok((measured, comparison))
    }
}

/// A phase's bytes split by bill: the model's state as measured, the rest
/// of what was in use as activations and the excess of the phase's peak as workspace.
fn phase_bills(phase: &PhaseSample, step: &MeasuredStep) -> BillBytes {
    let model = step.bills.parameters - step.gradients + phase.gradients;
    let input = step.bills.input_batch;
    let rest = phase.in_use.saturating_sub(model + step.bills.optimizer_state + input);
    BillBytes {
        parameters: model,
        optimizer_state: step.bills.optimizer_state,
        activations: rest,
        input_batch: input,
        context_and_workspace: phase.peak.saturating_sub(phase.in_use),
    }
}
