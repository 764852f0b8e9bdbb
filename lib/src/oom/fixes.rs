//! Concrete configurations that fit, each with what it costs.

use std::fmt;

use serde::Serialize;

use crate::gpus::Card;
use crate::ledger::{estimate, Cards, Checkpointing, Levers, OptimizerKind, Shard, StepConfig};
use crate::models::{analyze, ModelSpec, Precision};

use super::verdict::target_bytes;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FixKind {
    MixedPrecision,
    Accumulation,
    Checkpointing,
    Sgd,
    Adam8bit,
    SmallerResolution,
    LargestBatch,
    Combined,
    /// More cards, each with its share of the batch, and what they shard.
    SeveralCards,
}

/// The card counts offered when the step is spread over more cards.
const CARD_COUNTS: [usize; 6] = [2, 4, 8, 16, 32, 64];
/// What each doubling of the cards weighs in a fix's score: a second card
/// ranks after the free and low-risk levers, before any that risks accuracy.
const CARDS_DOUBLING_WEIGHT: f64 = 15.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Risk {
    None,
    Low,
    Medium,
    High,
}

impl Risk {
    fn weight(self) -> f64 {
        match self {
            Risk::None => 0.0,
            Risk::Low => 1.0,
            Risk::Medium => 3.0,
            Risk::High => 5.0,
        }
    }
}

impl fmt::Display for Risk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Risk::None => "none",
            Risk::Low => "low",
            Risk::Medium => "medium",
            Risk::High => "high",
        })
    }
}

/// What a fix costs besides memory.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FixCost {
    /// Estimated change of the time per sample, in percent (negative is faster).
    pub extra_time_pct: i32,
    pub accuracy_risk: Risk,
    pub effective_batch: usize,
    pub effective_batch_kept: bool,
    /// Why it costs what it costs.
    pub note: String,
}

impl FixCost {
    /// Lower is cheaper: accuracy risk weighs most, then a changed effective
    /// batch (the recipe's learning rate no longer matches), then time. A
    /// speed-up counts for at most 10%: running faster does not buy back accuracy.
    pub fn score(&self) -> f64 {
        10.0 * self.accuracy_risk.weight()
            + if self.effective_batch_kept { 0.0 } else { 15.0 }
            + f64::from(self.extra_time_pct.max(-10)) / 5.0
    }
}

/// A configuration that fits, its predicted peak and its cost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fix {
    pub kind: FixKind,
    /// What changes, in words (`f16 mixed precision`, `batch 8 x 4 accumulation steps`).
    pub change: String,
    pub config: StepConfig,
    pub peak_bytes: u64,
    pub cost: FixCost,
}

impl Fix {
    /// What ranks the fixes of `base`, lower first: the cost's score and
    /// what the fix's cards cost beyond the base's.
    pub fn score(&self, base: &StepConfig) -> f64 {
        let more = self.config.levers.cards.count as f64 / base.levers.cards.count as f64;
        self.cost.score() + CARDS_DOUBLING_WEIGHT * more.log2()
    }
}

struct Search<'a> {
    spec: &'a ModelSpec,
    base: &'a StepConfig,
    device: &'a Card,
    target: u64,
    base_macs: u64,
}

