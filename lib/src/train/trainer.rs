//! The Trainer: optimizer steps over micro-batches with every lever of the
//! lesson (mixed precision with loss scaling, accumulation, checkpointing,
//! clipping, a learning-rate schedule), epochs over any batch source, and
//! events for whoever is watching.

use std::sync::Arc;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::amp::GradScaler;
use super::clip::{clip_to, grad_norm};
use super::data_parallel::DataParallel;
use super::error::TrainError;
use super::events::{EpochReport, EvalReport, History, MemorySample, StepReport, TrainEvent};
use super::oom::{self, StepOom};
use super::optim::Optimizer;
use super::step::{accumulate, correct, cross_entropy, forward_backward_walked, grad_bytes, PhaseWalk, StepWatcher};
use super::train_config::TrainConfig;
use crate::dist::Collective;
use crate::ledger::{Cards, Segment, StepPhase, StepPlan};
use crate::memory::StepMeter;
use crate::models::{Network, Pass, Precision};

/// Batches of `(images N x C x H x W f32, labels N u32)`, epoch after epoch.
pub trait BatchSource {
    /// Batches per epoch.
    fn batches_per_epoch(&self) -> usize;
    /// The batches of `epoch`, in that epoch's order.
    fn epoch(&mut self, epoch: usize) -> Box<dyn Iterator<Item = candle_core::Result<(Tensor, Tensor)>> + '_>;
}

/// A dataset held in memory as two tensors, served in batches, shuffled per
/// epoch from a seed (the same order for the same seed and epoch).
#[derive(Debug, Clone)]
pub struct InMemory {
    images: Tensor,
    labels: Tensor,
    batch_size: usize,
    shuffle: Option<u64>,
    drop_last: bool,
}

impl InMemory {
    pub fn new(images: Tensor, labels: Tensor, batch_size: usize) -> Self {
        InMemory { images, labels, batch_size: batch_size.max(1), shuffle: None, drop_last: false }
    }

    pub fn shuffled(mut self, seed: u64) -> Self {
        self.shuffle = Some(seed);
        self
    }

    pub fn drop_last(mut self) -> Self {
        self.drop_last = true;
        self
    }

    fn len(&self) -> usize {
        self.labels.dim(0).unwrap_or(0)
    }
}

impl BatchSource for InMemory {
    fn batches_per_epoch(&self) -> usize {
        if self.drop_last {
            self.len() / self.batch_size
        } else {
            self.len().div_ceil(self.batch_size)
        }
    }

    fn epoch(&mut self, epoch: usize) -> Box<dyn Iterator<Item = candle_core::Result<(Tensor, Tensor)>> + '_> {
        let mut order: Vec<u32> = (0..self.len() as u32).collect();
        if let Some(seed) = self.shuffle {
            order.shuffle(&mut StdRng::seed_from_u64(seed.wrapping_add(epoch as u64)));
        }
        let batches = self.batches_per_epoch();
        let batch_size = self.batch_size;
        Box::new((0..batches).map(move |b| {
            let end = ((b + 1) * batch_size).min(order.len());
            let index = Tensor::new(&order[b * batch_size..end], self.images.device())?;
            Ok((self.images.index_select(&index, 0)?, self.labels.index_select(&index, 0)?))
        }))
    }
}

/// A network with its optimizer and levers, ready to step.
pub struct Trainer {
    net: Network,
    config: TrainConfig,
    optimizer: Box<dyn Optimizer>,
    scaler: GradScaler,
    plan: Arc<StepPlan>,
    pass: Pass,
    steps: u64,
    history: History,
    meter: StepMeter,
    spread: Option<DataParallel>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer").field("net", &self.net).field("config", &self.config).field("steps", &self.steps).finish()
    }
}

impl Trainer {
    pub fn new(net: Network, config: TrainConfig) -> Result<Self, TrainError> {
        Trainer::with_spread(net, config, None)
    }

    /// A trainer whose steps are spread over the processes of `collective`
    /// (`cards.count` of them, each with its own batch): backward runs a
    /// stage at a time, each stage's gradients averaged over them as it
    /// ends (once the micro-batches are summed, when accumulating), and from `--shard
    /// optimizer` on each updates only its own parameters. With
    /// `cards.sync_batch_norm`, batch-norm normalises by the statistics of
    /// every process's batch.
    pub fn spread_over(net: Network, config: TrainConfig, cards: Cards, collective: Box<dyn Collective>) -> Result<Self, TrainError> {
        let spread = DataParallel::new(&net, cards, collective)?;
        Trainer::with_spread(net, config, Some(spread))
    }

