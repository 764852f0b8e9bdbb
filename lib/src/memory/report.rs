//! `%mem` and `%%mem` as tables and charts.

use serde::Serialize;

use super::host::{EmptyCache, HostMemory};
use super::probe::CellUsage;
use super::snapshot::Snapshot;
use crate::ledger::BillKind;
use crate::render::Composer;
use crate::render::{Bundle, Chart, Render, Series, Table};
use crate::units::{grouped, human};

const MIB: f64 = (1u64 << 20) as f64;

/// Everything `%mem` shows about one process.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemReport {
    pub pid: u32,
    pub memory: HostMemory,
    /// The host's MemAvailable and MemTotal, when readable.
    pub host: Option<(u64, u64)>,
    pub snapshot: Option<Snapshot>,
    /// What `--empty-cache` did, when asked.
    pub emptied: Option<EmptyCache>,
    /// Whether `--reset-peak` was asked.
    pub peak_reset: bool,
    /// The process's simulated card's caching allocator, when it has one
    /// (after `--empty-cache`, emptied).
    pub card: Option<super::PoolStats>,
    /// The cell process's GPU: its memory pool and the driver's free/total.
    #[cfg(feature = "cuda")]
    pub cuda: super::cuda::CellCuda,
}

impl MemReport {
    /// Free and total for the "free / total" row: the simulated budget when
    /// one is set, otherwise the host.
    pub fn free_total(&self) -> Option<(u64, u64, &'static str)> {
        match (self.memory.budget, self.host) {
            (Some(budget), _) => Some((
                budget.room().saturating_sub(self.memory.in_use),
                budget.usable,
                "simulated device budget, its CUDA context and cuDNN workspace in use",
            )),
            (None, Some((available, total))) => Some((available, total, "host: MemAvailable / MemTotal")),
            (None, None) => None,
        }
    }

    pub fn table(&self) -> Table {
        let m = &self.memory;
        let how = if m.exact { "every allocation counted" } else { "sampled from glibc, not exact" };
        let mut table =
            Table::new(["", "bytes", "size", "what"]).title(format!("cell process {}: heap memory ({how})", self.pid)).right_align(&[1, 2]);
        let row = |table: &mut Table, name: &str, bytes: u64, what: &str| {
            table.push_row([name.to_owned(), grouped(bytes), human(bytes), what.to_owned()]);
        };
        row(&mut table, "in use", m.in_use, "bytes in live heap blocks (memory_allocated)");
        row(&mut table, "held", m.held, "taken from the OS by malloc (memory_reserved)");
        row(&mut table, "idle in the cache", m.idle(), "held but not in use");
        if let Some(peak) = m.peak {
            row(&mut table, "peak", peak, if self.peak_reset { "since now (reset)" } else { "in use at most since the last reset" });
        }
        if let Some(count) = m.allocations {
            table.push_row([
                "allocations".to_owned(),
                grouped(count),
                String::new(),
                "heap allocations made by the process so far".to_owned(),
            ]);
        }
        row(&mut table, "RSS", m.rss, "resident in RAM, whole process");
        row(&mut table, "RSS high-water", m.hwm, "VmHWM");
        if let Some((free, total, what)) = self.free_total() {
            table.push_row([
                "free / total".to_owned(),
                format!("{} / {}", grouped(free), grouped(total)),
                format!("{} / {}", human(free), human(total)),
                what.to_owned(),
            ]);
        }
        table
    }

    /// The five bills predicted beside measured, when a snapshot says so.
    pub fn bills_table(&self) -> Option<Table> {
        let snapshot = self.snapshot.as_ref()?;
        let predicted = snapshot.predicted.as_ref();
        let measured = snapshot.measured.as_ref();
        let mut table = Table::new(["bill", "predicted", "measured", "difference"])
            .title(format!("registered: {}", snapshot.label))
            .right_align(&[1, 2, 3]);
        let cell = |bytes: Option<u64>| bytes.map_or_else(|| "-".to_owned(), human);
        for kind in BillKind::ALL {
            let (p, m) = (predicted.map(|p| p.bills.get(kind)), measured.map(|m| m.bills.get(kind)));
            table.push_row([kind.title().to_owned(), cell(p), cell(m), difference(p, m)]);
        }
        let (p, m) = (predicted.map(|p| p.peak), measured.map(|m| m.peak));
        Some(table.footer(["peak".to_owned(), cell(p), cell(m), difference(p, m)]))
    }

    fn headline(&self) -> Option<String> {
        let emptied = self.emptied.as_ref()?;
        Some(format!(
            "empty_cache (malloc_trim): held {} -> {}, RSS {} -> {}; in use stays {}",
            human(emptied.before.held),
            human(emptied.after.held),
            human(emptied.before.rss),
            human(emptied.after.rss),
            human(emptied.after.in_use)
        ))
    }
}

/// `+4.2%`: measured against predicted.
fn difference(predicted: Option<u64>, measured: Option<u64>) -> String {
    match (predicted, measured) {
        (Some(p), Some(m)) if p > 0 => format!("{:+.1}%", 100.0 * (m as f64 - p as f64) / p as f64),
        (Some(0), Some(0)) => "0.0%".to_owned(),
        _ => "-".to_owned(),
    }
}

