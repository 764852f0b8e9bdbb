//! A learnable synthetic image task, generated in memory from a seed: each
//! class is a stripe orientation, drawn with a random phase, frequency, tint
//! and noise, so a CNN must learn oriented filters to tell them apart.

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
        let mut rng = StdRng::seed_from_u64(seed);
        let noise = Normal::new(0.0f32, self.noise.max(f32::MIN_POSITIVE)).map_err(candle_core::Error::wrap)?;
        let plane = self.res * self.res;
        let mut pixels = Vec::with_capacity(count * 3 * plane);
        let mut labels = Vec::with_capacity(count);
        for i in 0..count {
            let class = i % self.classes.max(1);
            labels.push(class as u32);
            let angle = PI * class as f32 / self.classes.max(1) as f32;
            let (dx, dy) = (angle.cos(), angle.sin());
            let freq = rng.random_range(0.25..0.45f32);
            let phase = rng.random_range(0.0..2.0 * PI);
            let tint: [f32; 3] = [rng.random_range(0.5..1.0), rng.random_range(0.5..1.0), rng.random_range(0.5..1.0)];
            for tint in tint {
                for y in 0..self.res {
                    for x in 0..self.res {
                        let t = (x as f32 * dx + y as f32 * dy) * freq + phase;
                        pixels.push(tint * t.sin() + noise.sample(&mut rng));
                    }
                }
            }
        }
        Ok((Tensor::from_vec(pixels, (count, 3, self.res, self.res), device)?, Tensor::from_vec(labels, count, device)?))
    }
}
