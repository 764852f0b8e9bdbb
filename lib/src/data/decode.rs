//! Bytes to RGB: JPEG (with DCT-domain downscaling), PNG and the rest of
//! what `image` reads; greyscale, CMYK, alpha and EXIF orientation handled.

use std::cell::RefCell;
use std::io::Cursor;
use std::path::Path;
use std::sync::LazyLock;
use std::time::Instant;

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use image::metadata::Orientation;
use image::{DynamicImage, ImageDecoder, ImageReader};
use turbojpeg::{Colorspace, Decompressor, PixelFormat, ScalingFactor};

use super::DataError;

/// An 8-bit RGB image, rows top to bottom, pixels interleaved R, G, B.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
}

impl RgbImage {
    pub fn new(width: u32, height: u32, pixels: Vec<u8>) -> Result<Self, DataError> {
        let expected = width as usize * height as usize * 3;
        if width == 0 || height == 0 || pixels.len() != expected {
            return Err(DataError::invalid("RgbImage::new", format!("{width}x{height} RGB needs {expected} bytes, got {}", pixels.len())));
        }
        Ok(RgbImage { width, height, pixels })
    }

    /// An image whose every pixel is `rgb`.
    pub fn filled(width: u32, height: u32, rgb: [u8; 3]) -> Result<Self, DataError> {
        let pixels = rgb.iter().copied().cycle().take(width as usize * height as usize * 3).collect();
        RgbImage::new(width, height, pixels)
    }

    /// Pixels in B, G, R order (what OpenCV's `imread` returns) put right.
    /// Feeding BGR to a model trained on RGB swaps red and blue: a brown
    /// lesion looks blue-grey and a green leaf keeps its green, so the error is easy to miss.
    pub fn from_bgr(width: u32, height: u32, mut bgr: Vec<u8>) -> Result<Self, DataError> {
        for pixel in bgr.chunks_exact_mut(3) {
            pixel.swap(0, 2);
        }
        RgbImage::new(width, height, bgr)
    }

    pub fn width(&self) -> u32 {
        self.width
    }

    pub fn height(&self) -> u32 {
        self.height
    }

    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    pub fn pixels_mut(&mut self) -> &mut [u8] {
        &mut self.pixels
    }

    pub fn into_pixels(self) -> Vec<u8> {
        self.pixels
    }

    /// Bytes held by the pixels.
    pub fn bytes(&self) -> usize {
        self.pixels.len()
    }

