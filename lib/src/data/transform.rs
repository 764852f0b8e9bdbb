//! Per-sample transforms on the CPU (geometry and colour), then to a normalised CHW tensor slice.
//! A segmentation mask goes through the same geometry, sampled without mixing classes.

use rand::Rng as _;

use super::decode::RgbImage;
use super::mask::Mask;
use super::{DataError, Rng};

/// Channel mean and standard deviation, applied after scaling pixels to 0-1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalize {
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Normalize {
    /// ImageNet statistics, the lesson's template.
    pub const IMAGENET: Normalize = Normalize { mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225] };
}

/// Random colour changes, each factor drawn uniformly; torchvision's meaning.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ColorJitter {
    /// Brightness factor in [1-b, 1+b].
    pub brightness: f32,
    /// Contrast factor in [1-c, 1+c], blending with the mean grey.
    pub contrast: f32,
    /// Saturation factor in [1-s, 1+s], blending with the greyscale image.
    pub saturation: f32,
    /// Hue shift in [-h, h] turns (h at most 0.5).
    pub hue: f32,
}

/// One step of a per-sample pipeline.
#[derive(Debug, Clone, PartialEq)]
pub enum Transform {
    /// To exactly width x height (aspect not kept): the lesson's `Resize((224, 224))`.
    Resize {
        width: u32,
        height: u32,
    },
    /// Shorter side to `size`, aspect kept.
    ResizeShortSide {
        size: u32,
    },
    /// A random region of `scale` (area share) and `ratio` (aspect) resized to size x size.
    RandomResizedCrop {
        size: u32,
        scale: (f64, f64),
        ratio: (f64, f64),
    },
    CenterCrop {
        size: u32,
    },
    HorizontalFlip {
        p: f64,
    },
    VerticalFlip {
        p: f64,
    },
    /// A rotation by an angle drawn in [-max_degrees, max_degrees]; corners filled black
    /// (class 0 in a mask). Keep it small: large turns move lesions off the leaf.
    Rotation {
        max_degrees: f32,
    },
    ColorJitter(ColorJitter),
}

impl Transform {
    /// torchvision's defaults: scale (0.08, 1), ratio (3/4, 4/3).
    pub fn random_resized_crop(size: u32) -> Transform {
        Transform::RandomResizedCrop { size, scale: (0.08, 1.0), ratio: (0.75, 4.0 / 3.0) }
    }

    /// The shorter side this step reads at full quality, when it is the first to shrink the image.
    fn needed_short_side(&self) -> Option<u32> {
        match *self {
            Transform::Resize { width, height } => Some(width.max(height)),
            Transform::ResizeShortSide { size } | Transform::RandomResizedCrop { size, .. } | Transform::CenterCrop { size } => Some(size),
            _ => None,
        }
    }

    pub fn apply(&self, image: RgbImage, rng: &mut Rng) -> Result<RgbImage, DataError> {
        self.draw(image.width(), image.height(), rng).image(image)
    }

    /// The random choices of this step for a `width` x `height` input.
    fn draw(&self, width: u32, height: u32, rng: &mut Rng) -> Drawn {
        match *self {
            Transform::Resize { width, height } => Drawn::Resize { width, height },
            Transform::ResizeShortSide { size } => Drawn::ShortSide { size },
            Transform::RandomResizedCrop { size, scale, ratio } => {
                Drawn::Region { crop: random_region(width, height, scale, ratio, rng), width: size, height: size }
            }
            Transform::CenterCrop { size } => {
                let (w, h) = (width as f64, height as f64);
                let side = (size as f64).min(w).min(h);
                Drawn::Region { crop: ((w - side) / 2.0, (h - side) / 2.0, side, side), width: size, height: size }
            }
            Transform::HorizontalFlip { p } => {
                if rng.random::<f64>() < p {
                    Drawn::FlipHorizontal
                } else {
                    Drawn::Keep
                }
            }
            Transform::VerticalFlip { p } => {
                if rng.random::<f64>() < p {
                    Drawn::FlipVertical
                } else {
                    Drawn::Keep
                }
            }
            Transform::Rotation { max_degrees } => Drawn::Rotate { degrees: rng.random_range(-max_degrees.abs()..=max_degrees.abs()) },
            Transform::ColorJitter(jitter) => Drawn::Jitter(jitter.draw(rng)),
        }
    }
}

