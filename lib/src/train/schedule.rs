//! Learning-rate schedules as data: the rate at any step, in PyTorch's closed forms.

use std::f64::consts::PI;
use std::fmt;

use serde::Serialize;

use super::optim::{OptimError, Optimizer};

/// A learning rate as a function of the step (or epoch: the caller picks the unit).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Schedule(Kind);

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
enum Kind {
    Constant { lr: f64 },
    Step { lr: f64, step_size: u64, gamma: f64 },
    Cosine { lr: f64, t_max: u64, eta_min: f64 },
    Warmup { steps: u64, start_factor: f64, then: Box<Schedule> },
}

fn check(schedule: &'static str, what: &'static str, value: f64, ok: bool, rule: &'static str) -> Result<(), OptimError> {
    if ok {
        Ok(())
    } else {
        Err(OptimError::Schedule { schedule, what, value, rule })
    }
}

fn check_lr(schedule: &'static str, what: &'static str, lr: f64) -> Result<(), OptimError> {
    check(schedule, what, lr, lr >= 0.0 && lr.is_finite(), "finite and >= 0")
}

impl Schedule {
    /// `lr` at every step.
    pub fn constant(lr: f64) -> Result<Self, OptimError> {
        check_lr("constant schedule", "lr", lr)?;
        Ok(Schedule(Kind::Constant { lr }))
    }

    /// `StepLR`: `lr * gamma^floor(step / step_size)`.
    pub fn step(lr: f64, step_size: u64, gamma: f64) -> Result<Self, OptimError> {
        check_lr("StepLR", "lr", lr)?;
        check("StepLR", "step_size", step_size as f64, step_size > 0, "at least 1")?;
        check("StepLR", "gamma", gamma, gamma >= 0.0 && gamma.is_finite(), "finite and >= 0")?;
        Ok(Schedule(Kind::Step { lr, step_size, gamma }))
    }

    /// `CosineAnnealingLR`: `eta_min + (lr - eta_min) * (1 + cos(pi * step / t_max)) / 2`,
    /// which falls to `eta_min` at `t_max` and, as in PyTorch, rises again after it.
    pub fn cosine(lr: f64, t_max: u64, eta_min: f64) -> Result<Self, OptimError> {
        check_lr("CosineAnnealingLR", "lr", lr)?;
        check("CosineAnnealingLR", "t_max", t_max as f64, t_max > 0, "at least 1")?;
        check_lr("CosineAnnealingLR", "eta_min", eta_min)?;
        Ok(Schedule(Kind::Cosine { lr, t_max, eta_min }))
    }

    /// Linear warm-up for `steps` steps from `start_factor` times this schedule's
    /// first rate, then this schedule from its step 0: PyTorch's
    /// `SequentialLR([LinearLR(start_factor, 1.0, steps), this], milestones=[steps])`.
    pub fn with_warmup(self, steps: u64, start_factor: f64) -> Result<Self, OptimError> {
        check("LinearLR warm-up", "steps", steps as f64, steps > 0, "at least 1")?;
        check("LinearLR warm-up", "start_factor", start_factor, start_factor > 0.0 && start_factor <= 1.0, "in (0, 1]")?;
        Ok(Schedule(Kind::Warmup { steps, start_factor, then: Box::new(self) }))
    }

    /// The learning rate at `step` (0 is the first).
    pub fn lr_at(&self, step: u64) -> f64 {
        match &self.0 {
            Kind::Constant { lr } => *lr,
            Kind::Step { lr, step_size, gamma } => {
                let decays = i32::try_from(step / step_size).unwrap_or(i32::MAX);
                lr * gamma.powi(decays)
            }
            Kind::Cosine { lr, t_max, eta_min } => eta_min + (lr - eta_min) * (1.0 + (PI * step as f64 / *t_max as f64).cos()) / 2.0,
            Kind::Warmup { steps, start_factor, then } => {
                if step < *steps {
                    let progress = step as f64 / *steps as f64;
                    then.lr_at(0) * (start_factor + (1.0 - start_factor) * progress)
                } else {
                    then.lr_at(step - steps)
                }
            }
        }
    }