    fn with_spread(net: Network, config: TrainConfig, spread: Option<DataParallel>) -> Result<Self, TrainError> {
        if config.accumulation == 0 {
            return Err(TrainError::Accumulation(0));
        }
        check_precision(config.precision, net.device())?;
        let updated = spread.as_ref().map_or_else(|| net.vars(), |s| s.updated_vars(&net));
        let optimizer = config.optimizer.build(updated)?;
        let scaler = if config.precision == Precision::F16Amp { GradScaler::new(config.scaler.clone())? } else { GradScaler::disabled() };
        let cards = spread.as_ref().map_or_else(Cards::default, DataParallel::cards);
        let plan = StepPlan::training(&net.stage_names(), &config.checkpointing, config.accumulation, config.optimizer.kind())?.on(cards);
        let pass = Pass::train(config.precision.compute_dtype());
        let meter = StepMeter::for_device(net.device())?;
        let history = History::default();
        Ok(Trainer { net, config, optimizer, scaler, plan: Arc::new(plan), pass, steps: 0, history, meter, spread })
    }

    /// The cards this trainer's steps are spread over: one, unless made by
    /// [`Trainer::spread_over`].
    pub fn cards(&self) -> Cards {
        self.spread.as_ref().map_or_else(Cards::default, DataParallel::cards)
    }

    /// This process's rank among those the step is spread over (0 alone).
    pub fn rank(&self) -> usize {
        self.spread.as_ref().map_or(0, DataParallel::rank)
    }

    pub fn net(&self) -> &Network {
        &self.net
    }

    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// The phases of this trainer's step, named as the ledger names them.
    pub fn plan(&self) -> &StepPlan {
        &self.plan
    }

    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    pub fn scaler(&self) -> &GradScaler {
        &self.scaler
    }

    pub fn history(&self) -> &History {
        &self.history
    }

    /// What this trainer's steps are measured with: the host's counters or the device's pool.
    pub fn meter(&self) -> &StepMeter {
        &self.meter
    }

    /// Optimizer steps taken (skipped ones included).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One optimizer step over `micro_batches` (as many as the accumulation).
    pub fn step(&mut self, micro_batches: &[(Tensor, Tensor)], epoch: usize) -> Result<StepReport, TrainError> {
        self.step_watched(micro_batches, epoch, &mut [])
    }

    /// [`Trainer::step`], telling each of `watchers` as each phase of its
    /// [plan](Self::plan) ends (those of the last micro-batch: the earlier
    /// ones repeat it).
    pub fn step_watched(
        &mut self,
        micro_batches: &[(Tensor, Tensor)],
        epoch: usize,
        watchers: &mut [&mut dyn StepWatcher],
    ) -> Result<StepReport, TrainError> {
        if micro_batches.len() != self.config.accumulation {
            return Err(TrainError::MicroBatches { expected: self.config.accumulation, got: micro_batches.len() });
        }
        oom::clear_raised();
        let before = self.meter.in_use()?;
        self.meter.open_window()?;
        let outside = self.outside(before, micro_batches);
        let plan = Arc::clone(&self.plan);
        let mut walk = PhaseWalk::new(&plan, watchers);
        let on_cpu = self.net.device().is_cpu();
        // The error is read on the thread that ran the step: the budget keeps
        // what it raised there.
        let mut run = || {
            let result = self.run_step(micro_batches, epoch, &mut walk);
            result.map_err(|error| self.out_of_memory(error, walk.last(), micro_batches, outside))
        };
        if on_cpu {
            // On the CPU the step runs on one of rayon's threads: a parallel op
            // started there is taken up by the other threads as they go, where
            // one started from outside the pool waits for a sleeping worker to
            // wake for it, and a step starts hundreds (ResNet18 b32@64 on 2
            // threads: 0.268 -> 0.231 s).
            rayon::scope(|_| run())
        } else {
            // CUDA's context is current on the thread that made it.
            run()
        }
    }

