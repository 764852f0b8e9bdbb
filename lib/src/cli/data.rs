//! Arguments of the data commands: `synth`, `preprocess` and `bench loader`.

use std::path::PathBuf;

use clap::{ColorChoice, Parser, ValueEnum};

use crate::data::{DataError, Decoder, LeafDiseaseSynth, LesionShare, LoaderBenchConfig, Manifest};

/// `synth --out DIR [--images N] [--seed S] [--masks DIR [--masks-only]]`
#[derive(Debug, Clone, Parser)]
#[command(
    name = "synth",
    color = ColorChoice::Never,
    about = "Write the synthetic leaf-disease dataset (ImageFolder layout + manifest.csv), and its lesion masks with --masks"
)]
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
    /// Also write each photo's lesion mask to DIR/class/<photo>.png (8-bit greyscale: 0 not lesion, 1 lesion)
    #[arg(long, value_name = "DIR")]
    pub masks: Option<PathBuf>,
    /// Write only the masks, for the photos already under --out (checked against its manifest.csv)
    #[arg(long, requires = "masks")]
    pub masks_only: bool,
}

/// What `synth` wrote: the photos' manifest and the masks' lesion share.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SynthOutput {
    #[serde(flatten)]
    pub manifest: Option<Manifest>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masks: Option<LesionShare>,
}

impl SynthArgs {
    pub fn generator(&self) -> LeafDiseaseSynth {
        let synth = LeafDiseaseSynth::new(self.images, self.seed);
        match self.size {
            Some((w, h)) => synth.with_size(w, h),
            None => synth,
        }
    }

    /// Writes the photos (unless `--masks-only`) and the masks (with `--masks`).
    pub fn run(&self) -> Result<SynthOutput, DataError> {
        let synth = self.generator();
        let manifest = if self.masks_only {
            synth.check_manifest(&Manifest::read(&self.out)?, &self.out)?;
            None
        } else {
            Some(synth.generate(&self.out)?)
        };
        let masks = self.masks.as_deref().map(|dir| synth.generate_masks(dir)).transpose()?;
        Ok(SynthOutput { manifest, masks })
    }
}

impl SynthOutput {
    /// The plain-text report of what was written under `args`' folders.
    pub fn text(&self, args: &SynthArgs) -> String {
        let mut text = String::new();
        if let Some(manifest) = &self.manifest {
            text += &format!("wrote {}\n{}\n{}", args.out.display(), manifest.table(), manifest.size_table());
        }
        if let (Some(share), Some(dir)) = (&self.masks, &args.masks) {
            text += &format!("wrote {}\n{}", dir.display(), share.table());
        }
        text
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