    pub fn pixel(&self, x: u32, y: u32) -> [u8; 3] {
        let i = (y as usize * self.width as usize + x as usize) * 3;
        [self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]]
    }

    /// Mean of each channel, 0-255.
    pub fn mean_rgb(&self) -> [f64; 3] {
        let mut sum = [0u64; 3];
        for p in self.pixels.chunks_exact(3) {
            for c in 0..3 {
                sum[c] += p[c] as u64;
            }
        }
        let n = (self.pixels.len() / 3).max(1) as f64;
        sum.map(|s| s as f64 / n)
    }

    pub fn flip_horizontal(&mut self) {
        let row = self.width as usize * 3;
        for line in self.pixels.chunks_exact_mut(row) {
            let w = self.width as usize;
            for x in 0..w / 2 {
                let (a, b) = (x * 3, (w - 1 - x) * 3);
                for c in 0..3 {
                    line.swap(a + c, b + c);
                }
            }
        }
    }

    pub fn flip_vertical(&mut self) {
        let row = self.width as usize * 3;
        let h = self.height as usize;
        for y in 0..h / 2 {
            let (top, bottom) = self.pixels.split_at_mut((h - 1 - y) * row);
            top[y * row..(y + 1) * row].swap_with_slice(&mut bottom[..row]);
        }
    }

    /// The image as it should be shown, given an EXIF orientation tag (1-8).
    pub fn oriented(self, orientation: u8) -> Result<Self, DataError> {
        let orientation = Orientation::from_exif(orientation)
            .ok_or_else(|| DataError::invalid("RgbImage::oriented", format!("EXIF orientation {orientation} is not in 1..=8")))?;
        if orientation == Orientation::NoTransforms {
            return Ok(self);
        }
        let mut image = DynamicImage::ImageRgb8(self.into_image()?);
        image.apply_orientation(orientation);
        RgbImage::from_dynamic(image)
    }

    /// Resizes the region `crop` (x, y, width, height in source pixels) to
    /// `width` x `height` with a SIMD bilinear filter.
    pub fn resize_region(&self, crop: (f64, f64, f64, f64), width: u32, height: u32) -> Result<RgbImage, DataError> {
        let err = |message: String| DataError::Resize { from_w: self.width, from_h: self.height, to_w: width, to_h: height, message };
        if width == 0 || height == 0 {
            return Err(err("target size must be at least 1x1".into()));
        }
        let src = ImageRef::new(self.width, self.height, &self.pixels, PixelType::U8x3).map_err(|e| err(e.to_string()))?;
        let mut dst = Image::new(width, height, PixelType::U8x3);
        let options = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear)).crop(crop.0, crop.1, crop.2, crop.3);
        Resizer::new().resize(&src, &mut dst, &options).map_err(|e| err(e.to_string()))?;
        RgbImage::new(width, height, dst.into_vec())
    }

    /// The whole image resized to `width` x `height`.
    pub fn resize(&self, width: u32, height: u32) -> Result<RgbImage, DataError> {
        if (width, height) == (self.width, self.height) {
            return Ok(self.clone());
        }
        self.resize_region((0.0, 0.0, self.width as f64, self.height as f64), width, height)
    }

    /// Resized so that the shorter side is `short_side`, keeping the aspect ratio.
    pub fn resize_short_side(&self, short_side: u32) -> Result<RgbImage, DataError> {
        let (w, h) = short_side_dims(self.width, self.height, short_side);
        self.resize(w, h)
    }

    fn into_image(self) -> Result<image::RgbImage, DataError> {
        let (w, h) = (self.width, self.height);
        image::RgbImage::from_raw(w, h, self.pixels)
            .ok_or_else(|| DataError::invalid("RgbImage", format!("{w}x{h} buffer has the wrong length")))
    }

    fn from_dynamic(image: DynamicImage) -> Result<Self, DataError> {
        let rgb = match image {
            DynamicImage::ImageRgb8(rgb) => rgb,
            other if other.color().has_alpha() => composite_on_white(other.into_rgba8()),
            other => other.into_rgb8(),
        };
        let (w, h) = rgb.dimensions();
        RgbImage::new(w, h, rgb.into_raw())
    }
}

/// Width and height with the shorter side at `short_side`, aspect kept.
pub(crate) fn short_side_dims(width: u32, height: u32, short_side: u32) -> (u32, u32) {
    let scale = short_side as f64 / width.min(height).max(1) as f64;
    let w = ((width as f64 * scale).round() as u32).max(1);
    let h = ((height as f64 * scale).round() as u32).max(1);
    (w, h)
}

/// Transparent pixels have no defined colour: blend onto white, as a viewer shows them.
fn composite_on_white(rgba: image::RgbaImage) -> image::RgbImage {
    let (w, h) = rgba.dimensions();
    let mut out = Vec::with_capacity(w as usize * h as usize * 3);
    for p in rgba.pixels() {
        let a = p[3] as u32;
        for c in 0..3 {
            out.push(((p[c] as u32 * a + 255 * (255 - a) + 127) / 255) as u8);
        }
    }
    image::RgbImage::from_raw(w, h, out).unwrap_or_default()
}

/// Which library turns JPEG bytes into pixels (other formats always use `image`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decoder {
    /// libjpeg-turbo (through `turbojpeg`): decodes at any M/8 of the stored
    /// size in the DCT domain, SIMD throughout.
    #[default]
    #[serde(rename = "turbojpeg")]
    TurboJpeg,
    /// `image` (its JPEG path is zune-jpeg): always full size.
    Image,
}

/// How to decode: the library, and the smallest shorter side the caller
/// needs (the JPEG decoder then skips detail it would throw away).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecodeOptions {
    pub decoder: Decoder,
    pub min_short_side: Option<u32>,
}