/// One step with its random choices made, so that an image and its mask get the same geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Drawn {
    Resize { width: u32, height: u32 },
    ShortSide { size: u32 },
    Region { crop: (f64, f64, f64, f64), width: u32, height: u32 },
    FlipHorizontal,
    FlipVertical,
    Keep,
    Rotate { degrees: f32 },
    Jitter(JitterFactors),
}

impl Drawn {
    fn image(self, mut image: RgbImage) -> Result<RgbImage, DataError> {
        match self {
            Drawn::Resize { width, height } => image.resize(width, height),
            Drawn::ShortSide { size } => image.resize_short_side(size),
            Drawn::Region { crop, width, height } => image.resize_region(crop, width, height),
            Drawn::FlipHorizontal => {
                image.flip_horizontal();
                Ok(image)
            }
            Drawn::FlipVertical => {
                image.flip_vertical();
                Ok(image)
            }
            Drawn::Keep => Ok(image),
            Drawn::Rotate { degrees } => Ok(rotate(&image, degrees)),
            Drawn::Jitter(factors) => Ok(color_jitter(image, &factors)),
        }
    }

    /// Class indices are never blended: every resampling takes the nearest
    /// pixel, and colour steps leave the mask alone.
    fn mask(self, mut mask: Mask) -> Result<Mask, DataError> {
        match self {
            Drawn::Resize { width, height } => mask.resize(width, height),
            Drawn::ShortSide { size } => mask.resize_short_side(size),
            Drawn::Region { crop, width, height } => mask.resize_region(crop, width, height),
            Drawn::FlipHorizontal => {
                mask.flip_horizontal();
                Ok(mask)
            }
            Drawn::FlipVertical => {
                mask.flip_vertical();
                Ok(mask)
            }
            Drawn::Keep | Drawn::Jitter(_) => Ok(mask),
            Drawn::Rotate { degrees } => rotate_mask(&mask, degrees),
        }
    }
}

/// A pipeline: transforms in order, then scale to 0-1 and normalise into CHW f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Transforms {
    pub steps: Vec<Transform>,
    pub normalize: Normalize,
}

impl Transforms {
    pub fn new(steps: Vec<Transform>) -> Self {
        Transforms { steps, normalize: Normalize::IMAGENET }
    }

    /// The lesson's template: Resize((size, size)), then normalise.
    pub fn resize(size: u32) -> Self {
        Transforms::new(vec![Transform::Resize { width: size, height: size }])
    }

    /// The usual training pipeline: RandomResizedCrop, horizontal flip, small
    /// rotation, colour jitter.
    pub fn train(size: u32) -> Self {
        Transforms::new(vec![
            Transform::RandomResizedCrop { size, scale: (0.35, 1.0), ratio: (0.75, 4.0 / 3.0) },
            Transform::HorizontalFlip { p: 0.5 },
            Transform::Rotation { max_degrees: 15.0 },
            Transform::ColorJitter(ColorJitter { brightness: 0.3, contrast: 0.3, saturation: 0.2, hue: 0.02 }),
        ])
    }

    /// Evaluation: shorter side to size x 8/7, centre crop.
    pub fn eval(size: u32) -> Self {
        Transforms::new(vec![Transform::ResizeShortSide { size: size * 8 / 7 }, Transform::CenterCrop { size }])
    }

    /// The shorter side the decoder must deliver for the first shrinking step
    /// to work at full quality (None: the whole image is needed).
    pub fn decode_hint(&self) -> Option<u32> {
        for step in &self.steps {
            match step {
                Transform::Rotation { .. } => return None,
                step => {
                    if let Some(side) = step.needed_short_side() {
                        return Some(side);
                    }
                }
            }
        }
        None
    }

    pub fn apply(&self, mut image: RgbImage, rng: &mut Rng) -> Result<RgbImage, DataError> {
        for step in &self.steps {
            image = step.apply(image, rng)?;
        }
        Ok(image)
    }

