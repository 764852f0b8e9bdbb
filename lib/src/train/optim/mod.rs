//! Optimizers with PyTorch's update rules: SGD (momentum, dampening, Nesterov,
//! weight decay), Adam (L2 weight decay, AMSGrad), AdamW (decoupled weight decay)
//! and 8-bit Adam (bitsandbytes' block-wise quantised moments).
//!
//! Parameters are candle [`Var`]s holding f32 master weights. State is created on
//! a parameter's first step, as PyTorch does, and a parameter without a gradient
//! in the [`GradStore`] is skipped (its state and step count stay as they are).
//!
//! On the CPU, f32 parameters are updated by one fused in-place pass per state
//! tensor; on CUDA, SGD and Adam/AdamW update every parameter in one launch
//! of our multi-tensor kernels (inside `ops::on_reference`, their twins on
//! host memory); elsewhere the update is a chain of tensor ops on the
//! parameter's device.

mod adam;
mod adam8bit;
mod fused;
mod multi;
mod quant;
mod sgd;

#[cfg(test)]
pub(crate) mod tests;

pub use adam::{Adam, AdamConfig, AdamW, AdamWConfig};
pub use adam8bit::{Adam8bit, Adam8bitConfig, BLOCK_SIZE};
pub use quant::DynamicMap;
pub use sgd::{Sgd, SgdConfig};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::ledger;

/// One optimizer, whatever its kind: what a training loop needs.
pub trait Optimizer: Send {
    /// A short human name ("SGD", "AdamW", "8-bit Adam").
    fn name(&self) -> &'static str;

    /// The parameters it updates, in the order given to its constructor.
    fn vars(&self) -> &[Var];

    /// One update of every parameter that has a gradient in `grads`.
    fn step(&mut self, grads: &GradStore) -> Result<(), OptimError>;

    fn learning_rate(&self) -> f64;

    fn set_learning_rate(&mut self, lr: f64);

    /// Bytes of optimizer state held now, summed over the state tensors
    /// (element count x element size). Zero before the first step.
    fn state_bytes(&self) -> usize;
}

