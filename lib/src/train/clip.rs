//! Gradient clipping by global norm, with `torch.nn.utils.clip_grad_norm_`'s semantics.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::optim::OptimError;

/// What PyTorch adds to the norm before dividing, so a zero norm never divides by zero.
const EPSILON: f64 = 1e-6;

/// The `norm_type`-norm of all gradients of `vars` taken as one vector
/// (`f64::INFINITY` for the largest magnitude). Variables without a gradient
/// are left out; with none at all the norm is 0.
pub fn grad_norm(grads: &GradStore, vars: &[Var], norm_type: f64) -> Result<f64, OptimError> {
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(OptimError::Clip { what: "norm_type", value: norm_type, rule: "> 0 (or infinity)" });
    }
    let partials = vars
        .iter()
        .filter_map(|var| grads.get(var))
        .map(|g| {
            let abs = g.abs()?;
            let partial = if norm_type == f64::INFINITY {
                abs.max_all()?
            } else if norm_type == 2.0 {
                abs.sqr()?.sum_all()?
            } else if norm_type == 1.0 {
                abs.sum_all()?
            } else {
                abs.powf(norm_type)?.sum_all()?
            };
            partial.to_dtype(DType::F32)
        })
        .collect::<candle_core::Result<Vec<Tensor>>>()?;
    if partials.is_empty() {
        return Ok(0.0);
    }
    let partials = Tensor::stack(&partials, 0)?.to_vec1::<f32>()?;
    let partials = partials.into_iter().map(f64::from);
    Ok(if norm_type == f64::INFINITY { partials.fold(0.0, f64::max) } else { partials.sum::<f64>().powf(1.0 / norm_type) })
}

/// Clips the gradients of `vars` in `grads` so their global norm is at most
/// `max_norm`: when `total > max_norm` every gradient is multiplied by
/// `max_norm / (total + 1e-6)`. Returns the norm before clipping. Like
/// PyTorch, a NaN or infinite norm scales the gradients too (to NaN or zero).
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[Var], max_norm: f64, norm_type: f64) -> Result<f64, OptimError> {
    let total = grad_norm(grads, vars, norm_type)?;
    clip_to(grads, vars, max_norm, total)?;
    Ok(total)
}

/// Clips the gradients of `vars` in `grads` as [`clip_grad_norm`] does,
/// given their global norm `total` (all the processes' gradients' where
/// each holds a part of them).
pub(crate) fn clip_to(grads: &mut GradStore, vars: &[Var], max_norm: f64, total: f64) -> Result<(), OptimError> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(OptimError::Clip { what: "max_norm", value: max_norm, rule: ">= 0" });
    }
    let coefficient = max_norm / (total + EPSILON);
    if coefficient < 1.0 || coefficient.is_nan() {
        for var in vars {
            if let Some(grad) = grads.get(var) {
                let clipped = grad.affine(coefficient, 0.0)?;
                grads.insert(var, clipped);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::train::optim::tests::grad_store;

    fn vars() -> (Var, Var, Var) {
        let v = |n: usize| Var::zeros(n, DType::F32, &Device::Cpu).unwrap();
        (v(2), v(1), v(3))
    }

    fn grad(grads: &GradStore, var: &Var) -> Vec<f32> {
        grads.get(var).unwrap().to_vec1().unwrap()
    }

    #[test]
    fn gradients_over_max_norm_are_scaled_to_it() {
        let (a, b, unused) = vars();
        let mut grads = grad_store(&[(&a, &[3.0, 4.0]), (&b, &[12.0])]);
        let all = [a.clone(), b.clone(), unused];
        let total = clip_grad_norm(&mut grads, &all, 6.5, 2.0).unwrap();
        assert_eq!(total, 13.0);
        let coefficient = (6.5 / (13.0 + 1e-6)) as f32;
        assert_eq!(grad(&grads, &a), [3.0 * coefficient, 4.0 * coefficient]);
        assert_eq!(grad(&grads, &b), [12.0 * coefficient]);
        let after = grad_norm(&grads, &all, 2.0).unwrap();
        assert!((after - 6.5).abs() < 1e-5, "{after}");
    }

    #[test]
    fn clipping_gives_torchs_gradients() {
        // torch 2.15: a.grad = [3, -4], b.grad = [12];
        // clip_grad_norm_([a, b], max_norm=6.5) returns 13.0 and leaves these.
        let (a, b, _) = vars();
        let mut grads = grad_store(&[(&a, &[3.0, -4.0]), (&b, &[12.0])]);
        let total = clip_grad_norm(&mut grads, &[a.clone(), b.clone()], 6.5, 2.0).unwrap();
        assert_eq!(total, 13.0);
        let a_torch = [1.4999998807907104f64, -1.9999998807907104];
        let b_torch = [5.999999523162842f64];
        assert_eq!(grad(&grads, &a), a_torch.map(|x| x as f32));
        assert_eq!(grad(&grads, &b), b_torch.map(|x| x as f32));
    }

    #[test]
    fn gradients_under_max_norm_are_left_alone() {
        let (a, b, _) = vars();
        let mut grads = grad_store(&[(&a, &[3.0, 4.0]), (&b, &[12.0])]);
        let total = clip_grad_norm(&mut grads, &[a.clone(), b.clone()], 13.5, 2.0).unwrap();
        assert_eq!(total, 13.0);
        assert_eq!(grad(&grads, &a), [3.0, 4.0]);
        assert_eq!(grad(&grads, &b), [12.0]);
    }

    #[test]
    fn other_norms_follow_their_definitions() {
        let (a, b, _) = vars();
        let grads = grad_store(&[(&a, &[3.0, -4.0]), (&b, &[-12.0])]);
        let all = [a, b];
        assert_eq!(grad_norm(&grads, &all, 1.0).unwrap(), 19.0);
        assert_eq!(grad_norm(&grads, &all, f64::INFINITY).unwrap(), 12.0);
        let cubic = (27.0f64 + 64.0 + 1728.0).powf(1.0 / 3.0);
        assert!((grad_norm(&grads, &all, 3.0).unwrap() - cubic).abs() < 1e-9);
        assert_eq!(grad_norm(&grads, &[], 2.0).unwrap(), 0.0);
    }

    #[test]
    fn an_infinite_norm_zeroes_finite_gradients_as_pytorch_does() {
        let (a, b, _) = vars();
        let mut grads = grad_store(&[(&a, &[f32::INFINITY, 1.0]), (&b, &[2.0])]);
        let total = clip_grad_norm(&mut grads, &[a.clone(), b.clone()], 1.0, 2.0).unwrap();
        assert_eq!(total, f64::INFINITY);
        assert_eq!(grad(&grads, &b), [0.0]);
        assert!(grad(&grads, &a)[0].is_nan());
    }

    #[test]
    fn bad_arguments_are_refused() {
        let (a, _, _) = vars();
        let mut grads = grad_store(&[(&a, &[1.0, 1.0])]);
        let message = clip_grad_norm(&mut grads, std::slice::from_ref(&a), -1.0, 2.0).err().unwrap().to_string();
        assert_eq!(message, "clip_grad_norm: max_norm must be >= 0, got -1");
        let message = grad_norm(&grads, &[a], 0.0).err().unwrap().to_string();
        assert_eq!(message, "clip_grad_norm: norm_type must be > 0 (or infinity), got 0");
    }
}
