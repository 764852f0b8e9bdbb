//! Loader throughput over one pass, and decoder speed, on a folder of images.

use std::path::Path;
use std::time::Instant;

use super::decode::{decode_bytes, DecodeOptions, Decoder};
use super::folder::{ImageFolder, OnError};
use super::loader::{DataLoader, LoadTiming, LoaderConfig};
use super::transform::{Transform, Transforms};
use super::DataError;

/// The benchmark's pipeline: decode, resize to res x res, random horizontal
/// flip, normalise; batches of `batch`; `workers` threads.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LoaderBenchConfig {
    pub batch: usize,
    pub res: u32,
    pub workers: usize,
    pub prefetch: usize,
    pub decoder: Decoder,
    /// Only the first `limit` images (all when None).
    pub limit: Option<usize>,
}

impl Default for LoaderBenchConfig {
    fn default() -> Self {
        LoaderBenchConfig { batch: 32, res: 224, workers: 0, prefetch: 2, decoder: Decoder::TurboJpeg, limit: None }
    }
}

/// One pass of the loader over a folder.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LoaderBench {
    pub config: LoaderBenchConfig,
    pub images: usize,
    pub batches: usize,
    pub seconds: f64,
    pub images_per_s: f64,
    /// Compressed megabytes (10^6) decoded per second of decoding time on one core.
    pub decode_mb_per_s_per_core: f64,
    /// Compressed megabytes read over the pass.
    pub encoded_mb: f64,
    pub decode_seconds: f64,
    pub transform_seconds: f64,
    /// Megapixels the decoder produced (after DCT downscaling).
    pub decoded_megapixels: f64,
    /// Peak bytes of batches and decode buffers alive at once.
    pub peak_host_bytes: u64,
}

pub fn bench_loader(root: &Path, config: &LoaderBenchConfig) -> Result<LoaderBench, DataError> {
    let folder = ImageFolder::open(root, OnError::Fail)?;
    let count = config.limit.unwrap_or(folder.items.len()).min(folder.items.len());
    let transforms =
        Transforms::new(vec![Transform::Resize { width: config.res, height: config.res }, Transform::HorizontalFlip { p: 0.5 }]);
    let indices: Vec<usize> = (0..count).collect();
    let dataset = folder.dataset(&indices, transforms).with_decoder(config.decoder);
    let loader = DataLoader::new(
        dataset,
        LoaderConfig {
            batch_size: config.batch,
            shuffle: false,
            num_workers: config.workers,
            prefetch: config.prefetch,
            ..LoaderConfig::default()
        },
    )?;
    let started = Instant::now();
    let mut timing = LoadTiming::default();
    let (mut images, mut batches) = (0, 0);
    for batch in loader.epoch(0) {
        let batch = batch?;
        timing.add(&batch.timing);
        images += batch.len();
        batches += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    let encoded_mb = timing.encoded_bytes as f64 / 1e6;
    Ok(LoaderBench {
        config: config.clone(),
        images,
        batches,
        seconds,
        images_per_s: images as f64 / seconds,
        decode_mb_per_s_per_core: encoded_mb / timing.decode_seconds.max(1e-9),
        encoded_mb,
        decode_seconds: timing.decode_seconds,
        transform_seconds: timing.transform_seconds,
        decoded_megapixels: timing.decoded_pixels as f64 / 1e6,
        peak_host_bytes: loader.gauge().peak(),
    })
}

/// One decoder's speed on a set of files, on one core.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DecoderBench {
    pub label: String,
    pub images: usize,
    pub seconds: f64,
    pub images_per_s: f64,
    pub mb_per_s: f64,
    pub megapixels_out: f64,
}

/// Decodes `files` with each of: `image` at full size, libjpeg-turbo at
/// full size, and libjpeg-turbo at the DCT scale that still covers `short_side`.
pub fn bench_decoders(files: &[std::path::PathBuf], short_side: u32) -> Result<Vec<DecoderBench>, DataError> {
    let runs = [
        ("image (zune-jpeg), full size", DecodeOptions { decoder: Decoder::Image, min_short_side: None }),
        ("libjpeg-turbo, full size", DecodeOptions { decoder: Decoder::TurboJpeg, min_short_side: None }),
        ("libjpeg-turbo, DCT-scaled", DecodeOptions { decoder: Decoder::TurboJpeg, min_short_side: Some(short_side) }),
    ];
    let mut out = Vec::new();
    for (label, options) in runs {
        let (mut seconds, mut bytes, mut pixels) = (0.0, 0u64, 0u64);
        for path in files {
            let data = std::fs::read(path).map_err(DataError::io("reading", path))?;
            let started = Instant::now();
            let decoded = decode_bytes(&data, path, options)?;
            seconds += started.elapsed().as_secs_f64();
            bytes += data.len() as u64;
            pixels += decoded.image.width() as u64 * decoded.image.height() as u64;
        }
        out.push(DecoderBench {
            label: label.to_owned(),
            images: files.len(),
            seconds,
            images_per_s: files.len() as f64 / seconds.max(1e-9),
            mb_per_s: bytes as f64 / 1e6 / seconds.max(1e-9),
            megapixels_out: pixels as f64 / 1e6,
        });
    }
    Ok(out)
}
