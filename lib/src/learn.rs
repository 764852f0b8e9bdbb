//! Training straight from an image folder, above both the data pipeline and
//! the trainer: the loader as the Trainer's batch source, and the validation accuracy per class beside the majority-class
//! and colour-histogram baselines (is a dataset learnable, and how hard?).
//!
//! # The room
//!
//! Training from an image folder: the loader as the trainer's batch source, with AMP, accumulation
//! and a cosine schedule; per-class accuracy and the confusion matrix beside the baselines; from a
//! folder with masks, segmentation (`learn/segment.rs`: each class's IoU beside the trivial mask's)
//! (above both `data` and `train`).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use crate::data::{
    histogram_baseline, BaselineReport, DataError, DataLoader, Dataset, ImageFolder, LoaderConfig, Part, Split, Symptom, Transform,
    Transforms,
};
use crate::dist::Collective;
use crate::ledger::{Cards, Checkpointing};
use crate::models::{Layers, ModelError, ModelName, Network, Pass, Precision, Shape};
use crate::train::{BatchSource, GradScalerConfig, OptimizerConfig, Schedule, TrainConfig, TrainError, TrainEvent, Trainer};

mod scores;
mod segment;

pub use segment::{fit_segmentation, SegmentReport};

/// Why training from a folder stopped: the data, the model or the training.
#[derive(Debug, thiserror::Error)]
pub enum LearnError {
    #[error(transparent)]
    Data(Box<DataError>),
    #[error("building the model: {0}")]
    Model(Box<ModelError>),
    #[error(transparent)]
    Train(Box<TrainError>),
}

// Boxed: each would make every result of a run several times larger.
impl From<DataError> for LearnError {
    fn from(error: DataError) -> Self {
        LearnError::Data(Box::new(error))
    }
}

impl From<ModelError> for LearnError {
    fn from(error: ModelError) -> Self {
        LearnError::Model(Box::new(error))
    }
}

impl From<TrainError> for LearnError {
    fn from(error: TrainError) -> Self {
        LearnError::Train(Box::new(error))
    }
}

/// Each epoch's batches as they come off the loader, on the host.
impl<D: Dataset> BatchSource for DataLoader<D> {
    fn batches_per_epoch(&self) -> usize {
        self.len()
    }

    fn epoch(&mut self, epoch: usize) -> Box<dyn Iterator<Item = candle_core::Result<(Tensor, Tensor)>> + '_> {
        Box::new(DataLoader::epoch(self, epoch as u64).map(|batch| {
            let batch = batch.map_err(candle_core::Error::wrap)?;
            Ok((batch.images, batch.labels))
        }))
    }
}

/// A batch source whose batches are copied to `device` on the way (a no-op on the CPU).
#[derive(Debug)]
pub struct OnDevice<S> {
    pub source: S,
    pub device: Device,
}

impl<S: BatchSource> BatchSource for OnDevice<S> {
    fn batches_per_epoch(&self) -> usize {
        self.source.batches_per_epoch()
    }

    fn epoch(&mut self, epoch: usize) -> Box<dyn Iterator<Item = candle_core::Result<(Tensor, Tensor)>> + '_> {
        let device = self.device.clone();
        Box::new(self.source.epoch(epoch).map(move |batch| {
            let (images, labels) = batch?;
            Ok((images.to_device(&device)?, labels.to_device(&device)?))
        }))
    }
}

/// How [`fit_folder`] trains. Defaults: small-cnn at 64x64, 12 epochs of
/// batch 32 in f32, Adam at 0.002, two loader workers, resize and flip only.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LearnConfig {
    pub model: ModelName,
    /// Square input side in pixels.
    pub res: u32,
    pub epochs: usize,
    /// Images per micro-batch: what one forward and backward hold at once.
    pub batch_size: usize,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub accumulation: usize,
    pub precision: Precision,
    pub optimizer: OptimizerConfig,
    pub checkpointing: Checkpointing,
    /// The layers the network is built from.
    pub layers: Layers,
    /// Anneal the learning rate to zero over the run on a cosine
    /// (`CosineAnnealingLR`), so the last epochs settle instead of jumping.
    pub cosine: bool,
    pub workers: usize,
    /// The full training augmentation (random resized crop, rotation, colour
    /// jitter) instead of resize and horizontal flip.
    pub augment: bool,
    /// Seed of the weights, the batch order and the augmentation.
    pub seed: u64,
    /// Also fit the colour-histogram baseline on the same split.
    pub baseline: bool,
    /// Loss scaling under f16 (PyTorch's `GradScaler` defaults; disable it
    /// to see what half precision does without it).
    pub scaler: GradScalerConfig,
    /// The processes that train together, each on its part of every epoch
    /// with `batch_size` a micro-batch ([`fit_folder_on`] takes their
    /// collective); one by default.
    pub cards: Cards,
}

