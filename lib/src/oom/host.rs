//! The second kind of OOM (lesson 4.3): host RAM held by the data loader,
//! batches in flight times their size plus the photos being decoded.
//! "DataLoader worker killed by signal" is this, not the GPU.

use serde::Serialize;

use crate::data::{HostFootprint, LoaderShape};
use crate::render::{Bundle, Render, Table};
use crate::units::{human, percent};

/// Above this share of host RAM the loader leaves too little for the
/// process, the page cache and the rest of the machine.
pub const HOST_SHARE_LIMIT: f64 = 0.5;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostReport {
    pub footprint: HostFootprint,
    pub host_ram: Option<u64>,
    /// Alternatives with fewer batches in flight, each with its footprint.
    pub alternatives: Vec<(String, HostFootprint)>,
}

/// The loader's host memory for `shape`, judged against `host_ram` when given.
pub fn host_check(shape: LoaderShape, host_ram: Option<u64>) -> HostReport {
    let mut alternatives = Vec::new();
    if shape.prefetch > 1 {
        alternatives.push(("--prefetch 1".to_owned(), LoaderShape { prefetch: 1, ..shape }.footprint()));
    }
    if shape.num_workers > 2 {
        let half = shape.num_workers / 2;
        alternatives.push((format!("--workers {half}"), LoaderShape { num_workers: half, ..shape }.footprint()));
    }
    if shape.num_workers > 0 {
        alternatives.push(("--workers 0 (check the code first)".to_owned(), LoaderShape { num_workers: 0, ..shape }.footprint()));
    }
    let (w, h) = shape.source;
    if w.min(h) > 512 {
        let short = 512.0 / w.min(h) as f64;
        let resized = ((w as f64 * short).round() as u32, (h as f64 * short).round() as u32);
        alternatives.push((
            format!("resize offline to short side 512 ({}x{})", resized.0, resized.1),
            LoaderShape { source: resized, ..shape }.footprint(),
        ));
    }
    HostReport { footprint: shape.footprint(), host_ram, alternatives }
}

impl HostReport {
    pub fn too_large(&self) -> bool {
        self.host_ram.is_some_and(|ram| self.footprint.total_bytes as f64 > HOST_SHARE_LIMIT * ram as f64)
    }

    pub fn verdict_line(&self) -> String {
        let f = &self.footprint;
        let total = human(f.total_bytes);
        match self.host_ram {
            Some(ram) if self.too_large() => format!(
                "HOST RAM AT RISK: the loader alone holds {total}, {} of {}; workers get killed by signal (lesson 4.3).",
                percent(f.total_bytes, ram),
                human(ram)
            ),
            Some(ram) => format!("Host RAM: the loader holds {total}, {} of {}.", percent(f.total_bytes, ram), human(ram)),
            None => format!("Host RAM: the loader holds {total} (give --host-ram to judge it)."),
        }
    }

    pub fn table(&self) -> Table {
        let f = &self.footprint;
        let s = &f.shape;
        let mut table = Table::new(["host memory of the loader", "count", "each", "total"])
            .title(format!(
                "data loader: {} workers x prefetch {}, batch {} of {}x{}x{}{}, photos up to {}x{}",
                s.num_workers,
                s.prefetch,
                s.batch_size,
                s.sample[0],
                s.sample[1],
                s.sample[2],
                if s.masks { " with a label per pixel" } else { "" },
                s.source.0,
                s.source.1
            ))
            .right_align(&[1, 2, 3]);
        table.push_row([
            "batches in flight (queues + building + training)".to_owned(),
            f.batches_in_flight.to_string(),
            human(f.batch_bytes),
            human(f.batches_in_flight * f.batch_bytes),
        ]);
        let builders = s.num_workers.max(1) as u64;
        table.push_row([
            if s.masks { "decoded photos and masks (one per worker)" } else { "decoded photos (one per worker)" }.to_owned(),
            builders.to_string(),
            human(f.decode_bytes_per_worker),
            human(builders * f.decode_bytes_per_worker),
        ]);
        for (change, alt) in &self.alternatives {
            table.push_row([format!("with {change}"), String::new(), String::new(), human(alt.total_bytes)]);
        }
        table.footer(["total".to_owned(), String::new(), String::new(), human(f.total_bytes)]).note(
            "Thread workers share one copy of the dataset; process workers (PyTorch) each add their own interpreter and dataset copy on top.",
        )
    }
}

crate::render::shown_as_bundles!(HostReport);

impl Render for HostReport {
    fn bundle(&self) -> Bundle {
        let color = if self.too_large() { "#b22222" } else { "#2a7d2a" };
        crate::render::Composer::new().headline(&self.verdict_line(), color).part(&self.table().bundle()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(workers: usize, prefetch: usize) -> LoaderShape {
        LoaderShape { batch_size: 32, sample: [3, 224, 224], num_workers: workers, prefetch, source: (4000, 3000), masks: false }
    }

    #[test]
    fn sixteen_workers_on_a_small_host_are_flagged_with_cheaper_settings() {
        let report = host_check(shape(16, 4), Some(2 << 30));
        assert!(report.too_large(), "{}", report.verdict_line());
        assert!(report.verdict_line().starts_with("HOST RAM AT RISK"));
        assert!(report.alternatives.iter().all(|(_, alt)| alt.total_bytes < report.footprint.total_bytes));
        let text = report.table().to_string();
        assert!(text.contains("--workers 8") && text.contains("--prefetch 1"), "{text}");
        let calm = host_check(shape(2, 2), Some(32 << 30));
        assert!(!calm.too_large());
        assert!(host_check(shape(2, 2), None).verdict_line().contains("--host-ram"));
    }
}
