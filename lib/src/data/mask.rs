//! `Mask`: one class index per pixel, what a segmentation network learns to
//! predict, stored as an 8-bit greyscale PNG whose pixel values are the classes.

use std::io::Cursor;
use std::path::Path;

use image::{ImageEncoder, ImageFormat, ImageReader};

use super::decode::short_side_dims;
use super::DataError;

/// Class indices, rows top to bottom, one byte per pixel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mask {
    width: u32,
    height: u32,
    classes: Vec<u8>,
}

impl Mask {
    pub fn new(width: u32, height: u32, classes: Vec<u8>) -> Result<Self, DataError> {
        let expected = width as usize * height as usize;
        if width == 0 || height == 0 || classes.len() != expected {
            return Err(DataError::invalid("Mask::new", format!("a {width}x{height} mask needs {expected} values, got {}", classes.len())));
        }
        Ok(Mask { width, height, classes })
    }

    /// A mask whose every pixel is `class`.
    pub fn filled(width: u32, height: u32, class: u8) -> Result<Self, DataError> {
        Mask::new(width, height, vec![class; width as usize * height as usize])
    }

    pub fn width(&self) -> u32 {
        self.width
    }

    pub fn height(&self) -> u32 {
        self.height
    }

    pub fn classes(&self) -> &[u8] {
        &self.classes
    }

    pub fn into_classes(self) -> Vec<u8> {
        self.classes
    }

    pub fn get(&self, x: u32, y: u32) -> u8 {
        self.classes[y as usize * self.width as usize + x as usize]
    }

    pub(crate) fn set(&mut self, x: u32, y: u32, class: u8) {
        self.classes[y as usize * self.width as usize + x as usize] = class;
    }

    /// Pixels of class `class`.
    pub fn count(&self, class: u8) -> u64 {
        self.classes.iter().filter(|&&c| c == class).count() as u64
    }

    /// The first pixel (x, y) whose class is not below `classes`, with that class.
    pub fn first_outside(&self, classes: u32) -> Option<(u32, u32, u8)> {
        let at = self.classes.iter().position(|&c| c as u32 >= classes)?;
        Some(((at % self.width as usize) as u32, (at / self.width as usize) as u32, self.classes[at]))
    }

    pub fn flip_horizontal(&mut self) {
        for row in self.classes.chunks_exact_mut(self.width as usize) {
            row.reverse();
        }
    }

    pub fn flip_vertical(&mut self) {
        let row = self.width as usize;
        let h = self.height as usize;
        for y in 0..h / 2 {
            let (top, bottom) = self.classes.split_at_mut((h - 1 - y) * row);
            top[y * row..(y + 1) * row].swap_with_slice(&mut bottom[..row]);
        }
    }

    /// The region `crop` (x, y, width, height in source pixels) at `width` x
    /// `height`, each pixel taking the class of the source pixel under its
    /// centre: the sampling points of [`RgbImage::resize_region`](super::RgbImage::resize_region),
    /// without mixing classes.
    pub fn resize_region(&self, crop: (f64, f64, f64, f64), width: u32, height: u32) -> Result<Mask, DataError> {
        if width == 0 || height == 0 {
            return Err(DataError::Resize {
                from_w: self.width,
                from_h: self.height,
                to_w: width,
                to_h: height,
                message: "target size must be at least 1x1".into(),
            });
        }
        let source = |start: f64, extent: f64, out: u32, limit: u32| -> Vec<usize> {
            (0..out).map(|i| ((start + (i as f64 + 0.5) * extent / out as f64).floor().max(0.0) as usize).min(limit as usize - 1)).collect()
        };
        let xs = source(crop.0, crop.2, width, self.width);
        let ys = source(crop.1, crop.3, height, self.height);
        let w = self.width as usize;
        let classes = ys.iter().flat_map(|&y| xs.iter().map(move |&x| self.classes[y * w + x])).collect();
        Mask::new(width, height, classes)
    }

    /// The whole mask at `width` x `height`.
    pub fn resize(&self, width: u32, height: u32) -> Result<Mask, DataError> {
        if (width, height) == (self.width, self.height) {
            return Ok(self.clone());
        }
        self.resize_region((0.0, 0.0, self.width as f64, self.height as f64), width, height)
    }

