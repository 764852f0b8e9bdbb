//! Arguments of the data commands: `synth`, `preprocess` and `bench loader`.

use std::path::PathBuf;

use clap::{ColorChoice, Parser, ValueEnum};

use crate::data::{Decoder, LeafDiseaseSynth, LoaderBenchConfig};

/// `synth --out DIR [--images N] [--seed S]`
#[derive(Debug, Clone, Parser)]
#[command(name = "synth", color = ColorChoice::Never, about = "Write the synthetic leaf-disease dataset (ImageFolder layout + manifest.csv)")]
pub struct SynthArgs {
    /// Directory to write root/class/*.jpg and manifest.csv into
    #[arg(long)]
    pub out: PathBuf,
    /// Number of photos
    #[arg(long, default_value_t = 3000)]
    pub images: usize,
    /// Seed: the same seed writes the same bytes
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// All photos at one size, WIDTHxHEIGHT, instead of the realistic mix
    #[arg(long, value_parser = super::args::parse_dims)]
    pub size: Option<(u32, u32)>,
}

impl SynthArgs {
    pub fn generator(&self) -> LeafDiseaseSynth {
        let synth = LeafDiseaseSynth::new(self.images, self.seed);
        match self.size {
            Some((w, h)) => synth.with_size(w, h),
            None => synth,
        }
    }
}

/// `preprocess --src DIR --out DIR [--short-side 512] [--quality 90]`
#[derive(Debug, Clone, Parser)]
#[command(name = "preprocess", color = ColorChoice::Never, about = "Resize an ImageFolder offline to a short side and save compressed JPEGs")]
pub struct PreprocessArgs {
    #[arg(long)]
    pub src: PathBuf,
    #[arg(long)]
    pub out: PathBuf,
    /// Shorter side of the copies (smaller images are kept at their size)
    #[arg(long, default_value_t = 512)]
    pub short_side: u32,
    /// JPEG quality of the copies
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub quality: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DecoderChoice {
    /// libjpeg-turbo with DCT-domain downscaling
    #[value(name = "turbojpeg")]
    TurboJpeg,
    /// image (zune-jpeg), full size
    Image,
}

impl From<DecoderChoice> for Decoder {
    fn from(choice: DecoderChoice) -> Decoder {
        match choice {
            DecoderChoice::TurboJpeg => Decoder::TurboJpeg,
            DecoderChoice::Image => Decoder::Image,
        }
    }
}

/// `bench loader --root DIR [--batch 32] [--res 224] [--workers W]`
#[derive(Debug, Clone, Parser)]
#[command(name = "loader", color = ColorChoice::Never, about = "One pass of the loader (decode, resize, flip, normalise): images/s")]
pub struct BenchLoaderArgs {
    #[arg(long)]
    pub root: PathBuf,
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch: u64,
    #[arg(long, default_value_t = 224, value_parser = clap::value_parser!(u32).range(1..))]
    pub res: u32,
    /// Worker threads (0: on the calling thread)
    #[arg(long, default_value_t = 0)]
    pub workers: usize,
    /// Batches each worker queues ahead
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    pub prefetch: u64,
    #[arg(long, value_enum, default_value_t = DecoderChoice::TurboJpeg)]
    pub decoder: DecoderChoice,
    /// Only the first N images
    #[arg(long)]
    pub limit: Option<usize>,
}

impl BenchLoaderArgs {
    pub fn config(&self) -> LoaderBenchConfig {
        LoaderBenchConfig {
            batch: self.batch as usize,
            res: self.res,
            workers: self.workers,
            prefetch: self.prefetch as usize,
            decoder: self.decoder.into(),
            limit: self.limit,
        }
    }
}

/// `bench h2d [--mib 64] [--repeats 20] [--device 0]` (feature `cuda`)
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Parser)]
#[command(name = "h2d", color = ColorChoice::Never, about = "Host-to-device copy speed from pageable and page-locked memory (pin_memory): MB/s")]
pub struct BenchH2dArgs {
    /// MiB per copy
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub mib: u64,
    /// Timed copies of each kind (the median is reported)
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub repeats: u64,
    /// CUDA device ordinal
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}
