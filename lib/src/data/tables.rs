//! Tables for the data pipeline's results.

use std::collections::{BTreeMap, BTreeSet};

use crate::render::{Bundle, Render, Table};
use crate::units::human;

use super::baseline::BaselineReport;
use super::bench::{DecoderBench, LoaderBench};
use super::decode::RgbImage;
use super::folder::ImageFolder;
use super::manifest::Manifest;
use super::preprocess::PreprocessReport;
use super::split::Split;
use super::synth::{LesionShare, Symptom, CLASSES};
use super::DataError;

impl Manifest {
    /// Per class: photos, plants, share, and the sizes on disk.
    pub fn table(&self) -> Table {
        let mut by_class: BTreeMap<&str, (usize, BTreeSet<u64>, u64)> = BTreeMap::new();
        for e in &self.entries {
            let row = by_class.entry(e.class.as_str()).or_default();
            row.0 += 1;
            row.1.insert(e.group);
            row.2 += e.bytes;
        }
        let total = self.entries.len().max(1);
        let mut table = Table::new(["class", "photos", "plants", "share", "on disk"])
            .title(format!(
                "{} photos of {} plants, {}",
                self.entries.len(),
                self.entries.iter().map(|e| e.group).collect::<BTreeSet<_>>().len(),
                human(self.total_bytes())
            ))
            .right_align(&[1, 2, 3, 4]);
        for (class, (photos, plants, bytes)) in by_class {
            table.push_row([
                class.to_owned(),
                photos.to_string(),
                plants.len().to_string(),
                format!("{:.1}%", 100.0 * photos as f64 / total as f64),
                human(bytes),
            ]);
        }
        table
    }

    /// Photos per stored resolution.
    pub fn size_table(&self) -> Table {
        let mut sizes: BTreeMap<(u32, u32), (usize, u64)> = BTreeMap::new();
        for e in &self.entries {
            let key = (e.width.max(e.height), e.width.min(e.height));
            let row = sizes.entry(key).or_default();
            row.0 += 1;
            row.1 += e.bytes;
        }
        let mut table = Table::new(["resolution", "photos", "mean file"]).title("resolutions (either orientation)").right_align(&[1, 2]);
        for ((long, short), (n, bytes)) in sizes.into_iter().rev() {
            table.push_row([format!("{long}x{short}"), n.to_string(), human(bytes / n.max(1) as u64)]);
        }
        table
    }
}

impl LesionShare {
    /// Per class: photos, the lesion share of their pixels and the photos without a lesion.
    pub fn table(&self) -> Table {
        let mut table = Table::new(["class", "symptom", "photos", "lesion pixels", "photos without lesion"])
            .title(format!(
                "lesion masks: {:.2}% of all pixels are lesion, {:.2}% of a photo on average",
                100.0 * self.share(),
                100.0 * self.mean_photo_share()
            ))
            .right_align(&[2, 3, 4]);
        for (class, name) in CLASSES.iter().enumerate() {
            table.push_row([
                name.to_string(),
                Symptom::of(name).map_or("", Symptom::as_str).to_owned(),
                self.photos[class].to_string(),
                format!("{:.2}%", 100.0 * self.class_share(class)),
                self.empty_masks[class].to_string(),
            ]);
        }
        table.note(format!("predicting \"not lesion\" everywhere: pixel accuracy {:.2}%, lesion IoU 0", 100.0 * (1.0 - self.share())))
    }
}

impl ImageFolder {
    /// Per class: photos and plants on each side of `split`, and the
    /// validation share; a note names any class that validation lacks.
    pub fn split_table(&self, split: &Split) -> Table {
        let labels = self.labels();
        let groups = self.groups();
        let side = |indices: &[usize], class: u32| {
            let of_class: Vec<usize> = indices.iter().copied().filter(|&i| labels[i] == class).collect();
            (of_class.len(), of_class.iter().map(|&i| groups[i]).collect::<BTreeSet<u64>>().len())
        };
        let mut table = Table::new(["class", "train photos", "train plants", "val photos", "val plants", "val share"])
            .title(format!("{} train / {} val photos, no plant on both sides", split.train.len(), split.val.len()))
            .right_align(&[1, 2, 3, 4, 5]);
        let mut unvalidated = Vec::new();
        for (class, name) in self.classes.iter().enumerate() {
            let ((train, train_plants), (val, val_plants)) = (side(&split.train, class as u32), side(&split.val, class as u32));
            if val == 0 {
                unvalidated.push(format!("{name} ({} plant{})", train_plants, if train_plants == 1 { "" } else { "s" }));
            }
            let share = if train + val == 0 { "-".to_owned() } else { format!("{:.0}%", 100.0 * val as f64 / (train + val) as f64) };
            table.push_row([name.clone(), train.to_string(), train_plants.to_string(), val.to_string(), val_plants.to_string(), share]);
        }
        if !unvalidated.is_empty() {
            table = table.note(format!("Not validated: {}. A class of one plant cannot be on both sides.", unvalidated.join(", ")));
        }
        table
    }
}

impl Render for Manifest {
    fn bundle(&self) -> Bundle {
        self.table().bundle()
    }
}

