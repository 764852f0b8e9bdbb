use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};

use super::multi::{self, Entry, Launcher};
use super::{fusable, fused, grad_of, require_beta, require_non_negative, tensor_bytes};
use super::{OptimError, Optimizer};

/// Adam's hyperparameters; the defaults are PyTorch's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdamConfig {
    /// Learning rate. Default 1e-3.
    pub lr: f64,
    /// Decay of the first moment. Default 0.9.
    pub beta1: f64,
    /// Decay of the second moment. Default 0.999.
    pub beta2: f64,
    /// Added to the bias-corrected `sqrt(v)` (outside the root). Default 1e-8.
    pub eps: f64,
    /// L2 penalty added to the gradient (`g + weight_decay * p`). Default 0.
    pub weight_decay: f64,
    /// Divide by the running maximum of `v` (AMSGrad); keeps a third buffer. Default false.
    pub amsgrad: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, amsgrad: false }
    }
}

/// AdamW's hyperparameters; the defaults are PyTorch's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate. Default 1e-3.
    pub lr: f64,
    /// Decay of the first moment. Default 0.9.
    pub beta1: f64,
    /// Decay of the second moment. Default 0.999.
    pub beta2: f64,
    /// Added to the bias-corrected `sqrt(v)` (outside the root). Default 1e-8.
    pub eps: f64,
    /// Decoupled decay: `p *= 1 - lr * weight_decay` before the Adam step. Default 0.01.
    pub weight_decay: f64,
    /// Divide by the running maximum of `v` (AMSGrad); keeps a third buffer. Default false.
    pub amsgrad: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, amsgrad: false }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decay {
    /// Adam: added to the gradient.
    L2,
    /// AdamW: applied to the parameter.
    Decoupled,
}

/// Adam's constants for one step, in the precision the update runs in.
#[derive(Debug, Clone, Copy)]
pub(super) struct AdamStep {
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub eps: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias_correction2_sqrt: f32,
}

impl AdamStep {
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, step: u64) -> Self {
        let t = step as f64;
        AdamStep {
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            eps: eps as f32,
            step_size: (lr / (1.0 - beta1.powf(t))) as f32,
            bias_correction2_sqrt: (1.0 - beta2.powf(t)).sqrt() as f32,
        }
    }

    /// The new first moment: `torch.lerp(m, g, 1 - beta1)`.
    #[inline]
    pub fn first_moment(&self, m: f32, g: f32) -> f32 {
        lerp(m, g, self.one_minus_beta1)
    }

    /// The new second moment: `v * beta2 + (1 - beta2) * g * g`.
    #[inline]
    pub fn second_moment(&self, v: f32, g: f32) -> f32 {
        v * self.beta2 + self.one_minus_beta2 * g * g
    }

    /// The change of the parameter: `-step_size * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)`.
    #[inline]
    pub fn delta(&self, m: f32, v: f32) -> f32 {
        -self.step_size * m / (v.sqrt() / self.bias_correction2_sqrt + self.eps)
    }
}

/// `torch.lerp` as its CPU kernel computes it (exact at both ends).
#[inline]
fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    if weight.abs() < 0.5 {
        start + weight * (end - start)
    } else {
        end - (end - start) * (1.0 - weight)
    }
}

fn lerp_tensors(start: &Tensor, end: &Tensor, weight: f64) -> candle_core::Result<Tensor> {
    let diff = (end - start)?;
    if weight.abs() < 0.5 {
        start + diff.affine(weight, 0.0)?
    } else {
        end - diff.affine(1.0 - weight, 0.0)?
    }
}

struct AdamState {
    step: u64,
    m: Tensor,
    v: Tensor,
    max_v: Option<Tensor>,
}

/// `torch.optim.Adam` (single-tensor path): `g += wd * p`; `m = lerp(m, g, 1 - beta1)`;
/// `v = beta2 * v + (1 - beta2) * g^2`; `p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)`,
/// with `v` replaced by its running maximum under AMSGrad.
pub struct Adam {
    name: &'static str,
    vars: Vec<Var>,
    config: AdamConfig,
    decay: Decay,
    states: Vec<Option<AdamState>>,
    fuse_on_cpu: bool,
}

