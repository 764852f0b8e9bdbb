use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};

use super::multi::{self, Launcher};
use super::{fusable, fused, grad_of, require, require_non_negative, tensor_bytes};
use super::{OptimError, Optimizer};

const NAME: &str = "SGD";

/// SGD's hyperparameters; the defaults are PyTorch's (`lr` aside, which
/// PyTorch requires and which is 0.01 here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate. Default 0.01.
    pub lr: f64,
    /// Momentum factor; 0 keeps no buffer. Default 0.
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer. Default 0.
    pub dampening: f64,
    /// L2 penalty added to the gradient (`g + weight_decay * p`). Default 0.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0). Default false.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 0.01, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

impl SgdConfig {
    fn validate(&self) -> Result<(), OptimError> {
        require_non_negative(NAME, "lr", self.lr)?;
        require_non_negative(NAME, "momentum", self.momentum)?;
        require(NAME, "dampening", self.dampening, self.dampening.is_finite(), "finite")?;
        require_non_negative(NAME, "weight_decay", self.weight_decay)?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(OptimError::Nesterov { optimizer: NAME, momentum: self.momentum, dampening: self.dampening });
        }
        Ok(())
    }
}

/// `torch.optim.SGD`: with `d = g + wd * p`, the momentum buffer starts as `d`
/// on a parameter's first step and is then `buf = momentum * buf + (1 - dampening) * d`;
/// the step is `p -= lr * (d + momentum * buf)` with Nesterov, `p -= lr * buf` without.
pub struct Sgd {
    vars: Vec<Var>,
    config: SgdConfig,
    momentum_buffers: Vec<Option<Tensor>>,
    fuse_on_cpu: bool,
}

impl Sgd {
    pub fn new(vars: Vec<Var>, config: SgdConfig) -> Result<Self, OptimError> {
        config.validate()?;
        Ok(Sgd { momentum_buffers: vec![None; vars.len()], vars, config, fuse_on_cpu: true })
    }

    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// Forces the tensor-op path on the CPU too, so that the tests and
    /// check-ops compare the two paths.
    pub(crate) fn unfused(mut self) -> Self {
        self.fuse_on_cpu = false;
        self
    }

    /// `p` is the parameter's storage, updated in place.
    fn step_fused(&self, p: &Tensor, g: &Tensor, buffer: &mut Option<Tensor>) -> candle_core::Result<()> {
        let c = &self.config;
        let lr = c.lr as f32;
        let wd = c.weight_decay as f32;
        let momentum = c.momentum as f32;
        let damp = (1.0 - c.dampening) as f32;
        let decayed = |g: f32, p: f32| if wd != 0.0 { g + wd * p } else { g };
        if c.momentum == 0.0 {
            return fused::update2("sgd", p, g, |p, g| *p += -lr * decayed(g, *p));
        }
        let buf = match buffer.take() {
            Some(buf) => {
                fused::update3("sgd momentum", &buf, g, p, |b, g, p| *b = *b * momentum + damp * decayed(g, p))?;
                buf
            }
            None => decayed_grad(p, g, c.weight_decay)?.copy()?,
        };
        let buf = &*buffer.insert(buf);
        if c.nesterov {
            fused::update3("sgd nesterov", p, g, buf, |p, g, b| *p += -lr * (decayed(g, *p) + momentum * b))
        } else {
            fused::update2("sgd", p, buf, |p, b| *p += -lr * b)
        }
    }

    fn step_tensors(&self, var: &Var, g: &Tensor, buffer: &mut Option<Tensor>) -> candle_core::Result<()> {
        let c = &self.config;
        let p = var.as_detached_tensor();
        let mut d = decayed_grad(&p, g, c.weight_decay)?;
        if c.momentum != 0.0 {
            let buf = match buffer.take() {
                Some(buf) => (buf.affine(c.momentum, 0.0)? + d.affine(1.0 - c.dampening, 0.0)?)?,
                None => d.copy()?,
            };
            d = if c.nesterov { (d + buf.affine(c.momentum, 0.0)?)? } else { buf.clone() };
            *buffer = Some(buf);
        }
        var.set(&(p + d.affine(-c.lr, 0.0)?)?)
    }
}

impl Sgd {
    /// Every parameter in one launch of the multi-tensor kernel; a
    /// parameter's momentum buffer is made (zeros, which its first step
    /// overwrites with the gradient) the first time it has a gradient.
    fn step_multi(&mut self, launcher: &dyn Launcher, grads: &GradStore) -> Result<(), OptimError> {
        let c = &self.config;
        let mut entries = Vec::with_capacity(self.vars.len());
        // The contiguous gradients, alive until the launch is queued.
        let mut gradients = Vec::with_capacity(self.vars.len());
        for (index, var) in self.vars.iter().enumerate() {
            let Some(g) = grad_of(grads, var, index)? else {
                continue;
            };
            let g = g.contiguous()?;
            let mut update = multi::entry(launcher, var, &g)?;
            if c.momentum != 0.0 {
                let buffer = match &self.momentum_buffers[index] {
                    Some(buffer) => buffer.clone(),
                    None => {
                        update.first = 1;
                        var.zeros_like()?
                    }
                };
                update.state[0] = launcher.address(&buffer)?;
                self.momentum_buffers[index] = Some(buffer);
            }
            entries.push(update);
            gradients.push(g);
        }
        let args = multi::SgdArgs {
            lr: c.lr as f32,
            momentum: c.momentum as f32,
            keep: (1.0 - c.dampening) as f32,
            weight_decay: c.weight_decay as f32,
            nesterov: c.nesterov,
        };
        multi::sgd(launcher, entries, args)?;
        drop(gradients);
        Ok(())
    }
}

/// `g + wd * p`, or `g` itself without weight decay.
fn decayed_grad(p: &Tensor, g: &Tensor, weight_decay: f64) -> candle_core::Result<Tensor> {
    if weight_decay == 0.0 {
        Ok(g.clone())
    } else {
        g + p.affine(weight_decay, 0.0)?
    }
}

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        NAME
    }

    fn vars(&self) -> &[Var] {
        &self.vars
    }

    fn step(&mut self, grads: &GradStore) -> Result<(), OptimError> {
        if let Some(launcher) = multi::launcher_for(&self.vars) {
            return self.step_multi(&*launcher, grads);
        }
        for (index, var) in self.vars.iter().enumerate() {
            let Some(g) = grad_of(grads, var, index)? else {
                continue;
            };
            let mut buffer = self.momentum_buffers[index].take();
            let fuse = self.fuse_on_cpu && fusable(var, &[&g]) && buffer.as_ref().is_none_or(|b| fusable(b, &[]));
            let result =
                if fuse { self.step_fused(&var.as_detached_tensor(), &g, &mut buffer) } else { self.step_tensors(var, &g, &mut buffer) };
            self.momentum_buffers[index] = buffer;
            result?;
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn state_bytes(&self) -> usize {
        self.momentum_buffers.iter().flatten().map(tensor_bytes).sum()
    }
}