impl Search<'_> {
    /// The peak of `config`, or `None` when the model can't take it.
    fn peak(&self, config: &StepConfig) -> Option<u64> {
        estimate(self.spec, config, self.device).ok().map(|l| l.peak.bytes)
    }

    fn fitting(&self, config: StepConfig) -> Option<(StepConfig, u64)> {
        let peak = self.peak(&config)?;
        (peak <= self.target).then_some((config, peak))
    }

    fn fix(
        &self,
        kind: FixKind,
        change: String,
        found: Option<(StepConfig, u64)>,
        cost: impl FnOnce(&StepConfig) -> FixCost,
    ) -> Option<Fix> {
        let (config, peak_bytes) = found?;
        let cost = cost(&config);
        Some(Fix { kind, change, config, peak_bytes, cost })
    }

    fn kept(&self, extra_time_pct: i32, accuracy_risk: Risk, note: impl Into<String>) -> FixCost {
        FixCost {
            extra_time_pct,
            accuracy_risk,
            effective_batch: self.base.effective_batch(),
            effective_batch_kept: true,
            note: note.into(),
        }
    }

    fn amp_precision(&self) -> Precision {
        if self.device.bf16 {
            Precision::Bf16Amp
        } else {
            Precision::F16Amp
        }
    }

    fn mixed_precision(&self) -> Option<Fix> {
        if self.base.levers.precision.is_mixed() {
            return None;
        }
        let precision = self.amp_precision();
        let found = self.fitting(StepConfig { levers: Levers { precision, ..self.base.levers.clone() }, ..self.base.clone() });
        let (time, note) = if self.device.is_cpu() {
            (900, "half precision on a CPU without half units is many times slower")
        } else if self.device.tensor_cores {
            (-30, "tensor cores run half-precision convs faster; batch-norm stays in f32")
        } else {
            (0, "no tensor cores: memory saved, no speed-up")
        };
        let (risk, note) = match precision {
            Precision::F16Amp => (Risk::Low, format!("{note}; f16 needs loss scaling against underflow")),
            _ => (Risk::Low, note.to_owned()),
        };
        self.fix(FixKind::MixedPrecision, format!("{precision}"), found, |_| self.kept(time, risk, note))
    }

    fn accumulation(&self) -> Option<Fix> {
        let batch = self.base.batch;
        let found = (2..=batch).filter(|&d| batch.is_multiple_of(d)).find_map(|d| {
            self.fitting(StepConfig {
                batch: batch / d,
                levers: Levers { accumulation: self.base.levers.accumulation * d, ..self.base.levers.clone() },
                ..self.base.clone()
            })
        });
        let micro = found.as_ref().map(|(c, _)| c.batch).unwrap_or(batch);
        let change =
            found.as_ref().map(|(c, _)| format!("batch {} x {} accumulation steps", c.batch, c.levers.accumulation)).unwrap_or_default();
        self.fix(FixKind::Accumulation, change, found, |_| {
            let steps = (batch / micro.max(1)) as f64;
            let time = (5.0 * steps.log2()).round() as i32;
            let risk = bn_risk(micro);
            self.kept(time, risk, format!("same effective batch; batch-norm statistics over {micro} samples"))
        })
    }

    fn checkpointing(&self) -> Option<Fix> {
        let cost = analyze(self.spec, self.base.input, self.base.levers.precision, self.base.levers.layers).ok()?;
        let already = self.base.levers.checkpointing.resolve(&cost.stages).ok()?;
        let last = cost.stages.len().saturating_sub(1);
        let mut candidates: Vec<usize> = (0..last).filter(|&i| !already[i]).collect();
        candidates.sort_by_key(|&i| std::cmp::Reverse(cost.stages[i].cost.saved_bytes));
        let mut chosen = already.clone();
        for i in candidates {
            chosen[i] = true;
            let names: Vec<String> = (0..cost.stages.len()).filter(|&j| chosen[j]).map(|j| cost.stages[j].name.clone()).collect();
            let config = StepConfig {
                levers: Levers { checkpointing: Checkpointing::Segments(names.clone()), ..self.base.levers.clone() },
                ..self.base.clone()
            };
            if let Some(found) = self.fitting(config) {
                let macs: u64 = (0..cost.stages.len()).filter(|&j| chosen[j]).map(|j| cost.stages[j].cost.macs).sum();
                let time = (100.0 * macs as f64 / self.base_macs.max(1) as f64 / 3.0).round() as i32;
                return self.fix(FixKind::Checkpointing, format!("checkpoint {}", names.join(", ")), Some(found), |_| {
                    self.kept(time, Risk::None, "those stages' forward runs twice; results are identical")
                });
            }
        }
        None
    }

    fn optimizer(&self, optimizer: OptimizerKind, kind: FixKind) -> Option<Fix> {
        if !self.base.levers.optimizer.is_adam() || self.base.levers.optimizer == optimizer {
            return None;
        }
        let found = self.fitting(StepConfig { levers: Levers { optimizer, ..self.base.levers.clone() }, ..self.base.clone() });
        self.fix(kind, format!("{optimizer} instead of {}", self.base.levers.optimizer), found, |_| match optimizer {
            OptimizerKind::Adam8bit => self.kept(5, Risk::Low, "moments quantised block-wise; matches 32-bit Adam in published results"),
            _ => self.kept(-2, Risk::Medium, "the learning rate must be retuned; Adam-tuned recipes may converge slower"),
        })
    }

    fn smaller_resolution(&self) -> Option<Fix> {
        let current = self.base.resolution();
        let found = largest_fitting(current.saturating_sub(1) / 32, |k| self.fitting(self.base.with_resolution(32 * k)))?;
        let r = found.0.resolution();
        let time = (100.0 * ((r * r) as f64 / (current * current) as f64 - 1.0)).round() as i32;
        let risk = if 4 * r < 3 * current { Risk::High } else { Risk::Medium };
        self.fix(FixKind::SmallerResolution, format!("resolution {r} instead of {current}"), Some(found), |_| {
            self.kept(time, risk, "fine detail (small lesions, thin structures) is lost")
        })
    }

    fn largest_batch(&self) -> Option<Fix> {
        let found = largest_fitting(self.base.batch - 1, |b| self.fitting(StepConfig { batch: b, ..self.base.clone() }))?;
        let b = found.0.batch;
        self.fix(FixKind::LargestBatch, format!("batch {b} instead of {}", self.base.batch), Some(found), |config| FixCost {
            extra_time_pct: (5.0 * (self.base.batch as f64 / b as f64).log2()).round() as i32,
            accuracy_risk: bn_risk(b).max(Risk::Medium),
            effective_batch: config.effective_batch(),
            effective_batch_kept: false,
            note: "scale the learning rate with the batch".to_owned(),
        })
    }

    /// The step spread over more cards, each running its share of the
    /// same samples: for each sharding stage from the base's on, the fewest
    /// cards that fit, offered only where the stage needs fewer cards than
    /// the stages below it.
    fn several_cards(&self) -> Vec<Fix> {
        let base = self.base.levers.cards;
        let samples = self.base.batch * base.count;
        let mut fewest = usize::MAX;
        let mut fixes = Vec::new();
        for shard in Shard::ALL.into_iter().filter(|&s| s >= base.shard) {
            let counts = CARD_COUNTS.iter().filter(|&&n| n >= base.count && n < fewest && samples.is_multiple_of(n));
            let found = counts.filter(|&&n| (n, shard) != (base.count, base.shard)).find_map(|&count| {
                let cards = Cards { count, shard, ..base };
                self.fitting(StepConfig {
                    batch: samples / count,
                    levers: Levers { cards, ..self.base.levers.clone() },
                    ..self.base.clone()
                })
            });
            let Some((config, _)) = &found else { continue };
            let (count, batch) = (config.levers.cards.count, config.batch);
            fewest = count;
            // Per sample: the cards share the samples; the exchange costs
            // about a tenth of a step, ZeRO-3's gathers half as much again.
            let exchange = if shard == Shard::Parameters { 1.15 } else { 1.1 };
            let time = (100.0 * (base.count as f64 / count as f64 * exchange - 1.0)).round() as i32;
            let change = format!("{count} cards, {}: batch {batch} on each", shard.name());
            let note = format!("{count} cards instead of {}; batch-norm statistics over each card's {batch} samples", base.count);
            fixes.extend(self.fix(FixKind::SeveralCards, change, found, |_| self.kept(time, bn_risk(batch), note)));
        }
        fixes
    }

    /// When no single change fits: the cheap levers together, then accumulation.
    fn combined(&self) -> Option<Fix> {
        let mut config = self.base.clone();
        let mut changes = Vec::new();
        let mut time = 0;
        let mut risk = Risk::None;
        if !config.levers.precision.is_mixed() {
            config.levers.precision = self.amp_precision();
            changes.push(format!("{}", config.levers.precision));
            time += if self.device.tensor_cores { -30 } else { 0 };
            risk = Risk::Low;
        }
        config.levers.checkpointing = Checkpointing::Stages;
        changes.push("checkpoint every stage".to_owned());
        time += 33;
        if config.levers.optimizer.is_adam() {
            config.levers.optimizer = OptimizerKind::Adam8bit;
            changes.push("8-bit Adam".to_owned());
            time += 5;
            risk = risk.max(Risk::Low);
        }
        let batch = config.batch;
        let found = (1..=batch).filter(|&d| batch.is_multiple_of(d)).find_map(|d| {
            self.fitting(StepConfig {
                batch: batch / d,
                levers: Levers { accumulation: config.levers.accumulation * d, ..config.levers.clone() },
                ..config.clone()
            })
        })?;
        if found.0.levers.accumulation > config.levers.accumulation {
            changes.push(format!("batch {} x {} accumulation steps", found.0.batch, found.0.levers.accumulation));
            time += (5.0 * ((found.0.levers.accumulation / config.levers.accumulation) as f64).log2()).round() as i32;
            risk = risk.max(bn_risk(found.0.batch));
        }
        self.fix(FixKind::Combined, changes.join(" + "), Some(found), |_| self.kept(time, risk, "several levers at once"))
    }
}