crate::render::shown_as_bundles!(MemReport, CellUsage);

impl Render for MemReport {
    fn bundle(&self) -> Bundle {
        let mut composer = Composer::new();
        if let Some(line) = self.headline() {
            composer = composer.headline(&line, "#2a7d2a");
        }
        composer = composer.part(&self.table().bundle());
        if let Some(card) = &self.card {
            composer = composer.part(&card.table().bundle());
        }
        #[cfg(feature = "cuda")]
        {
            if let Some(line) = self.cuda.headline() {
                composer = composer.headline(&line, "#2a7d2a");
            }
            composer = match self.cuda.table() {
                Ok(table) => composer.part(&table.bundle()),
                Err(line) => composer.headline(line, "#555555"),
            };
        }
        if self.memory.budget.is_some() {
            composer = composer.headline("The device budget is simulated: tensors live in host memory; past the budget, check_budget() raises CUDA's out-of-memory error.", "#b36b00");
        }
        // After an action (`--reset-peak`, `--empty-cache`) the registered step is what it was:
        // one line names it, and plain `%mem` shows its bills.
        let acted = self.peak_reset || self.emptied.is_some();
        match (self.bills_table(), &self.snapshot) {
            (Some(_), Some(snapshot)) if acted => {
                composer.headline(&format!("registered: {} (unchanged; %mem shows its bills)", snapshot.label), "#555555")
            }
            (Some(bills), _) => composer.part(&bills.bundle()),
            _ => composer.headline("No prediction or measurement registered (vramlab::memory::publish).", "#555555"),
        }
        .finish()
    }
}

/// The last step's timeline: the measured samples stacked by bill, the
/// predicted peak of each phase drawn over them. `None` when the snapshot
/// has no measured phases.
pub fn timeline_chart(snapshot: &Snapshot) -> Option<Chart> {
    let measured = snapshot.measured.as_ref().filter(|m| !m.phases.is_empty())?;
    let mut chart = Chart::new(format!("last step, by bill: {}", snapshot.label))
        .x_label("sample (phase order, see the table)")
        .y_label("MiB")
        .size(640, 380);
    for kind in BillKind::ALL {
        let points: Vec<(f64, f64)> =
            measured.phases.iter().enumerate().map(|(i, p)| ((i + 1) as f64, p.bills.get(kind) as f64 / MIB)).collect();
        if points.iter().any(|&(_, y)| y > 0.0) {
            chart = chart.series(Series::stacked(format!("measured: {}", kind.title()), points));
        }
    }
    if let Some(predicted) = snapshot.predicted.as_ref() {
        let by_name: Vec<(f64, f64)> = measured
            .phases
            .iter()
            .enumerate()
            .filter_map(|(i, m)| predicted.phases.iter().find(|p| p.name == m.name).map(|p| ((i + 1) as f64, p.peak as f64 / MIB)))
            .collect();
        chart = if by_name.is_empty() {
            chart.series(Series::limit(format!("predicted peak {}", human(predicted.peak)), predicted.peak as f64 / MIB))
        } else {
            chart.series(Series::line("predicted peak of the phase", by_name))
        };
    }
    Some(chart)
}

/// The phases of the chart, by number.
pub fn timeline_table(snapshot: &Snapshot) -> Option<Table> {
    let measured = snapshot.measured.as_ref().filter(|m| !m.phases.is_empty())?;
    let mut table =
        Table::new(["#", "phase", "measured", "predicted peak of the phase"]).title("last step's samples").right_align(&[0, 2, 3]);
    for (i, phase) in measured.phases.iter().enumerate() {
        let predicted = snapshot
            .predicted
            .as_ref()
            .and_then(|p| p.phases.iter().find(|q| q.name == phase.name))
            .map_or("-".to_owned(), |p| human(p.peak));
        table.push_row([(i + 1).to_string(), phase.name.clone(), human(phase.bills.total()), predicted]);
    }
    Some(table)
}

/// `--plot`: the chart and its table, or a line saying there is nothing to draw.
pub fn plot(snapshot: Option<&Snapshot>) -> Bundle {
    let drawn = snapshot.and_then(|s| Some((timeline_chart(s)?, timeline_table(s)?)));
    match drawn {
        Some((chart, table)) => Composer::new().html_only(&chart.bundle()).part(&table.bundle()).finish(),
        None => Bundle::plain(
            "No step timeline registered: a trainer publishes one (vramlab::memory::publish with measured phases) after a step.\n",
        ),
    }
}

impl Render for CellUsage {
    fn bundle(&self) -> Bundle {
        let net = self.net();
        let sign = if net < 0 { "-" } else { "+" };
        Bundle::plain(format!(
            "peak memory: {} (+{} during the cell), net change: {sign}{} (in use {} -> {})\n",
            human(self.peak),
            human(self.increment()),
            human(net.unsigned_abs()),
            human(self.before),
            human(self.after)
        ))
    }
}
