//! Argument structs shared by the `vramlab` binary and the kernel's magics.

use clap::{ColorChoice, Parser};

use crate::data::LoaderShape;
use crate::gpus::Card;
use crate::ledger::{LayersFlag, LeverFlags, Levers, Mode, StepConfig};
use crate::models::{ModelName, ModelSpec, Precision, Shape, MAX_CLASSES};
use crate::oom::SweepSpec;
use crate::units::parse_positive;

/// `summary MODEL|--spec FILE.json [--input 32x3x224x224] [--dtype f16] [--depth N] [--eval]`
#[derive(Debug, Clone, Parser)]
#[command(name = "summary", color = ColorChoice::Never, about = "Per-layer shapes, parameters, saved-for-backward bytes and MACs of a zoo model or a spec")]
pub struct SummaryArgs {
    /// resnet18, resnet34, resnet50, efficientnet-b0, small-cnn, vit-tiny, vit-small or unet
    #[arg(value_parser = parse_model, required_unless_present = "spec")]
    pub model: Option<ModelName>,
    /// A model spec as JSON (a serialised `ModelSpec`) instead of a zoo model
    #[arg(long, value_parser = parse_spec_file, conflicts_with = "model")]
    pub spec: Option<SpecFile>,
    /// Batch x channels x height x width (or channels x height x width for batch 1)
    #[arg(long, value_parser = parse_input, default_value = "1x3x224x224")]
    pub input: InputShape,
    /// Arithmetic: f32, or f16 / bf16 mixed precision
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub dtype: Precision,
    /// Rows down to this depth: 1 stages, 2 blocks, 3 every layer
    #[arg(long, default_value_t = 3)]
    pub depth: usize,
    /// Inference: show what lives at once instead of what backward keeps
    #[arg(long)]
    pub eval: bool,
    /// Number of classes (default: 1000 for a classifier, 2 for unet: background and lesion)
    #[arg(long, value_parser = |s: &str| whole(s, 1..=MAX_CLASSES))]
    pub classes: Option<usize>,
    #[command(flatten)]
    pub layers: LayersFlag,
}

/// `%summary VARIABLE [--batch N] [--dtype f32|f16|bf16] [--depth D] [--eval]`:
/// the layer table of a model built in a cell (a `Network` or a `Trainer`),
/// for the input it was built for.
#[derive(Debug, Clone, Parser)]
#[command(name = "summary", color = ColorChoice::Never, about = "The layer table of a model built in a cell")]
pub struct SummaryOfArgs {
    /// Samples in the batch
    #[arg(long, default_value_t = 1, value_parser = parse_positive)]
    pub batch: usize,
    /// Arithmetic (default: the trainer's, or f32 for a bare network)
    #[arg(long, value_enum)]
    pub dtype: Option<Precision>,
    /// Rows down to this depth: 1 stages, 2 blocks, 3 every layer
    #[arg(long, default_value_t = 3)]
    pub depth: usize,
    /// Inference: show what lives at once instead of what backward keeps
    #[arg(long)]
    pub eval: bool,
}

/// `oomcheck MODEL --batch B --res R [--amp f16|bf16] [--opt ...] [--accum N] [--ckpt ...] [--gpu NAME|8GiB] [--sweep ...]`
#[derive(Debug, Clone, Parser)]
#[command(name = "oomcheck", color = ColorChoice::Never, about = "Will a training step fit? The five bills, the peak, and ranked fixes")]
pub struct OomcheckArgs {
    /// resnet18, resnet34, resnet50, efficientnet-b0, small-cnn, vit-tiny, vit-small or unet
    #[arg(value_parser = parse_model, required_unless_present = "spec")]
    pub model: Option<ModelName>,
    /// A model spec as JSON (a serialised `ModelSpec`) instead of a zoo model
    #[arg(long, value_parser = parse_spec_file, conflicts_with = "model")]
    pub spec: Option<SpecFile>,
    /// Samples per forward pass (the micro-batch when accumulating)
    #[arg(long, value_parser = parse_positive)]
    pub batch: usize,
    /// Square input resolution in pixels
    #[arg(long, value_parser = parse_positive)]
    pub res: usize,
    /// Input channels
    #[arg(long, default_value_t = 3, value_parser = parse_positive)]
    pub channels: usize,
    #[command(flatten)]
    pub levers: LeverFlags,
    #[command(flatten)]
    pub card: CardFlag,
    /// Peak against batch or resolution: batch=8..64, res=128..512:32, batch=8,16,32
    #[arg(long, value_parser = parse_sweep)]
    pub sweep: Option<SweepSpec>,
    /// Number of classes (default: 1000 for a classifier, 2 for unet: background and lesion)
    #[arg(long, value_parser = |s: &str| whole(s, 1..=MAX_CLASSES))]
    pub classes: Option<usize>,
    /// Inference instead of training
    #[arg(long)]
    pub eval: bool,
    /// Data loader workers: adds the loader's host memory to the report (the second kind of OOM)
    #[arg(long, value_parser = |s: &str| whole(s, 0..=1024))]
    pub workers: Option<usize>,
    /// Batches each loader worker queues ahead (PyTorch's prefetch_factor)
    #[arg(long, default_value_t = 2, value_parser = |s: &str| whole(s, 1..=1024))]
    pub prefetch: usize,
    /// Largest photo a loader worker decodes, WIDTHxHEIGHT
    #[arg(long, value_parser = parse_dims, default_value = "4000x3000")]
    pub source: (u32, u32),
    /// Host RAM to judge the loader against, such as 32GiB
    #[arg(long, value_parser = crate::units::parse_bytes)]
    pub host_ram: Option<u64>,
    /// Show only the loader's host memory (needs --workers), not the card's bills
    #[arg(long, requires = "workers")]
    pub host: bool,
    /// Only the verdict (the peak against the card) and, when it does not fit, one line per fix
    #[arg(long, conflicts_with_all = ["sweep", "host"])]
    pub brief: bool,
    /// Only the verdict and, when it does not fit, the fixes' table (extra time, accuracy risk, flags): no bills, no timeline
    #[arg(long, conflicts_with_all = ["sweep", "host", "brief"])]
    pub fixes: bool,
}