/// Batch-norm statistics get noisy on small batches.
pub(crate) fn bn_risk(batch: usize) -> Risk {
    match batch {
        0..=3 => Risk::High,
        4..=15 => Risk::Medium,
        _ => Risk::Low,
    }
}

/// Binary search over `1..=largest` for the largest value that fits,
/// assuming memory grows with the value: a logarithmic number of estimates
/// whatever the range.
fn largest_fitting<T>(largest: usize, mut fits: impl FnMut(usize) -> Option<T>) -> Option<T> {
    let (mut lo, mut hi) = (1, largest.saturating_add(1));
    let mut best = None;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match fits(mid) {
            Some(found) => {
                best = Some(found);
                lo = mid + 1;
            }
            None => hi = mid,
        }
    }
    best
}

/// Every single fix that brings `base` under 90% of `device`, cheapest first;
/// a combination of levers when no single change keeps the recipe (only a
/// smaller batch or resolution fits); and the fewest cards of each sharding
/// stage that fit, ranked with the rest by what the cards cost.
pub fn search(spec: &ModelSpec, base: &StepConfig, device: &Card) -> Vec<Fix> {
    let base_macs = analyze(spec, base.input, base.levers.precision, base.levers.layers).map(|c| c.total.macs).unwrap_or(1);
    let s = Search { spec, base, device, target: target_bytes(device), base_macs };
    let mut fixes: Vec<Fix> = [
        s.mixed_precision(),
        s.accumulation(),
        s.checkpointing(),
        s.optimizer(OptimizerKind::Adam8bit, FixKind::Adam8bit),
        s.optimizer(OptimizerKind::SgdMomentum, FixKind::Sgd),
        s.smaller_resolution(),
        s.largest_batch(),
    ]
    .into_iter()
    .flatten()
    .collect();
    if fixes.iter().all(|f| f.kind == FixKind::LargestBatch || f.kind == FixKind::SmallerResolution) {
        fixes.extend(s.combined());
    }
    fixes.extend(s.several_cards());
    fixes.sort_by(|a, b| a.score(base).total_cmp(&b.score(base)).then(a.peak_bytes.cmp(&b.peak_bytes)));
    fixes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn largest_fitting_finds_the_boundary() {
        assert_eq!(largest_fitting(99, |v| (v <= 37).then_some(v)), Some(37));
        assert_eq!(largest_fitting(99, |v| (v == 0).then_some(v)), None);
        assert_eq!(largest_fitting(99, Some), Some(99));
        assert_eq!(largest_fitting(0, Some), None);
        let mut asked = 0;
        assert_eq!(
            largest_fitting(usize::MAX - 1, |v| {
                asked += 1;
                (v <= 1 << 40).then_some(v)
            }),
            Some(1 << 40)
        );
        assert!(asked <= 65, "{asked} estimates");
    }

    #[test]
    fn risk_dominates_the_score() {
        let cost = |time, risk, kept| FixCost {
            extra_time_pct: time,
            accuracy_risk: risk,
            effective_batch: 32,
            effective_batch_kept: kept,
            note: String::new(),
        };
        assert!(cost(33, Risk::None, true).score() < cost(0, Risk::Medium, true).score());
        assert!(cost(0, Risk::Medium, true).score() < cost(0, Risk::Medium, false).score());
    }
}
