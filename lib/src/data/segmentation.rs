//! Images paired with masks of their pixels' classes, for segmentation
//! networks: `root/class/photo.jpg` goes with `masks_root/class/photo.png`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::decode::{decode_file, DecodeOptions, Decoder};
use super::folder::{ImageFolder, ImageItem, OnError};
use super::loader::{Dataset, Example, LoadTiming, MemoryGauge};
use super::mask::Mask;
use super::transform::Transforms;
use super::{DataError, Rng};

/// An image (with its photo class and plant) and the path of its mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentationItem {
    pub image: ImageItem,
    pub mask: PathBuf,
}

/// The images under `root/class/` as [`ImageFolder`] finds them, each with
/// its mask under `masks_root` at the same relative path, extension `.png`.
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentationFolder {
    pub root: PathBuf,
    pub masks_root: PathBuf,
    /// Photo classes (the image folders), in sorted order: what an item's label indexes.
    pub classes: Vec<String>,
    /// Mask pixels hold the classes 0 to `mask_classes - 1`.
    pub mask_classes: u32,
    pub items: Vec<SegmentationItem>,
    /// Files left out, with why.
    pub skipped: Vec<(PathBuf, String)>,
}

impl SegmentationFolder {
    /// Lists the images as [`ImageFolder::open`] does and pairs each with its
    /// mask without decoding either: an image whose mask is missing fails with
    /// an error naming both, or is left out by policy. [`SegmentationFolder::verify`]
    /// checks every mask's size and values; each load checks its own.
    pub fn open(root: &Path, masks_root: &Path, mask_classes: u32, policy: OnError) -> Result<Self, DataError> {
        if !(1..=256).contains(&mask_classes) {
            return Err(DataError::invalid(
                "SegmentationFolder",
                format!("{mask_classes} mask classes: an 8-bit mask holds 1 to 256 classes"),
            ));
        }
        if !masks_root.is_dir() {
            return Err(DataError::invalid(
                "SegmentationFolder",
                format!(
                    "the masks folder {} is not a directory (expected masks_root/class/*.png beside {})",
                    masks_root.display(),
                    root.display()
                ),
            ));
        }
        let folder = ImageFolder::open(root, policy)?;
        let mut skipped = folder.skipped;
        let mut items = Vec::with_capacity(folder.items.len());
        let mut paired: HashMap<PathBuf, PathBuf> = HashMap::new();
        for image in folder.items {
            let relative = image.path.strip_prefix(&folder.root).unwrap_or(&image.path);
            let mask = masks_root.join(relative).with_extension("png");
            if let Some(first) = paired.get(&mask) {
                let message = format!(
                    "it is already the mask of {}: two photos that differ only in their extension would share one mask; rename one",
                    first.display()
                );
                if policy == OnError::Fail {
                    return Err(DataError::Mask { image: image.path, mask, message });
                }
                skipped.push((image.path, message));
            } else if mask.is_file() {
                paired.insert(mask.clone(), image.path.clone());
                items.push(SegmentationItem { image, mask });
            } else if policy == OnError::Fail {
                return Err(DataError::Mask { image: image.path, mask, message: MISSING.into() });
            } else {
                skipped.push((image.path, format!("no mask at {}", mask.display())));
            }
        }
        if items.is_empty() {
            return Err(DataError::Empty { root: root.to_owned() });
        }
        Ok(SegmentationFolder {
            root: folder.root,
            masks_root: masks_root.to_owned(),
            classes: folder.classes,
            mask_classes,
            items,
            skipped,
        })
    }

    /// Reads every mask and the header of every image (decoded at 1/8 scale
    /// where possible) and, by policy, fails on the first pair that does not
    /// match (sizes, a class out of range, an unreadable file) or moves it to `skipped`.
    pub fn verify(&mut self, policy: OnError) -> Result<(), DataError> {
        let options = DecodeOptions { decoder: Decoder::TurboJpeg, min_short_side: Some(1) };
        let mut kept = Vec::with_capacity(self.items.len());
        for item in self.items.drain(..) {
            let checked = decode_file(&item.image.path, options)
                .and_then(|decoded| Ok((decoded, Mask::read_png(&item.mask)?)))
                .and_then(|(decoded, mask)| check_pair(&item, decoded.upright_size, &mask, self.mask_classes));
            match checked {
                Ok(()) => kept.push(item),
                Err(err) if policy == OnError::Skip => self.skipped.push((item.image.path.clone(), err.to_string())),
                Err(err) => return Err(err),
            }
        }
        self.items = kept;
        if self.items.is_empty() {
            return Err(DataError::Empty { root: self.root.clone() });
        }
        Ok(())
    }