/// `--gpu`: the card a step is checked against.
#[derive(Debug, Clone, clap::Args)]
pub struct CardFlag {
    /// A catalogue GPU (4090, a100-80gb, rtx4060-laptop...), a size (8GiB, 12GB) or cpu
    #[arg(long, value_parser = parse_device, default_value = "rtx4060-laptop")]
    pub gpu: Card,
}

/// A model spec read from a JSON file, and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecFile {
    pub path: std::path::PathBuf,
    pub spec: ModelSpec,
}

fn parse_spec_file(text: &str) -> Result<SpecFile, String> {
    let json = std::fs::read_to_string(text).map_err(|e| format!("cannot read the spec {text}: {e}"))?;
    let spec = serde_json::from_str(&json).map_err(|e| format!("{text} is not a model spec (a serialised ModelSpec): {e}"))?;
    Ok(SpecFile { path: text.into(), spec })
}

/// The spec a zoo model's name or `--spec` names.
fn spec_of(model: Option<ModelName>, spec: &Option<SpecFile>, classes: Option<usize>) -> Result<ModelSpec, super::UsageError> {
    match (spec, model) {
        (Some(file), _) => Ok(file.spec.clone()),
        (None, Some(model)) => Ok(model.spec(classes.unwrap_or(model.default_classes()))),
        (None, None) => Err(super::UsageError("name a zoo model or give --spec FILE.json".to_owned())),
    }
}

impl SummaryArgs {
    /// The spec summarised: the zoo model's, or the file's.
    pub fn model_spec(&self) -> Result<ModelSpec, super::UsageError> {
        spec_of(self.model, &self.spec, self.classes)
    }
}

/// `%oomcheck VARIABLE --batch B [...]`: the fit check of a model built in a
/// cell (a `Network` or a `Trainer`), for its input unless `--res` says
/// otherwise, with a trainer's own levers unless a flag overrides one.
#[derive(Debug, Clone, Parser)]
#[command(name = "oomcheck", color = ColorChoice::Never, about = "Will a training step of a model built in a cell fit?")]
pub struct OomcheckOfArgs {
    /// Samples per forward pass (the micro-batch when accumulating)
    #[arg(long, value_parser = parse_positive)]
    pub batch: usize,
    /// Square input resolution in pixels; default: the model's own input
    #[arg(long, value_parser = parse_positive)]
    pub res: Option<usize>,
    /// The levers; a flag left out keeps the trainer's own (a bare network's: f32, adam, no accumulation
    /// or checkpointing, the layers it was built with)
    #[command(flatten)]
    pub levers: LeverFlags,
    #[command(flatten)]
    pub card: CardFlag,
    /// Peak against batch or resolution: batch=8..64, res=128..512:32, batch=8,16,32
    #[arg(long, value_parser = parse_sweep)]
    pub sweep: Option<SweepSpec>,
    /// Inference instead of training
    #[arg(long)]
    pub eval: bool,
    /// Only the verdict (the peak against the card) and, when it does not fit, one line per fix
    #[arg(long, conflicts_with = "sweep")]
    pub brief: bool,
    /// Only the verdict and, when it does not fit, the fixes' table (extra time, accuracy risk, flags): no bills, no timeline
    #[arg(long, conflicts_with_all = ["sweep", "brief"])]
    pub fixes: bool,
}

