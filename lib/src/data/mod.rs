//! From disk to device: datasets, decoding, transforms, the loader, splits and the synthetic leaf-disease data.
//!
//! # The room
//!
//! Datasets, decoding, transforms, the loader, a folder's inventory (read from headers), splits
//! (every class of two or more plants on both sides), the synthetic leaf-disease set and its lesion
//! masks (`mask.rs`; `segmentation.rs` pairs each photo with its mask and gives both the same
//! transforms, `Transforms::apply_with_mask`).

mod baseline;
mod bench;
mod decode;
mod folder;
mod footprint;
mod inventory;
mod loader;
mod manifest;
mod mask;
mod mix;
mod pinned;
mod preprocess;
mod segmentation;
mod split;
mod synth;
mod tables;
mod transform;

pub use baseline::{colour_histogram, histogram_baseline, BaselineReport, HISTOGRAM_BINS};
pub use bench::{bench_decoders, bench_loader, DecoderBench, LoaderBench, LoaderBenchConfig};
pub use decode::{decode_bytes, decode_file, DecodeOptions, Decoded, Decoder, RgbImage};
pub use folder::{ImageDataset, ImageFolder, ImageItem, OnError, IMAGE_EXTENSIONS};
pub use footprint::{HostFootprint, LoaderShape};
pub use inventory::{Inventory, InventoryEntry};
pub use loader::{
    loader_usage, Batch, DataLoader, Dataset, Epoch, Example, LoadTiming, LoaderConfig, LoaderUsage, MemoryGauge, Part, Sampler,
};
pub use manifest::{Manifest, ManifestEntry, MANIFEST_FILE};
pub use mask::Mask;
pub use mix::{cutmix, mixup, one_hot, Mixed};
#[cfg(feature = "cuda")]
pub use pinned::bench_h2d;
pub use pinned::{H2dBench, H2dRecord, Pinning, TorchH2d};
pub use preprocess::{preprocess, PreprocessReport};
pub use segmentation::{SegmentationDataset, SegmentationFolder, SegmentationItem};
pub use split::{group_split, stratified_group_kfold, stratified_split, Split};
pub use synth::{LeafDiseaseSynth, LesionShare, PhotoPlan, SizeShare, Symptom, CLASSES, MASK_CLASSES};
pub use tables::{contact_sheet, decoder_table, loader_bench_table};
pub use transform::{to_image, ColorJitter, Normalize, Transform, Transforms};

use std::path::PathBuf;

/// Everything that can go wrong between a file on disk and a batch tensor.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("decoding {path}: {message}")]
    Decode { path: PathBuf, message: String },
    #[error("encoding {path}: {message}")]
    Encode { path: PathBuf, message: String },
    #[error("resizing {from_w}x{from_h} to {to_w}x{to_h}: {message}")]
    Resize { from_w: u32, from_h: u32, to_w: u32, to_h: u32, message: String },
    #[error("no images found under {root} (expected root/class/*.jpg or *.png)")]
    Empty { root: PathBuf },
    #[error("class folder {dir} has no image (.jpg, .jpeg or .png): add its photos or remove it, or open the folder with OnError::Skip to leave it out")]
    EmptyClass { dir: PathBuf },
    #[error("mask {mask} of image {image}: {message}")]
    Mask { image: PathBuf, mask: PathBuf, message: String },
    #[error("manifest {path}, line {line}: {message}")]
    Manifest { path: PathBuf, line: usize, message: String },
    #[error("{what}: {message}")]
    Invalid { what: &'static str, message: String },
    #[error("{op} on tensor of shape {shape:?}: {source}")]
    Tensor {
        op: &'static str,
        shape: Vec<usize>,
        #[source]
        source: candle_core::Error,
    },
    #[error("loader worker {worker} stopped without finishing batch {batch}")]
    WorkerLost { worker: usize, batch: usize },
    #[error(
        "DataLoader worker {worker} was killed: the loader held {} of host RAM, past its host budget of {} \
         ({workers} workers x prefetch {prefetch} batches queued, each with its decode buffers); \
         this is host memory, not the GPU's: lower num_workers or prefetch, or use 0 workers to check the code first",
        crate::units::human(*held),
        crate::units::human(*budget)
    )]
    WorkerKilled { worker: usize, held: u64, budget: u64, workers: usize, prefetch: usize },
}

impl DataError {
    pub(crate) fn invalid(what: &'static str, message: impl Into<String>) -> Self {
        DataError::Invalid { what, message: message.into() }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| DataError::Io { op, path, source }
    }
}

/// The seeded generator used everywhere: ChaCha8 is portable and stable across versions.
pub type Rng = rand_chacha::ChaCha8Rng;

/// A generator for one item of a seeded stream: the same (seed, stream, index)
/// always gives the same numbers, whichever thread asks.
pub fn rng_for(seed: u64, stream: u64, index: u64) -> Rng {
    use rand::SeedableRng;
    let mixed = splitmix(splitmix(splitmix(seed) ^ stream) ^ index);
    Rng::seed_from_u64(mixed)
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}
