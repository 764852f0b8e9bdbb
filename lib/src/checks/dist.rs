//! Proof that a step spread over several processes computes the step one
//! process computes on all their samples: each process trains on its part
//! of every batch, then rank 0 trains alone on the whole batches and
//! compares the weights.
//!
//! Alone, the whole batch is taken as the processes' parts one after the
//! other (gradient accumulation, the same step for a network without
//! batch-norm), so that the gradients are summed in the same order as the
//! processes sum them and the weights can agree to the last bit. Taken in
//! one forward instead, the sums run in another order; the difference is
//! reported beside: small under SGD, up to a step's size under Adam on the
//! weights whose gradient is zero in exact arithmetic (attention's key
//! bias), whose update Adam makes of rounding noise.

use candle_core::{Device, Tensor};
use serde::Serialize;

use crate::dist::{Collective, DistError};
use crate::ledger::Cards;
use crate::train::{BenchSpec, TrainConfig, TrainError, Trainer};

/// What [`same_step`] found, on rank 0.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SameStep {
    pub model: String,
    pub cards: usize,
    pub shard: String,
    pub optimizer: String,
    /// Each process's batch; the process alone takes `cards` times as many.
    pub batch: usize,
    pub steps: usize,
    pub parameters: u64,
    /// The largest |spread - alone| over every weight after the steps,
    /// alone taking the whole batch in the processes' parts.
    pub max_difference: f64,
    /// The same, alone taking the whole batch in one forward.
    pub max_difference_one_forward: f64,
    /// The parameter that differs most then.
    pub differs_most_one_forward: String,
    /// The largest |weight| alone, for scale.
    pub max_weight: f64,
    pub tolerance: f64,
    /// Each step's loss, spread (rank 0's part) and alone.
    pub losses_spread: Vec<f32>,
    pub losses_alone: Vec<f32>,
}

impl SameStep {
    pub fn passed(&self) -> bool {
        self.max_difference <= self.tolerance
    }

    pub fn line(&self) -> String {
        format!(
            "{} on {} processes ({}, {}), batch {} on each, {} steps: the weights differ from one process's on the {} samples by at most \
             {:.2e} (largest weight {:.3}; tolerance {:.0e}): {}; taken in one forward alone, by {:.2e} (most on {})",
            self.model,
            self.cards,
            self.shard,
            self.optimizer,
            self.batch,
            self.steps,
            self.batch * self.cards,
            self.max_difference,
            self.max_weight,
            self.tolerance,
            if self.passed() { "the same step" } else { "NOT the same step" },
            self.max_difference_one_forward,
            self.differs_most_one_forward
        )
    }
}

/// Trains `spec` for `steps` on the processes of `collective`, each on its
/// part of the same batches, and on rank 0 alone on the whole batches;
/// `None` on the other ranks. A network with batch-norm is refused: its
/// statistics are each process's own (DDP's), so its weights differ by
/// design.
pub fn same_step(
    spec: &BenchSpec,
    cards: Cards,
    collective: Box<dyn Collective>,
    steps: usize,
    tolerance: f64,
) -> Result<Option<SameStep>, TrainError> {
    let device = Device::Cpu;
    let net = spec.network(&device)?;
    if !net.buffers().is_empty() {
        return Err(DistError::BatchNorm(spec.model.as_str().to_owned()).into());
    }
    let rank = collective.rank();
    let mut spread = Trainer::spread_over(net, spec.config.clone(), cards, collective)?;
    let whole = |step: usize, micro: usize| {
        let seed = spec.seed.wrapping_add((step * spec.config.accumulation + micro) as u64);
        spec.batch_of(spec.batch * cards.count, seed, &device)
    };
    let part = |(images, labels): (Tensor, Tensor)| -> candle_core::Result<(Tensor, Tensor)> {
        Ok((images.narrow(0, rank * spec.batch, spec.batch)?, labels.narrow(0, rank * spec.batch, spec.batch)?))
    };
    let mut losses_spread = Vec::with_capacity(steps);
    for step in 0..steps {
        let micro_batches = (0..spec.config.accumulation).map(|i| part(whole(step, i)?)).collect::<candle_core::Result<Vec<_>>>()?;
        losses_spread.push(spread.step(&micro_batches, 0)?.loss);
    }
    if rank != 0 {
        return Ok(None);
    }
    // Alone: the processes' parts one after the other, then the whole batch in one forward.
    let in_parts = TrainConfig { accumulation: spec.config.accumulation * cards.count, ..spec.config.clone() };
    let mut alone = Trainer::new(spec.network(&device)?, in_parts)?;
    let mut losses_alone = Vec::with_capacity(steps);
    for step in 0..steps {
        let micro_batches = (0..spec.config.accumulation)
            .map(|i| {
                let (images, labels) = whole(step, i)?;
                (0..cards.count)
                    .map(|r| Ok((images.narrow(0, r * spec.batch, spec.batch)?, labels.narrow(0, r * spec.batch, spec.batch)?)))
                    .collect()
            })
            .collect::<candle_core::Result<Vec<Vec<_>>>>()?;
        losses_alone.push(alone.step(&micro_batches.concat(), 0)?.loss);
    }
    let mut one_forward = Trainer::new(spec.network(&device)?, spec.config.clone())?;
    for step in 0..steps {
        let micro_batches = (0..spec.config.accumulation).map(|i| whole(step, i)).collect::<candle_core::Result<Vec<_>>>()?;
        one_forward.step(&micro_batches, 0)?;
    }
    let largest = |a: &Trainer, b: &Trainer| -> candle_core::Result<(f64, String)> {
        let mut most = (0f64, String::new());
        for (a, b) in a.net().params().iter().zip(b.net().params()) {
            let difference = f64::from((a.var.as_tensor() - b.var.as_tensor())?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
            if difference > most.0 {
                most = (difference, a.name.clone());
            }
        }
        Ok(most)
    };
    let mut max_weight = 0f64;
    for param in alone.net().params() {
        max_weight = max_weight.max(f64::from(param.var.as_tensor().abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?));
    }
    let (max_difference, _) = largest(&spread, &alone)?;
    let (max_difference_one_forward, differs_most_one_forward) = largest(&spread, &one_forward)?;
    Ok(Some(SameStep {
        model: spec.model.as_str().to_owned(),
        cards: cards.count,
        shard: cards.shard.name().to_owned(),
        optimizer: spread.optimizer().name().to_owned(),
        batch: spec.batch,
        steps,
        parameters: spread.net().param_count(),
        max_difference,
        max_difference_one_forward,
        differs_most_one_forward,
        max_weight,
        tolerance,
        losses_spread,
        losses_alone,
    }))
}
