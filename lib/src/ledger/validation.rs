//! How the ledger's rules for a card's step were last checked on a real card.
//!
//! A GPU run records what it measured in `benchmarks/card-validation.json`
//! (`scripts/gpu_report.py DIR --record`): the card, the date, the build, the
//! fingerprint of the rules that build followed, and how far its measured peaks
//! fell from the predicted ones. The record is compiled in. Every card verdict
//! carries a line saying so until a run of this build's rules (the same
//! fingerprint, `VRAMLAB_DEVICE_RULES`, from build.rs) measured every peak
//! within [`TOLERANCE_PERCENT`] of the prediction.

use serde::Deserialize;

use crate::gpus::{Card, CardKind};

/// How far a measured peak may fall from the prediction for the card figures to stand unqualified.
pub const TOLERANCE_PERCENT: f64 = 5.0;

const RECORD: &str = include_str!("../../../benchmarks/card-validation.json");

/// A GPU run's measurement of the ledger's predicted steps.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CardRun {
    /// The fingerprint of the rules the run's build followed; `None` for a build before fingerprints.
    pub device_rules: Option<String>,
    pub card: String,
    pub date: String,
    pub build: String,
    pub configurations: usize,
    /// The smallest and largest `(measured - predicted) / predicted` of the peaks, in percent.
    pub peak_error_percent: (f64, f64),
}

/// The fingerprint of this build's rules for a card's step.
pub fn device_rules() -> &'static str {
    env!("VRAMLAB_DEVICE_RULES")
}

/// The last recorded card run; `None` where no card has run the ledger's steps.
pub fn last_card_run() -> Option<CardRun> {
    parse(RECORD)
}

fn parse(record: &str) -> Option<CardRun> {
    serde_json::from_str::<Option<CardRun>>(record).ok().flatten()
}

/// The line a verdict on `card` carries: `None` on the CPU and on a simulated
/// budget, whose figures are measured here, and where a card run of this
/// build's rules measured every peak within the tolerance.
pub fn card_caveat(card: &Card) -> Option<String> {
    match card.kind {
        CardKind::Cpu | CardKind::Simulated => None,
        CardKind::Catalogue | CardKind::Sized => caveat(last_card_run().as_ref(), device_rules()),
    }
}

fn caveat(run: Option<&CardRun>, rules: &str) -> Option<String> {
    let Some(run) = run else {
        return Some("A prediction: no card has run the ledger's steps yet, so these card figures are unmeasured.".into());
    };
    let errors = describe(run.peak_error_percent);
    if run.device_rules.as_deref() != Some(rules) {
        return Some(format!(
            "A prediction: this build's rules for a card's step have not been measured on a card (the last card run, on an \
             {} on {} with {}, measured peaks {errors} its ledger's).",
            run.card, run.date, run.build
        ));
    }
    let (low, high) = run.peak_error_percent;
    if low.abs() <= TOLERANCE_PERCENT && high.abs() <= TOLERANCE_PERCENT {
        return None;
    }
    Some(format!(
        "A prediction: this build's rules measured on an {} on {} ({} steps) gave peaks {errors} the ledger's, beyond the {}% \
         they aim for.",
        run.card, run.date, run.configurations, TOLERANCE_PERCENT
    ))
}

/// `22-244% above`, `3% below to 12% above`, `2-4% below`.
fn describe((low, high): (f64, f64)) -> String {
    let side = |p: f64| if p < 0.0 { "below" } else { "above" };
    if (low < 0.0) == (high < 0.0) {
        let (a, b) = if low < 0.0 { (high.abs(), low.abs()) } else { (low, high) };
        format!("{a:.0}-{b:.0}% {}", side(low))
    } else {
        format!("{:.0}% {} to {:.0}% {}", low.abs(), side(low), high.abs(), side(high))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(rules: Option<&str>, errors: (f64, f64)) -> CardRun {
        CardRun {
            device_rules: rules.map(str::to_owned),
            card: "NVIDIA H100".into(),
            date: "2026-12-07".into(),
            build: "build abc".into(),
            configurations: 18,
            peak_error_percent: errors,
        }
    }

    #[test]
    fn the_committed_record_reads_and_a_card_verdict_says_what_it_is() {
        let committed = last_card_run().expect("benchmarks/card-validation.json reads");
        assert_eq!(committed.configurations, 18);
        let line = card_caveat(&Card::parse("rtx4060-laptop").unwrap()).expect("no run measured this build's rules");
        assert!(line.contains("not been measured on a card") && line.contains("22-244% above"), "{line}");
        assert_eq!(card_caveat(&Card::parse("cpu").unwrap()), None);
    }

    #[test]
    fn the_line_goes_only_when_the_same_rules_measured_within_five_percent() {
        assert_eq!(caveat(Some(&run(Some("f00"), (-2.0, 4.9))), "f00"), None);
        let beyond = caveat(Some(&run(Some("f00"), (-3.0, 12.0))), "f00").unwrap();
        assert!(beyond.contains("3% below to 12% above") && beyond.contains("5%"), "{beyond}");
        let other = caveat(Some(&run(Some("f00"), (-2.0, 4.9))), "ba5").unwrap();
        assert!(other.contains("not been measured") && other.contains("2% below to 5% above"), "{other}");
        assert!(caveat(None, "f00").unwrap().contains("no card has run"));
        assert_eq!(describe((-4.0, -2.0)), "2-4% below");
    }

    #[test]
    fn a_record_of_no_run_is_null() {
        assert_eq!(parse("null"), None);
    }
}
