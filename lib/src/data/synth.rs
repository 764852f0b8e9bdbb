//! `LeafDiseaseSynth`: a seeded generator of leaf photos in the ImageFolder
//! layout. Twelve classes (healthy and eleven diseases, each with its own
//! lesion colour, shape, size and texture), imbalanced, several photos per
//! plant, mixed resolutions, lighting, in-plane angle, EXIF orientation and
//! JPEG quality. It knows where it drew each lesion: [`LeafDiseaseSynth::mask`]
//! gives a photo's lesion mask for segmentation.

use std::f32::consts::PI;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rand::Rng as _;
use rayon::prelude::*;

use super::decode::RgbImage;
use super::manifest::{Manifest, ManifestEntry};
use super::mask::Mask;
use super::{rng_for, DataError, Rng};
use crate::render::Progress;

/// Class folder names; a folder's index in this list is its label.
pub const CLASSES: [&str; 12] = [
    "bacterial_spot",
    "early_blight",
    "healthy",
    "late_blight",
    "leaf_mold",
    "leaf_scorch",
    "mosaic_virus",
    "powdery_mildew",
    "rust",
    "septoria_spot",
    "target_spot",
    "yellow_curl",
];

/// The classes of a lesion mask: a pixel value is its index here. Healthy
/// leaf and background are both "not lesion".
pub const MASK_CLASSES: [&str; 2] = ["not_lesion", "lesion"];

/// A point is lesion where some spot's relative distance is below this: the
/// lesion itself. What a class draws beyond it (a yellow halo, a water-soaked
/// rim, the fading edge of mould or mildew) is leaf tissue around the lesion.
const LESION_EDGE: f32 = 1.0;

/// The mask value of a lesion pixel, its index in [`MASK_CLASSES`].
const LESION: u8 = 1;

/// What a class does to the leaf, for reports that group the classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Symptom {
    Healthy,
    /// Many small lesions that differ in size, ring pattern and colour.
    Spots,
    /// A few large patches.
    Blotches,
    /// Colour changes of the leaf itself (mottle, yellow or brown margins), no lesions.
    Discolouration,
}

impl Symptom {
    /// The symptom of a class of [`CLASSES`]; `None` for any other name.
    pub fn of(class: &str) -> Option<Symptom> {
        Some(match class {
            "healthy" => Symptom::Healthy,
            "bacterial_spot" | "early_blight" | "rust" | "septoria_spot" | "target_spot" => Symptom::Spots,
            "late_blight" | "leaf_mold" | "powdery_mildew" => Symptom::Blotches,
            "leaf_scorch" | "mosaic_virus" | "yellow_curl" => Symptom::Discolouration,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Symptom::Healthy => "healthy",
            Symptom::Spots => "spots",
            Symptom::Blotches => "blotches",
            Symptom::Discolouration => "discolouration",
        }
    }
}

/// Relative class frequencies: healthy is the largest, leaf scorch 10x rarer.
const FREQUENCY: [f64; 12] = [2.6, 6.0, 10.0, 4.5, 3.5, 1.0, 1.6, 2.2, 1.9, 3.0, 1.2, 1.4];

/// A share of the photos taken at one resolution (landscape; EXIF may turn it).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SizeShare {
    pub width: u32,
    pub height: u32,
    pub share: f64,
}

/// The generator's settings. Same settings, same bytes.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LeafDiseaseSynth {
    pub images: usize,
    pub seed: u64,
    pub sizes: Vec<SizeShare>,
    /// JPEG quality range, inclusive.
    pub quality: (u8, u8),
    /// Photos per plant, inclusive.
    pub photos_per_plant: (u32, u32),
}

/// One photo to generate.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PhotoPlan {
    pub index: usize,
    pub class: usize,
    pub plant: u64,
    pub photo: u32,
    /// Upright size.
    pub width: u32,
    pub height: u32,
    pub quality: u8,
    pub orientation: u8,
}

impl PhotoPlan {
    pub fn relative_path(&self) -> PathBuf {
        PathBuf::from(CLASSES[self.class]).join(format!("p{:05}_{}.jpg", self.plant, self.photo))
    }

