//! Timing real training steps: the library side of `vramlab bench train`.

use std::time::Instant;

use candle_core::{Device, Tensor};
use serde::Serialize;

use super::compare::{Comparison, MeasuredStep};
use super::error::TrainError;
use super::task::Stripes;
use super::train_config::TrainConfig;
use super::trainer::Trainer;
use crate::models::{ModelName, Network, Precision, Shape};

/// What to time or measure: a zoo model at one batch and resolution, with one training setup.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    pub model: ModelName,
    pub classes: usize,
    pub batch: usize,
    pub res: usize,
    pub config: TrainConfig,
    pub layers: crate::models::Layers,
    pub warmup: usize,
    pub steps: usize,
    pub seed: u64,
}

/// Step times in seconds, after the warm-up, and what they were measured on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub batch: usize,
    pub res: usize,
    pub precision: Precision,
    pub optimizer: String,
    pub accumulation: usize,
    pub checkpointing: String,
    pub parameters: u64,
    pub threads: usize,
    pub step_seconds: Vec<f64>,
    pub median_seconds: f64,
    pub images_per_second: f64,
    /// The highest bytes in use during a timed step, where the process counts them exactly.
    pub peak_bytes: Option<u64>,
    pub final_loss: f32,
    /// On CUDA, each convolution's cuDNN plan.
    pub cudnn: Option<crate::ops::CudnnPlans>,
}

/// The trainer and synthetic micro-batches a spec describes, its step
/// spread over the processes of `spread` when given.
fn setup(spec: &BenchSpec, device: &Device, spread: Option<Spread>) -> Result<(Trainer, Vec<(Tensor, Tensor)>), TrainError> {
    let net = spec.network(device)?;
    let trainer = match spread {
        Some(Spread { cards, collective }) => Trainer::spread_over(net, spec.config.clone(), cards, collective)?,
        None => Trainer::new(net, spec.config.clone())?,
    };
    if device.is_cpu() {
        refuse_what_the_host_cannot_hold(&trainer, spec.batch)?;
    }
    // Each process its own images, as a distributed sampler gives each its part of an epoch.
    let rank = trainer.rank() as u64;
    let micro_batches = (0..spec.config.accumulation)
        .map(|i| spec.batch_of(spec.batch, spec.seed.wrapping_add(i as u64).wrapping_add(rank << 32), device))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok((trainer, micro_batches))
}

/// The processes a step is spread over: as many as `cards.count`, each
/// with the spec's batch.
pub struct Spread {
    pub cards: crate::ledger::Cards,
    pub collective: Box<dyn crate::dist::Collective>,
}

impl BenchSpec {
    /// The spec's network, its weights made from its seed.
    pub fn network(&self, device: &Device) -> Result<Network, TrainError> {
        Ok(Network::with_layers(&self.model.spec(self.classes), Shape::map(3, self.res, self.res), device, self.seed, self.layers)?)
    }

    /// `batch` synthetic images of the spec's task made from `seed`, with their labels.
    pub fn batch_of(&self, batch: usize, seed: u64, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let task = Stripes::new(self.classes, self.res);
        if self.model.segments() {
            task.generate_regions(batch, seed, device)
        } else {
            task.generate(batch, seed, device)
        }
    }
}

/// On the CPU, a step predicted to need more than the host has available would be
/// killed by the system, or abort on a failed allocation, losing everything:
/// it is refused before its images are made. Under a simulated budget smaller
/// than that, the budget's out-of-memory error comes first, as it should.
fn refuse_what_the_host_cannot_hold(trainer: &Trainer, batch: usize) -> Result<(), TrainError> {
    let predicted = trainer.predict(batch)?.peak.bytes;
    let available = crate::gpus::Card::host()?.usable_bytes;
    let budgeted = crate::memory::budget().is_some_and(|b| b.room() < available);
    if predicted > available && !budgeted {
        return Err(TrainError::HostTooSmall { predicted, available });
    }
    Ok(())
}

