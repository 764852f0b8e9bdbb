//! Offline resize: every image once to a short side of 512 and saved as a
//! compressed JPEG, so later epochs never decode a 4000x3000 photo again.

use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use rayon::prelude::*;

use super::decode::{decode_file, DecodeOptions, Decoder};
use super::folder::{ImageFolder, OnError};
use super::manifest::{Manifest, MANIFEST_FILE};
use super::DataError;
use crate::render::Progress;

/// What a preprocessing run did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PreprocessReport {
    pub images: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub seconds: f64,
    pub short_side: u32,
    pub quality: u8,
    /// Images smaller than the short side, copied at their own size.
    pub kept_size: usize,
}

/// Resizes every image of the ImageFolder `src` so its shorter side is at
/// most `short_side` (EXIF orientation applied, so the copies are upright),
/// writes JPEGs at `quality` under `out` in the same layout, and carries the
/// manifest over with the new sizes.
pub fn preprocess(src: &Path, out: &Path, short_side: u32, quality: u8) -> Result<PreprocessReport, DataError> {
    if short_side == 0 || !(1..=100).contains(&quality) {
        return Err(DataError::invalid(
            "preprocess",
            format!("short side {short_side} and quality {quality}: need at least 1 and 1..=100"),
        ));
    }
    let started = Instant::now();
    let folder = ImageFolder::open(src, OnError::Fail)?;
    for class in &folder.classes {
        let dir = out.join(class);
        std::fs::create_dir_all(&dir).map_err(DataError::io("creating", dir))?;
    }
    let options = DecodeOptions { decoder: Decoder::TurboJpeg, min_short_side: Some(short_side) };
    let progress = Mutex::new(Progress::new("preprocess", folder.items.len() as u64));
    let results: Result<Vec<Copied>, DataError> = folder
        .items
        .par_iter()
        .map(|item| {
            let decoded = decode_file(&item.path, options)?;
            let small = decoded.stored_size.0.min(decoded.stored_size.1) <= short_side;
            let image = decoded.image;
            let image = if image.width().min(image.height()) <= short_side { image } else { image.resize_short_side(short_side)? };
            let relative = item.path.strip_prefix(src).unwrap_or(&item.path).with_extension("jpg");
            let target = out.join(&relative);
            let mut bytes = Vec::new();
            jpeg_encoder::Encoder::new(&mut bytes, quality)
                .encode(image.pixels(), image.width() as u16, image.height() as u16, jpeg_encoder::ColorType::Rgb)
                .map_err(|e| DataError::Encode { path: target.clone(), message: e.to_string() })?;
            std::fs::write(&target, &bytes).map_err(DataError::io("writing", &target))?;
            if let Ok(mut p) = progress.lock() {
                p.inc(1);
            }
            Ok(Copied {
                relative,
                bytes_in: decoded.encoded_bytes as u64,
                bytes_out: bytes.len() as u64,
                width: image.width(),
                height: image.height(),
                kept_size: small,
            })
        })
        .collect();
    if let Ok(mut p) = progress.lock() {
        p.finish();
    }
    let results = results?;
    if let Some(mut manifest) = Manifest::read_if_present(src)? {
        for entry in &mut manifest.entries {
            let relative = entry.path.with_extension("jpg");
            if let Some(copy) = results.iter().find(|r| r.relative == relative) {
                entry.path = relative;
                entry.width = copy.width;
                entry.height = copy.height;
                entry.bytes = copy.bytes_out;
                entry.quality = quality;
                entry.orientation = 1;
            }
        }
        manifest.write(out)?;
    } else if out.join(MANIFEST_FILE).exists() {
        std::fs::remove_file(out.join(MANIFEST_FILE)).map_err(DataError::io("removing", out.join(MANIFEST_FILE)))?;
    }
    Ok(PreprocessReport {
        images: results.len(),
        bytes_in: results.iter().map(|r| r.bytes_in).sum(),
        bytes_out: results.iter().map(|r| r.bytes_out).sum(),
        seconds: started.elapsed().as_secs_f64(),
        short_side,
        quality,
        kept_size: results.iter().filter(|r| r.kept_size).count(),
    })
}

/// One image's copy: where it went, its sizes, and whether it was already small enough.
struct Copied {
    relative: std::path::PathBuf,
    bytes_in: u64,
    bytes_out: u64,
    width: u32,
    height: u32,
    kept_size: bool,
}