    /// Photo classes (what samplers and splits balance and stratify).
    pub fn labels(&self) -> Vec<u32> {
        self.items.iter().map(|i| i.image.label).collect()
    }

    /// Group ids; an image without one is its own group.
    pub fn groups(&self) -> Vec<u64> {
        self.items.iter().enumerate().map(|(i, item)| item.image.group.unwrap_or(u64::MAX - i as u64)).collect()
    }

    /// The pairs at `indices`, as a dataset with `transforms`.
    pub fn dataset(&self, indices: &[usize], transforms: Transforms) -> SegmentationDataset {
        SegmentationDataset::new(indices.iter().map(|&i| self.items[i].clone()).collect(), self.mask_classes, transforms)
    }

    /// Every pair, as a dataset with `transforms`.
    pub fn all(&self, transforms: Transforms) -> SegmentationDataset {
        SegmentationDataset::new(self.items.clone(), self.mask_classes, transforms)
    }
}

const MISSING: &str = "missing: every image needs a mask at its relative path under the masks folder, extension .png";

/// The mask must cover its image as shown (upright, at full size) and hold only known classes.
fn check_pair(item: &SegmentationItem, upright: (u32, u32), mask: &Mask, mask_classes: u32) -> Result<(), DataError> {
    let err = |message: String| DataError::Mask { image: item.image.path.clone(), mask: item.mask.clone(), message };
    if (mask.width(), mask.height()) != upright {
        return Err(err(format!(
            "the mask is {}x{} but the image is {}x{} (upright, after its EXIF orientation)",
            mask.width(),
            mask.height(),
            upright.0,
            upright.1
        )));
    }
    if let Some((x, y, class)) = mask.first_outside(mask_classes) {
        return Err(err(format!("pixel ({x}, {y}) holds class {class}, but there are {mask_classes} classes (0 to {})", mask_classes - 1)));
    }
    Ok(())
}

/// Image and mask pairs read from disk when asked for, given the same
/// geometric transforms; each example carries its mask, so batches carry N x H x W labels.
#[derive(Debug, Clone)]
pub struct SegmentationDataset {
    pub items: Vec<SegmentationItem>,
    pub mask_classes: u32,
    pub transforms: Transforms,
    pub decoder: Decoder,
}

impl SegmentationDataset {
    pub fn new(items: Vec<SegmentationItem>, mask_classes: u32, transforms: Transforms) -> Self {
        SegmentationDataset { items, mask_classes, transforms, decoder: Decoder::default() }
    }

    pub fn with_decoder(mut self, decoder: Decoder) -> Self {
        self.decoder = decoder;
        self
    }
}

impl Dataset for SegmentationDataset {
    fn len(&self) -> usize {
        self.items.len()
    }

    /// The photo's class, not a pixel's.
    fn label(&self, index: usize) -> u32 {
        self.items[index].image.label
    }

    fn has_masks(&self) -> bool {
        true
    }

    fn describe(&self, index: usize) -> String {
        self.items[index].image.path.display().to_string()
    }

    fn load(&self, index: usize, rng: &mut Rng, gauge: &MemoryGauge) -> Result<Example, DataError> {
        let item = &self.items[index];
        let options = DecodeOptions { decoder: self.decoder, min_short_side: self.transforms.decode_hint() };
        let decoded = decode_file(&item.image.path, options)?;
        let mask = Mask::read_png(&item.mask)?;
        let _decoded_bytes = gauge.hold(decoded.image.bytes() + mask.classes().len());
        check_pair(item, decoded.upright_size, &mask, self.mask_classes)?;
        let started = Instant::now();
        let decoded_pixels = decoded.image.width() as u64 * decoded.image.height() as u64;
        // A JPEG decoded at a DCT scale below full size is smaller than its mask.
        let mask = mask.resize(decoded.image.width(), decoded.image.height())?;
        let (image, mask) = self.transforms.apply_with_mask(decoded.image, mask, rng)?;
        let shape = [3, image.height() as usize, image.width() as usize];
        let mut pixels = vec![0.0f32; shape.iter().product()];
        self.transforms.to_tensor_into(&image, &mut pixels)?;
        Ok(Example {
            pixels,
            shape,
            label: item.image.label,
            mask: Some(mask.into_classes()),
            timing: LoadTiming {
                encoded_bytes: decoded.encoded_bytes as u64,
                decode_seconds: decoded.seconds,
                transform_seconds: started.elapsed().as_secs_f64(),
                decoded_pixels,
            },
        })
    }
}

#[cfg(test)]
mod tests;