#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{optimizer}: {what} = {value} is invalid: it must be {rule}")]
    Hyperparameter { optimizer: &'static str, what: &'static str, value: f64, rule: &'static str },
    #[error("{optimizer}: Nesterov momentum needs momentum > 0 and dampening = 0 (got momentum {momentum}, dampening {dampening})")]
    Nesterov { optimizer: &'static str, momentum: f64, dampening: f64 },
    #[error("{optimizer} keeps f32 master weights, but parameter {index} (shape {shape:?}) is {dtype:?}")]
    NotF32 { optimizer: &'static str, index: usize, shape: Vec<usize>, dtype: DType },
    #[error("gradient of parameter {index} has shape {grad:?}, the parameter has {param:?}")]
    GradShape { index: usize, param: Vec<usize>, grad: Vec<usize> },
    #[error("GradScaler: unscale was already called since the last update")]
    AlreadyUnscaled,
    #[error("GradScaler: update needs a step or unscale since the last update (no inf check recorded)")]
    NoInfCheck,
    #[error("{schedule}: {what} must be {rule}, got {value}")]
    Schedule { schedule: &'static str, what: &'static str, value: f64, rule: &'static str },
    #[error("clip_grad_norm: {what} must be {rule}, got {value}")]
    Clip { what: &'static str, value: f64, rule: &'static str },
}

/// An optimizer chosen at run time (`--opt`), with its hyperparameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum OptimizerConfig {
    Sgd(SgdConfig),
    Adam(AdamConfig),
    AdamW(AdamWConfig),
    Adam8bit(Adam8bitConfig),
}

impl OptimizerConfig {
    /// PyTorch's defaults for the ledger's optimizer kind at learning rate `lr`;
    /// `SgdMomentum` is SGD with momentum 0.9.
    pub fn for_kind(kind: ledger::OptimizerKind, lr: f64) -> Self {
        match kind {
            ledger::OptimizerKind::Sgd => OptimizerConfig::Sgd(SgdConfig { lr, ..SgdConfig::default() }),
            ledger::OptimizerKind::SgdMomentum => OptimizerConfig::Sgd(SgdConfig { lr, momentum: 0.9, ..SgdConfig::default() }),
            ledger::OptimizerKind::Adam => OptimizerConfig::Adam(AdamConfig { lr, ..AdamConfig::default() }),
            ledger::OptimizerKind::AdamW => OptimizerConfig::AdamW(AdamWConfig { lr, ..AdamWConfig::default() }),
            ledger::OptimizerKind::Adam8bit => OptimizerConfig::Adam8bit(Adam8bitConfig { lr, ..Adam8bitConfig::default() }),
        }
    }

    /// The ledger's name for it, so an estimate and a measurement can be paired.
    pub fn kind(&self) -> ledger::OptimizerKind {
        match self {
            OptimizerConfig::Sgd(c) if c.momentum != 0.0 => ledger::OptimizerKind::SgdMomentum,
            OptimizerConfig::Sgd(_) => ledger::OptimizerKind::Sgd,
            OptimizerConfig::Adam(_) => ledger::OptimizerKind::Adam,
            OptimizerConfig::AdamW(_) => ledger::OptimizerKind::AdamW,
            OptimizerConfig::Adam8bit(_) => ledger::OptimizerKind::Adam8bit,
        }
    }

    pub fn learning_rate(&self) -> f64 {
        match self {
            OptimizerConfig::Sgd(c) => c.lr,
            OptimizerConfig::Adam(c) => c.lr,
            OptimizerConfig::AdamW(c) => c.lr,
            OptimizerConfig::Adam8bit(c) => c.lr,
        }
    }

    pub fn build(&self, vars: Vec<Var>) -> Result<Box<dyn Optimizer>, OptimError> {
        Ok(match self {
            OptimizerConfig::Sgd(c) => Box::new(Sgd::new(vars, c.clone())?),
            OptimizerConfig::Adam(c) => Box::new(Adam::new(vars, c.clone())?),
            OptimizerConfig::AdamW(c) => Box::new(AdamW::new(vars, c.clone())?),
            OptimizerConfig::Adam8bit(c) => Box::new(Adam8bit::new(vars, c.clone())?),
        })
    }
}

/// Fails unless `ok`, naming the hyperparameter and the rule it breaks.
fn require(optimizer: &'static str, what: &'static str, value: f64, ok: bool, rule: &'static str) -> Result<(), OptimError> {
    if ok {
        Ok(())
    } else {
        Err(OptimError::Hyperparameter { optimizer, what, value, rule })
    }
}

fn require_non_negative(optimizer: &'static str, what: &'static str, value: f64) -> Result<(), OptimError> {
    require(optimizer, what, value, value >= 0.0 && value.is_finite(), "finite and >= 0")
}

fn require_beta(optimizer: &'static str, what: &'static str, value: f64) -> Result<(), OptimError> {
    require(optimizer, what, value, (0.0..1.0).contains(&value), "in [0, 1)")
}

/// The gradient of `var`, checked against its shape and cut off from any graph.
fn grad_of(grads: &GradStore, var: &Var, index: usize) -> Result<Option<Tensor>, OptimError> {
    let Some(grad) = grads.get(var) else {
        return Ok(None);
    };
    if grad.shape() != var.shape() {
        return Err(OptimError::GradShape { index, param: var.dims().to_vec(), grad: grad.dims().to_vec() });
    }
    Ok(Some(grad.detach()))
}

fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Whether the fused CPU kernels can update `param` from `others` in place.
fn fusable(param: &Tensor, others: &[&Tensor]) -> bool {
    param.device().is_cpu()
        && param.dtype() == DType::F32
        && param.is_contiguous()
        && others.iter().all(|t| t.dtype() == DType::F32 && t.is_contiguous())
}