/// A decoded image and what it cost.
#[derive(Debug, Clone)]
pub struct Decoded {
    pub image: RgbImage,
    /// Size stored in the file (before EXIF orientation and DCT scaling).
    pub stored_size: (u32, u32),
    /// Size after EXIF orientation at full scale: what `image` is when `dct_eighths` is 8.
    pub upright_size: (u32, u32),
    /// The image was decoded at `dct_eighths`/8 of its stored size (8: full size).
    pub dct_eighths: u32,
    pub encoded_bytes: usize,
    pub seconds: f64,
}

const JPEG_MAGIC: [u8; 2] = [0xFF, 0xD8];
const FULL_SIZE: u32 = 8;

pub fn decode_file(path: &Path, options: DecodeOptions) -> Result<Decoded, DataError> {
    let bytes = std::fs::read(path).map_err(DataError::io("reading", path))?;
    decode_bytes(&bytes, path, options)
}

/// Decodes `bytes` (read from `path`, named in errors) to upright RGB.
pub fn decode_bytes(bytes: &[u8], path: &Path, options: DecodeOptions) -> Result<Decoded, DataError> {
    let started = Instant::now();
    let err = |message: String| DataError::Decode { path: path.to_owned(), message };
    let (image, stored_size, upright_size, dct_eighths) = if bytes.starts_with(&JPEG_MAGIC) && options.decoder == Decoder::TurboJpeg {
        decode_jpeg(bytes, options.min_short_side).map_err(err)?
    } else {
        decode_with_image(bytes).map_err(err)?
    };
    Ok(Decoded { image, stored_size, upright_size, dct_eighths, encoded_bytes: bytes.len(), seconds: started.elapsed().as_secs_f64() })
}

/// The image, its stored size, its upright size and the DCT scale in eighths.
type Pixels = (RgbImage, (u32, u32), (u32, u32), u32);

fn decode_with_image(bytes: &[u8]) -> Result<Pixels, String> {
    let reader = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| e.to_string())?;
    if reader.format().is_none() {
        return Err("not an image (unknown format)".into());
    }
    let mut decoder = reader.into_decoder().map_err(|e| e.to_string())?;
    let orientation = decoder.orientation().unwrap_or(Orientation::NoTransforms);
    let stored = decoder.dimensions();
    let mut image = DynamicImage::from_decoder(decoder).map_err(|e| e.to_string())?;
    image.apply_orientation(orientation);
    let image = RgbImage::from_dynamic(image).map_err(|e| e.to_string())?;
    let upright = (image.width(), image.height());
    Ok((image, stored, upright, FULL_SIZE))
}

/// The smallest DCT scale, in eighths of the stored size, among those
/// libjpeg-turbo offers up to full size, that keeps the shorter side at least `min`.
fn dct_eighths(width: u32, height: u32, min: Option<u32>) -> u32 {
    let Some(min) = min else { return FULL_SIZE };
    let short = width.min(height) as usize;
    (1..FULL_SIZE)
        .filter(|&m| DCT_SCALES.contains(&m))
        .find(|&m| ScalingFactor::new(m as usize, 8).scale(short) >= min as usize)
        .unwrap_or(FULL_SIZE)
}

/// Eighths of the stored size libjpeg-turbo decodes to in the DCT domain.
static DCT_SCALES: LazyLock<Vec<u32>> = LazyLock::new(|| {
    Decompressor::supported_scaling_factors()
        .into_iter()
        .filter(|f| f.num() <= f.denom() && 8 % f.denom() == 0)
        .map(|f| (f.num() * 8 / f.denom()) as u32)
        .collect()
});

thread_local! {
    /// A libjpeg-turbo handle per thread: set up once, reused for every file.
    static DECOMPRESSOR: RefCell<Option<Decompressor>> = const { RefCell::new(None) };
}

fn decode_jpeg(bytes: &[u8], min_short_side: Option<u32>) -> Result<Pixels, String> {
    DECOMPRESSOR.with_borrow_mut(|slot| {
        let decompressor = match slot {
            Some(decompressor) => decompressor,
            None => slot.insert(Decompressor::new().map_err(|e| format!("starting libjpeg-turbo: {e}"))?),
        };
        decode_jpeg_with(decompressor, bytes, min_short_side)
    })
}

