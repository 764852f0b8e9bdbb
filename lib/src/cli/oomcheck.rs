//! The reports of `summary` and `oomcheck`, as bundles.

use serde::Serialize;

use crate::oom::{CheckReport, HostReport, Sweep, Verdict};
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
            if report.verdict != Verdict::Fits && report.ledger.config.mode == crate::ledger::Mode::Training {
                composer = composer.part(&report.fixes_table().bundle());
            }
        }
        composer.finish()
    }
}