    /// Of `in_use` bytes, those that are neither this trainer's state
    /// (weights, buffers, optimizer state) nor `micro_batches`: what the
    /// process holds besides the step.
    pub(crate) fn outside(&self, in_use: u64, micro_batches: &[(Tensor, Tensor)]) -> u64 {
        let state = self.net.param_bytes() + self.net.buffer_bytes() + self.optimizer.state_bytes() as u64;
        let batches: u64 = micro_batches.iter().map(|(x, y)| tensor_bytes(x) + tensor_bytes(y)).sum();
        in_use.saturating_sub(state + batches)
    }

    /// Keeps the step's record when `error` is an out-of-memory error, for
    /// the diagnosis; the error itself is returned as it came, the budget's
    /// with its phase.
    fn out_of_memory(
        &self,
        error: TrainError,
        last_phase: Option<StepPhase>,
        micro_batches: &[(Tensor, Tensor)],
        outside: u64,
    ) -> TrainError {
        let raised = oom::raised(&error);
        let message = error.to_string();
        if raised.is_none() && !oom::is_out_of_memory(&message) {
            return error;
        }
        let phase = match (&raised, last_phase) {
            (Some((_, phase)), _) => *phase,
            (None, None) => StepPhase::InputCopied,
            (None, Some(done)) => self.plan.after(done).unwrap_or(done),
        };
        let simulated = raised.map(|(oom, _)| oom);
        let cuda = match self.net.device().location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => Some(gpu_id),
            _ => None,
        };
        oom::remember(&StepOom {
            message,
            simulated: simulated.clone(),
            phase_name: self.plan.name(phase),
            phase,
            spec: self.net.spec().clone(),
            input: self.net.input(),
            batch: micro_batches.first().map_or(0, |(x, _)| x.dim(0).unwrap_or(0)),
            config: self.config.clone(),
            layers: self.net.layers(),
            cuda,
            outside,
        });
        match simulated {
            Some(oom) => TrainError::OutOfMemory(oom),
            None => error,
        }
    }

    fn run_step(
        &mut self,
        micro_batches: &[(Tensor, Tensor)],
        epoch: usize,
        walk: &mut PhaseWalk<'_, '_>,
    ) -> Result<StepReport, TrainError> {
        let started = Instant::now();
        if let Some(schedule) = &self.config.schedule {
            schedule.apply(self.optimizer.as_mut(), self.steps);
        }
        let loss_scale = self.scaler.scale_factor() / self.config.accumulation as f64;
        let mut grads = GradStore::default();
        let (mut scores, mut samples, mut scored) = (Vec::with_capacity(micro_batches.len()), 0, 0);
        let last = micro_batches.len() - 1;
        let mut earlier_peak = None;
        for (i, (images, labels)) in micro_batches.iter().enumerate() {
            if i == last && i > 0 {
                // The phases reported are the last micro-batch's, as the ledger's
                // are: its window starts here, so that the earlier micro-batches'
                // backward does not count as its input copy. Their peak still
                // counts in the step's.
                earlier_peak = self.meter.window_peak()?;
                self.meter.open_window()?;
            }
            let accumulated = grad_bytes(&grads, &self.net);
            walk.micro_batch(i == last, accumulated);
            walk.ended(StepPhase::InputCopied, accumulated)?;
            let spread = self.spread.as_ref().filter(|_| self.plan.reduces_in_backward());
            let net = &self.net;
            let mut reduce_segment = |grads: &mut GradStore, segment: &Segment| match spread {
                Some(spread) => spread.reduce(grads, net, net.stage_params(segment.stages())).map_err(candle_core::Error::wrap),
                None => Ok(()),
            };
            let mut forward_backward = || forward_backward_walked(net, images, labels, self.pass, loss_scale, walk, &mut reduce_segment);
            let part = match self.spread.as_ref().and_then(DataParallel::batch_norm_sum) {
                Some(sum) => crate::ops::synchronised(sum, forward_backward)?,
                None => forward_backward()?,
            };
            scores.push((part.loss, part.correct));
            samples += part.samples;
            scored += part.labels;
            if i == last {
                walk.ended(StepPhase::GraphDropped, accumulated + grad_bytes(&part.grads, &self.net))?;
            }
            accumulate(&mut grads, &self.net, part.grads)?;
        }
        if self.config.accumulation > 1 {
            walk.ended(StepPhase::Accumulated, grad_bytes(&grads, &self.net))?;
        }
        let spread = self.spread.as_ref();
        if let Some(spread) = spread.filter(|_| self.plan.all_reduces()) {
            spread.reduce(&mut grads, &self.net, 0..self.net.params().len())?;
        }
        let vars = self.net.vars();
        let found_inf = self.scaler.unscale(&mut grads, &vars)?;
        if let Some(spread) = spread.filter(|_| self.scaler.is_enabled()) {
            if spread.any_not_finite(found_inf)? && !found_inf {
                self.scaler.found_inf_elsewhere();
            }
        }
        let norm = |grads: &GradStore| -> Result<f64, TrainError> {
            let own = grad_norm(grads, &vars, 2.0)?;
            Ok(match spread {
                Some(spread) => spread.norm(own, 2.0)?,
                None => own,
            })
        };
        let (grad_norm, applied_grad_norm) = match self.config.clip_norm {
            Some(max_norm) => {
                let before = norm(&grads)?;
                clip_to(&mut grads, &vars, max_norm, before)?;
                (Some(before), Some(norm(&grads)?))
            }
            None => (None, None),
        };
        if self.plan.all_reduces() {
            walk.ended(StepPhase::GradientsReduced, grad_bytes(&grads, &self.net))?;
        }
        let grads_bytes = grad_bytes(&grads, &self.net);
        let stepped = self.scaler.step(self.optimizer.as_mut(), &mut grads)?;
        walk.ended(StepPhase::OptimizerStep, grads_bytes)?;
        if let Some(spread) = self.spread.as_ref().filter(|s| s.cards().shard != crate::ledger::Shard::None) {
            spread.gather_weights(&self.net)?;
            walk.ended(StepPhase::WeightsGathered, grads_bytes)?;
        }
        if let Some(spread) = &self.spread {
            spread.share_buffers(&self.net)?;
        }
        let loss_scale = self.scaler.is_enabled().then(|| self.scaler.scale_factor());
        self.scaler.update()?;
        drop(grads);
        walk.ended(StepPhase::StepDone, 0)?;
        // Read once everything is queued: the one wait for the device in a step.
        let (mut loss, mut correct) = (0.0f32, 0usize);
        for (part_loss, part_correct) in scores {
            loss += part_loss.to_scalar::<f32>()? / self.config.accumulation as f32;
            correct += part_correct.to_scalar::<u32>()? as usize;
        }
        self.steps += 1;
        let seconds = started.elapsed().as_secs_f64();
        let in_use = self.meter.in_use()?;
        let report = StepReport {
            epoch,
            step: self.steps,
            loss,
            accuracy: correct as f64 / scored.max(1) as f64,
            samples,
            seconds,
            images_per_second: samples as f64 / seconds.max(1e-9),
            learning_rate: self.optimizer.learning_rate(),
            loss_scale,
            skipped: !stepped,
            grad_norm,
            applied_grad_norm,
            memory: self.meter.window_peak()?.map(|peak| MemorySample { in_use, peak: peak.max(earlier_peak.unwrap_or(0)) }),
        };
        self.history.events.push(TrainEvent::Step(report.clone()));
        Ok(report)
    }

    /// Mean loss and accuracy over `batches`, batch-norm on its running
    /// statistics; for segmentation the pixels' accuracy and each class's IoU.
    pub fn evaluate(&mut self, batches: &mut dyn BatchSource, epoch: usize) -> Result<EvalReport, TrainError> {
        let pass = Pass::eval(self.pass.compute);
        let (mut loss_sum, mut correct_sum, mut samples, mut scored) = (0.0f64, 0usize, 0usize, 0usize);
        let mut overlap = Overlap::default();
        for batch in batches.epoch(0) {
            let (images, labels) = batch?;
            let logits = self.net.forward(&images, pass)?;
            let n = labels.elem_count();
            loss_sum += cross_entropy(&logits, &labels)?.to_scalar::<f32>()? as f64 * n as f64;
            correct_sum += correct(&logits, &labels)?.to_scalar::<u32>()? as usize;
            if labels.rank() > 1 {
                overlap.add(&logits.argmax(1)?, &labels, logits.dim(1)?)?;
            }
            samples += images.dim(0)?;
            scored += n;
        }
        if samples == 0 {
            return Err(TrainError::Empty);
        }
        let report = EvalReport {
            epoch,
            loss: (loss_sum / scored as f64) as f32,
            accuracy: correct_sum as f64 / scored as f64,
            samples,
            iou: overlap.iou(),
            labelled: overlap.labelled,
        };
        self.history.events.push(TrainEvent::Eval(report.clone()));
        Ok(report)
    }

    /// `epochs` passes over `train`, grouping its batches `accumulation` at a
    /// time (a short remainder at the end of an epoch is left out), evaluating on
    /// `val` after each epoch. `watch` sees every event as it happens.
    pub fn fit(
        &mut self,
        train: &mut dyn BatchSource,
        mut val: Option<&mut dyn BatchSource>,
        epochs: usize,
        watch: &mut dyn FnMut(&TrainEvent),
    ) -> Result<&History, TrainError> {
        for epoch in 0..epochs {
            let started = Instant::now();
            let (mut loss_sum, mut correct, mut samples, mut steps) = (0.0f64, 0.0f64, 0usize, 0usize);
            let mut group = Vec::with_capacity(self.config.accumulation);
            // Batch by batch, so a loader's prefetch bound holds and loading overlaps training.
            for batch in train.epoch(epoch) {
                group.push(batch?);
                if group.len() < self.config.accumulation {
                    continue;
                }
                let report = self.step(&group, epoch)?;
                group.clear();
                loss_sum += report.loss as f64;
                correct += report.accuracy * report.samples as f64;
                samples += report.samples;
                steps += 1;
                watch(&TrainEvent::Step(report));
            }
            if steps == 0 {
                return Err(TrainError::Empty);
            }
            let seconds = started.elapsed().as_secs_f64();
            let epoch_report = EpochReport {
                epoch,
                loss: (loss_sum / steps as f64) as f32,
                accuracy: correct / samples.max(1) as f64,
                seconds,
                images_per_second: samples as f64 / seconds.max(1e-9),
            };
            self.history.events.push(TrainEvent::Epoch(epoch_report.clone()));
            watch(&TrainEvent::Epoch(epoch_report));
            if let Some(val) = val.as_deref_mut() {
                let report = self.evaluate(val, epoch)?;
                watch(&TrainEvent::Eval(report));
            }
        }
        Ok(&self.history)
    }
}

