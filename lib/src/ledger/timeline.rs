//! The step as a sequence of phases, with what is resident in each.

use serde::Serialize;

use super::bill::BillKind;
use super::plan::{StepPhase, StepPlan};

/// Everything that can be resident during a step, each in one bill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    Context,
    Weights,
    Buffers,
    Gradients,
    AccumulatedGradients,
    AmpWeightCopies,
    OptimizerState,
    Activations,
    Recompute,
    PassedGradient,
    Images,
    Labels,
    Workspace,
    BackwardTemporaries,
    OptimizerTemporaries,
    GatheredWeights,
    Bucket,
    Collective,
}

impl Part {
    const COUNT: usize = 18;
    const ALL: [Part; Part::COUNT] = [
        Part::Context,
        Part::Weights,
        Part::Buffers,
        Part::Gradients,
        Part::AccumulatedGradients,
        Part::AmpWeightCopies,
        Part::OptimizerState,
        Part::Activations,
        Part::Recompute,
        Part::PassedGradient,
        Part::Images,
        Part::Labels,
        Part::Workspace,
        Part::BackwardTemporaries,
        Part::OptimizerTemporaries,
        Part::GatheredWeights,
        Part::Bucket,
        Part::Collective,
    ];

    pub fn bill(self) -> BillKind {
        match self {
            Part::Weights | Part::Buffers | Part::Gradients | Part::AccumulatedGradients | Part::GatheredWeights => BillKind::Parameters,
            Part::OptimizerState => BillKind::OptimizerState,
            Part::Activations | Part::AmpWeightCopies | Part::Recompute | Part::PassedGradient => BillKind::Activations,
            Part::Images | Part::Labels => BillKind::InputBatch,
            Part::Context | Part::Workspace | Part::BackwardTemporaries | Part::OptimizerTemporaries | Part::Bucket | Part::Collective => {
                BillKind::ContextAndWorkspace
            }
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Part::Context => "CUDA context",
            Part::Weights => "weights",
            Part::Buffers => "batch-norm running statistics",
            Part::Gradients => "gradients",
            Part::AccumulatedGradients => "accumulated gradients",
            Part::AmpWeightCopies => "half-precision weight copies",
            Part::OptimizerState => "optimizer state",
            Part::Activations => "activations",
            Part::Recompute => "checkpointed segment graph",
            Part::PassedGradient => "gradient passed to the segment below",
            Part::Images => "images",
            Part::Labels => "labels",
            Part::Workspace => "conv workspace",
            Part::BackwardTemporaries => "backward temporaries",
            Part::OptimizerTemporaries => "optimizer temporaries",
            Part::GatheredWeights => "weights gathered from the other cards",
            Part::Bucket => "bucket exchanged with the other cards",
            Part::Collective => "collective library's buffers",
        }
    }
}

/// Bytes per [`Part`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Parts([u64; Part::COUNT]);

impl Parts {
    pub fn get(&self, part: Part) -> u64 {
        self.0[part as usize]
    }

    pub fn set(&mut self, part: Part, bytes: u64) {
        self.0[part as usize] = bytes;
    }

    pub fn add(&mut self, part: Part, bytes: u64) {
        self.0[part as usize] += bytes;
    }

    pub fn remove(&mut self, part: Part, bytes: u64) {
        self.0[part as usize] = self.0[part as usize].saturating_sub(bytes);
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    pub fn plus(&self, other: &Parts) -> Parts {
        let mut sum = *self;
        for (a, b) in sum.0.iter_mut().zip(other.0) {
            *a += b;
        }
        sum
    }

    pub fn lines(&self) -> Vec<PeakLine> {
        Part::ALL
            .iter()
            .filter(|&&p| self.get(p) > 0)
            .map(|&p| PeakLine { part: p, bill: p.bill(), label: p.label(), bytes: self.get(p) })
            .collect()
    }
}

/// One phase of the step: what stays resident after it and the most held during it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Phase {
    pub phase: StepPhase,
    pub name: String,
    pub resident_bytes: u64,
    pub peak_bytes: u64,
}

/// One part of memory at the peak; the lines of a [`Peak`] sum to its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeakLine {
    pub part: Part,
    pub bill: BillKind,
    pub label: &'static str,
    pub bytes: u64,
}

/// The highest memory of the step, where it happens, and what it is made of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Peak {
    pub bytes: u64,
    /// The name of the phase during which it happens.
    pub phase: String,
    pub during: StepPhase,
    pub breakdown: Vec<PeakLine>,
    /// What stays resident once the peak's phase ends; the rest of the peak
    /// was transient.
    pub resident: Vec<PeakLine>,
}

impl Peak {
    /// The part of the peak that belongs to one bill.
    pub fn bill(&self, kind: BillKind) -> u64 {
        sum_of(&self.breakdown, kind)
    }

    /// The peak split as a measurement can split it: each bill's bytes still
    /// resident when the peak's phase ends, and everything transient in that
    /// phase counted as workspace, so the five sum to the peak.
    pub fn composition(&self) -> [u64; 5] {
        let mut bills = BillKind::ALL.map(|kind| sum_of(&self.resident, kind));
        let workspace = BillKind::ContextAndWorkspace as usize;
        let others: u64 = bills.iter().enumerate().filter(|&(i, _)| i != workspace).map(|(_, b)| b).sum();
        bills[workspace] = self.bytes.saturating_sub(others);
        bills
    }
}

fn sum_of(lines: &[PeakLine], kind: BillKind) -> u64 {
    lines.iter().filter(|l| l.bill == kind).map(|l| l.bytes).sum()
}

/// Records the phases of a plan and keeps the highest.
pub(crate) struct Recorder<'a> {
    plan: &'a StepPlan,
    pub phases: Vec<Phase>,
    peak: Option<(u64, StepPhase, Parts, Parts)>,
}

impl<'a> Recorder<'a> {
    pub fn new(plan: &'a StepPlan) -> Self {
        Recorder { plan, phases: Vec::new(), peak: None }
    }

    /// Records a phase whose resident set after it is `resident` and which
    /// briefly also holds `transient`.
    pub fn phase(&mut self, phase: StepPhase, resident: &Parts, transient: &Parts) {
        self.phase_during(phase, resident, resident.plus(transient));
    }

    /// Records a phase that holds `during` at its highest and `resident` after it.
    pub fn phase_during(&mut self, phase: StepPhase, resident: &Parts, during: Parts) {
        let peak_bytes = during.total();
        if self.peak.as_ref().is_none_or(|(bytes, ..)| peak_bytes > *bytes) {
            self.peak = Some((peak_bytes, phase, during, *resident));
        }
        self.phases.push(Phase { phase, name: self.plan.name(phase), resident_bytes: resident.total(), peak_bytes });
    }

    pub fn finish(self) -> (Vec<Phase>, Peak) {
        let (bytes, during, at_peak, resident) = self.peak.unwrap_or((0, StepPhase::Loaded, Parts::default(), Parts::default()));
        (self.phases, Peak { bytes, phase: self.plan.name(during), during, breakdown: at_peak.lines(), resident: resident.lines() })
    }
}