    /// Resized so that the shorter side is `short_side`, keeping the aspect ratio.
    pub fn resize_short_side(&self, short_side: u32) -> Result<Mask, DataError> {
        let (w, h) = short_side_dims(self.width, self.height, short_side);
        self.resize(w, h)
    }

    /// Writes the mask as an 8-bit greyscale PNG.
    pub fn write_png(&self, path: &Path) -> Result<(), DataError> {
        let mut bytes = Vec::new();
        image::codecs::png::PngEncoder::new(&mut bytes)
            .write_image(&self.classes, self.width, self.height, image::ExtendedColorType::L8)
            .map_err(|e| DataError::Encode { path: path.to_owned(), message: e.to_string() })?;
        std::fs::write(path, bytes).map_err(DataError::io("writing", path))
    }

    /// Reads an 8-bit greyscale PNG of class indices; any other file is an error naming it.
    pub fn read_png(path: &Path) -> Result<Mask, DataError> {
        let bytes = std::fs::read(path).map_err(DataError::io("reading", path))?;
        let err = |message: String| DataError::Decode { path: path.to_owned(), message };
        let reader = ImageReader::new(Cursor::new(&bytes)).with_guessed_format().map_err(|e| err(e.to_string()))?;
        if reader.format() != Some(ImageFormat::Png) {
            return Err(err("a mask must be a PNG (8-bit greyscale, pixel values are class indices)".into()));
        }
        match reader.decode().map_err(|e| err(e.to_string()))? {
            image::DynamicImage::ImageLuma8(grey) => {
                let (w, h) = grey.dimensions();
                Mask::new(w, h, grey.into_raw())
            }
            other => Err(err(format!("a mask must be 8-bit greyscale (pixel values are class indices), this PNG is {:?}", other.color()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_round_trips_through_an_8_bit_greyscale_png() {
        let dir = tempfile::tempdir().unwrap();
        let mask = Mask::new(3, 2, vec![0, 1, 2, 255, 1, 0]).unwrap();
        let path = dir.path().join("m.png");
        mask.write_png(&path).unwrap();
        assert_eq!(Mask::read_png(&path).unwrap(), mask);
        let decoded = image::open(&path).unwrap();
        assert_eq!(decoded.color(), image::ColorType::L8);
        assert_eq!(mask.first_outside(3), Some((0, 1, 255)));
        assert_eq!(mask.first_outside(256), None);
        assert_eq!(mask.count(1), 2);
        assert!(Mask::new(3, 2, vec![0; 5]).is_err());
    }

    #[test]
    fn colour_pngs_and_other_files_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let rgb = dir.path().join("rgb.png");
        image::RgbImage::new(4, 4).save(&rgb).unwrap();
        let err = Mask::read_png(&rgb).unwrap_err().to_string();
        assert!(err.contains("rgb.png") && err.contains("8-bit greyscale"), "{err}");
        let text = dir.path().join("notes.png");
        std::fs::write(&text, "not a png").unwrap();
        let err = Mask::read_png(&text).unwrap_err().to_string();
        assert!(err.contains("notes.png"), "{err}");
        assert!(Mask::read_png(&dir.path().join("absent.png")).unwrap_err().to_string().contains("absent.png"));
    }

    #[test]
    fn nearest_resizing_and_flips_move_classes_without_mixing_them() {
        let mask = Mask::new(4, 2, vec![0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
        assert_eq!(mask.resize(8, 4).unwrap().classes()[..8], [0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(mask.resize(2, 1).unwrap().classes(), [5, 7], "the pixel under each sample's centre");
        assert_eq!(mask.resize_region((1.0, 0.0, 2.0, 2.0), 2, 2).unwrap().classes(), [1, 2, 5, 6]);
        assert_eq!(mask.resize_short_side(4).unwrap().width(), 8);
        let mut flipped = mask.clone();
        flipped.flip_horizontal();
        assert_eq!(flipped.classes(), [3, 2, 1, 0, 7, 6, 5, 4]);
        flipped.flip_vertical();
        assert_eq!(flipped.classes(), [7, 6, 5, 4, 3, 2, 1, 0]);
    }
}