    /// The mask's path under the masks folder: the photo's, with the extension `.png`.
    pub fn mask_path(&self) -> PathBuf {
        self.relative_path().with_extension("png")
    }

    /// The size the file stores: turned when the orientation is 5 to 8 (the decoder shows width x height).
    fn stored_size(&self) -> (u32, u32) {
        if matches!(self.orientation, 5..=8) {
            (self.height, self.width)
        } else {
            (self.width, self.height)
        }
    }

    /// The canvas the shapes are drawn on before enlarging: up to 960 pixels a side.
    fn canvas_size(&self) -> (u32, u32) {
        let limit = 960.0;
        let scale = (limit / self.width.max(self.height) as f32).min(1.0);
        let cw = ((self.width as f32 * scale).round() as u32).max(16);
        let ch = ((self.height as f32 * scale).round() as u32).max(16);
        (cw, ch)
    }
}

impl Default for LeafDiseaseSynth {
    fn default() -> Self {
        LeafDiseaseSynth::new(3000, 42)
    }
}

impl LeafDiseaseSynth {
    /// `images` photos: 10% small (224x224), 50% 640x480, 30% 1600x1200, 10% 4000x3000.
    pub fn new(images: usize, seed: u64) -> Self {
        LeafDiseaseSynth {
            images,
            seed,
            sizes: vec![
                SizeShare { width: 224, height: 224, share: 0.10 },
                SizeShare { width: 640, height: 480, share: 0.50 },
                SizeShare { width: 1600, height: 1200, share: 0.30 },
                SizeShare { width: 4000, height: 3000, share: 0.10 },
            ],
            quality: (60, 95),
            photos_per_plant: (1, 5),
        }
    }

    /// All photos at one size (tests, quick notebook runs).
    pub fn with_size(mut self, width: u32, height: u32) -> Self {
        self.sizes = vec![SizeShare { width, height, share: 1.0 }];
        self
    }

    pub fn with_sizes(mut self, sizes: Vec<SizeShare>) -> Self {
        self.sizes = sizes;
        self
    }

    fn check(&self) -> Result<(), DataError> {
        let bad = |m: String| Err(DataError::invalid("LeafDiseaseSynth", m));
        if self.images < CLASSES.len() {
            return bad(format!("{} images cannot cover {} classes", self.images, CLASSES.len()));
        }
        if self.sizes.is_empty()
            || self.sizes.iter().any(|s| s.width < 16 || s.height < 16 || s.width > 65_000 || s.height > 65_000 || s.share < 0.0)
        {
            return bad("sizes must be 16 to 65000 pixels a side with shares of at least 0".into());
        }
        if self.sizes.iter().map(|s| s.share).sum::<f64>() <= 0.0 {
            return bad("the size shares add up to 0".into());
        }
        if !(1..=100).contains(&self.quality.0) || self.quality.0 > self.quality.1 || self.quality.1 > 100 {
            return bad(format!("JPEG quality {:?} must be a range within 1..=100", self.quality));
        }
        if self.photos_per_plant.0 == 0 || self.photos_per_plant.0 > self.photos_per_plant.1 {
            return bad(format!("photos per plant {:?} must be a range starting at 1 or more", self.photos_per_plant));
        }
        Ok(())
    }

    /// Images per class: proportional to the class frequencies, at least one each, summing to `images`.
    pub fn class_counts(&self) -> Vec<usize> {
        let total: f64 = FREQUENCY.iter().sum();
        let mut counts: Vec<usize> = FREQUENCY.iter().map(|f| ((self.images as f64 * f / total).floor() as usize).max(1)).collect();
        let mut order: Vec<usize> = (0..CLASSES.len()).collect();
        order.sort_by(|&a, &b| FREQUENCY[b].total_cmp(&FREQUENCY[a]));
        let mut i = 0;
        while counts.iter().sum::<usize>() < self.images {
            counts[order[i % order.len()]] += 1;
            i += 1;
        }
        while counts.iter().sum::<usize>() > self.images {
            let largest = order[0];
            counts[largest] -= 1;
        }
        counts
    }

