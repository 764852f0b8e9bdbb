//! What a model or trainer registers for `%mem` to show: the ledger's
//! prediction and what was measured, by bill, with the last step's timeline.

use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::error::MemoryError;
use super::{counters, region};
use crate::ledger::{BillKind, Ledger};

/// Bytes per bill, in the lesson's order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BillBytes {
    pub parameters: u64,
    pub optimizer_state: u64,
    pub activations: u64,
    pub input_batch: u64,
    pub context_and_workspace: u64,
}

impl BillBytes {
    pub fn get(&self, kind: BillKind) -> u64 {
        match kind {
            BillKind::Parameters => self.parameters,
            BillKind::OptimizerState => self.optimizer_state,
            BillKind::Activations => self.activations,
            BillKind::InputBatch => self.input_batch,
            BillKind::ContextAndWorkspace => self.context_and_workspace,
        }
    }

    pub fn set(&mut self, kind: BillKind, bytes: u64) {
        *match kind {
            BillKind::Parameters => &mut self.parameters,
            BillKind::OptimizerState => &mut self.optimizer_state,
            BillKind::Activations => &mut self.activations,
            BillKind::InputBatch => &mut self.input_batch,
            BillKind::ContextAndWorkspace => &mut self.context_and_workspace,
        } = bytes;
    }

    pub fn total(&self) -> u64 {
        BillKind::ALL.iter().map(|&k| self.get(k)).sum()
    }
}

/// One predicted phase of the step: resident after it, most held during it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PredictedPhase {
    pub name: String,
    pub resident: u64,
    pub peak: u64,
}

/// The ledger's prediction for one step. The bills are the peak's
/// composition (see [`crate::ledger::Peak::composition`]), so they sum to it
/// and compare with a measurement split the same way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prediction {
    pub bills: BillBytes,
    pub peak: u64,
    pub phases: Vec<PredictedPhase>,
}

impl Prediction {
    pub fn from_ledger(ledger: &Ledger) -> Prediction {
        let mut bills = BillBytes::default();
        for (kind, bytes) in BillKind::ALL.into_iter().zip(ledger.peak.composition()) {
            bills.set(kind, bytes);
        }
        Prediction {
            bills,
            peak: ledger.peak.bytes,
            phases: ledger
                .timeline
                .iter()
                .map(|p| PredictedPhase { name: p.name.clone(), resident: p.resident_bytes, peak: p.peak_bytes })
                .collect(),
        }
    }
}

/// One measured sample of a step: after a named phase, bytes by bill.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeasuredPhase {
    pub name: String,
    pub bills: BillBytes,
}

/// What one step really used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Measurement {
    pub bills: BillBytes,
    pub peak: u64,
    /// The last step's samples, in order.
    pub phases: Vec<MeasuredPhase>,
}

/// What `%mem` shows beside the live counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// What was registered: "resnet18, batch 32 at 64x64, f32, adam".
    pub label: String,
    pub predicted: Option<Prediction>,
    pub measured: Option<Measurement>,
}

/// Processes without the counters keep the snapshot here (each copy of the
/// crate its own; only the counters' region is shared with the kernel).
static LOCAL: Mutex<Option<Vec<u8>>> = Mutex::new(None);

/// Registers `snapshot` as this process's latest, where `%mem` reads it.
pub fn publish(snapshot: &Snapshot) -> Result<(), MemoryError> {
    let bytes = serde_json::to_vec(snapshot).map_err(|e| MemoryError::Snapshot { reason: e.to_string() })?;
    match counters::find() {
        Some(counters) => region::write_snapshot(counters, &bytes),
        None => {
            *LOCAL.lock().unwrap_or_else(|e| e.into_inner()) = Some(bytes);
            Ok(())
        }
    }
}

/// This process's latest published snapshot.
pub fn published() -> Option<Snapshot> {
    let bytes = match counters::find() {
        Some(counters) => region::read_snapshot(counters),
        None => LOCAL.lock().unwrap_or_else(|e| e.into_inner()).clone(),
    }?;
    serde_json::from_slice(&bytes).ok()
}

pub(crate) fn decode(bytes: &[u8]) -> Result<Snapshot, MemoryError> {
    serde_json::from_slice(bytes).map_err(|e| MemoryError::Snapshot { reason: e.to_string() })
}