impl Adam {
    pub fn new(vars: Vec<Var>, config: AdamConfig) -> Result<Self, OptimError> {
        Adam::with_decay("Adam", vars, config, Decay::L2)
    }

    fn with_decay(name: &'static str, vars: Vec<Var>, config: AdamConfig, decay: Decay) -> Result<Self, OptimError> {
        require_non_negative(name, "lr", config.lr)?;
        require_beta(name, "beta1", config.beta1)?;
        require_beta(name, "beta2", config.beta2)?;
        require_non_negative(name, "eps", config.eps)?;
        require_non_negative(name, "weight_decay", config.weight_decay)?;
        Ok(Adam { name, states: (0..vars.len()).map(|_| None).collect(), vars, config, decay, fuse_on_cpu: true })
    }

    /// Forces the tensor-op path on the CPU too, so that the tests and
    /// check-ops compare the two paths.
    pub(crate) fn unfused(mut self) -> Self {
        self.fuse_on_cpu = false;
        self
    }

    fn new_state(&self, var: &Var) -> candle_core::Result<AdamState> {
        let max_v = if self.config.amsgrad { Some(var.zeros_like()?) } else { None };
        Ok(AdamState { step: 0, m: var.zeros_like()?, v: var.zeros_like()?, max_v })
    }

    fn constants(&self, step: u64) -> AdamStep {
        let c = &self.config;
        AdamStep::new(c.lr, c.beta1, c.beta2, c.eps, step)
    }

    /// `p` is the parameter's storage, updated in place.
    fn step_fused(&self, p: &Tensor, g: &Tensor, state: &AdamState) -> candle_core::Result<()> {
        let k = self.constants(state.step);
        let wd = self.config.weight_decay as f32;
        let l2 = self.decay == Decay::L2 && wd != 0.0;
        let grad = |g: f32, p: f32| if l2 { g + wd * p } else { g };
        fused::update3("adam m", &state.m, g, p, |m, g, p| *m = k.first_moment(*m, grad(g, p)))?;
        fused::update3("adam v", &state.v, g, p, |v, g, p| *v = k.second_moment(*v, grad(g, p)))?;
        let denominator = match &state.max_v {
            Some(max_v) => {
                fused::update2("amsgrad max", max_v, &state.v, |max, v| {
                    if v.is_nan() || v > *max {
                        *max = v
                    }
                })?;
                max_v
            }
            None => &state.v,
        };
        let shrink =
            if self.decay == Decay::Decoupled && wd != 0.0 { (1.0 - self.config.lr * self.config.weight_decay) as f32 } else { 1.0 };
        fused::update3("adam step", p, &state.m, denominator, |p, m, v| *p = *p * shrink + k.delta(m, v))
    }

    fn step_tensors(&self, var: &Var, g: &Tensor, state: &mut AdamState) -> candle_core::Result<()> {
        let c = &self.config;
        let mut p = var.as_detached_tensor();
        let g = if self.decay == Decay::L2 && c.weight_decay != 0.0 { (g + p.affine(c.weight_decay, 0.0)?)? } else { g.clone() };
        if self.decay == Decay::Decoupled && c.weight_decay != 0.0 {
            p = p.affine(1.0 - c.lr * c.weight_decay, 0.0)?;
        }
        state.m = lerp_tensors(&state.m, &g, 1.0 - c.beta1)?;
        state.v = (state.v.affine(c.beta2, 0.0)? + (g.affine(1.0 - c.beta2, 0.0)? * &g)?)?;
        let v = match &mut state.max_v {
            Some(max_v) => {
                *max_v = max_v.maximum(&state.v)?;
                max_v.clone()
            }
            None => state.v.clone(),
        };
        let t = state.step as f64;
        let step_size = c.lr / (1.0 - c.beta1.powf(t));
        let bias_correction2_sqrt = (1.0 - c.beta2.powf(t)).sqrt();
        let denominator = (v.sqrt()? / bias_correction2_sqrt)?.affine(1.0, c.eps)?;
        let delta = (state.m.affine(-step_size, 0.0)? / denominator)?;
        var.set(&(p + delta)?)
    }
}