/// Loader passes side by side.
pub fn loader_bench_table(runs: &[LoaderBench]) -> Table {
    let mut table = Table::new(["workers", "decoder", "images", "images/s", "decode MB/s/core", "decoded MP", "peak host"])
        .title("one pass: decode, resize, flip, normalise, batch")
        .right_align(&[0, 2, 3, 4, 5, 6]);
    for run in runs {
        table.push_row([
            run.config.workers.to_string(),
            format!("{:?}", run.config.decoder),
            run.images.to_string(),
            format!("{:.1}", run.images_per_s),
            format!("{:.1}", run.decode_mb_per_s_per_core),
            format!("{:.0}", run.decoded_megapixels),
            human(run.peak_host_bytes),
        ]);
    }
    table
}

impl Render for LoaderBench {
    fn bundle(&self) -> Bundle {
        loader_bench_table(std::slice::from_ref(self)).bundle()
    }
}

impl LoaderBench {
    /// Shows the pass as a table in a notebook cell's result.
    pub fn evcxr_display(&self) {
        self.bundle().print_as_cell_result();
    }
}

/// Decoders side by side.
pub fn decoder_table(runs: &[DecoderBench]) -> Table {
    let mut table =
        Table::new(["decoder", "images/s", "MB/s (one core)", "megapixels out"]).title("decoding the same JPEGs").right_align(&[1, 2, 3]);
    for run in runs {
        table.push_row([
            run.label.clone(),
            format!("{:.1}", run.images_per_s),
            format!("{:.1}", run.mb_per_s),
            format!("{:.1}", run.megapixels_out),
        ]);
    }
    table
}

impl Render for PreprocessReport {
    fn bundle(&self) -> Bundle {
        Table::new(["images", "in", "out", "seconds", "images/s"])
            .title(format!("resized to short side {} (JPEG quality {})", self.short_side, self.quality))
            .right_align(&[0, 1, 2, 3, 4])
            .row([
                self.images.to_string(),
                human(self.bytes_in),
                human(self.bytes_out),
                format!("{:.1}", self.seconds),
                format!("{:.1}", self.images as f64 / self.seconds.max(1e-9)),
            ])
            .note(format!("{} images were already small enough and were only re-encoded.", self.kept_size))
            .bundle()
    }
}

impl PreprocessReport {
    /// Shows the report as a table in a notebook cell's result.
    pub fn evcxr_display(&self) {
        self.bundle().print_as_cell_result();
    }
}

impl BaselineReport {
    /// Validation accuracy per class, with the overall figures in the title.
    pub fn table(&self, classes: &[String]) -> Table {
        let mut table = Table::new(["class", "val accuracy"])
            .title(format!(
                "colour-histogram baseline: train {:.1}%, val {:.1}% (majority class {:.1}%; {} train / {} val)",
                100.0 * self.train_accuracy,
                100.0 * self.val_accuracy,
                100.0 * self.majority_accuracy,
                self.train_images,
                self.val_images
            ))
            .right_align(&[1]);
        for (class, acc) in classes.iter().zip(&self.per_class) {
            table.push_row([class.clone(), if acc.is_nan() { "-".to_owned() } else { format!("{:.0}%", 100.0 * acc) }]);
        }
        table
    }
}

impl Render for RgbImage {
    /// A PNG, so a notebook shows the picture.
    fn bundle(&self) -> Bundle {
        let text = format!("RGB image {}x{}", self.width(), self.height());
        let mut png = Vec::new();
        let encoded = image::RgbImage::from_raw(self.width(), self.height(), self.pixels().to_vec())
            .map(|img| img.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).is_ok())
            .unwrap_or(false);
        if encoded {
            Bundle::plain(text).with("image/png", base64::encode(&png))
        } else {
            Bundle::plain(text)
        }
    }
}

impl RgbImage {
    /// Shows the image in a notebook cell's result.
    pub fn evcxr_display(&self) {
        self.bundle().print_as_cell_result();
    }
}

/// Images side by side in rows of `columns`, each fitted into a `cell` x `cell` square on grey.
pub fn contact_sheet(images: &[RgbImage], columns: usize, cell: u32) -> Result<RgbImage, DataError> {
    if images.is_empty() || columns == 0 || cell == 0 {
        return Err(DataError::invalid("contact_sheet", "needs images, at least one column and a cell size"));
    }
    let rows = images.len().div_ceil(columns);
    let (w, h) = (columns as u32 * cell, rows as u32 * cell);
    let mut sheet = RgbImage::filled(w, h, [235, 235, 235])?;
    for (i, image) in images.iter().enumerate() {
        let scale = cell as f64 / image.width().max(image.height()) as f64;
        let tw = ((image.width() as f64 * scale) as u32).clamp(1, cell);
        let th = ((image.height() as f64 * scale) as u32).clamp(1, cell);
        let thumb = image.resize(tw, th)?;
        let (x0, y0) = ((i % columns) as u32 * cell + (cell - tw) / 2, (i / columns) as u32 * cell + (cell - th) / 2);
        for y in 0..th {
            let src = &thumb.pixels()[(y * tw * 3) as usize..((y + 1) * tw * 3) as usize];
            let start = (((y0 + y) * w + x0) * 3) as usize;
            sheet.pixels_mut()[start..start + src.len()].copy_from_slice(src);
        }
    }
    Ok(sheet)
}