    /// Every photo's class, plant, size, quality and orientation.
    pub fn plan(&self) -> Result<Vec<PhotoPlan>, DataError> {
        self.check()?;
        let mut rng = rng_for(self.seed, 5, 0);
        let total_share: f64 = self.sizes.iter().map(|s| s.share).sum();
        let mut plans = Vec::with_capacity(self.images);
        let mut plant = 0u64;
        for (class, count) in self.class_counts().into_iter().enumerate() {
            let mut left = count;
            while left > 0 {
                let photos = (rng.random_range(self.photos_per_plant.0..=self.photos_per_plant.1) as usize).min(left);
                for photo in 0..photos {
                    let mut pick = rng.random::<f64>() * total_share;
                    let size = *self
                        .sizes
                        .iter()
                        .find(|s| {
                            pick -= s.share;
                            pick < 0.0
                        })
                        .unwrap_or(&self.sizes[self.sizes.len() - 1]);
                    let orientation = match rng.random_range(0..100) {
                        0..=79 => 1,
                        80..=89 => 6,
                        90..=95 => 8,
                        _ => 3,
                    };
                    plans.push(PhotoPlan {
                        index: plans.len(),
                        class,
                        plant,
                        photo: photo as u32,
                        width: size.width,
                        height: size.height,
                        quality: rng.random_range(self.quality.0..=self.quality.1),
                        orientation,
                    });
                }
                left -= photos;
                plant += 1;
            }
        }
        Ok(plans)
    }

    /// Writes every photo under `out/class/` and `out/manifest.csv`, with a progress bar.
    pub fn generate(&self, out: &Path) -> Result<Manifest, DataError> {
        let plans = self.plan()?;
        for class in CLASSES {
            let dir = out.join(class);
            std::fs::create_dir_all(&dir).map_err(DataError::io("creating", dir))?;
        }
        let progress = Mutex::new(Progress::new("synth", plans.len() as u64));
        let entries: Result<Vec<ManifestEntry>, DataError> = plans
            .par_iter()
            .map(|plan| {
                let bytes = self.encode(plan)?;
                let path = out.join(plan.relative_path());
                std::fs::write(&path, &bytes).map_err(DataError::io("writing", &path))?;
                if let Ok(mut p) = progress.lock() {
                    p.inc(1);
                }
                let (width, height) = plan.stored_size();
                Ok(ManifestEntry {
                    path: plan.relative_path(),
                    class: CLASSES[plan.class].to_owned(),
                    group: plan.plant,
                    width,
                    height,
                    bytes: bytes.len() as u64,
                    quality: plan.quality,
                    orientation: plan.orientation,
                })
            })
            .collect();
        if let Ok(mut p) = progress.lock() {
            p.finish();
        }
        let manifest = Manifest { entries: entries? };
        manifest.write(out)?;
        Ok(manifest)
    }

    /// Writes every photo's lesion mask under `masks_out/class/` (the photo's
    /// relative path with the extension `.png`; see [`Mask`]), with a
    /// progress bar, and says how much of the photos is lesion. Only the
    /// geometry is drawn again: the photos need not exist, nor be rewritten.
    pub fn generate_masks(&self, masks_out: &Path) -> Result<LesionShare, DataError> {
        let plans = self.plan()?;
        for class in CLASSES {
            let dir = masks_out.join(class);
            std::fs::create_dir_all(&dir).map_err(DataError::io("creating", dir))?;
        }
        self.measure_masks(&plans, Some(masks_out))
    }

    /// How much of the photos is lesion, from their masks, writing nothing.
    pub fn lesion_share(&self) -> Result<LesionShare, DataError> {
        self.measure_masks(&self.plan()?, None)
    }

    fn measure_masks(&self, plans: &[PhotoPlan], write_to: Option<&Path>) -> Result<LesionShare, DataError> {
        let progress = Mutex::new(Progress::new("masks", plans.len() as u64));
        let counted: Result<Vec<(usize, u64, u64)>, DataError> = plans
            .par_iter()
            .map(|plan| {
                let mask = self.mask(plan)?;
                if let Some(root) = write_to {
                    mask.write_png(&root.join(plan.mask_path()))?;
                }
                if let Ok(mut p) = progress.lock() {
                    p.inc(1);
                }
                Ok((plan.class, mask.classes().len() as u64, mask.count(LESION)))
            })
            .collect();
        if let Ok(mut p) = progress.lock() {
            p.finish();
        }
        let mut share = LesionShare {
            photos: vec![0; CLASSES.len()],
            pixels: vec![0; CLASSES.len()],
            lesion_pixels: vec![0; CLASSES.len()],
            photo_shares: vec![0.0; CLASSES.len()],
            empty_masks: vec![0; CLASSES.len()],
        };
        for (class, pixels, lesion) in counted? {
            share.photos[class] += 1;
            share.pixels[class] += pixels;
            share.lesion_pixels[class] += lesion;
            share.photo_shares[class] += lesion as f64 / pixels as f64;
            share.empty_masks[class] += usize::from(lesion == 0);
        }
        Ok(share)
    }

