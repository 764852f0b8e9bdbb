//! `%mem` and `%%mem` as tables and charts.

use serde::Serialize;

use super::card::pool::PoolStats;
use super::card::process_card::card_stats_in;
use super::probes::cell::{CellProbe, CellUsage};
use super::probes::error::MemoryError;
use super::probes::host::{EmptyCache, HostMemory};
use super::probes::region::Request;
use super::probes::snapshot::Snapshot;
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
    pub card: Option<PoolStats>,
    /// The cell process's GPU: its memory pool and the driver's free/total.
    #[cfg(feature = "cuda")]
    pub cuda: super::probes::cuda::CellCuda,
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

    /// `%mem --brief`: the counters as `print_mem` writes them and, when a
    /// step is registered, its peak predicted beside measured.
    pub fn brief(&self) -> String {
        let mut line = self.headline().map_or_else(String::new, |h| h + "\n") + &self.memory.to_string();
        if let Some(snapshot) = &self.snapshot {
            let (p, m) = (snapshot.predicted.as_ref().map(|p| p.peak), snapshot.measured.as_ref().map(|m| m.peak));
            let cell = |bytes: Option<u64>| bytes.map_or_else(|| "-".to_owned(), human);
            line += &format!("\nregistered: {}: peak predicted {}, measured {} ({})", snapshot.label, cell(p), cell(m), difference(p, m));
        }
        line + "\n"
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
        let by_name: Vec<(f64, f64)> = window_peaks(snapshot)
            .into_iter()
            .enumerate()
            .filter_map(|(i, peak)| peak.map(|peak| ((i + 1) as f64, peak as f64 / MIB)))
            .collect();
        chart = if by_name.is_empty() {
            chart.series(Series::limit(format!("predicted peak {}", human(predicted.peak)), predicted.peak as f64 / MIB))
        } else {
            chart.series(Series::line("predicted peak since the previous sample", by_name))
        };
    }
    Some(chart)
}

/// The predicted peak of each measured phase on the meter's terms: from the
/// sample before it to its own, so a phase that frees memory starts with what
/// the phase before it left in use. `None` for a phase the ledger lacks.
fn window_peaks(snapshot: &Snapshot) -> Vec<Option<u64>> {
    let (Some(measured), Some(predicted)) = (snapshot.measured.as_ref(), snapshot.predicted.as_ref()) else {
        return snapshot.measured.as_ref().map_or(Vec::new(), |m| vec![None; m.phases.len()]);
    };
    measured
        .phases
        .iter()
        .map(|phase| {
            let at = predicted.phases.iter().position(|p| p.name == phase.name)?;
            let before = at.checked_sub(1).map_or(0, |b| predicted.phases[b].resident);
            Some(predicted.phases[at].peak.max(before))
        })
        .collect()
}

/// The phases of the chart, by number: in use after each, and the most in
/// use since the sample before it, measured beside predicted.
pub fn timeline_table(snapshot: &Snapshot) -> Option<Table> {
    let measured = snapshot.measured.as_ref().filter(|m| !m.phases.is_empty())?;
    let mut table = Table::new(["#", "phase", "in use after", "predicted", "peak since the sample before", "predicted"])
        .title("last step's samples")
        .right_align(&[0, 2, 3, 4, 5]);
    let resident = |name: &str| {
        snapshot.predicted.as_ref().and_then(|p| p.phases.iter().find(|q| q.name == name)).map_or("-".to_owned(), |p| human(p.resident))
    };
    for ((i, phase), window) in measured.phases.iter().enumerate().zip(window_peaks(snapshot)) {
        let in_use = phase.bills.total() - phase.bills.context_and_workspace;
        table.push_row([
            (i + 1).to_string(),
            phase.name.clone(),
            human(in_use),
            resident(&phase.name),
            human(phase.bills.total()),
            window.map_or("-".to_owned(), human),
        ]);
    }
    Some(table.note(
        "Each sample is read after its phase; its peak counts from the sample before, so a phase that frees memory \
         (the graph, the gradients) peaks at what the phase before it left.",
    ))
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

/// The reports' side of the probe: what `%mem` shows, read from the cell process.
impl CellProbe {
    /// What `%mem` shows: first `--reset-peak` / `--empty-cache` when asked,
    /// then the reading, the host or budget, and the registered snapshot.
    pub fn report(&self, reset_peak: bool, empty_cache: bool) -> Result<MemReport, MemoryError> {
        let pid = self.started()?;
        if reset_peak {
            self.region.counters().reset_peak();
            #[cfg(feature = "cuda")]
            self.ask(Request::ResetPeak)?;
        }
        let request = if empty_cache { Request::EmptyCache } else { Request::Sample };
        let answer = self.ask(request)?;
        let emptied = empty_cache.then(|| self.emptied(answer));
        let memory = emptied.map_or_else(|| self.reading(answer), |emptied| emptied.after);
        let host = crate::gpus::Card::host().ok().map(|d| (d.usable_bytes, d.total_bytes));
        Ok(MemReport {
            pid,
            memory,
            host,
            snapshot: self.snapshot()?,
            emptied,
            peak_reset: reset_peak,
            card: card_stats_in(self.region.counters()),
            #[cfg(feature = "cuda")]
            cuda: super::probes::cuda::CellCuda::from_answer(request, answer.device),
        })
    }
}
