//! A measured model as a report: what forward keeps for backward, the bills
//! at the measured batches and at the batch asked for, and, against a card,
//! the verdict and the fixes that need no spec.

use crate::ledger::validation::card_caveat;
use serde::Serialize;

use super::{Measured, PartBills, Scenario};
use crate::gpus::Card;
use crate::ledger::{BillKind, OptimizerKind};
use crate::oom::{bn_risk, target_bytes, verdict, FixCost, FixKind, Risk, Verdict};
use crate::render::{Bundle, Composer, Render, Table};
use crate::units::{human, percent};

/// What `%summary VAR --input` and `%oomcheck VAR --input` show.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModuleReport {
    /// How the learner named the model (the cell's variable).
    pub model: String,
    pub measured: Measured,
    /// The batch asked for, and the peak of a step at it on the measured device.
    pub batch: usize,
    pub peak: PartBills,
    /// The verdict on a card, when one was asked for.
    pub card: Option<CardCheck>,
}

/// A measured step judged against a card.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CardCheck {
    pub card: Card,
    /// The step's peak plus the card's context.
    pub peak_bytes: u64,
    pub verdict: Verdict,
    /// Ranked, cheapest first, those that fit; empty when the step fits comfortably.
    pub fixes: Vec<ModuleFix>,
}

/// A change that brings the step under the card's comfortable limit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModuleFix {
    pub kind: FixKind,
    pub change: String,
    pub peak_bytes: u64,
    pub cost: FixCost,
    /// How the peak was found: measured, extrapolated, or estimated.
    pub basis: &'static str,
}

impl ModuleReport {
    /// The report of `measured` at `batch`, judged against `card` when given.
    pub fn new(model: &str, measured: Measured, batch: usize, card: Option<Card>) -> ModuleReport {
        let peak = measured.peak_at(batch, Scenario::default());
        let card = card.map(|card| {
            let peak_bytes = peak.bills.total() + card.context_bytes;
            let verdict = verdict(peak_bytes, &card);
            let fixes = if verdict == Verdict::Fits { Vec::new() } else { fixes(&measured, batch, &card) };
            CardCheck { card, peak_bytes, verdict, fixes }
        });
        ModuleReport { model: model.to_owned(), measured, batch, peak, card }
    }

    /// Whether the batch's figures were measured or extrapolated, in words.
    fn basis(&self) -> String {
        if self.measured.was_measured(self.batch) {
            format!("measured at batch {}", self.batch)
        } else {
            format!("extrapolated to batch {} from steps measured at batches {}", self.batch, self.measured.batches())
        }
    }

    fn input(&self) -> String {
        std::iter::once(self.batch).chain(self.measured.sample.iter().copied()).map(|d| d.to_string()).collect::<Vec<_>>().join("x")
    }

    pub fn headline(&self) -> String {
        match &self.card {
            Some(check) => {
                let card = &check.card;
                let margin = (card.usable_bytes as i64 - check.peak_bytes as i64).unsigned_abs();
                let verdict = match check.verdict {
                    Verdict::Fits => format!("FITS: peak {} on {card} leaves {} free", human(check.peak_bytes), human(margin)),
                    Verdict::Tight => format!("FITS, BUT TIGHT: peak {} on {card} leaves only {}", human(check.peak_bytes), human(margin)),
                    Verdict::DoesNotFit => format!("DOES NOT FIT: peak {} on {card} is {} over", human(check.peak_bytes), human(margin)),
                };
                format!("{verdict} ({}, {}).", self.input(), self.basis())
            }
            None => format!(
                "{} at input {}: peak {} during {} ({}).",
                self.model,
                self.input(),
                human(self.peak.bills.total()),
                self.peak.part.name(),
                self.basis()
            ),
        }
    }