    /// Checks that the photos described by `manifest` (read from `root`) are
    /// the ones these settings write, so that masks made from the settings fit them.
    pub fn check_manifest(&self, manifest: &Manifest, root: &Path) -> Result<(), DataError> {
        let plans = self.plan()?;
        let path = root.join(super::manifest::MANIFEST_FILE);
        let mismatch = |line: usize, message: String| DataError::Manifest {
            path: path.clone(),
            line,
            message: format!("{message}: these photos were written with other settings (images, seed, sizes) than the masks'"),
        };
        if manifest.entries.len() != plans.len() {
            return Err(mismatch(1, format!("{} photos listed, the settings make {}", manifest.entries.len(), plans.len())));
        }
        for (i, (entry, plan)) in manifest.entries.iter().zip(&plans).enumerate() {
            let (width, height) = plan.stored_size();
            if entry.path != plan.relative_path() || (entry.width, entry.height, entry.orientation) != (width, height, plan.orientation) {
                return Err(mismatch(
                    i + 2,
                    format!(
                        "{} is stored {}x{} with orientation {}, the settings make {} stored {width}x{height} with orientation {}",
                        entry.path.display(),
                        entry.width,
                        entry.height,
                        entry.orientation,
                        plan.relative_path().display(),
                        plan.orientation
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The JPEG file of one photo: pixels stored turned so that its EXIF orientation shows them upright.
    pub fn encode(&self, plan: &PhotoPlan) -> Result<Vec<u8>, DataError> {
        let upright = self.render(plan)?;
        let (w, h) = (upright.width(), upright.height());
        let image = image::RgbImage::from_raw(w, h, upright.into_pixels())
            .ok_or_else(|| DataError::invalid("synth", "rendered buffer has the wrong length"))?;
        let stored = match plan.orientation {
            6 => image::imageops::rotate270(&image),
            8 => image::imageops::rotate90(&image),
            3 => image::imageops::rotate180(&image),
            _ => image,
        };
        let mut bytes = Vec::new();
        let err = |e: jpeg_encoder::EncodingError| DataError::Encode { path: plan.relative_path(), message: e.to_string() };
        let mut encoder = jpeg_encoder::Encoder::new(&mut bytes, plan.quality);
        if plan.orientation != 1 {
            encoder.add_app_segment(1, exif_orientation(plan.orientation)).map_err(err)?;
        }
        let (sw, sh) = stored.dimensions();
        encoder.encode(stored.as_raw(), sw as u16, sh as u16, jpeg_encoder::ColorType::Rgb).map_err(err)?;
        Ok(bytes)
    }

    /// The upright photo.
    pub fn render(&self, plan: &PhotoPlan) -> Result<RgbImage, DataError> {
        let plant = Plant::new(self.seed, plan.plant, plan.class);
        let mut rng = rng_for(self.seed, 3, plan.index as u64);
        let scene = Scene::new(&mut rng);
        // Shapes are drawn on the canvas, then enlarged; sensor noise is added at full size.
        let (cw, ch) = plan.canvas_size();
        let canvas = draw(&plant, &scene, cw, ch)?;
        let mut image = canvas.resize(plan.width, plan.height)?;
        let noise_seed = rng.random::<u32>();
        let amplitude = scene.noise;
        for (i, p) in image.pixels_mut().chunks_exact_mut(3).enumerate() {
            let n = (hash(i as u32, noise_seed) as f32 / u32::MAX as f32 - 0.5) * 2.0 * amplitude;
            for c in p.iter_mut() {
                *c = (*c as f32 + n).clamp(0.0, 255.0) as u8;
            }
        }
        Ok(image)
    }

    /// The upright photo's lesion mask, the size of [`LeafDiseaseSynth::render`]'s
    /// image (and of the decoded JPEG, after its EXIF orientation): 1 where a
    /// lesion is drawn on the leaf (the small blemish some healthy leaves
    /// carry included), 0 on healthy leaf and background. A pixel
    /// is classed by the leaf point at its centre, where the enlargement of
    /// the canvas samples; on the canvas itself that is the point the drawing colours.
    pub fn mask(&self, plan: &PhotoPlan) -> Result<Mask, DataError> {
        let plant = Plant::new(self.seed, plan.plant, plan.class);
        let scene = Scene::new(&mut rng_for(self.seed, 3, plan.index as u64));
        let (cw, ch) = plan.canvas_size();
        let framing = Framing::new(&scene, cw, ch);
        let (sx, sy) = (cw as f32 / plan.width as f32, ch as f32 / plan.height as f32);
        let mut mask = Mask::filled(plan.width, plan.height, 0)?;
        for spot in &plant.spots {
            // Only the pixels near the spot can be inside it.
            let (cx, cy) = framing.canvas_point(spot.u, spot.v);
            let reach = spot.r * 1.8 * framing.half_length + 1.0;
            let span = |centre: f32, scale: f32, size: u32| {
                let first = ((centre - reach) / scale - 0.5).floor().max(0.0) as u32;
                let last = (((centre + reach) / scale - 0.5).ceil().max(0.0) as u32).min(size - 1);
                first..=last
            };
            for y in span(cy, sy, plan.height) {
                for x in span(cx, sx, plan.width) {
                    let (u, v) = framing.leaf_point((x as f32 + 0.5) * sx, (y as f32 + 0.5) * sy);
                    if plant.covers(u, v).is_some() && spot.distance(u, v).is_some_and(|t| t < LESION_EDGE) {
                        mask.set(x, y, LESION);
                    }
                }
            }
        }
        Ok(mask)
    }
}

/// How much of a set's photos is lesion, per class of [`CLASSES`] (indexed as it).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LesionShare {
    pub photos: Vec<usize>,
    /// Mask pixels, all classes.
    pub pixels: Vec<u64>,
    pub lesion_pixels: Vec<u64>,
    /// Sum of each photo's lesion share.
    pub photo_shares: Vec<f64>,
    /// Photos without a lesion pixel.
    pub empty_masks: Vec<usize>,
}

impl LesionShare {
    /// Lesion pixels over all pixels: predicting "not lesion" everywhere
    /// scores 1 minus this in pixel accuracy (and 0 lesion IoU).
    pub fn share(&self) -> f64 {
        self.lesion_pixels.iter().sum::<u64>() as f64 / self.pixels.iter().sum::<u64>().max(1) as f64
    }

    /// The mean of each photo's lesion share: the share a batch shows when
    /// every photo is resized to one size, whatever its resolution.
    pub fn mean_photo_share(&self) -> f64 {
        self.photo_shares.iter().sum::<f64>() / self.photos.iter().sum::<usize>().max(1) as f64
    }

    /// Lesion pixels over all pixels of the photos of class `class`.
    pub fn class_share(&self, class: usize) -> f64 {
        self.lesion_pixels[class] as f64 / self.pixels[class].max(1) as f64
    }
}

/// A minimal EXIF block (little-endian TIFF) holding only the orientation tag.
pub(crate) fn exif_orientation(orientation: u8) -> Vec<u8> {
    let mut b = b"Exif\0\0II\x2a\0\x08\0\0\0".to_vec();
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&0x0112u16.to_le_bytes());
    b.extend_from_slice(&3u16.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&(orientation as u16).to_le_bytes());
    b.extend_from_slice(&[0, 0]);
    b.extend_from_slice(&0u32.to_le_bytes());
    b
}

fn hash(x: u32, seed: u32) -> u32 {
    let mut h = x.wrapping_mul(0x9E37_79B1) ^ seed.wrapping_mul(0x85EB_CA77);
    h ^= h >> 15;
    h = h.wrapping_mul(0x2C1B_3C6D);
    h ^= h >> 12;
    h = h.wrapping_mul(0x297A_2D39);
    h ^ (h >> 15)
}

/// Smooth noise in 0..1 with features about one unit apart.
fn value_noise(x: f32, y: f32, seed: u32) -> f32 {
    let (x0, y0) = (x.floor(), y.floor());
    let (fx, fy) = (x - x0, y - y0);
    let (sx, sy) = (fx * fx * (3.0 - 2.0 * fx), fy * fy * (3.0 - 2.0 * fy));
    let at = |i: f32, j: f32| {
        let k = (i as i32 as u32).wrapping_mul(73_856_093) ^ (j as i32 as u32).wrapping_mul(19_349_663);
        hash(k, seed) as f32 / u32::MAX as f32
    };
    let top = at(x0, y0) * (1.0 - sx) + at(x0 + 1.0, y0) * sx;
    let bottom = at(x0, y0 + 1.0) * (1.0 - sx) + at(x0 + 1.0, y0 + 1.0) * sx;
    top * (1.0 - sy) + bottom * sy
}

/// A lesion in leaf coordinates (u along the midrib, v across, both about -1..1).
#[derive(Debug, Clone, Copy)]
struct Spot {
    u: f32,
    v: f32,
    r: f32,
    seed: u32,
}

impl Spot {
    /// The relative distance t of (u, v) from the centre (1 at the wobbly
    /// edge); `None` beyond anything the spot draws.
    fn distance(&self, u: f32, v: f32) -> Option<f32> {
        let (du, dv) = (u - self.u, v - self.v);
        let d2 = du * du + dv * dv;
        let reach = self.r * 1.8;
        if d2 > reach * reach {
            return None;
        }
        let d = d2.sqrt();
        let wobble = 1.0 + 0.25 * (value_noise(du / self.r * 2.0, dv / self.r * 2.0, self.seed) - 0.5);
        Some(d / (self.r * wobble))
    }
}

/// What stays the same in every photo of one plant.
struct Plant {
    class: usize,
    leaf: [f32; 3],
    width: f32,
    spots: Vec<Spot>,
    seed: u32,
}

impl Plant {
    fn new(seed: u64, plant: u64, class: usize) -> Plant {
        let mut rng = rng_for(seed, 4, plant);
        let leaf = [rng.random_range(40.0..90.0), rng.random_range(110.0..165.0), rng.random_range(30.0..70.0)];
        let texture_seed = rng.random();
        let width = rng.random_range(0.38..0.55) * if CLASSES[class] == "yellow_curl" { 0.8 } else { 1.0 };
        let (count, radius): ((u32, u32), (f32, f32)) = match CLASSES[class] {
            "healthy" => ((0, 1), (0.005, 0.012)),
            "early_blight" => ((4, 9), (0.06, 0.11)),
            "late_blight" => ((1, 3), (0.22, 0.4)),
            "leaf_mold" => ((4, 8), (0.12, 0.24)),
            "septoria_spot" => ((25, 55), (0.025, 0.045)),
            "bacterial_spot" => ((40, 90), (0.012, 0.022)),
            "powdery_mildew" => ((5, 11), (0.08, 0.17)),
            "rust" => ((30, 70), (0.018, 0.035)),
            "target_spot" => ((8, 18), (0.03, 0.055)),
            _ => ((0, 0), (0.0, 0.0)),
        };
        let n = if count.1 > 0 { rng.random_range(count.0..=count.1) } else { 0 };
        let spots = (0..n)
            .map(|_| Spot {
                u: rng.random_range(-0.85..0.85),
                v: rng.random_range(-0.9..0.9),
                r: if radius.1 > 0.0 { rng.random_range(radius.0..=radius.1) } else { 0.0 },
                seed: rng.random(),
            })
            .collect();
        Plant { class, leaf, width, spots, seed: texture_seed }
    }

    /// The leaf's half-width at (u, v) when the point is on the leaf.
    fn covers(&self, u: f32, v: f32) -> Option<f32> {
        let edge = self.width * (1.0 - u * u).max(0.0).powf(0.7) * (1.0 + 0.06 * (u * 9.0 + self.seed as f32).sin());
        (u.abs() < 1.0 && v.abs() < edge).then_some(edge)
    }
}

/// What changes from photo to photo: framing, angle, light, background, noise.
struct Scene {
    cx: f32,
    cy: f32,
    length: f32,
    angle: f32,
    gain: f32,
    tint: [f32; 3],
    background: [f32; 3],
    shadow: f32,
    noise: f32,
    seed: u32,
}

impl Scene {
    fn new(rng: &mut Rng) -> Scene {
        let gain = rng.random_range(0.6..1.35);
        let warm = rng.random_range(-0.12..0.12);
        let background = match rng.random_range(0..3) {
            0 => [rng.random_range(90.0..130.0), rng.random_range(70.0..95.0), rng.random_range(50.0..70.0)],
            1 => [rng.random_range(150.0..200.0); 3],
            _ => [rng.random_range(40.0..80.0), rng.random_range(70.0..110.0), rng.random_range(40.0..70.0)],
        };
        Scene {
            cx: rng.random_range(0.4..0.6),
            cy: rng.random_range(0.4..0.6),
            length: rng.random_range(0.7..0.95),
            angle: rng.random_range(-PI..PI),
            gain,
            tint: [1.0 + warm, 1.0, 1.0 - warm],
            background,
            shadow: rng.random_range(0.0..0.35),
            noise: rng.random_range(2.0..7.0) / gain,
            seed: rng.random(),
        }
    }
}

/// Where a scene puts the leaf on a canvas: canvas points to leaf coordinates and back.
struct Framing {
    half_length: f32,
    sin: f32,
    cos: f32,
    cx: f32,
    cy: f32,
}

impl Framing {
    fn new(scene: &Scene, w: u32, h: u32) -> Framing {
        let (wf, hf) = (w as f32, h as f32);
        let (sin, cos) = scene.angle.sin_cos();
        Framing { half_length: 0.5 * scene.length * wf.min(hf), sin, cos, cx: scene.cx * wf, cy: scene.cy * hf }
    }

    /// Leaf coordinates of the canvas point (px, py), pixel x's centre being x + 0.5.
    fn leaf_point(&self, px: f32, py: f32) -> (f32, f32) {
        let (dx, dy) = (px - self.cx, py - self.cy);
        let u = (dx * self.cos + dy * self.sin) / self.half_length;
        let v = (-dx * self.sin + dy * self.cos) / self.half_length;
        (u, v)
    }

    /// The canvas point of leaf coordinates (u, v).
    fn canvas_point(&self, u: f32, v: f32) -> (f32, f32) {
        (self.cx + self.half_length * (u * self.cos - v * self.sin), self.cy + self.half_length * (u * self.sin + v * self.cos))
    }
}

fn mix(a: [f32; 3], b: [f32; 3], t: f32) -> [f32; 3] {
    let t = t.clamp(0.0, 1.0);
    [0, 1, 2].map(|c| a[c] * (1.0 - t) + b[c] * t)
}

fn draw(plant: &Plant, scene: &Scene, w: u32, h: u32) -> Result<RgbImage, DataError> {
    let (wf, hf) = (w as f32, h as f32);
    let framing = Framing::new(scene, w, h);
    let mut pixels = Vec::with_capacity(w as usize * h as usize * 3);
    for y in 0..h {
        for x in 0..w {
            let (px, py) = (x as f32 + 0.5, y as f32 + 0.5);
            let noise = value_noise(px / wf * 6.0, py / hf * 6.0, scene.seed);
            let mut rgb = scene.background.map(|c| c * (0.8 + 0.35 * noise));
            let (u, v) = framing.leaf_point(px, py);
            if let Some(edge) = plant.covers(u, v) {
                rgb = leaf_colour(plant, u, v / edge, v);
            } else if u.abs() < 1.12 && u < 0.0 && v.abs() < 0.012 {
                rgb = mix(plant.leaf, [120.0, 140.0, 60.0], 0.5);
            }
            let shade = 1.0 - scene.shadow * (px / wf);
            let light = scene.gain * shade;
            for (channel, tint) in rgb.iter().zip(scene.tint) {
                pixels.push((channel * light * tint).clamp(0.0, 255.0) as u8);
            }
        }
    }
    RgbImage::new(w, h, pixels)
}

/// The leaf at (u, v): `across` is v relative to the local half-width (-1..1).
fn leaf_colour(plant: &Plant, u: f32, across: f32, v: f32) -> [f32; 3] {
    let texture = value_noise(u * 14.0 + 50.0, v * 14.0, plant.seed);
    let mut rgb = plant.leaf.map(|c| c * (0.88 + 0.2 * texture));
    // Midrib and lateral veins: lighter lines.
    let vein = (((u - across.abs() * 0.45) * 11.0).fract() - 0.5).abs();
    if v.abs() < 0.012 || (vein < 0.04 && across.abs() > 0.08) {
        rgb = mix(rgb, [170.0, 200.0, 120.0], 0.45);
    }
    let class = CLASSES[plant.class];
    match class {
        "mosaic_virus" => {
            let mottle = value_noise(u * 5.0 + 9.0, v * 5.0, plant.seed ^ 0xA5);
            if mottle > 0.55 {
                rgb = mix(rgb, [150.0, 190.0, 70.0], (mottle - 0.55) * 2.2);
            }
        }
        "yellow_curl" => {
            let margin = (across.abs() - 0.55) / 0.45;
            if margin > 0.0 {
                rgb = mix(rgb, [205.0, 195.0, 70.0], margin * 0.9);
            }
        }
        "leaf_scorch" => {
            let band = 0.72 + 0.15 * value_noise(u * 7.0, 3.0, plant.seed);
            if across.abs() > band || u > 0.85 {
                rgb = mix([120.0, 75.0, 35.0], [90.0, 55.0, 25.0], texture);
            } else if across.abs() > band - 0.1 {
                rgb = mix(rgb, [190.0, 170.0, 60.0], 0.6);
            }
        }
        _ => {}
    }
    for spot in &plant.spots {
        if let Some(t) = spot.distance(u, v) {
            rgb = lesion(class, rgb, t, spot, texture);
        }
    }
    rgb
}

/// A lesion's colour at relative distance t (1 = its edge) from its centre.
fn lesion(class: &str, rgb: [f32; 3], t: f32, spot: &Spot, texture: f32) -> [f32; 3] {
    match class {
        "early_blight" if t < 1.0 => {
            let ring = (t * 4.0 * PI).sin() * 0.5 + 0.5;
            mix([95.0, 60.0, 30.0], [60.0, 40.0, 20.0], ring)
        }
        "early_blight" if t < 1.25 => mix(rgb, [200.0, 185.0, 60.0], 0.6),
        "late_blight" if t < 1.0 => mix([70.0, 72.0, 45.0], [50.0, 45.0, 35.0], texture),
        "late_blight" if t < 1.3 => mix(rgb, [110.0, 120.0, 80.0], 0.7),
        "leaf_mold" if t < 1.6 => mix(rgb, [200.0, 200.0, 90.0], (1.6 - t) / 1.6 * 0.85),
        "septoria_spot" if t < 0.65 => [200.0, 195.0, 180.0],
        "septoria_spot" if t < 1.0 => [85.0, 50.0, 35.0],
        "bacterial_spot" if t < 1.0 => [35.0, 30.0, 25.0],
        "bacterial_spot" if t < 1.4 => mix(rgb, [170.0, 170.0, 60.0], 0.5),
        "powdery_mildew" if t < 1.3 => {
            let dust = value_noise(t * 30.0, (spot.seed % 97) as f32 + texture * 10.0, spot.seed);
            mix(rgb, [235.0, 238.0, 230.0], ((1.3 - t) / 1.3 * 1.2).min(1.0) * (0.5 + 0.5 * dust))
        }
        "rust" if t < 1.0 => mix([205.0, 110.0, 35.0], [170.0, 80.0, 25.0], t),
        "target_spot" if t < 1.0 => mix([120.0, 80.0, 40.0], [80.0, 50.0, 25.0], (t * 3.0 * PI).cos() * 0.5 + 0.5),
        "target_spot" if t < 1.7 => mix(rgb, [225.0, 215.0, 50.0], 0.85),
        "healthy" if t < 1.0 => mix(rgb, [110.0, 100.0, 60.0], 0.6),
        _ => rgb,
    }
}

#[cfg(test)]
mod tests;