impl Default for LearnConfig {
    fn default() -> Self {
        LearnConfig {
            model: ModelName::SmallCnn,
            res: 64,
            // 12 reach about 70% on 3,000 synthetic leaf photos; 6 only tie the colour histogram.
            epochs: 12,
            batch_size: 32,
            accumulation: 1,
            precision: Precision::F32,
            optimizer: OptimizerConfig::for_kind(crate::ledger::OptimizerKind::Adam, 0.002),
            checkpointing: Checkpointing::None,
            layers: Layers::Lean,
            cosine: false,
            workers: 2,
            augment: false,
            seed: 0,
            baseline: true,
            scaler: GradScalerConfig::default(),
            cards: Cards::default(),
        }
    }
}

/// One epoch: the training side's running figures, then the validation pass.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LearnEpoch {
    pub epoch: usize,
    pub train_loss: f32,
    pub train_accuracy: f64,
    pub val_loss: f32,
    /// Of the images, or of the pixels for segmentation.
    pub val_accuracy: f64,
    /// Segmentation only: each class's IoU on the validation set.
    pub val_iou: Vec<Option<f64>>,
    /// Loading and training, without the validation pass.
    pub seconds: f64,
}

/// Validation accuracy of one class.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassScore {
    pub class: String,
    /// For the synthetic leaf-disease classes; `None` for other names.
    pub symptom: Option<Symptom>,
    pub val_images: usize,
    /// `None` when the class has no validation image.
    pub accuracy: Option<f64>,
    pub baseline_accuracy: Option<f64>,
}

/// What training from the folder reached, and the floors to judge it by.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LearnReport {
    pub config: LearnConfig,
    pub train_images: usize,
    pub val_images: usize,
    pub epochs: Vec<LearnEpoch>,
    /// After the last epoch.
    pub val_accuracy: f64,
    /// The mean of the per-class accuracies (classes with validation images).
    pub balanced_accuracy: f64,
    pub per_class: Vec<ClassScore>,
    /// Validation images by true class (rows) and predicted class (columns).
    pub confusion: Vec<Vec<usize>>,
    /// Always answering the most frequent training class.
    pub majority_accuracy: f64,
    pub baseline: Option<BaselineReport>,
    pub seconds: f64,
}

impl LearnReport {
    /// Validation images and accuracy over the classes with `symptom`
    /// (`None`: no class has it or none of its images was validated).
    pub fn symptom_accuracy(&self, symptom: Symptom) -> Option<(usize, f64)> {
        let (mut images, mut hits) = (0usize, 0.0f64);
        for score in self.per_class.iter().filter(|s| s.symptom == Some(symptom)) {
            if let Some(accuracy) = score.accuracy {
                images += score.val_images;
                hits += accuracy * score.val_images as f64;
            }
        }
        (images > 0).then(|| (images, hits / images as f64))
    }
}

fn tensor_err(op: &'static str) -> impl Fn(candle_core::Error) -> DataError {
    move |source| DataError::Tensor { op, shape: Vec::new(), source }
}

/// Trains `config.model` on `split.train` of `folder`, read through the
/// loader (never all in memory), validating after every epoch on `split.val`
/// resized to the same side; then scores each class. `watch` sees every
/// training event as it happens.
pub fn fit_folder(
    folder: &ImageFolder,
    split: &Split,
    config: &LearnConfig,
    device: &Device,
    watch: &mut dyn FnMut(&TrainEvent),
) -> Result<LearnReport, LearnError> {
    fit_folder_on(folder, split, config, device, None, watch)
}

