//! The reports of `summary` and `oomcheck`, as bundles.

use serde::Serialize;

use crate::ledger::BillKind;
use crate::oom::{verdict, CheckReport, HostReport, Sharding, Sweep, Verdict};
use crate::render::{Bundle, Render, Table};
use crate::units::{human, percent};

use crate::render::Composer;

/// What `oomcheck` computes: the fit report and, when asked, a sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Oomcheck {
    pub report: CheckReport,
    pub sweep: Option<Sweep>,
    /// The data loader's host memory, when loader settings were given.
    pub host: Option<HostReport>,
    /// Only the verdict and, where the step does not fit, one line per fix.
    #[serde(skip)]
    pub brief: bool,
    /// Only the verdict and, where the step does not fit, the fixes' table.
    #[serde(skip)]
    pub fixes_only: bool,
}

impl CheckReport {
    /// The ranked fixes as a table.
    pub fn fixes_table(&self) -> Table {
        let card = self.ledger.device.usable_bytes;
        let mut table = Table::new(["#", "fix", "peak", "% of card", "extra time", "accuracy risk", "effective batch", "flags"])
            .title(format!("fixes that peak under {} (90% of the card), cheapest first", human(self.target_bytes)))
            .right_align(&[0, 2, 3, 4]);
        for (i, fix) in self.fixes.iter().enumerate() {
            let batch = if fix.cost.effective_batch_kept {
                format!("{} (kept)", fix.cost.effective_batch)
            } else {
                format!("{} (was {})", fix.cost.effective_batch, self.ledger.config.effective_batch())
            };
            table.push_row([
                (i + 1).to_string(),
                fix.change.clone(),
                human(fix.peak_bytes),
                percent(fix.peak_bytes, card),
                format!("{:+}%", fix.cost.extra_time_pct),
                format!("{}: {}", fix.cost.accuracy_risk, fix.cost.note),
                batch,
                crate::ledger::oomcheck_flags(&fix.config).unwrap_or_else(|| "-".to_owned()),
            ]);
        }
        if self.fixes.is_empty() {
            table = table.note(NO_FIX);
        }
        table
    }

    /// The ranked fixes, one line each: the change, its peak and its share of the card.
    pub fn fixes_brief(&self) -> String {
        if self.fixes.is_empty() {
            return NO_FIX.to_owned();
        }
        let card = self.ledger.device.usable_bytes;
        let lines: Vec<String> = self
            .fixes
            .iter()
            .enumerate()
            .map(|(i, fix)| {
                format!("{}. {}: peak {} ({} of the card)", i + 1, fix.change, human(fix.peak_bytes), percent(fix.peak_bytes, card))
            })
            .collect();
        format!("Fixes that peak under {} (90% of the card), cheapest first:\n{}", human(self.target_bytes), lines.join("\n"))
    }
}

impl Sharding {
    /// One card's five bills and peak at each sharding stage, beside the
    /// same samples on one card.
    pub fn table(&self, chosen: &crate::ledger::StepConfig) -> Table {
        let cards = chosen.levers.cards;
        let mut columns = vec![String::from("bill")];
        let single = self.single_card.iter().map(|l| (format!("1 card, batch {}", l.config.batch), l));
        let stages = self.stages.iter().map(|l| {
            let shard = l.config.levers.cards.shard;
            let chosen = if shard == cards.shard { " (this)" } else { "" };
            (format!("{}{chosen}", shard.name()), l)
        });
        let ledgers: Vec<(String, &crate::ledger::Ledger)> = single.chain(stages).collect();
        columns.extend(ledgers.iter().map(|(name, _)| name.clone()));
        let mut table = Table::new(columns)
            .title(format!("one of {} cards, batch {} on each, at each sharding stage", cards.count, chosen.batch))
            .right_align(&(1..=ledgers.len()).collect::<Vec<_>>());
        for kind in BillKind::ALL {
            let row = std::iter::once(kind.title().to_owned()).chain(ledgers.iter().map(|(_, l)| human(l.bill(kind).bytes)));
            table.push_row(row.collect::<Vec<_>>());
        }
        let peak = |l: &crate::ledger::Ledger| format!("{} ({})", human(l.peak.bytes), percent(l.peak.bytes, l.device.usable_bytes));
        table.push_row(std::iter::once("peak (% of card)".to_owned()).chain(ledgers.iter().map(|(_, l)| peak(l))).collect::<Vec<_>>());
        let fit = |l: &crate::ledger::Ledger| verdict(l.peak.bytes, &l.device).to_string();
        table.push_row(std::iter::once("verdict".to_owned()).chain(ledgers.iter().map(|(_, l)| fit(l))).collect::<Vec<_>>());
        table.note(
            "Each card runs its own batch and keeps what its stage leaves it: DDP keeps everything, ZeRO-1 divides the optimizer \
             state, ZeRO-2 the gradients too, ZeRO-3 the weights too, gathering each stage's while it runs. On several cards \
             backward runs a stage at a time: each stage's graph is dropped and its gradients exchanged as its backward \
             ends (ZeRO-2 and ZeRO-3 keep their part), where one card's backward holds every stage's graph to its end. \
             Under ZeRO-3 a stage's graph keeps the weights gathered for it until its backward, so it saves most where \
             stages are checkpointed.",
        )
    }
}

const NO_FIX: &str = "No single change or combination fits: a smaller model or a larger card is needed.";

crate::render::shown_as_bundles!(Oomcheck);

impl Render for Oomcheck {
    fn bundle(&self) -> Bundle {
        let report = &self.report;
        let color = match report.verdict {
            Verdict::Fits => "#2a7d2a",
            Verdict::Tight => "#b36b00",
            Verdict::DoesNotFit => "#b22222",
        };
        let mut composer = Composer::new().headline(&report.verdict_line(), color);
        if let Some(caveat) = &report.card_caveat {
            composer = composer.remark(caveat);
        }
        if self.brief || self.fixes_only {
            let training = report.ledger.config.mode == crate::ledger::Mode::Training;
            if report.verdict != Verdict::Fits && training {
                let fixes = if self.brief { Bundle::plain(report.fixes_brief()) } else { report.fixes_table().bundle() };
                composer = composer.part(&fixes);
            }
            return composer.finish();
        }
        // Loader settings ask about host RAM: its verdict comes before the card's detail.
        if let Some(host) = &self.host {
            composer = composer.part(&host.bundle());
        }
        // A sweep answers its own question; the step's bills are one `--sweep` less away.
        if let Some(sweep) = &self.sweep {
            composer = composer
                .html_only(&sweep.chart().bundle())
                .part(&sweep.table().note("The step's bills, timeline and fixes: the same command without --sweep.").bundle());
        } else {
            composer = composer
                .part(&report.ledger.table().bundle())
                .html_only(&report.ledger.chart().bundle())
                .part(&report.ledger.timeline_table().bundle());
            if let Some(sharding) = &report.sharding {
                composer = composer.part(&sharding.table(&report.ledger.config).bundle());
            }
            if report.verdict != Verdict::Fits && report.ledger.config.mode == crate::ledger::Mode::Training {
                composer = composer.part(&report.fixes_table().bundle());
            }
        }
        composer.finish()
    }
}
