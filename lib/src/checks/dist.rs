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
//!
//! A network with batch-norm computes the same step only with `--sync-bn`,
//! and then against one forward over the whole batch (its statistics are
//! the whole batch's, not a part's); its running statistics are compared
//! beside its weights.

use candle_core::{Device, Tensor};
use serde::Serialize;

use crate::dist::{Collective, DistError};
use crate::ledger::Cards;
use crate::train::{BenchSpec, TrainConfig, TrainError, Trainer};

/// How the process alone takes each whole batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Alone {
    /// As the processes' parts one after the other, its gradients accumulated.
    InParts,
    /// In one forward.
    OneForward,
}

/// The largest |spread - alone| over every weight and running statistic,
/// and the tensor it is on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Difference {
    pub max: f64,
    pub on: String,
}

/// What [`same_step`] found, on rank 0.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SameStep {
    pub model: String,
    pub cards: usize,
    pub shard: String,
    pub sync_batch_norm: bool,
    pub optimizer: String,
    /// Each process's batch; the process alone takes `cards` times as many.
    pub batch: usize,
    pub steps: usize,
    pub parameters: u64,
    /// How the process alone took the whole batches it is compared with.
    pub alone: Alone,
    /// After the steps, against it.
    pub difference: Difference,
    /// With [`Alone::InParts`], against the process alone taking each whole
    /// batch in one forward.
    pub one_forward: Option<Difference>,
    /// The largest |weight| alone, for scale.
    pub max_weight: f64,
    pub tolerance: f64,
    /// Each step's loss, spread (rank 0's part) and alone.
    pub losses_spread: Vec<f32>,
    pub losses_alone: Vec<f32>,
}

impl SameStep {
    pub fn passed(&self) -> bool {
        self.difference.max <= self.tolerance
    }

    pub fn line(&self) -> String {
        let (sync, taken) = match self.alone {
            Alone::InParts => ("", "in their parts"),
            Alone::OneForward => (", batch-norm synchronised", "in one forward"),
        };
        let by = match self.difference.max {
            0.0 => "not at all, to the bit".to_owned(),
            max => format!("by at most {max:.2e}, on {}", self.difference.on),
        };
        let mut line = format!(
            "{} on {} processes ({}{sync}, {}), batch {} on each, {} steps: the weights differ from one process's on the {} samples \
             {taken} {by} (largest weight {:.3}; tolerance {:.0e}): {}",
            self.model,
            self.cards,
            self.shard,
            self.optimizer,
            self.batch,
            self.steps,
            self.batch * self.cards,
            self.max_weight,
            self.tolerance,
            if self.passed() { "the same step" } else { "NOT the same step" },
        );
        if let Some(one_forward) = &self.one_forward {
            line += &format!("; taken in one forward alone, by {:.2e} (most on {})", one_forward.max, one_forward.on);
        }
        line
    }
}

/// Trains `spec` for `steps` on the processes of `collective`, each on its
/// part of the same batches, and on rank 0 alone on the whole batches;
/// `None` on the other ranks. A network with batch-norm is refused unless
/// `cards` synchronise it: otherwise its statistics are each process's own
/// (DDP's), so its weights differ by design.
pub fn same_step(
    spec: &BenchSpec,
    cards: Cards,
    collective: Box<dyn Collective>,
    steps: usize,
    tolerance: f64,
) -> Result<Option<SameStep>, TrainError> {
    let device = Device::Cpu;
    let net = spec.network(&device)?;
    let alone = match (net.buffers().is_empty(), cards.sync_batch_norm) {
        (true, _) => Alone::InParts,
        (false, true) => Alone::OneForward,
        (false, false) => return Err(DistError::BatchNorm(spec.model.as_str().to_owned()).into()),
    };
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
    let mut one_forward = Trainer::new(spec.network(&device)?, spec.config.clone())?;
    let mut losses_one_forward = Vec::with_capacity(steps);
    for step in 0..steps {
        let micro_batches = (0..spec.config.accumulation).map(|i| whole(step, i)).collect::<candle_core::Result<Vec<_>>>()?;
        losses_one_forward.push(one_forward.step(&micro_batches, 0)?.loss);
    }
    let max_weight = one_forward
        .net()
        .params()
        .iter()
        .try_fold(0f64, |most, p| Ok::<_, candle_core::Error>(most.max(largest_abs(p.var.as_tensor())?)))?;
    let against_one_forward = difference(&spread, &one_forward)?;
    let (difference, one_forward, losses_alone) = match alone {
        Alone::OneForward => (against_one_forward, None, losses_one_forward),
        Alone::InParts => {
            let in_parts = TrainConfig { accumulation: spec.config.accumulation * cards.count, ..spec.config.clone() };
            let mut in_parts = Trainer::new(spec.network(&device)?, in_parts)?;
            let mut losses = Vec::with_capacity(steps);
            for step in 0..steps {
                let micro_batches = (0..spec.config.accumulation)
                    .map(|i| {
                        let (images, labels) = whole(step, i)?;
                        (0..cards.count)
                            .map(|r| Ok((images.narrow(0, r * spec.batch, spec.batch)?, labels.narrow(0, r * spec.batch, spec.batch)?)))
                            .collect()
                    })
                    .collect::<candle_core::Result<Vec<Vec<_>>>>()?;
                losses.push(in_parts.step(&micro_batches.concat(), 0)?.loss);
            }
            (difference(&spread, &in_parts)?, Some(against_one_forward), losses)
        }
    };
    Ok(Some(SameStep {
        model: spec.model.as_str().to_owned(),
        cards: cards.count,
        shard: cards.shard.name().to_owned(),
        sync_batch_norm: cards.sync_batch_norm,
        optimizer: spread.optimizer().name().to_owned(),
        batch: spec.batch,
        steps,
        parameters: spread.net().param_count(),
        alone,
        difference,
        one_forward,
        max_weight,
        tolerance,
        losses_spread,
        losses_alone,
    }))
}

fn largest_abs(t: &Tensor) -> candle_core::Result<f64> {
    Ok(f64::from(t.to_dtype(candle_core::DType::F32)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?))
}

/// The largest difference between two trainers' weights and running
/// statistics, and where it is.
fn difference(a: &Trainer, b: &Trainer) -> candle_core::Result<Difference> {
    let (a, b) = (a.net(), b.net());
    let params = a.params().iter().zip(b.params()).map(|(a, b)| (&a.name, a.var.as_tensor(), b.var.as_tensor()));
    let buffers = a.buffers().iter().zip(b.buffers()).map(|(a, b)| (&a.name, a.var.as_tensor(), b.var.as_tensor()));
    let mut most = Difference { max: 0.0, on: String::new() };
    for (name, a, b) in params.chain(buffers) {
        let max = largest_abs(&(a.to_dtype(candle_core::DType::F32)? - b.to_dtype(candle_core::DType::F32)?)?)?;
        if max > most.max || most.on.is_empty() {
            most = Difference { max, on: name.clone() };
        }
    }
    Ok(most)
}
