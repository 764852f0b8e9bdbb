//! What PyTorch keeps for the same training steps, as `scripts/bench_saved.py --record` measured it
//! beside vramlab's layers on this project's machine. The record is committed in
//! `benchmarks/pytorch-saved.json` and compiled in, so that a notebook sets a measurement beside
//! PyTorch's by reading the record, never from a figure copied into its code or prose.
//!
//! # The room
//!
//! What PyTorch keeps for the same steps, as `scripts/bench_saved.py --record` measured it beside
//! our layers: `benchmarks/pytorch-saved.json`, compiled in, which notebooks read instead of
//! copying figures.

use serde::Deserialize;

const RECORD: &str = include_str!("../../benchmarks/pytorch-saved.json");

/// One step measured in both frameworks: torchvision's model (or the U-Net's twin) in f32 with SGD
/// and momentum on the CPU, and vramlab's lean and plain layers on the same model, batch and size.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PeerStep {
    pub model: String,
    pub batch: usize,
    pub res: usize,
    pub classes: usize,
    /// Bytes forward keeps for backward: PyTorch's unique saved storages, vramlab's counted bytes.
    pub kept_by_forward: KeptBytes,
    /// The step's peak: vramlab's counted bytes in use, PyTorch's resident set (an upper bound).
    pub peak: PeakBytes,
    pub date: String,
    pub torch: String,
    pub cpu: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct KeptBytes {
    pub lean: u64,
    pub plain: u64,
    pub pytorch: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct PeakBytes {
    pub lean: u64,
    pub plain: u64,
    pub pytorch_rss: u64,
}

#[derive(Deserialize)]
struct Record {
    rows: Vec<PeerStep>,
}

/// Every recorded step.
pub fn recorded() -> Vec<PeerStep> {
    parse(RECORD)
}

/// The recorded step of `model` (the zoo's name, `resnet50`) at this batch and side, if measured.
pub fn recorded_step(model: &str, batch: usize, res: usize) -> Option<PeerStep> {
    recorded().into_iter().find(|step| step.model == model && step.batch == batch && step.res == res)
}

fn parse(record: &str) -> Vec<PeerStep> {
    // The record is this crate's own file, read by its tests: a malformed one fails them.
    serde_json::from_str::<Record>(record).map(|record| record.rows).unwrap_or_default()
}

impl PeerStep {
    /// What the lean layers keep for backward, as a share of what PyTorch keeps.
    pub fn lean_over_pytorch(&self) -> f64 {
        self.kept_by_forward.lean as f64 / self.kept_by_forward.pytorch as f64
    }

    /// What PyTorch keeps per image.
    pub fn pytorch_per_image(&self) -> u64 {
        self.kept_by_forward.pytorch / self.batch.max(1) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_record_reads_and_every_step_has_its_figures() {
        let steps = recorded();
        assert!(!steps.is_empty(), "benchmarks/pytorch-saved.json has no rows, or does not parse");
        for step in &steps {
            let kept = step.kept_by_forward;
            assert!(kept.lean > 0 && kept.plain > 0 && kept.pytorch > 0, "{step:?}");
            assert!(step.peak.lean > kept.lean && step.peak.plain > kept.plain, "{step:?}");
            assert_eq!(recorded_step(&step.model, step.batch, step.res).as_ref(), Some(step));
        }
    }

    #[test]
    fn a_step_is_found_by_model_batch_and_side_only() {
        let record = r#"{"rows": [{"model": "resnet50", "batch": 8, "res": 224, "classes": 1000,
            "kept_by_forward": {"lean": 540000000, "plain": 1200000000, "pytorch": 683000000},
            "peak": {"lean": 1000000000, "plain": 1700000000, "pytorch_rss": 1500000000},
            "date": "2026-12-06 23:55 UTC", "torch": "2.15.0", "cpu": "x", "threads": 2, "optimizer": "SGD with momentum", "dtype": "f32"}]}"#;
        let steps = parse(record);
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].pytorch_per_image(), 683000000 / 8);
        assert!((steps[0].lean_over_pytorch() - 540.0 / 683.0).abs() < 1e-12);
        assert!(parse("{}").is_empty());
    }
}