impl Optimizer for Adam {
    fn name(&self) -> &'static str {
        self.name
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
            let mut state = match self.states[index].take() {
                Some(state) => state,
                None => self.new_state(var)?,
            };
            state.step += 1;
            let fuse = self.fuse_on_cpu && fusable(var, &[&g, &state.m, &state.v]);
            let result = if fuse { self.step_fused(&var.as_detached_tensor(), &g, &state) } else { self.step_tensors(var, &g, &mut state) };
            self.states[index] = Some(state);
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
        self.states.iter().flatten().map(|s| tensor_bytes(&s.m) + tensor_bytes(&s.v) + s.max_v.as_ref().map_or(0, tensor_bytes)).sum()
    }
}

impl Adam {
    /// Every parameter in one launch of the multi-tensor kernel, each with
    /// its own step's bias corrections.
    fn step_multi(&mut self, launcher: &dyn Launcher, grads: &GradStore) -> Result<(), OptimError> {
        let mut entries = Vec::with_capacity(self.vars.len());
        // The contiguous gradients, alive until the launch is queued.
        let mut gradients = Vec::with_capacity(self.vars.len());
        for (index, var) in self.vars.iter().enumerate() {
            let Some(g) = grad_of(grads, var, index)? else {
                continue;
            };
            let g = g.contiguous()?;
            let mut state = match self.states[index].take() {
                Some(state) => state,
                None => self.new_state(var)?,
            };
            state.step += 1;
            let k = self.constants(state.step);
            let max_v = state.max_v.as_ref().map(|t| launcher.address(t)).transpose()?.unwrap_or(0);
            entries.push(Entry {
                state: [launcher.address(&state.m)?, launcher.address(&state.v)?, max_v],
                step_size: k.step_size,
                bias_correction2_sqrt: k.bias_correction2_sqrt,
                ..multi::entry(launcher, var, &g)?
            });
            self.states[index] = Some(state);
            gradients.push(g);
        }
        let (c, k) = (&self.config, self.constants(1));
        let decoupled = self.decay == Decay::Decoupled;
        let args = multi::AdamArgs {
            one_minus_beta1: k.one_minus_beta1,
            beta2: k.beta2,
            one_minus_beta2: k.one_minus_beta2,
            eps: k.eps,
            weight_decay: c.weight_decay as f32,
            shrink: if decoupled && c.weight_decay != 0.0 { (1.0 - c.lr * c.weight_decay) as f32 } else { 1.0 },
            decoupled,
            amsgrad: c.amsgrad,
        };
        multi::adam(launcher, entries, args)?;
        drop(gradients);
        Ok(())
    }
}

/// `torch.optim.AdamW`: Adam with the weight decay applied to the parameter
/// (`p *= 1 - lr * weight_decay`) instead of added to the gradient.
pub struct AdamW(Adam);

impl AdamW {
    pub fn new(vars: Vec<Var>, config: AdamWConfig) -> Result<Self, OptimError> {
        let AdamWConfig { lr, beta1, beta2, eps, weight_decay, amsgrad } = config;
        let config = AdamConfig { lr, beta1, beta2, eps, weight_decay, amsgrad };
        Ok(AdamW(Adam::with_decay("AdamW", vars, config, Decay::Decoupled)?))
    }

    pub(crate) fn unfused(self) -> Self {
        AdamW(self.0.unfused())
    }
}

impl Optimizer for AdamW {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn vars(&self) -> &[Var] {
        self.0.vars()
    }

    fn step(&mut self, grads: &GradStore) -> Result<(), OptimError> {
        self.0.step(grads)
    }

    fn learning_rate(&self) -> f64 {
        self.0.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.0.set_learning_rate(lr)
    }

    fn state_bytes(&self) -> usize {
        self.0.state_bytes()
    }
}
