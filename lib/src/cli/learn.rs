//! The arguments of `vramlab train`: a zoo model trained on an image folder
//! through the loader, scored per class against the baselines.

use std::path::PathBuf;

use clap::{ColorChoice, Parser};

use super::args::parse_model;
use crate::data::{group_split, ImageFolder, OnError, SegmentationFolder, Split, MASK_CLASSES};
use crate::learn::LearnConfig;
use crate::ledger::{LeverFlags, Levers};
use crate::models::ModelName;
use crate::train::{GradScalerConfig, OptimizerConfig};
use crate::units::parse_positive;

/// `train --root DIR [--model small-cnn] [--res 64] [--epochs 12] [--batch 32] [--amp f16] [--opt adam] [--accum 1] [--ckpt stages] [--layers plain] [--lr 0.002] [--cosine] [--val 0.2] [--seed 0] [--workers 2] [--augment] [--no-baseline]`
#[derive(Debug, Clone, Parser)]
#[command(
    name = "train",
    color = ColorChoice::Never,
    about = "Train a zoo model on an image folder through the loader, validating on whole plants held out: accuracy per class against the baselines"
)]
pub struct LearnArgs {
    /// The dataset: root/class/*.jpg (groups from root/manifest.csv when present)
    #[arg(long)]
    pub root: PathBuf,
    /// Segmentation: each photo's mask, at the same relative path as a .png of class
    /// indices (what `vramlab synth --masks DIR` writes); needs a model that labels each pixel (unet)
    #[arg(long)]
    pub masks: Option<PathBuf>,
    /// resnet18, resnet34, resnet50, efficientnet-b0, small-cnn, vit-tiny, vit-small or unet
    #[arg(long, value_parser = parse_model, default_value = "small-cnn")]
    pub model: ModelName,
    /// Square input side in pixels
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(8..))]
    pub res: u32,
    /// Passes over the training split (for small-cnn, 12 reach about 70% validation accuracy on
    /// 3,000 synthetic leaf photos and about 52% on 2,000; 6 only tie the colour-histogram baseline)
    #[arg(long, default_value_t = 12, value_parser = parse_positive)]
    pub epochs: usize,
    /// Images per forward pass (the micro-batch when accumulating)
    #[arg(long, default_value_t = 32, value_parser = parse_positive)]
    pub batch: usize,
    #[command(flatten)]
    pub levers: LeverFlags,
    /// Learning rate
    #[arg(long, default_value_t = 0.002)]
    pub lr: f64,
    /// Anneal the learning rate to zero over the run on a cosine
    #[arg(long)]
    pub cosine: bool,
    /// Share of the photos held out for validation, whole plants at a time, class shares kept
    #[arg(long, default_value_t = 0.2)]
    pub val: f64,
    /// Under f16, train without loss scaling (to see what half precision does without it)
    #[arg(long)]
    pub no_loss_scaling: bool,
    /// Seed of the split, the weights, the batch order and the augmentation
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Loader worker threads
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Random resized crop, rotation and colour jitter instead of resize and flip
    #[arg(long)]
    pub augment: bool,
    /// Skip the colour-histogram baseline
    #[arg(long)]
    pub no_baseline: bool,
}

impl LearnArgs {
    /// How to train: the flags over the lesson's levers (f32, Adam, lean layers).
    pub fn config(&self) -> LearnConfig {
        let levers = self.levers.over(&Levers::default());
        LearnConfig {
            model: self.model,
            res: self.res,
            epochs: self.epochs,
            batch_size: self.batch,
            accumulation: levers.accumulation,
            precision: levers.precision,
            optimizer: OptimizerConfig::for_kind(levers.optimizer, self.lr),
            checkpointing: levers.checkpointing,
            layers: levers.layers,
            cosine: self.cosine,
            workers: self.workers,
            augment: self.augment,
            seed: self.seed,
            baseline: !self.no_baseline,
            scaler: GradScalerConfig { enabled: !self.no_loss_scaling, ..GradScalerConfig::default() },
            cards: levers.cards,
        }
    }

    /// The folder (failing on a file that is not an image) and its stratified group split.
    pub fn open(&self) -> Result<(ImageFolder, Split), crate::data::DataError> {
        let folder = ImageFolder::open(&self.root, OnError::Fail)?;
        let split = group_split(&folder.labels(), &folder.groups(), self.val, self.seed)?;
        Ok((folder, split))
    }

    /// The folder with its masks (failing on a missing or mis-sized mask, or a
    /// class index the model cannot give) and the same kind of split.
    pub fn open_segmentation(&self, masks: &std::path::Path) -> Result<(SegmentationFolder, Split), crate::data::DataError> {
        let folder = SegmentationFolder::open(&self.root, masks, MASK_CLASSES.len() as u32, OnError::Fail)?;
        let split = group_split(&folder.labels(), &folder.groups(), self.val, self.seed)?;
        Ok((folder, split))
    }
}