    /// What forward keeps for backward, by the op that made it.
    pub fn kept_table(&self) -> Table {
        let kept = self.measured.kept_at(self.batch);
        let measured_batches = self.measured.batches();
        let last = &self.measured.steps[self.measured.steps.len() - 1];
        let mut table = Table::new(["made by", "storages", "read by backward", "held by the graph"])
            .title(format!("What forward keeps for backward at batch {}, by the op that made it", self.batch))
            .right_align(&[1, 2, 3]);
        for row in &kept.by_op {
            table.push_row([row.op.clone(), row.storages.to_string(), human(row.read), human(row.held)]);
        }
        table
            .footer([
                "all".to_owned(),
                kept.by_op.iter().map(|k| k.storages).sum::<usize>().to_string(),
                human(kept.read()),
                human(kept.held()),
            ])
            .note(format!(
                "Read off the autograd graph of a real step, each storage once, the parameters and the batch left out ({}). \
                 Candle's graph holds every tensor an op was computed from until the loss is dropped, read or not. \
                 The allocation counters saw forward add {} at batch {} (the graph: {}).",
                if self.measured.was_measured(self.batch) {
                    "measured".to_owned()
                } else {
                    format!("each op's bytes extrapolated from batches {}", measured_batches)
                },
                human(last.kept_by_counters),
                last.batch,
                human(last.kept.held()),
            ))
    }

    /// The peak's bills at each measured batch and at the batch asked for.
    pub fn bills_table(&self) -> Table {
        let measured = &self.measured;
        let at = |batch: usize| measured.peak_at(batch, Scenario::default());
        let mut columns: Vec<String> = vec!["bill, at the peak".to_owned()];
        columns.extend(measured.steps.iter().map(|s| format!("batch {} (measured)", s.batch)));
        // The batch asked for has a column of its own unless it is one of those measured.
        let extrapolated = !measured.was_measured(self.batch);
        if extrapolated {
            columns.push(format!("batch {} (extrapolated)", self.batch));
        }
        if let Some(check) = &self.card {
            columns.push(format!("on {}", check.card.name));
        }
        let peaks: Vec<PartBills> = measured.steps.iter().map(|s| at(s.batch)).collect();
        let width = columns.len();
        let mut table = Table::new(columns)
            .title(format!("A training step of {}, measured ({}, {})", self.model, measured.optimizer, measured.loss))
            .right_align(&(1..width).collect::<Vec<_>>());
        for kind in BillKind::ALL {
            let mut row: Vec<String> = vec![kind.to_string()];
            row.extend(peaks.iter().map(|p| human(p.bills.get(kind))));
            if extrapolated {
                row.push(human(self.peak.bills.get(kind)));
            }
            if let Some(check) = &self.card {
                let context = if kind == BillKind::ContextAndWorkspace { check.card.context_bytes } else { 0 };
                row.push(human(self.peak.bills.get(kind) + context));
            }
            table.push_row(row);
        }
        let mut footer: Vec<String> = vec!["peak".to_owned()];
        footer.extend(peaks.iter().map(|p| format!("{} ({})", human(p.bills.total()), p.part.name())));
        if extrapolated {
            footer.push(format!("{} ({})", human(self.peak.bills.total()), self.peak.part.name()));
        }
        if let Some(check) = &self.card {
            footer.push(human(check.peak_bytes));
        }
        table.footer(footer).note(format!(
            "Each bill is read at the part of the step that peaks: parameters with the gradients then held, the optimizer's state, \
             the batch with its labels, activations (the rest then in use) and the part's transients. Measured on {} with {}; \
             the updates ran and the weights were put back. Parameters, gradients and optimizer state stay constant with the batch; \
             activations, the batch and transients are a straight line through the measured steps. {}",
            measured.device,
            measured.measured_with,
            match &self.card {
                Some(check) => format!(
                    "On the card: plus its context, {}; the transients are the measuring device's.",
                    human(check.card.context_bytes)
                ),
                None => String::new(),
            }
        ))
    }

    pub fn fixes_table(&self) -> Option<Table> {
        let check = self.card.as_ref().filter(|c| c.verdict != Verdict::Fits)?;
        let mut table = Table::new(["#", "fix", "peak", "% of card", "found by", "extra time", "accuracy risk", "effective batch"])
            .title(format!("fixes that peak under {} (90% of the card), cheapest first", human(target_bytes(&check.card))))
            .right_align(&[0, 2, 3, 5]);
        for (i, fix) in check.fixes.iter().enumerate() {
            table.push_row([
                (i + 1).to_string(),
                fix.change.clone(),
                human(fix.peak_bytes),
                percent(fix.peak_bytes, check.card.usable_bytes),
                fix.basis.to_owned(),
                format!("{:+}%", fix.cost.extra_time_pct),
                format!("{}: {}", fix.cost.accuracy_risk, fix.cost.note),
                if fix.cost.effective_batch_kept {
                    format!("{} (kept)", fix.cost.effective_batch)
                } else {
                    fix.cost.effective_batch.to_string()
                },
            ]);
        }
        if check.fixes.is_empty() {
            table = table.note("No single change fits: a smaller input, a smaller model or a larger card is needed.");
        }
        Some(table)
    }
}

