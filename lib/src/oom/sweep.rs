//! Peak memory against batch size or resolution.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::gpus::Card;
use crate::ledger::{estimate, LedgerError, StepConfig};
use crate::models::ModelSpec;
use crate::render::{Chart, Series, Table};
use crate::units::{grouped, human, percent};

use super::verdict::{verdict, Verdict};

const MAX_POINTS: usize = 64;
const GIB: f64 = (1u64 << 30) as f64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Axis {
    Batch,
    Resolution,
}

impl Axis {
    fn apply(self, base: &StepConfig, value: usize) -> StepConfig {
        match self {
            Axis::Batch => StepConfig { batch: value, ..base.clone() },
            Axis::Resolution => base.with_resolution(value),
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Axis::Batch => "batch",
            Axis::Resolution => "res",
        })
    }
}

/// `batch=8..64`, `res=128..512:32`, `batch=8,16,32`: an axis and its values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SweepSpec {
    pub axis: Axis,
    pub values: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad sweep `{text}`: {reason} (write batch=8..64, res=128..512:32 or batch=8,16,32)")]
pub struct SweepParseError {
    text: String,
    reason: String,
}

impl FromStr for SweepSpec {
    type Err = SweepParseError;

    /// A range without a step takes the smallest of 1, 2, 4, 8... (32, 64...
    /// for resolution) that gives at most 16 points.
    fn from_str(text: &str) -> Result<Self, SweepParseError> {
        let bad = |reason: &str| SweepParseError { text: text.to_owned(), reason: reason.to_owned() };
        let (axis, values) = text.split_once('=').ok_or_else(|| bad("missing `=`"))?;
        let axis = match axis.trim().to_ascii_lowercase().as_str() {
            "batch" | "b" => Axis::Batch,
            "res" | "resolution" | "r" => Axis::Resolution,
            other => return Err(bad(&format!("unknown axis `{other}`, expected batch or res"))),
        };
        let number = |s: &str| {
            s.trim().parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| bad(&format!("`{}` is not a positive whole number", s.trim())))
        };
        let values: Vec<usize> = if let Some((from, rest)) = values.split_once("..") {
            let (to, step) = match rest.split_once(':') {
                Some((to, step)) => (number(to)?, Some(number(step)?)),
                None => (number(rest)?, None),
            };
            let from = number(from)?;
            if to < from {
                return Err(bad("the range runs backwards"));
            }
            let smallest = if axis == Axis::Resolution { 32 } else { 1 };
            let step = step.unwrap_or_else(|| {
                let mut step = smallest;
                while (to - from) / step + 1 > 16 {
                    step *= 2;
                }
                step
            });
            let points = (to - from) / step + 1;
            if points > MAX_POINTS {
                return Err(bad(&format!("{points} points; at most {MAX_POINTS}")));
            }
            (from..=to).step_by(step).collect()
        } else {
            values.split(',').map(number).collect::<Result<_, _>>()?
        };
        if values.len() > MAX_POINTS {
            return Err(bad(&format!("{} points; at most {MAX_POINTS}", values.len())));
        }
        Ok(SweepSpec { axis, values })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SweepPoint {
    pub value: usize,
    pub peak_bytes: u64,
    pub verdict: Verdict,
}

/// The peak at each value of one axis, the rest of the configuration fixed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sweep {
    pub model: String,
    pub axis: Axis,
    pub device: Card,
    pub points: Vec<SweepPoint>,
}

pub fn sweep(spec: &ModelSpec, base: &StepConfig, device: &Card, plan: &SweepSpec) -> Result<Sweep, LedgerError> {
    let points = plan
        .values
        .iter()
        .map(|&value| {
            let ledger = estimate(spec, &plan.axis.apply(base, value), device)?;
            Ok(SweepPoint { value, peak_bytes: ledger.peak.bytes, verdict: verdict(ledger.peak.bytes, device) })
        })
        .collect::<Result<_, LedgerError>>()?;
    Ok(Sweep { model: spec.name.clone(), axis: plan.axis, device: device.clone(), points })
}

impl Sweep {
    pub fn chart(&self) -> Chart {
        Chart::new(format!("{}: peak memory vs {}", self.model, self.axis))
            .x_label(self.axis.to_string())
            .y_label("GiB")
            .series(Series::line("predicted peak", self.points.iter().map(|p| (p.value as f64, p.peak_bytes as f64 / GIB))))
            .series(Series::limit(format!("{} usable", self.device.name), self.device.usable_bytes as f64 / GIB))
    }

    pub fn table(&self) -> Table {
        let mut table = Table::new([self.axis.to_string().as_str(), "peak bytes", "peak", "% of card", "verdict"])
            .title(format!("sweep on {}", self.device))
            .right_align(&[0, 1, 2, 3]);
        for p in &self.points {
            table.push_row([
                p.value.to_string(),
                grouped(p.peak_bytes),
                human(p.peak_bytes),
                percent(p.peak_bytes, self.device.usable_bytes),
                p.verdict.to_string(),
            ]);
        }
        table
    }

    /// The largest swept value that fits comfortably.
    pub fn largest_fitting(&self) -> Option<usize> {
        self.points.iter().filter(|p| p.verdict == Verdict::Fits).map(|p| p.value).max()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ranges_steps_and_lists() {
        let spec: SweepSpec = "batch=8..64".parse().unwrap();
        assert_eq!(spec.values, [8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64]);
        let spec: SweepSpec = "res=128..512".parse().unwrap();
        assert_eq!(spec.axis, Axis::Resolution);
        assert_eq!(spec.values, (128..=512).step_by(32).collect::<Vec<_>>());
        assert_eq!("batch=8..64:8".parse::<SweepSpec>().unwrap().values, [8, 16, 24, 32, 40, 48, 56, 64]);
        assert_eq!("batch=8,16,32".parse::<SweepSpec>().unwrap().values, [8, 16, 32]);
    }

    #[test]
    fn bad_sweeps_say_what_is_wrong() {
        let err = "depth=1..4".parse::<SweepSpec>().unwrap_err().to_string();
        assert!(err.starts_with("bad sweep `depth=1..4`: unknown axis `depth`"), "{err}");
        assert!("batch=64..8".parse::<SweepSpec>().unwrap_err().to_string().contains("backwards"));
        assert!("batch=0..8".parse::<SweepSpec>().is_err());
        assert!("batch=1..1000:1".parse::<SweepSpec>().unwrap_err().to_string().contains("at most 64"));
    }
}