    /// The pipeline on an image and its mask: each step's random draws are
    /// made once and applied to both (the image is what [`Transforms::apply`]
    /// gives with the same `rng`); the mask is resampled to the nearest pixel
    /// and skips the colour steps.
    pub fn apply_with_mask(&self, mut image: RgbImage, mut mask: Mask, rng: &mut Rng) -> Result<(RgbImage, Mask), DataError> {
        if (image.width(), image.height()) != (mask.width(), mask.height()) {
            return Err(DataError::invalid(
                "Transforms::apply_with_mask",
                format!("the mask is {}x{} but its image {}x{}", mask.width(), mask.height(), image.width(), image.height()),
            ));
        }
        for step in &self.steps {
            let drawn = step.draw(image.width(), image.height(), rng);
            image = drawn.image(image)?;
            mask = drawn.mask(mask)?;
        }
        Ok((image, mask))
    }

    /// Writes `image` as normalised CHW f32 into `out` (3 x height x width values).
    pub fn to_tensor_into(&self, image: &RgbImage, out: &mut [f32]) -> Result<(), DataError> {
        let plane = image.width() as usize * image.height() as usize;
        if out.len() != 3 * plane {
            return Err(DataError::invalid(
                "to_tensor",
                format!("a {}x{} image needs {} values, the slot holds {}", image.width(), image.height(), 3 * plane, out.len()),
            ));
        }
        let Normalize { mean, std } = self.normalize;
        let scale = std.map(|s| 1.0 / (255.0 * s));
        let shift = [0, 1, 2].map(|c| mean[c] / std[c]);
        let (r, rest) = out.split_at_mut(plane);
        let (g, b) = rest.split_at_mut(plane);
        for (i, p) in image.pixels().chunks_exact(3).enumerate() {
            r[i] = p[0] as f32 * scale[0] - shift[0];
            g[i] = p[1] as f32 * scale[1] - shift[1];
            b[i] = p[2] as f32 * scale[2] - shift[2];
        }
        Ok(())
    }
}

/// A normalised 3 x H x W tensor back to 8-bit RGB, for looking at batches.
pub fn to_image(tensor: &candle_core::Tensor, normalize: &Normalize) -> Result<RgbImage, DataError> {
    let err = |source| DataError::Tensor { op: "to_image", shape: tensor.dims().to_vec(), source };
    let (c, h, w) = tensor.dims3().map_err(err)?;
    if c != 3 {
        return Err(DataError::invalid("to_image", format!("expected 3 channels, got {c}")));
    }
    let values = tensor.to_dtype(candle_core::DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>()).map_err(err)?;
    let plane = h * w;
    let pixels = (0..plane)
        .flat_map(|i| {
            [0, 1, 2].map(|ch| ((values[ch * plane + i] * normalize.std[ch] + normalize.mean[ch]) * 255.0).round().clamp(0.0, 255.0) as u8)
        })
        .collect();
    RgbImage::new(w as u32, h as u32, pixels)
}

/// torchvision's RandomResizedCrop region: ten tries at a random area and
/// aspect, then the centre crop clamped to the ratio range.
fn random_region(width: u32, height: u32, scale: (f64, f64), ratio: (f64, f64), rng: &mut Rng) -> (f64, f64, f64, f64) {
    let (w, h) = (width as f64, height as f64);
    let area = w * h;
    let (log_lo, log_hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target = area * rng.random_range(scale.0..=scale.1);
        let aspect = rng.random_range(log_lo..=log_hi).exp();
        let cw = (target * aspect).sqrt().round();
        let ch = (target / aspect).sqrt().round();
        if cw >= 1.0 && ch >= 1.0 && cw <= w && ch <= h {
            let x = rng.random_range(0.0..=w - cw).floor();
            let y = rng.random_range(0.0..=h - ch).floor();
            return (x, y, cw, ch);
        }
    }
    let in_ratio = w / h;
    let (cw, ch) = if in_ratio < ratio.0 {
        (w, (w / ratio.0).round())
    } else if in_ratio > ratio.1 {
        ((h * ratio.1).round(), h)
    } else {
        (w, h)
    };
    ((w - cw) / 2.0, (h - ch) / 2.0, cw, ch)
}

/// Where the pixels of a turn by `degrees` about the centre read from.
struct Turn {
    w: usize,
    h: usize,
    sin: f64,
    cos: f64,
    cx: f64,
    cy: f64,
}

impl Turn {
    fn new(width: u32, height: u32, degrees: f32) -> Turn {
        let (w, h) = (width as usize, height as usize);
        let (sin, cos) = (degrees.to_radians() as f64).sin_cos();
        Turn { w, h, sin, cos, cx: (w as f64 - 1.0) / 2.0, cy: (h as f64 - 1.0) / 2.0 }
    }