/// libjpeg-turbo treats a truncated stream as a warning and fills the rest in
/// grey; TurboJPEG then reports failure and `turbojpeg` an error, so such a file fails.
fn decode_jpeg_with(decompressor: &mut Decompressor, bytes: &[u8], min_short_side: Option<u32>) -> Result<Pixels, String> {
    let header = decompressor.read_header(bytes).map_err(|e| e.to_string())?;
    let stored = (u32::try_from(header.width), u32::try_from(header.height));
    let (Ok(w), Ok(h)) = stored else {
        return Err(format!("{}x{} is too large", header.width, header.height));
    };
    let eighths = if header.is_lossless { FULL_SIZE } else { dct_eighths(w, h, min_short_side) };
    let factor = ScalingFactor::new(eighths as usize, 8);
    decompressor.set_scaling_factor(factor).map_err(|e| e.to_string())?;
    let scaled = header.scaled(factor);
    let cmyk = matches!(header.colorspace, Colorspace::CMYK | Colorspace::YCCK);
    let format = if cmyk { PixelFormat::CMYK } else { PixelFormat::RGB };
    let pitch = scaled.width * format.size();
    let mut pixels = vec![0u8; pitch * scaled.height];
    let output = turbojpeg::Image { pixels: pixels.as_mut_slice(), width: scaled.width, pitch, height: scaled.height, format };
    decompressor.decompress(bytes, output).map_err(|e| e.to_string())?;
    if cmyk {
        pixels = cmyk_to_rgb(&pixels, app_segment(bytes, APP14, b"Adobe").is_some());
    }
    let (dw, dh) = (scaled.width as u32, scaled.height as u32);
    let orientation = app_segment(bytes, APP1, b"Exif\0\0").and_then(Orientation::from_exif_chunk).map_or(1, |o| o.to_exif());
    let image = RgbImage::new(dw, dh, pixels).map_err(|e| e.to_string())?;
    let upright = if matches!(orientation, 5..=8) { (h, w) } else { (w, h) };
    Ok((image.oriented(orientation).map_err(|e| e.to_string())?, (w, h), upright, eighths))
}

const APP1: u8 = 0xE1;
const APP14: u8 = 0xEE;

/// The rest of the first `marker` segment before the scan whose payload
/// starts with `tag` (EXIF, Adobe: libjpeg-turbo reads neither for us).
fn app_segment<'a>(bytes: &'a [u8], marker: u8, tag: &[u8]) -> Option<&'a [u8]> {
    const FILL: u8 = 0xFF;
    const START_OF_SCAN: u8 = 0xDA;
    let mut at = JPEG_MAGIC.len();
    loop {
        let found = *bytes.get(at + 1)?;
        if bytes[at] != 0xFF || found == START_OF_SCAN {
            return None;
        }
        if found == FILL {
            at += 1;
            continue;
        }
        let length = u16::from_be_bytes([*bytes.get(at + 2)?, *bytes.get(at + 3)?]) as usize;
        let payload = bytes.get(at + 4..at + 2 + length)?;
        if found == marker {
            if let Some(rest) = payload.strip_prefix(tag) {
                return Some(rest);
            }
        }
        at += 2 + length;
    }
}

/// libjpeg-turbo hands back the stored CMYK values. Adobe's files (what
/// Photoshop writes) store them inverted, 255 meaning no ink; others store
/// ink amounts. Uncalibrated conversion: R = (255 - C)(255 - K) / 255 in ink.
fn cmyk_to_rgb(cmyk: &[u8], adobe_inverted: bool) -> Vec<u8> {
    let no_ink = |v: u8| if adobe_inverted { v as u32 } else { 255 - v as u32 };
    cmyk.chunks_exact(4)
        .flat_map(|p| {
            let k = no_ink(p[3]);
            [0, 1, 2].map(|c| ((no_ink(p[c]) * k + 127) / 255) as u8)
        })
        .collect()
}

#[cfg(test)]
mod tests;
