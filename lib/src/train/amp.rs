//! Dynamic loss scaling for mixed-precision training, like `torch.cuda.amp.GradScaler`:
//! `scale(loss).backward()`, `step(optimizer, grads)`, `update()`.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::optim::{OptimError, Optimizer};
use crate::models::Precision;

/// The scaler's settings; the defaults are PyTorch's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GradScalerConfig {
    /// The first loss scale. Default 65536 (2^16).
    pub init_scale: f64,
    /// Factor applied after `growth_interval` steps without inf/NaN. Default 2.
    pub growth_factor: f64,
    /// Factor applied when a step finds inf/NaN gradients. Default 0.5.
    pub backoff_factor: f64,
    /// Consecutive good steps before the scale grows. Default 2000.
    pub growth_interval: u32,
    /// When false, `scale` returns the loss unchanged, nothing is unscaled and
    /// every step is taken (f32 or bf16 training). Default true.
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000, enabled: true }
    }
}

/// Where the scaler is within one iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checked {
    /// No inf check since the last `update`.
    No,
    /// Gradients were unscaled; whether they held inf/NaN.
    Unscaled { found_inf: bool },
}

/// Scales the loss so small f16 gradients don't flush to zero, unscales the
/// gradients before the optimizer sees them, skips steps whose gradients hold
/// inf/NaN, and adapts the scale: x`backoff_factor` on such a step,
/// x`growth_factor` after `growth_interval` good steps in a row.
#[derive(Debug, Clone)]
pub struct GradScaler {
    config: GradScalerConfig,
    scale: f64,
    growth_tracker: u32,
    checked: Checked,
    skipped_steps: u64,
}

impl GradScaler {
    pub fn new(config: GradScalerConfig) -> Result<Self, OptimError> {
        let check = |what, value: f64, ok: bool, rule| {
            if ok {
                Ok(())
            } else {
                Err(OptimError::Hyperparameter { optimizer: "GradScaler", what, value, rule })
            }
        };
        let s = config.init_scale;
        check("init_scale", s, s > 0.0 && s.is_finite(), "finite and > 0")?;
        let g = config.growth_factor;
        check("growth_factor", g, g > 1.0 && g.is_finite(), "finite and > 1")?;
        let b = config.backoff_factor;
        check("backoff_factor", b, b > 0.0 && b < 1.0, "in (0, 1)")?;
        let i = config.growth_interval;
        check("growth_interval", i.into(), i > 0, "at least 1")?;
        Ok(GradScaler { scale: config.init_scale, config, growth_tracker: 0, checked: Checked::No, skipped_steps: 0 })
    }

    /// A scaler that does nothing: for f32 and bf16 training.
    pub fn disabled() -> Self {
        GradScaler {
            config: GradScalerConfig { enabled: false, ..GradScalerConfig::default() },
            scale: 1.0,
            growth_tracker: 0,
            checked: Checked::No,
            skipped_steps: 0,
        }
    }

    /// PyTorch's practice: dynamic loss scaling for f16 (5 exponent bits),
    /// none for f32 and bf16 (f32's exponent range).
    pub fn for_precision(precision: Precision) -> Self {
        match precision {
            Precision::F16Amp => GradScaler {
                scale: GradScalerConfig::default().init_scale,
                config: GradScalerConfig::default(),
                growth_tracker: 0,
                checked: Checked::No,
                skipped_steps: 0,
            },
            Precision::F32 | Precision::Bf16Amp => GradScaler::disabled(),
        }
    }

    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    pub fn is_enabled(&self) -> bool {
        self.config.enabled
    }

    /// The current loss scale (1 when disabled).
    pub fn scale_factor(&self) -> f64 {
        self.scale
    }

    /// Good steps since the scale last changed.
    pub fn growth_tracker(&self) -> u32 {
        self.growth_tracker
    }