/// [`fit_folder`] on `config.cards` processes training together through
/// `collective` (under `mpirun`): each takes its part of every epoch (a
/// distributed sampler, the seed shared), the gradients are averaged over
/// them, and each validates on the whole validation set.
pub fn fit_folder_on(
    folder: &ImageFolder,
    split: &Split,
    config: &LearnConfig,
    device: &Device,
    collective: Option<Box<dyn Collective>>,
    watch: &mut dyn FnMut(&TrainEvent),
) -> Result<LearnReport, LearnError> {
    if config.model.segments() {
        let message =
            format!("{} labels each pixel: train it on a folder with masks (fit_segmentation, `vramlab train --masks DIR`)", config.model);
        return Err(DataError::invalid("fit_folder", message).into());
    }
    let classes = folder.classes.len();
    let started = Instant::now();
    let dataset = |indices: &[usize], transforms| folder.dataset(indices, transforms);
    let (trainer, mut val, epochs) = train_on("fit_folder", dataset, classes, split, config, Placement { device, collective }, watch)?;

    let (truth, predicted) = predictions(trainer.net(), &mut val)?;
    let hits = truth.iter().zip(&predicted).filter(|(t, p)| t == p).count();
    let val_accuracy = hits as f64 / truth.len().max(1) as f64;

    let baseline = if config.baseline { Some(histogram_baseline(folder, split)?) } else { None };
    let mut per_class = Vec::with_capacity(classes);
    for (c, name) in folder.classes.iter().enumerate() {
        let of_class: Vec<usize> = (0..truth.len()).filter(|&i| truth[i] as usize == c).collect();
        let accuracy =
            (!of_class.is_empty()).then(|| of_class.iter().filter(|&&i| predicted[i] as usize == c).count() as f64 / of_class.len() as f64);
        per_class.push(ClassScore {
            class: name.clone(),
            symptom: Symptom::of(name),
            val_images: of_class.len(),
            accuracy,
            baseline_accuracy: baseline.as_ref().and_then(|b| b.per_class.get(c).copied().filter(|a| !a.is_nan())),
        });
    }
    let mut confusion = vec![vec![0usize; classes]; classes];
    for (&t, &p) in truth.iter().zip(&predicted) {
        confusion[t as usize][p as usize] += 1;
    }
    let scored: Vec<f64> = per_class.iter().filter_map(|s| s.accuracy).collect();
    let balanced_accuracy = scored.iter().sum::<f64>() / scored.len().max(1) as f64;

    let labels = folder.labels();
    let mut counts = vec![0usize; classes];
    for &i in &split.train {
        counts[labels[i] as usize] += 1;
    }
    let majority = counts.iter().enumerate().max_by_key(|(_, &n)| n).map_or(0, |(c, _)| c) as u32;
    let majority_accuracy = truth.iter().filter(|&&t| t == majority).count() as f64 / truth.len().max(1) as f64;

    Ok(LearnReport {
        config: config.clone(),
        train_images: split.train.len(),
        val_images: split.val.len(),
        epochs,
        val_accuracy,
        balanced_accuracy,
        per_class,
        confusion,
        majority_accuracy,
        baseline,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// A run from a folder: its trainer, its validation batches, each epoch's figures.
type Trained<D> = (Trainer, OnDevice<DataLoader<D>>, Vec<LearnEpoch>);

/// Where a run trains: its device, and the collective of the processes it
/// trains with, if any.
struct Placement<'a> {
    device: &'a Device,
    collective: Option<Box<dyn Collective>>,
}

/// Trains `config.model` for `classes` outputs on `split.train` of the
/// samples `dataset` loads, validating after every epoch on `split.val`
/// resized to the same side: the trainer, the validation batches and each
/// epoch's figures.
fn train_on<D: Dataset>(
    what: &'static str,
    dataset: impl Fn(&[usize], Transforms) -> D,
    classes: usize,
    split: &Split,
    config: &LearnConfig,
    placement: Placement<'_>,
    watch: &mut dyn FnMut(&TrainEvent),
) -> Result<Trained<D>, LearnError> {
    let Placement { device, collective } = placement;
    let invalid = |m: String| Err(DataError::invalid(what, m).into());
    if config.epochs == 0 || config.batch_size == 0 || config.accumulation == 0 || config.res < 8 {
        return invalid(format!(
            "needs at least 1 epoch, a batch of at least 1, at least 1 micro-batch per step and a side of at least 8 pixels; \
             got {} epochs, batch {}, {} micro-batches, {} pixels",
            config.epochs, config.batch_size, config.accumulation, config.res
        ));
    }
    let part = match (&collective, config.cards.several()) {
        (None, false) => None,
        (Some(collective), true) => Some(Part { rank: collective.rank(), ranks: collective.ranks() }),
        (None, true) => {
            return invalid(format!(
                "{} cards train as {} processes together, under mpirun through their collective (fit_folder_on)",
                config.cards.count, config.cards.count
            ))
        }
        (Some(collective), false) => {
            return invalid(format!("a collective of {} processes, and one card in the configuration", collective.ranks()))
        }
    };
    let per_step = config.batch_size * config.accumulation;
    let each = split.train.len().div_ceil(config.cards.count);
    if each < per_step || split.val.is_empty() {
        return invalid(format!(
            "{} training images cannot fill one optimizer step of {} x {} on each of {} processes (or validation is empty: {} images)",
            split.train.len(),
            config.accumulation,
            config.batch_size,
            config.cards.count,
            split.val.len()
        ));
    }
    let res = config.res;
    let train_transforms = if config.augment {
        Transforms::train(res)
    } else {
        Transforms::new(vec![Transform::Resize { width: res, height: res }, Transform::HorizontalFlip { p: 0.5 }])
    };
    let loader = |indices: &[usize], transforms: Transforms, train: bool| {
        let config = LoaderConfig {
            batch_size: config.batch_size,
            shuffle: train,
            seed: config.seed,
            num_workers: config.workers,
            // Batch-norm statistics of a tiny last batch are noise.
            drop_last: train,
            part: if train { part } else { None },
            ..LoaderConfig::default()
        };
        DataLoader::new(dataset(indices, transforms), config)
    };
    let mut train = OnDevice { source: loader(&split.train, train_transforms, true)?, device: device.clone() };
    let mut val = OnDevice { source: loader(&split.val, Transforms::resize(res), false)?, device: device.clone() };

    let spec = config.model.spec(classes);
    let net = Network::with_layers(&spec, Shape::map(3, res as usize, res as usize), device, config.seed, config.layers)?;
    let steps = (config.epochs * (train.batches_per_epoch() / config.accumulation)) as u64;
    let schedule =
        if config.cosine { Some(Schedule::cosine(config.optimizer.learning_rate(), steps, 0.0).map_err(TrainError::from)?) } else { None };
    let train_config = TrainConfig {
        precision: config.precision,
        accumulation: config.accumulation,
        checkpointing: config.checkpointing.clone(),
        optimizer: config.optimizer.clone(),
        schedule,
        scaler: config.scaler.clone(),
        ..TrainConfig::default()
    };
    let mut trainer = match collective {
        Some(collective) => Trainer::spread_over(net, train_config, config.cards, collective)?,
        None => Trainer::new(net, train_config)?,
    };
    trainer.fit(&mut train, Some(&mut val), config.epochs, watch)?;

    let mut epochs: Vec<LearnEpoch> = Vec::with_capacity(config.epochs);
    for event in &trainer.history().events {
        match event {
            TrainEvent::Epoch(e) => epochs.push(LearnEpoch {
                epoch: e.epoch,
                train_loss: e.loss,
                train_accuracy: e.accuracy,
                val_loss: f32::NAN,
                val_accuracy: f64::NAN,
                val_iou: Vec::new(),
                seconds: e.seconds,
            }),
            TrainEvent::Eval(e) => {
                if let Some(last) = epochs.iter_mut().rev().find(|f| f.epoch == e.epoch) {
                    last.val_loss = e.loss;
                    last.val_accuracy = e.accuracy;
                    last.val_iou = e.iou.clone();
                }
            }
            TrainEvent::Step(_) => {}
        }
    }
    Ok((trainer, val, epochs))
}

/// True and predicted classes of every validation image, batch-norm on its running statistics.
fn predictions(net: &Network, val: &mut dyn BatchSource) -> Result<(Vec<u32>, Vec<u32>), DataError> {
    let pass = Pass::eval(DType::F32);
    let (mut truth, mut predicted) = (Vec::new(), Vec::new());
    for batch in val.epoch(0) {
        let (images, labels) = batch.map_err(tensor_err("loading a validation batch"))?;
        let logits = net.forward(&images, pass).map_err(tensor_err("validation forward"))?;
        let argmax = logits.argmax(1).and_then(|a| a.to_dtype(DType::U32)).and_then(|a| a.to_vec1::<u32>());
        predicted.extend(argmax.map_err(tensor_err("validation argmax"))?);
        truth.extend(labels.to_vec1::<u32>().map_err(tensor_err("validation labels"))?);
    }
    Ok((truth, predicted))
}

#[cfg(test)]
mod tests;