/// The changes that need no spec, each judged at the batch asked for.
fn fixes(measured: &Measured, batch: usize, card: &Card) -> Vec<ModuleFix> {
    let target = target_bytes(card);
    let peak = |b: usize, scenario: Scenario<'_>| measured.peak_at(b, scenario).bills.total() + card.context_bytes;
    let kept = |extra_time_pct: i32, accuracy_risk: Risk, note: &str| FixCost {
        extra_time_pct,
        accuracy_risk,
        effective_batch: batch,
        effective_batch_kept: true,
        note: note.to_owned(),
    };
    let basis = if measured.was_measured(batch) { "measured" } else { "extrapolated" };
    let mut fixes = Vec::new();
    let accumulated = (1..).map(|s| 1usize << s).take_while(|&steps| steps <= batch).find_map(|steps| {
        let micro = batch.div_ceil(steps);
        let bytes = peak(micro, Scenario { accumulation: steps, ..Scenario::default() });
        (bytes <= target).then_some((micro, steps, bytes))
    });
    if let Some((micro, steps, bytes)) = accumulated {
        fixes.push(ModuleFix {
            kind: FixKind::Accumulation,
            change: format!("batch {micro} x {steps} accumulation steps"),
            peak_bytes: bytes,
            cost: FixCost {
                effective_batch: micro * steps,
                effective_batch_kept: micro * steps == batch,
                ..kept((5.0 * (steps as f64).log2()).round() as i32, bn_risk(micro), &format!("batch-norm statistics over {micro} samples"))
            },
            basis: if measured.was_measured(micro) { "measured" } else { "extrapolated" },
        });
    }
    let half = peak(batch, Scenario { half_precision: true, ..Scenario::default() });
    if half <= target {
        let note = if card.tensor_cores {
            "f16 activations, an f16 copy of the weights; loss scaling against underflow"
        } else {
            "no tensor cores: memory saved, no speed-up"
        };
        fixes.push(ModuleFix {
            kind: FixKind::MixedPrecision,
            change: "f16 mixed precision".to_owned(),
            peak_bytes: half,
            cost: kept(if card.tensor_cores { -30 } else { 0 }, Risk::Low, note),
            basis: "estimated: half the activations and transients",
        });
    }
    for other in &measured.other_optimizers {
        if !measured.optimizer.is_adam() && other.kind == OptimizerKind::Adam8bit {
            continue;
        }
        let bytes = peak(batch, Scenario { optimizer: Some(other), ..Scenario::default() });
        if bytes <= target {
            let (kind, cost) = match other.kind {
                OptimizerKind::Adam8bit => {
                    (FixKind::Adam8bit, kept(5, Risk::Low, "moments quantised block-wise; matches 32-bit Adam in published results"))
                }
                _ => (FixKind::Sgd, kept(-2, Risk::Medium, "the learning rate must be retuned; Adam-tuned recipes may converge slower")),
            };
            fixes.push(ModuleFix {
                kind,
                change: format!("{} instead of {}", other.kind, measured.optimizer),
                peak_bytes: bytes,
                cost,
                basis,
            });
        }
    }
    fixes.sort_by(|a, b| a.cost.score().total_cmp(&b.cost.score()).then(a.peak_bytes.cmp(&b.peak_bytes)));
    fixes
}

crate::render::shown_as_bundles!(ModuleReport);

impl Render for ModuleReport {
    fn bundle(&self) -> Bundle {
        let color = match self.card.as_ref().map(|c| c.verdict) {
            Some(Verdict::DoesNotFit) => "#b22222",
            Some(Verdict::Tight) => "#b36b00",
            Some(Verdict::Fits) => "#2a7d2a",
            None => "#333333",
        };
        let mut composer = Composer::new().headline(&self.headline(), color);
        if let Some(caveat) = self.card.as_ref().and_then(|check| card_caveat(&check.card)) {
            composer = composer.remark(&caveat);
        }
        composer = composer.part(&self.bills_table().bundle());
        if let Some(fixes) = self.fixes_table() {
            composer = composer.part(&fixes.bundle());
        }
        composer.part(&self.kept_table().bundle()).finish()
    }
}