/// Each class's intersection and union of predicted and labelled pixels,
/// and its labelled pixels, summed over batches.
#[derive(Debug, Default)]
struct Overlap {
    intersection: Vec<u64>,
    union: Vec<u64>,
    labelled: Vec<u64>,
}

impl Overlap {
    fn add(&mut self, predicted: &Tensor, labels: &Tensor, classes: usize) -> candle_core::Result<()> {
        let predicted = predicted.flatten_all()?.to_vec1::<u32>()?;
        let labels = labels.flatten_all()?.to_vec1::<u32>()?;
        self.intersection.resize(classes, 0);
        self.union.resize(classes, 0);
        self.labelled.resize(classes, 0);
        for (&p, &l) in predicted.iter().zip(&labels) {
            let (p, l) = (p as usize, l as usize);
            if let Some(labelled) = self.labelled.get_mut(l) {
                *labelled += 1;
            }
            if p == l {
                self.intersection[p] += 1;
                self.union[p] += 1;
            } else {
                self.union[p] += 1;
                if let Some(union) = self.union.get_mut(l) {
                    *union += 1;
                }
            }
        }
        Ok(())
    }

    fn iou(&self) -> Vec<Option<f64>> {
        self.intersection.iter().zip(&self.union).map(|(&i, &u)| (u > 0).then(|| i as f64 / u as f64)).collect()
    }
}

pub(crate) fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Refuses a precision the device cannot run, before any step fails half-way:
/// candle's CPU matmul has no bf16 kernel, so bf16 convolutions fail there.
fn check_precision(precision: Precision, device: &Device) -> Result<(), TrainError> {
    if precision == Precision::Bf16Amp && device.is_cpu() {
        return Err(TrainError::Precision {
            precision,
            device: "the CPU".into(),
            reason: "candle's CPU matmul has no bf16 kernel (\"unsupported dtype BF16 for op matmul\"); use f16 mixed precision or f32 on the CPU, bf16 on a CUDA GPU".into(),
        });
    }
    Ok(())
}

impl crate::models::Summarize for Trainer {
    fn summary_spec(&self) -> &crate::models::ModelSpec {
        self.net.spec()
    }

    fn summary_input(&self) -> crate::models::Shape {
        self.net.input()
    }

    fn summary_precision(&self) -> Precision {
        self.config.precision
    }

    fn summary_layers(&self) -> crate::models::Layers {
        self.net.layers()
    }
}