    /// Steps skipped for inf/NaN gradients since the scaler was made.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// `loss * scale`, in f32: a half-precision loss is cast up first, since
    /// 65536 already overflows f16 (max 65504). `to_dtype` is differentiable,
    /// so backward carries the scaled gradient into the half-precision graph.
    /// Compute the loss itself in f32 from upcast logits, as autocast does: the
    /// gradient entering the f16 graph is then `scale * dloss/dlogit`, not `scale`.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor, OptimError> {
        if !self.config.enabled {
            return Ok(loss.clone());
        }
        let loss = match loss.dtype() {
            DType::F16 | DType::BF16 => loss.to_dtype(DType::F32)?,
            _ => loss.clone(),
        };
        Ok(loss.affine(self.scale, 0.0)?)
    }

    /// Divides the gradients of `vars` by the scale in place in `grads` and
    /// returns whether any holds inf or NaN. Call it before clipping; `step`
    /// calls it when it was not called. Once per iteration.
    pub fn unscale(&mut self, grads: &mut GradStore, vars: &[Var]) -> Result<bool, OptimError> {
        if !self.config.enabled {
            return Ok(false);
        }
        if self.checked != Checked::No {
            return Err(OptimError::AlreadyUnscaled);
        }
        let inverse = 1.0 / self.scale;
        let mut probes = Vec::with_capacity(vars.len());
        for var in vars {
            let Some(grad) = grads.get(var) else {
                continue;
            };
            let unscaled = grad.affine(inverse, 0.0)?;
            // x * 0 is NaN exactly for inf and NaN, and NaN survives the sum.
            probes.push(unscaled.affine(0.0, 0.0)?.sum_all()?.to_dtype(DType::F32)?);
            grads.insert(var, unscaled);
        }
        let found_inf = !probes.is_empty() && Tensor::stack(&probes, 0)?.sum_all()?.to_scalar::<f32>()?.is_nan();
        self.checked = Checked::Unscaled { found_inf };
        Ok(found_inf)
    }

    /// Records that another process found a gradient that is not finite
    /// among those it holds (ZeRO-2), after this one's `unscale`: the step
    /// is skipped everywhere, and the scale backs off everywhere.
    pub(crate) fn found_inf_elsewhere(&mut self) {
        if self.checked != Checked::No {
            self.checked = Checked::Unscaled { found_inf: true };
        }
    }

    /// Unscales (unless done already this iteration) and runs the optimizer
    /// step unless a gradient holds inf/NaN. Returns whether it stepped.
    pub fn step<O: Optimizer + ?Sized>(&mut self, optimizer: &mut O, grads: &mut GradStore) -> Result<bool, OptimError> {
        if !self.config.enabled {
            optimizer.step(grads)?;
            return Ok(true);
        }
        let found_inf = match self.checked {
            Checked::Unscaled { found_inf } => found_inf,
            Checked::No => {
                let vars = optimizer.vars().to_vec();
                self.unscale(grads, &vars)?
            }
        };
        if found_inf {
            self.skipped_steps += 1;
            return Ok(false);
        }
        optimizer.step(grads)?;
        Ok(true)
    }

    /// Adapts the scale to this iteration's inf check (PyTorch's
    /// `_amp_update_scale_`) and starts the next iteration.
    pub fn update(&mut self) -> Result<(), OptimError> {
        if !self.config.enabled {
            return Ok(());
        }
        let Checked::Unscaled { found_inf } = self.checked else {
            return Err(OptimError::NoInfCheck);
        };
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.config.growth_interval {
                let grown = self.scale * self.config.growth_factor;
                // The scale is an f32 in PyTorch, and `affine` casts it to f32 here.
                if (grown as f32).is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            }
        }
        self.checked = Checked::No;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::*;
    use crate::models::Precision;
    use crate::train::optim::tests::grad_store;
    use crate::train::optim::{Sgd, SgdConfig};

    fn setup() -> (Var, Sgd) {
        let w = Var::from_slice(&[1.0f32, 2.0], 2, &Device::Cpu).unwrap();
        let sgd = Sgd::new(vec![w.clone()], SgdConfig { lr: 0.5, ..SgdConfig::default() }).unwrap();
        (w, sgd)
    }

    fn values(w: &Var) -> Vec<f32> {
        w.as_tensor().to_vec1().unwrap()
    }

    #[test]
    fn an_inf_another_process_found_skips_this_ones_step_too() {
        let (w, mut sgd) = setup();
        let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        let mut grads = grad_store(&[(&w, &[65536.0, 65536.0])]);
        assert!(!scaler.unscale(&mut grads, std::slice::from_ref(&w)).unwrap(), "this process's part is finite");
        scaler.found_inf_elsewhere();
        assert!(!scaler.step(&mut sgd, &mut grads).unwrap());
        assert_eq!(values(&w), [1.0, 2.0], "parameters unchanged");
        scaler.update().unwrap();
        assert_eq!(scaler.scale_factor(), 32768.0);
    }

    #[test]
    fn an_inf_or_nan_gradient_skips_the_step_and_halves_the_scale() {
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let (w, mut sgd) = setup();
            let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
            assert_eq!(scaler.scale_factor(), 65536.0);
            let mut grads = grad_store(&[(&w, &[bad, 1.0])]);
            let stepped = scaler.step(&mut sgd, &mut grads).unwrap();
            assert!(!stepped);
            assert_eq!(values(&w), [1.0, 2.0], "parameters unchanged");
            scaler.update().unwrap();
            assert_eq!(scaler.scale_factor(), 32768.0);
            assert_eq!(scaler.skipped_steps(), 1);
        }
    }

    #[test]
    fn a_good_step_is_taken_with_unscaled_gradients() {
        let (w, mut sgd) = setup();
        let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        let mut grads = grad_store(&[(&w, &[65536.0 * 0.25, -65536.0])]);
        assert!(scaler.step(&mut sgd, &mut grads).unwrap());
        scaler.update().unwrap();
        // w - lr * g / scale
        assert_eq!(values(&w), [1.0 - 0.5 * 0.25, 2.0 + 0.5]);
        assert_eq!(scaler.scale_factor(), 65536.0);
        assert_eq!(scaler.growth_tracker(), 1);
    }

    #[test]
    fn the_scale_grows_after_growth_interval_good_steps_in_a_row() {
        let (w, mut sgd) = setup();
        let mut scaler = GradScaler::new(GradScalerConfig { growth_interval: 3, ..GradScalerConfig::default() }).unwrap();
        let mut iteration = |g: f32, scaler: &mut GradScaler| {
            let mut grads = grad_store(&[(&w, &[g, g])]);
            scaler.step(&mut sgd, &mut grads).unwrap();
            scaler.update().unwrap();
            scaler.scale_factor()
        };
        assert_eq!(iteration(1.0, &mut scaler), 65536.0);
        assert_eq!(iteration(1.0, &mut scaler), 65536.0);
        // An inf resets the run of good steps.
        assert_eq!(iteration(f32::INFINITY, &mut scaler), 32768.0);
        assert_eq!(iteration(1.0, &mut scaler), 32768.0);
        assert_eq!(iteration(1.0, &mut scaler), 32768.0);
        assert_eq!(iteration(1.0, &mut scaler), 65536.0);
        assert_eq!(scaler.growth_tracker(), 0);
        assert_eq!(iteration(1.0, &mut scaler), 65536.0);
    }

    #[test]
    fn the_default_interval_is_two_thousand_steps() {
        let (w, mut sgd) = setup();
        let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        for step in 1..=2000 {
            let mut grads = grad_store(&[(&w, &[0.0, 0.0])]);
            scaler.step(&mut sgd, &mut grads).unwrap();
            scaler.update().unwrap();
            let expected = if step < 2000 { 65536.0 } else { 131072.0 };
            assert_eq!(scaler.scale_factor(), expected, "after step {step}");
        }
    }

    #[test]
    fn a_half_precision_loss_is_scaled_in_f32() {
        let scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        let loss = Tensor::new(1.5f32, &Device::Cpu).unwrap().to_dtype(DType::F16).unwrap();
        let scaled = scaler.scale(&loss).unwrap();
        assert_eq!(scaled.dtype(), DType::F32);
        // 98304 is past f16's largest value, 65504.
        assert_eq!(scaled.to_scalar::<f32>().unwrap(), 1.5 * 65536.0);
    }

    #[test]
    fn backward_carries_the_scale_through_half_precision_and_unscale_removes_it() {
        let w = Var::from_slice(&[1.0f32, 2.0], 2, &Device::Cpu).unwrap();
        let half = (w.as_tensor().to_dtype(DType::F16).unwrap() * 0.5).unwrap();
        let loss = half.to_dtype(DType::F32).unwrap().mean_all().unwrap();
        let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        let scaled = scaler.scale(&loss).unwrap();
        assert_eq!(scaled.to_scalar::<f32>().unwrap(), 0.75 * 65536.0);
        let mut grads = scaled.backward().unwrap();
        // d(scaled)/dw = 65536 / 2 * 0.5, carried in f16 and cast back to the f32 weight.
        let grad = grads.get(&w).unwrap();
        assert_eq!(grad.dtype(), DType::F32);
        assert_eq!(grad.to_vec1::<f32>().unwrap(), [16384.0; 2]);
        assert!(!scaler.unscale(&mut grads, std::slice::from_ref(&w)).unwrap());
        assert_eq!(grads.get(&w).unwrap().to_vec1::<f32>().unwrap(), [0.25; 2]);
    }

    #[test]
    fn a_gradient_past_f16_range_is_caught() {
        // An f16 gradient of 65536 (the default scale on a summed loss) overflows to inf.
        let w = Var::from_slice(&[1.0f32, 2.0], 2, &Device::Cpu).unwrap();
        let loss = w.as_tensor().to_dtype(DType::F16).unwrap().sum_all().unwrap();
        let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
        assert!(scaler.unscale(&mut grads, std::slice::from_ref(&w)).unwrap());
        scaler.update().unwrap();
        assert_eq!(scaler.scale_factor(), 32768.0);
    }

    #[test]
    fn unscaling_twice_and_updating_unchecked_are_errors() {
        let (w, mut sgd) = setup();
        let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        assert!(matches!(scaler.update(), Err(OptimError::NoInfCheck)));
        let mut grads = grad_store(&[(&w, &[1.0, 1.0])]);
        scaler.unscale(&mut grads, std::slice::from_ref(&w)).unwrap();
        assert!(matches!(scaler.unscale(&mut grads, std::slice::from_ref(&w)), Err(OptimError::AlreadyUnscaled)));
        // step after an explicit unscale does not unscale again.
        assert!(scaler.step(&mut sgd, &mut grads).unwrap());
        assert_eq!(values(&w), [1.0 - 0.5 / 65536.0, 2.0 - 0.5 / 65536.0]);
        scaler.update().unwrap();
    }

    #[test]
    fn a_disabled_scaler_passes_everything_through() {
        let (w, mut sgd) = setup();
        let mut scaler = GradScaler::disabled();
        let loss = Tensor::new(2.5f32, &Device::Cpu).unwrap();
        assert_eq!(scaler.scale(&loss).unwrap().to_scalar::<f32>().unwrap(), 2.5);
        let mut grads = grad_store(&[(&w, &[1.0, 1.0])]);
        assert!(scaler.step(&mut sgd, &mut grads).unwrap());
        scaler.update().unwrap();
        assert_eq!(values(&w), [0.5, 1.5]);
        assert_eq!(scaler.scale_factor(), 1.0);
    }

    #[test]
    fn only_f16_scales_the_loss() {
        assert_eq!(GradScaler::for_precision(Precision::F16Amp).scale_factor(), 65536.0);
        assert!(!GradScaler::for_precision(Precision::Bf16Amp).is_enabled());
        assert!(!GradScaler::for_precision(Precision::F32).is_enabled());
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad = GradScaler::new(GradScalerConfig { backoff_factor: 1.5, ..GradScalerConfig::default() });
        assert_eq!(bad.err().unwrap().to_string(), "GradScaler: backoff_factor = 1.5 is invalid: it must be in (0, 1)");
        assert!(GradScaler::new(GradScalerConfig { growth_interval: 0, ..GradScalerConfig::default() }).is_err());
    }
}