impl OomcheckArgs {
    /// The spec checked: the zoo model's, or the file's.
    pub fn model_spec(&self) -> Result<ModelSpec, super::UsageError> {
        spec_of(self.model, &self.spec, self.classes)
    }

    /// How a fix's flags name the model: the zoo model, or `--spec FILE`.
    pub fn model_words(&self) -> String {
        match (&self.spec, self.model) {
            (Some(file), _) => format!("--spec {}", file.path.display()),
            (None, Some(model)) => model.as_str().to_owned(),
            (None, None) => String::new(),
        }
    }

    /// The loader settings, when `--workers` asks for the host-memory report;
    /// `masks` when the model labels each pixel.
    pub fn loader_shape(&self, masks: bool) -> Option<LoaderShape> {
        self.workers.map(|num_workers| LoaderShape {
            batch_size: self.batch,
            sample: [self.channels, self.res, self.res],
            num_workers,
            prefetch: self.prefetch,
            source: self.source,
            masks,
        })
    }

    /// The step checked: the batch and input, the levers laid over the lesson's defaults.
    pub fn step_config(&self) -> StepConfig {
        StepConfig {
            batch: self.batch,
            input: Shape::map(self.channels, self.res, self.res),
            levers: self.levers.over(&Levers::default()),
            mode: if self.eval { Mode::Inference } else { Mode::Training },
        }
    }
}

/// `mem [--reset-peak] [--empty-cache] [--plot] | --last-cell | --processes`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Parser)]
#[command(name = "mem", color = ColorChoice::Never, about = "The cell process's heap: in use, held, peak, RSS, free/total; the registered bills predicted vs measured")]
pub struct MemArgs {
    /// Start a new peak from what is in use now
    #[arg(long)]
    pub reset_peak: bool,
    /// Give the allocator's free memory back to the OS (malloc_trim) and show held and RSS before and after
    #[arg(long)]
    pub empty_cache: bool,
    /// Chart the last registered step by bill, the prediction drawn over it
    #[arg(long)]
    pub plot: bool,
    /// Only the peak and net change of the last Rust cell (what `%%mem` shows)
    #[arg(long, conflicts_with_all = ["reset_peak", "empty_cache", "plot", "processes"])]
    pub last_cell: bool,
    /// Only the vramlab processes on this machine and what each holds (nvidia-smi for a simulated card)
    #[arg(long, conflicts_with_all = ["reset_peak", "empty_cache", "plot"])]
    pub processes: bool,
    /// One line: in use, held, peak and RSS, and the registered step's peak predicted beside measured
    #[arg(long, conflicts_with_all = ["plot", "last_cell", "processes"])]
    pub brief: bool,
}

/// A batch and one sample's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputShape {
    pub batch: usize,
    pub sample: Shape,
}

pub(crate) fn parse_model(text: &str) -> Result<ModelName, String> {
    text.parse().map_err(|e: crate::models::ModelError| e.to_string())
}

/// A whole number in `range`.
fn whole(text: &str, range: std::ops::RangeInclusive<usize>) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if range.contains(&n) => Ok(n),
        _ => Err(format!("expected a whole number from {} to {}", range.start(), range.end())),
    }
}

fn parse_input(text: &str) -> Result<InputShape, String> {
    let dims: Vec<usize> = text
        .split(['x', 'X', ','])
        .map(|d| d.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<_>>()
        .ok_or("expected BATCHxCxHxW such as 32x3x224x224")?;
    match dims[..] {
        [batch, c, h, w] => Ok(InputShape { batch, sample: Shape::map(c, h, w) }),
        [c, h, w] => Ok(InputShape { batch: 1, sample: Shape::map(c, h, w) }),
        _ => Err("expected BATCHxCxHxW such as 32x3x224x224".to_owned()),
    }
}

fn parse_device(text: &str) -> Result<Card, String> {
    Card::parse(text).map_err(|e| e.to_string())
}

fn parse_sweep(text: &str) -> Result<SweepSpec, String> {
    text.parse().map_err(|e: crate::oom::SweepParseError| e.to_string())
}

/// `WIDTHxHEIGHT`, both at least 1.
pub(crate) fn parse_dims(text: &str) -> Result<(u32, u32), String> {
    let bad = || format!("expected WIDTHxHEIGHT such as 4000x3000, got `{text}`");
    let (w, h) = text.split_once(['x', 'X']).ok_or_else(bad)?;
    match (w.trim().parse::<u32>(), h.trim().parse::<u32>()) {
        (Ok(w), Ok(h)) if w > 0 && h > 0 => Ok((w, h)),
        _ => Err(bad()),
    }
}