    /// Sets the optimizer's learning rate to the rate at `step`.
    pub fn apply<O: Optimizer + ?Sized>(&self, optimizer: &mut O, step: u64) {
        optimizer.set_learning_rate(self.lr_at(step));
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Kind::Constant { lr } => write!(f, "constant {lr}"),
            Kind::Step { lr, step_size, gamma } => write!(f, "step {lr} x{gamma} every {step_size}"),
            Kind::Cosine { lr, t_max, eta_min } => {
                write!(f, "cosine {lr} to {eta_min} over {t_max}")
            }
            Kind::Warmup { steps, start_factor, then } => write!(f, "{steps} warm-up from x{start_factor}, then {then}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::optim::{Sgd, SgdConfig};

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn step_lr_decays_by_gamma_every_step_size_steps() {
        let s = Schedule::step(0.1, 30, 0.1).unwrap();
        for (step, lr) in [(0, 0.1), (29, 0.1), (30, 0.01), (59, 0.01), (60, 0.001), (95, 0.0001)] {
            assert!(close(s.lr_at(step), lr), "step {step}: {} vs {lr}", s.lr_at(step));
        }
    }

    #[test]
    fn cosine_falls_to_eta_min_at_t_max() {
        let s = Schedule::cosine(0.1, 10, 0.001).unwrap();
        assert!(close(s.lr_at(0), 0.1));
        assert!(close(s.lr_at(5), 0.001 + 0.099 * 0.5));
        assert!(close(s.lr_at(10), 0.001));
        let quarter = 0.001 + 0.099 * (1.0 + (PI / 4.0).cos()) / 2.0;
        assert!((s.lr_at(5) - 0.0505).abs() < 1e-15);
        let eighth = Schedule::cosine(0.1, 8, 0.001).unwrap();
        assert!(close(eighth.lr_at(2), quarter));
        // PyTorch's closed form is periodic: back up after t_max.
        assert!(close(s.lr_at(20), 0.1));
    }

    #[test]
    fn warmup_ramps_linearly_then_hands_over() {
        let s = Schedule::cosine(0.1, 10, 0.0).unwrap().with_warmup(5, 0.1).unwrap();
        assert!(close(s.lr_at(0), 0.01));
        assert!(close(s.lr_at(2), 0.1 * (0.1 + 0.9 * 2.0 / 5.0)));
        assert!(close(s.lr_at(4), 0.1 * (0.1 + 0.9 * 4.0 / 5.0)));
        assert!(close(s.lr_at(5), 0.1));
        assert!(close(s.lr_at(10), 0.05));
        assert!(close(s.lr_at(15), 0.0));
        assert_eq!(s.to_string(), "5 warm-up from x0.1, then cosine 0.1 to 0 over 10");
    }

    /// Produced with torch 2.15: an `SGD(lr=0.1)` optimizer's `param_groups[0]["lr"]`
    /// read before each `opt.step(); sched.step()`, for `StepLR(step_size=3, gamma=0.5)`,
    /// `CosineAnnealingLR(T_max=4, eta_min=0.01)` and `SequentialLR([LinearLR(start_factor=0.25,
    /// total_iters=3), CosineAnnealingLR(T_max=4)], milestones=[3])`.
    const TORCH_STEP: [f64; 8] = [0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025];
    const TORCH_COSINE: [f64; 10] = [
        0.1,
        0.08681980515339464,
        0.05500000000000001,
        0.023180194846605363,
        0.01,
        0.023180194846605363,
        0.05500000000000002,
        0.08681980515339469,
        0.10000000000000006,
        0.0868198051533947,
    ];
    const TORCH_WARMUP_COSINE: [f64; 9] =
        [0.025, 0.05, 0.07500000000000001, 0.1, 0.08535533905932738, 0.05, 0.014644660940672627, 0.0, 0.014644660940672622];

    #[test]
    fn schedules_give_torchs_rates() {
        let cases = [
            (Schedule::step(0.1, 3, 0.5).unwrap(), &TORCH_STEP[..]),
            (Schedule::cosine(0.1, 4, 0.01).unwrap(), &TORCH_COSINE[..]),
            (Schedule::cosine(0.1, 4, 0.0).unwrap().with_warmup(3, 0.25).unwrap(), &TORCH_WARMUP_COSINE[..]),
        ];
        for (schedule, torch) in cases {
            for (step, &expected) in torch.iter().enumerate() {
                let lr = schedule.lr_at(step as u64);
                // PyTorch updates recursively; the closed form differs by rounding only.
                assert!((lr - expected).abs() < 1e-15, "{schedule} at {step}: {lr} vs {expected}");
            }
        }
    }

    #[test]
    fn apply_sets_the_optimizers_rate() {
        let mut sgd = Sgd::new(vec![], SgdConfig::default()).unwrap();
        let s = Schedule::step(1.0, 2, 0.5).unwrap();
        s.apply(&mut sgd, 5);
        assert_eq!(sgd.learning_rate(), 0.25);
        let constant = Schedule::constant(0.3).unwrap();
        constant.apply(&mut sgd, 1000);
        assert_eq!(sgd.learning_rate(), 0.3);
    }

    #[test]
    fn bad_schedules_are_refused() {
        let message = Schedule::step(0.1, 0, 0.1).err().unwrap().to_string();
        assert_eq!(message, "StepLR: step_size must be at least 1, got 0");
        let message = Schedule::constant(0.1).unwrap().with_warmup(3, 0.0).err().unwrap().to_string();
        assert_eq!(message, "LinearLR warm-up: start_factor must be in (0, 1], got 0");
        assert!(Schedule::cosine(0.1, 0, 0.0).is_err());
        assert!(Schedule::constant(f64::NAN).is_err());
    }
}
