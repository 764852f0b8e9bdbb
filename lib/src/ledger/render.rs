//! Ledgers as tables and charts.

use crate::render::{Chart, Series, Table};

use super::bill::BillKind;
use super::estimate::Ledger;
use crate::units::{grouped, human, percent};

const GIB: f64 = (1u64 << 30) as f64;

impl Ledger {
    /// The five bills with their lines, bytes and share of the card, and the peak.
    pub fn table(&self) -> Table {
        let card = self.device.usable_bytes;
        let mut table = Table::new(["bill", "bytes", "size", "% of card"])
            .title(format!("{} on {}: {}", self.model, self.device, self.config))
            .right_align(&[1, 2, 3]);
        for bill in &self.bills {
            table.push_row([bill.kind.title().to_owned(), grouped(bill.bytes), human(bill.bytes), percent(bill.bytes, card)]);
            for line in &bill.lines {
                table.push_row([format!("    {}", line.label), grouped(line.bytes), human(line.bytes), percent(line.bytes, card)]);
            }
        }
        let peak = &self.peak;
        let table = table
            .footer([format!("peak, during \"{}\"", peak.phase), grouped(peak.bytes), human(peak.bytes), percent(peak.bytes, card)])
            .note(format!(
                "All bills summed: {} ({}). They are never all resident at once: the peak comes from walking the step phase by phase.",
                human(self.sum_of_bills()),
                percent(self.sum_of_bills(), card)
            ));
        table
    }

    /// What is resident after each phase of the step, and the most held during it.
    pub fn timeline_table(&self) -> Table {
        let card = self.device.usable_bytes;
        let mut table = Table::new(["phase", "resident after", "peak during", "% of card"]).title("step timeline").right_align(&[1, 2, 3]);
        for phase in &self.timeline {
            let name = if phase.phase == self.peak.during { format!("{} <- peak", phase.name) } else { phase.name.clone() };
            table.push_row([name, human(phase.resident_bytes), human(phase.peak_bytes), percent(phase.peak_bytes, card)]);
        }
        table
    }

    /// A stacked bar of the peak, split by bill, against the card's usable memory.
    pub fn chart(&self) -> Chart {
        let mut chart = Chart::new(format!("{} at its peak vs {}", self.model, self.device.name))
            .x_label("the step's peak, by bill")
            .y_label("GiB")
            .size(560, 380)
            .hide_x_ticks();
        for kind in BillKind::ALL {
            let bytes = self.peak.bill(kind);
            if bytes > 0 {
                // A bill's lines need not all be resident at the peak (the optimizer's
                // temporaries come after backward's), so the bar can be less than the table's bill.
                let whole = self.bill(kind).bytes;
                let label = if whole == bytes {
                    format!("{} {}", kind.title(), human(bytes))
                } else {
                    format!("{} {} at the peak (bill {})", kind.title(), human(bytes), human(whole))
                };
                chart = chart.series(Series::stacked(label, [(1.0, bytes as f64 / GIB)]));
            }
        }
        chart.series(Series::limit(
            format!("{} usable: {}", self.device.name, human(self.device.usable_bytes)),
            self.device.usable_bytes as f64 / GIB,
        ))
    }
}