/// Warm-up steps the loss scaler may skip before the optimizer state exists:
/// from 65536 it halves once per overflow, and f16 overflows at most 16 times.
const MAX_SKIPPED_WARMUP: usize = 16;

/// `warmup` steps, and more while the loss scaler has skipped them all (the
/// first applied step creates the optimizer state), then one step measured
/// phase by phase and compared with the ledger; both are published for `%mem`.
pub fn measure_train(spec: &BenchSpec, device: &Device) -> Result<(MeasuredStep, Comparison), TrainError> {
    measure_train_over(spec, device, None)
}

/// [`measure_train`], the step spread over the processes of `spread` when
/// given: each process measures its own part.
pub fn measure_train_over(spec: &BenchSpec, device: &Device, spread: Option<Spread>) -> Result<(MeasuredStep, Comparison), TrainError> {
    let (mut trainer, micro_batches) = setup(spec, device, spread)?;
    let mut applied = false;
    for taken in 0.. {
        if taken >= spec.warmup && (applied || taken >= spec.warmup + MAX_SKIPPED_WARMUP) {
            break;
        }
        applied |= !trainer.step(&micro_batches, 0)?.skipped;
    }
    trainer.measure_and_compare(&micro_batches)
}

pub fn bench_train(spec: &BenchSpec, device: &Device) -> Result<BenchReport, TrainError> {
    bench_train_over(spec, device, None)
}

/// [`bench_train`], the step spread over the processes of `spread` when given.
pub fn bench_train_over(spec: &BenchSpec, device: &Device, spread: Option<Spread>) -> Result<BenchReport, TrainError> {
    let (mut trainer, micro_batches) = setup(spec, device, spread)?;
    let parameters = trainer.net().param_count();
    for _ in 0..spec.warmup {
        trainer.step(&micro_batches, 0)?;
    }
    let plans_after_warmup = cudnn_plans(device)?.map(|(_, made)| made);
    let mut step_seconds = Vec::with_capacity(spec.steps);
    let mut peak_bytes: Option<u64> = None;
    let mut final_loss = f32::NAN;
    for _ in 0..spec.steps {
        let started = Instant::now();
        let report = trainer.step(&micro_batches, 0)?;
        step_seconds.push(started.elapsed().as_secs_f64());
        final_loss = report.loss;
        if let Some(memory) = report.memory {
            peak_bytes = Some(peak_bytes.unwrap_or(0).max(memory.peak));
        }
    }
    let median_seconds = median(&step_seconds);
    let cudnn = cudnn_plans(device)?
        .map(|(algorithms, made)| crate::ops::CudnnPlans { algorithms, made_while_timed: made - plans_after_warmup.unwrap_or(made) });
    let images = (spec.batch * spec.config.accumulation) as f64;
    Ok(BenchReport {
        model: spec.model.as_str().to_owned(),
        batch: spec.batch,
        res: spec.res,
        precision: spec.config.precision,
        optimizer: trainer.optimizer().name().to_owned(),
        accumulation: spec.config.accumulation,
        checkpointing: spec.config.checkpointing.to_string(),
        parameters,
        threads: candle_core::utils::get_num_threads(),
        median_seconds,
        images_per_second: images / median_seconds.max(1e-12),
        step_seconds,
        peak_bytes,
        final_loss,
        cudnn,
    })
}

type Plans = candle_core::Result<Option<(Vec<crate::ops::ConvAlgorithm>, usize)>>;

/// The cuDNN plans made on `device` so far and how many, where it is a CUDA device.
#[cfg(feature = "cuda")]
fn cudnn_plans(device: &Device) -> Plans {
    match device {
        Device::Cuda(dev) => crate::ops::conv_algorithms(dev).map(Some),
        _ => Ok(None),
    }
}

#[cfg(not(feature = "cuda"))]
fn cudnn_plans(_: &Device) -> Plans {
    Ok(None)
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}