    /// The source point of output pixel (x, y); `None` where the turned image does not cover it.
    fn source(&self, x: usize, y: usize) -> Option<(f64, f64)> {
        let (dx, dy) = (x as f64 - self.cx, y as f64 - self.cy);
        let sx = self.cos * dx + self.sin * dy + self.cx;
        let sy = -self.sin * dx + self.cos * dy + self.cy;
        if sx < 0.0 || sy < 0.0 || sx > (self.w - 1) as f64 || sy > (self.h - 1) as f64 {
            return None;
        }
        Some((sx, sy))
    }
}

/// Bilinear rotation about the centre, same size, uncovered corners black.
fn rotate(image: &RgbImage, degrees: f32) -> RgbImage {
    let turn = Turn::new(image.width(), image.height(), degrees);
    let (w, h) = (turn.w, turn.h);
    let src = image.pixels();
    let mut out = vec![0u8; w * h * 3];
    for y in 0..h {
        for x in 0..w {
            let Some((sx, sy)) = turn.source(x, y) else { continue };
            let (x0, y0) = (sx.floor() as usize, sy.floor() as usize);
            let (x1, y1) = ((x0 + 1).min(w - 1), (y0 + 1).min(h - 1));
            let (fx, fy) = (sx - x0 as f64, sy - y0 as f64);
            for c in 0..3 {
                let at = |xx: usize, yy: usize| src[(yy * w + xx) * 3 + c] as f64;
                let top = at(x0, y0) * (1.0 - fx) + at(x1, y0) * fx;
                let bottom = at(x0, y1) * (1.0 - fx) + at(x1, y1) * fx;
                out[(y * w + x) * 3 + c] = (top * (1.0 - fy) + bottom * fy).round() as u8;
            }
        }
    }
    RgbImage::new(image.width(), image.height(), out).unwrap_or_else(|_| image.clone())
}

/// The mask turned as [`rotate`] turns its image, each pixel taking the
/// class nearest its source point; uncovered corners are class 0.
fn rotate_mask(mask: &Mask, degrees: f32) -> Result<Mask, DataError> {
    let turn = Turn::new(mask.width(), mask.height(), degrees);
    let src = mask.classes();
    let mut out = vec![0u8; turn.w * turn.h];
    for y in 0..turn.h {
        for x in 0..turn.w {
            if let Some((sx, sy)) = turn.source(x, y) {
                out[y * turn.w + x] = src[sy.round() as usize * turn.w + sx.round() as usize];
            }
        }
    }
    Mask::new(mask.width(), mask.height(), out)
}

fn factor(amount: f32, rng: &mut Rng) -> f32 {
    if amount <= 0.0 {
        1.0
    } else {
        rng.random_range((1.0 - amount).max(0.0)..=1.0 + amount)
    }
}

/// The factors of one [`ColorJitter`] draw.
#[derive(Debug, Clone, Copy, PartialEq)]
struct JitterFactors {
    brightness: f32,
    contrast: f32,
    saturation: f32,
    hue: f32,
}

impl ColorJitter {
    fn draw(&self, rng: &mut Rng) -> JitterFactors {
        JitterFactors {
            brightness: factor(self.brightness, rng),
            contrast: factor(self.contrast, rng),
            saturation: factor(self.saturation, rng),
            hue: if self.hue > 0.0 { rng.random_range(-self.hue.min(0.5)..=self.hue.min(0.5)) } else { 0.0 },
        }
    }
}

fn color_jitter(mut image: RgbImage, factors: &JitterFactors) -> RgbImage {
    let JitterFactors { brightness, contrast, saturation, hue } = *factors;
    let grey = |p: [f32; 3]| 0.299 * p[0] + 0.587 * p[1] + 0.114 * p[2];
    let mean_grey = {
        let m = image.mean_rgb();
        grey([m[0] as f32, m[1] as f32, m[2] as f32]) * brightness
    };
    for p in image.pixels_mut().chunks_exact_mut(3) {
        let mut v = [p[0] as f32, p[1] as f32, p[2] as f32].map(|c| (c * brightness).clamp(0.0, 255.0));
        v = v.map(|c| (mean_grey + (c - mean_grey) * contrast).clamp(0.0, 255.0));
        let g = grey(v);
        v = v.map(|c| (g + (c - g) * saturation).clamp(0.0, 255.0));
        if hue != 0.0 {
            v = shift_hue(v, hue);
        }
        for c in 0..3 {
            p[c] = v[c].round() as u8;
        }
    }
    image
}

