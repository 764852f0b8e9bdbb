//! A learnable synthetic image task, generated in memory from a seed: each
//! class is a stripe orientation, drawn with a random phase, frequency, tint
//! and noise, so a CNN must learn oriented filters to tell them apart. Its
//! segmentation form draws each image as bands of classes, each pixel
//! labelled with the class whose stripes it shows.

use std::f32::consts::PI;

use candle_core::{Device, Result, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

/// `classes` stripe orientations at `res x res`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stripes {
    pub classes: usize,
    pub res: usize,
    /// Standard deviation of the pixel noise (the signal's amplitude is 1).
    pub noise: f32,
}

impl Stripes {
    pub fn new(classes: usize, res: usize) -> Self {
        Stripes { classes, res, noise: 0.8 }
    }

    /// `count` images (`count x 3 x res x res`, f32) and their labels (u32),
    /// the same for the same seed; labels cycle through the classes.
    pub fn generate(&self, count: usize, seed: u64, device: &Device) -> Result<(Tensor, Tensor)> {
        let labels: Vec<u32> = (0..count).map(|i| (i % self.classes.max(1)) as u32).collect();
        let (images, _) = self.draw(count, seed, |i, _| Classes::Whole(labels[i]))?;
        Ok((Tensor::from_vec(images, (count, 3, self.res, self.res), device)?, Tensor::from_vec(labels, count, device)?))
    }

    /// `count` images and their per-pixel labels (`count x res x res`, u32):
    /// each image is bands of classes across a random direction, each band
    /// striped in its class's orientation. The same for the same seed.
    pub fn generate_regions(&self, count: usize, seed: u64, device: &Device) -> Result<(Tensor, Tensor)> {
        let classes = self.classes.max(1);
        let res = self.res;
        let pixel_classes = |_: usize, rng: &mut StdRng| {
            let angle = rng.random_range(0.0..PI);
            let (dx, dy) = (angle.cos(), angle.sin());
            let (width, offset) = (rng.random_range(0.25..0.6f32) * res as f32, rng.random_range(0.0..classes as f32));
            let mut pixel = Vec::with_capacity(res * res);
            for y in 0..res {
                for x in 0..res {
                    let band = (x as f32 * dx + y as f32 * dy) / width + offset;
                    pixel.push(band.rem_euclid(classes as f32) as u32 % classes as u32);
                }
            }
            Classes::PerPixel(pixel)
        };
        let (images, labels) = self.draw(count, seed, pixel_classes)?;
        Ok((Tensor::from_vec(images, (count, 3, res, res), device)?, Tensor::from_vec(labels, (count, res, res), device)?))
    }

    /// The pixels of `count` images, each pixel striped in the orientation of
    /// the class `classes_of` gives it, and the per-pixel classes where it
    /// gives them pixel by pixel.
    fn draw(&self, count: usize, seed: u64, mut classes_of: impl FnMut(usize, &mut StdRng) -> Classes) -> Result<(Vec<f32>, Vec<u32>)> {
        let mut rng = StdRng::seed_from_u64(seed);
        let noise = Normal::new(0.0f32, self.noise.max(f32::MIN_POSITIVE)).map_err(candle_core::Error::wrap)?;
        let plane = self.res * self.res;
        let classes = self.classes.max(1) as f32;
        let mut pixels = Vec::with_capacity(count * 3 * plane);
        let mut labels = Vec::new();
        for i in 0..count {
            let classes_here = classes_of(i, &mut rng);
            let freq = rng.random_range(0.25..0.45f32);
            let phase = rng.random_range(0.0..2.0 * PI);
            let tint: [f32; 3] = [rng.random_range(0.5..1.0), rng.random_range(0.5..1.0), rng.random_range(0.5..1.0)];
            for tint in tint {
                for y in 0..self.res {
                    for x in 0..self.res {
                        let angle = PI * classes_here.at(y * self.res + x) as f32 / classes;
                        let t = (x as f32 * angle.cos() + y as f32 * angle.sin()) * freq + phase;
                        pixels.push(tint * t.sin() + noise.sample(&mut rng));
                    }
                }
            }
            if let Classes::PerPixel(classes_here) = classes_here {
                labels.extend(classes_here);
            }
        }
        Ok((pixels, labels))
    }
}

/// One image's classes: one for the whole image, or one per pixel.
enum Classes {
    Whole(u32),
    PerPixel(Vec<u32>),
}

impl Classes {
    fn at(&self, pixel: usize) -> u32 {
        match self {
            Classes::Whole(class) => *class,
            Classes::PerPixel(classes) => classes[pixel],
        }
    }
}
