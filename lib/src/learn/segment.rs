//! Training a segmentation network from an image folder and its masks, and
//! what it reached against labelling every pixel the commonest class.

use std::time::Instant;

use candle_core::Device;
use serde::Serialize;

use super::{train_on, LearnConfig, LearnEpoch, LearnError};
use crate::data::{DataError, SegmentationFolder, Split, MASK_CLASSES};
use crate::render::{Bundle, Render, Table};
use crate::train::TrainEvent;
use crate::units::percent_of_one;

/// What training from a folder with masks reached on the validation photos.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SegmentReport {
    pub config: LearnConfig,
    pub train_images: usize,
    pub val_images: usize,
    pub epochs: Vec<LearnEpoch>,
    /// The masks' classes, by index.
    pub classes: Vec<String>,
    /// After the last epoch: pixels labelled right.
    pub val_pixel_accuracy: f64,
    /// After the last epoch: each class's intersection over union.
    pub val_iou: Vec<Option<f64>>,
    /// Each class's share of the validation pixels.
    pub val_pixel_shares: Vec<f64>,
    /// The class most training pixels carry: labelling every pixel with it
    /// is the trivial mask, its pixel accuracy that class's share and its
    /// IoU that share for that class and 0 for the others.
    pub commonest_class: usize,
    pub seconds: f64,
}

impl SegmentReport {
    /// The trivial mask's pixel accuracy: the commonest class's validation share.
    pub fn trivial_pixel_accuracy(&self) -> f64 {
        self.val_pixel_shares.get(self.commonest_class).copied().unwrap_or(0.0)
    }

    /// The trivial mask's IoU of class `c`.
    pub fn trivial_iou(&self, c: usize) -> f64 {
        if c == self.commonest_class {
            self.trivial_pixel_accuracy()
        } else {
            0.0
        }
    }

    /// Loss, pixel accuracy and each class's IoU per epoch.
    pub fn epoch_table(&self) -> Table {
        let mut head = vec!["epoch".to_owned(), "train loss".into(), "train pixel acc".into(), "val loss".into(), "val pixel acc".into()];
        head.extend(self.classes.iter().map(|c| format!("IoU {c}")));
        head.push("seconds".into());
        let columns: Vec<usize> = (0..head.len()).collect();
        let mut table = Table::new(head).right_align(&columns);
        for e in &self.epochs {
            let mut row = vec![
                (e.epoch + 1).to_string(),
                format!("{:.4}", e.train_loss),
                percent_of_one(Some(e.train_accuracy)),
                format!("{:.4}", e.val_loss),
                percent_of_one(Some(e.val_accuracy)),
            ];
            row.extend((0..self.classes.len()).map(|c| percent_of_one(e.val_iou.get(c).copied().flatten())));
            row.push(format!("{:.1}", e.seconds));
            table.push_row(row);
        }
        table
    }

    /// IoU per class beside the share of pixels and the trivial mask's IoU.
    pub fn table(&self) -> Table {
        let c = &self.config;
        let mut table = Table::new(["class", "val pixels", "IoU", "IoU of the trivial mask"])
            .title(format!(
                "{} at {}x{}{}, {} epochs: pixel accuracy {:.1}% (every pixel {}: {:.1}%); {} train / {} val photos",
                c.model.as_str(),
                c.res,
                c.res,
                if c.precision == crate::models::Precision::F32 { String::new() } else { format!(", {}", c.precision) },
                c.epochs,
                100.0 * self.val_pixel_accuracy,
                self.classes.get(self.commonest_class).map_or("?", String::as_str),
                100.0 * self.trivial_pixel_accuracy(),
                self.train_images,
                self.val_images
            ))
            .right_align(&[1, 2, 3]);
        for (i, class) in self.classes.iter().enumerate() {
            table.push_row([
                class.clone(),
                percent_of_one(self.val_pixel_shares.get(i).copied()),
                percent_of_one(self.val_iou.get(i).copied().flatten()),
                percent_of_one(Some(self.trivial_iou(i))),
            ]);
        }
        table
    }
}

impl Render for SegmentReport {
    fn bundle(&self) -> Bundle {
        self.table().bundle()
    }
}

/// The names of `count` mask classes: the synthetic set's where they are
/// its two, numbers otherwise.
fn class_names(count: u32) -> Vec<String> {
    if count as usize == MASK_CLASSES.len() {
        MASK_CLASSES.iter().map(|c| c.to_string()).collect()
    } else {
        (0..count).map(|c| format!("class {c}")).collect()
    }
}

/// Trains `config.model` (a network that labels each pixel) on `split.train`
/// of `folder`, image and mask through the same transforms, validating after
/// every epoch on `split.val`; then the last epoch's IoU per class beside
/// each class's share of the pixels.
pub fn fit_segmentation(
    folder: &SegmentationFolder,
    split: &Split,
    config: &LearnConfig,
    device: &Device,
    watch: &mut dyn FnMut(&TrainEvent),
) -> Result<SegmentReport, LearnError> {
    if !config.model.segments() {
        return Err(DataError::invalid(
            "fit_segmentation",
            format!("{} gives one label per image; a folder with masks needs a model that labels each pixel (unet)", config.model),
        )
        .into());
    }
    let started = Instant::now();
    let classes = folder.mask_classes as usize;
    let (trainer, _, epochs) = train_on(
        "fit_segmentation",
        |indices, transforms| folder.dataset(indices, transforms),
        classes,
        split,
        config,
        super::Placement { device, collective: None },
        watch,
    )?;
    let last = epochs.last().cloned();
    let counts = trainer.history().evals().last().map(|eval| eval.labelled.clone()).unwrap_or_default();
    let total = counts.iter().sum::<u64>().max(1) as f64;
    let commonest_class = commonest(folder, split, classes)?;
    Ok(SegmentReport {
        config: config.clone(),
        train_images: split.train.len(),
        val_images: split.val.len(),
        classes: class_names(folder.mask_classes),
        val_pixel_accuracy: last.as_ref().map_or(f64::NAN, |e| e.val_accuracy),
        val_iou: last.map(|e| e.val_iou).unwrap_or_default(),
        val_pixel_shares: counts.iter().map(|&c| c as f64 / total).collect(),
        commonest_class,
        epochs,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The class most pixels of the training masks carry, at their full size.
fn commonest(folder: &SegmentationFolder, split: &Split, classes: usize) -> Result<usize, DataError> {
    let mut counts = vec![0u64; classes];
    for &i in &split.train {
        let mask = crate::data::Mask::read_png(&folder.items[i].mask)?;
        for (c, count) in counts.iter_mut().enumerate() {
            *count += mask.count(c as u8);
        }
    }
    Ok(counts.iter().enumerate().max_by_key(|(_, &n)| n).map_or(0, |(c, _)| c))
}