fn shift_hue([r, g, b]: [f32; 3], turns: f32) -> [f32; 3] {
    let max = r.max(g).max(b);
    let min = r.min(g).min(b);
    let delta = max - min;
    if delta <= 0.0 {
        return [r, g, b];
    }
    let h = if max == r {
        ((g - b) / delta).rem_euclid(6.0)
    } else if max == g {
        (b - r) / delta + 2.0
    } else {
        (r - g) / delta + 4.0
    };
    let h = (h / 6.0 + turns).rem_euclid(1.0) * 6.0;
    let x = delta * (1.0 - ((h % 2.0) - 1.0).abs());
    let (r1, g1, b1) = match h as u32 {
        0 => (delta, x, 0.0),
        1 => (x, delta, 0.0),
        2 => (0.0, delta, x),
        3 => (0.0, x, delta),
        4 => (x, 0.0, delta),
        _ => (delta, 0.0, x),
    };
    [r1 + min, g1 + min, b1 + min]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::rng_for;

    fn gradient(w: u32, h: u32) -> RgbImage {
        let pixels = (0..h).flat_map(|y| (0..w).flat_map(move |x| [(x * 255 / w.max(2)) as u8, (y * 255 / h.max(2)) as u8, 100])).collect();
        RgbImage::new(w, h, pixels).unwrap()
    }

    #[test]
    fn resize_crop_and_random_resized_crop_give_the_asked_size() {
        let mut rng = rng_for(1, 0, 0);
        let image = gradient(64, 40);
        for t in [Transform::Resize { width: 24, height: 24 }, Transform::random_resized_crop(24), Transform::CenterCrop { size: 24 }] {
            let out = t.apply(image.clone(), &mut rng).unwrap();
            assert_eq!((out.width(), out.height()), (24, 24), "{t:?}");
        }
        let out = Transform::ResizeShortSide { size: 20 }.apply(image, &mut rng).unwrap();
        assert_eq!((out.width(), out.height()), (32, 20));
    }

    #[test]
    fn random_regions_stay_inside_and_respect_scale() {
        let mut rng = rng_for(2, 0, 0);
        for _ in 0..200 {
            let (x, y, w, h) = random_region(100, 60, (0.2, 0.6), (0.75, 4.0 / 3.0), &mut rng);
            assert!(x >= 0.0 && y >= 0.0 && x + w <= 100.0 && y + h <= 60.0);
            let share = w * h / 6000.0;
            assert!((0.15..=0.65).contains(&share) || (w, h) == (80.0, 60.0), "share {share}");
        }
    }

    #[test]
    fn flips_mirror_and_zero_probability_keeps_the_image() {
        let mut rng = rng_for(3, 0, 0);
        let image = gradient(5, 3);
        let flipped = Transform::HorizontalFlip { p: 1.0 }.apply(image.clone(), &mut rng).unwrap();
        assert_eq!(flipped.pixel(0, 1), image.pixel(4, 1));
        let flipped = Transform::VerticalFlip { p: 1.0 }.apply(image.clone(), &mut rng).unwrap();
        assert_eq!(flipped.pixel(2, 0), image.pixel(2, 2));
        let kept = Transform::HorizontalFlip { p: 0.0 }.apply(image.clone(), &mut rng).unwrap();
        assert_eq!(kept, image);
    }

    #[test]
    fn rotation_by_zero_is_identity_and_ninety_turns_a_bar() {
        let image = gradient(9, 9);
        assert_eq!(rotate(&image, 0.0), image);
        let mut bar = RgbImage::filled(9, 9, [0, 0, 0]).unwrap();
        for x in 0..9 {
            let i = (4 * 9 + x) * 3;
            bar.pixels_mut()[i..i + 3].copy_from_slice(&[255, 255, 255]);
        }
        let turned = rotate(&bar, 90.0);
        assert_eq!(turned.pixel(4, 0), [255, 255, 255]);
        assert_eq!(turned.pixel(0, 4), [0, 0, 0]);
    }

    #[test]
    fn jitter_moves_brightness_within_bounds_and_hue_keeps_grey() {
        let image = RgbImage::filled(4, 4, [100, 150, 50]).unwrap();
        let jitter = ColorJitter { brightness: 0.5, ..Default::default() };
        let mut seen = Vec::new();
        for i in 0..50 {
            let out = Transform::ColorJitter(jitter).apply(image.clone(), &mut rng_for(4, 0, i)).unwrap();
            let g = out.pixel(0, 0)[1] as f32;
            assert!((74.0..=226.0).contains(&g), "{g}");
            seen.push(g as u32);
        }
        seen.dedup();
        assert!(seen.len() > 5);
        assert_eq!(shift_hue([80.0, 80.0, 80.0], 0.3), [80.0, 80.0, 80.0]);
        let shifted = shift_hue([255.0, 0.0, 0.0], 1.0 / 3.0);
        assert!((shifted[1] - 255.0).abs() < 1e-3 && shifted[0].abs() < 1e-3, "{shifted:?}");
    }

    #[test]
    fn normalise_writes_planes_with_imagenet_statistics() {
        let image = RgbImage::filled(2, 1, [255, 0, 124]).unwrap();
        let mut out = vec![0.0; 6];
        Transforms::resize(2).to_tensor_into(&image, &mut out).unwrap();
        let expect_r = (1.0 - 0.485) / 0.229;
        assert!((out[0] - expect_r).abs() < 1e-5 && (out[1] - expect_r).abs() < 1e-5);
        assert!((out[2] + 0.456 / 0.224).abs() < 1e-5);
        assert!((out[4] - (124.0 / 255.0 - 0.406) / 0.225).abs() < 1e-5);
        assert!(Transforms::resize(2).to_tensor_into(&image, &mut [0.0; 5]).is_err());
        let tensor = candle_core::Tensor::from_vec(out, (3, 1, 2), &candle_core::Device::Cpu).unwrap();
        assert_eq!(to_image(&tensor, &Normalize::IMAGENET).unwrap(), image);
    }

    /// Black and white blocks of uneven sizes (no symmetry a wrong flip could
    /// hide); the mask is 1 where the image is white.
    fn painted(w: u32, h: u32) -> (RgbImage, Mask) {
        let class = |x: u32, y: u32| (x / 5 * 7 + y / 7 * 3 + (x / 5) * (y / 7)).is_multiple_of(3) as u8;
        let classes: Vec<u8> = (0..h).flat_map(|y| (0..w).map(move |x| class(x, y))).collect();
        let pixels = classes.iter().flat_map(|&c| [c * 255; 3]).collect();
        (RgbImage::new(w, h, pixels).unwrap(), Mask::new(w, h, classes).unwrap())
    }

    /// Pixels where image and mask agree (white is class 1), and where a
    /// pure-coloured pixel (every source pixel it reads of one colour) disagrees.
    fn agreement(image: &RgbImage, mask: &Mask) -> (f64, usize) {
        let (mut agree, mut pure_wrong) = (0, 0);
        for y in 0..image.height() {
            for x in 0..image.width() {
                let grey = image.pixel(x, y)[0];
                let class = mask.get(x, y);
                agree += usize::from((grey > 127) == (class == 1));
                pure_wrong += usize::from((grey >= 250 && class != 1) || (grey <= 5 && class != 0));
            }
        }
        (agree as f64 / (image.width() * image.height()) as f64, pure_wrong)
    }

    #[test]
    fn a_mask_follows_its_image_through_every_transform() {
        let (image, mask) = painted(64, 48);
        let crop = Transform::RandomResizedCrop { size: 40, scale: (0.1, 1.0), ratio: (0.75, 4.0 / 3.0) };
        let mut pipelines: Vec<Transforms> = [
            crop.clone(),
            Transform::RandomResizedCrop { size: 32, scale: (0.5, 1.0), ratio: (0.75, 4.0 / 3.0) },
            Transform::CenterCrop { size: 30 },
            Transform::Resize { width: 90, height: 50 },
            Transform::Resize { width: 32, height: 30 },
            Transform::ResizeShortSide { size: 33 },
            Transform::HorizontalFlip { p: 0.5 },
            Transform::VerticalFlip { p: 0.5 },
            Transform::Rotation { max_degrees: 40.0 },
        ]
        .into_iter()
        .map(|t| Transforms::new(vec![t]))
        .collect();
        pipelines.push(Transforms::new(vec![
            crop,
            Transform::HorizontalFlip { p: 0.5 },
            Transform::VerticalFlip { p: 0.5 },
            Transform::Rotation { max_degrees: 25.0 },
        ]));
        pipelines.push(Transforms::eval(28));
        let mut report = Vec::new();
        let mut aligned = true;
        for pipeline in pipelines {
            let (mut worst, mut pure_wrong) = (1.0f64, 0);
            for seed in 0..30 {
                let (out, out_mask) = pipeline.apply_with_mask(image.clone(), mask.clone(), &mut rng_for(7, 1, seed)).unwrap();
                let alone = pipeline.apply(image.clone(), &mut rng_for(7, 1, seed)).unwrap();
                assert_eq!(out, alone, "{:?}: the image is what it is without a mask", pipeline.steps);
                assert_eq!((out_mask.width(), out_mask.height()), (out.width(), out.height()));
                let (agree, wrong) = agreement(&out, &out_mask);
                worst = worst.min(agree);
                pure_wrong += wrong;
            }
            // Half-pixel crops and downscaling blend black and white at block edges, which the nearest pixel cannot.
            aligned &= worst >= 0.9 && pure_wrong == 0;
            report.push(format!("{:?}: at worst {worst:.3} of the pixels agree, {pure_wrong} pure pixels disagree", pipeline.steps));
        }
        assert!(aligned, "{}", report.join("\n"));
    }

    #[test]
    fn mask_classes_are_never_blended_and_colour_steps_leave_the_mask_alone() {
        let classes: Vec<u8> = (0..48 * 40).map(|i| [0, 4, 9][(i * 7 + i / 48) % 3]).collect();
        let mask = Mask::new(48, 40, classes).unwrap();
        let image = RgbImage::filled(48, 40, [90, 160, 60]).unwrap();
        for seed in 0..20 {
            let (out, out_mask) = Transforms::train(24).apply_with_mask(image.clone(), mask.clone(), &mut rng_for(8, 0, seed)).unwrap();
            assert_eq!((out.width(), out.height(), out_mask.width(), out_mask.height()), (24, 24, 24, 24));
            assert!(out_mask.classes().iter().all(|c| [0, 4, 9].contains(c)), "{:?}", out_mask.classes());
        }
        let jitter =
            Transforms::new(vec![Transform::ColorJitter(ColorJitter { brightness: 0.5, contrast: 0.5, saturation: 0.5, hue: 0.1 })]);
        let (out, out_mask) = jitter.apply_with_mask(image.clone(), mask.clone(), &mut rng_for(8, 1, 0)).unwrap();
        assert_ne!(out, image);
        assert_eq!(out_mask, mask);
        let err = jitter.apply_with_mask(image, Mask::filled(40, 48, 0).unwrap(), &mut rng_for(8, 1, 0)).unwrap_err().to_string();
        assert!(err.contains("40x48") && err.contains("48x40"), "{err}");
    }

    #[test]
    fn rotation_corners_are_class_0_exactly_where_the_image_is_black() {
        let image = RgbImage::filled(31, 20, [255, 255, 255]).unwrap();
        let mask = Mask::filled(31, 20, 1).unwrap();
        let turn = Transforms::new(vec![Transform::Rotation { max_degrees: 30.0 }]);
        for seed in 0..5 {
            let (out, out_mask) = turn.apply_with_mask(image.clone(), mask.clone(), &mut rng_for(9, 0, seed)).unwrap();
            assert!(out_mask.count(0) > 0, "a turn uncovers corners");
            for y in 0..20 {
                for x in 0..31 {
                    assert_eq!(out_mask.get(x, y) == 0, out.pixel(x, y) == [0, 0, 0], "({x}, {y})");
                }
            }
        }
    }

    #[test]
    fn decode_hint_follows_the_first_shrinking_step() {
        assert_eq!(Transforms::resize(224).decode_hint(), Some(224));
        assert_eq!(Transforms::train(224).decode_hint(), Some(224));
        assert_eq!(Transforms::eval(224).decode_hint(), Some(256));
        let rotate_first = Transforms::new(vec![Transform::Rotation { max_degrees: 5.0 }, Transform::Resize { width: 64, height: 32 }]);
        assert_eq!(rotate_first.decode_hint(), None);
    }
}
