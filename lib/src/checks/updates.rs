//! `vramlab check-ops`'s optimizer checks: three updates of parameters of
//! ResNet-18's shapes from the same gradients, on the target against the
//! CPU. On CUDA that is the multi-tensor kernels (`lib/kernels/optim.cu`)
//! against the CPU's fused updates, on the reference the kernels' twins on
//! host memory against the same; on the CPU, the fused updates against
//! candle's per-tensor ops.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use super::ops::{normalised_error, Check, CheckTarget, CheckedDtype, Pass};
use crate::train::optim::{Adam, AdamConfig, AdamW, AdamWConfig, OptimError, Optimizer, Sgd, SgdConfig};

/// The stem's convolution and its batch-norm, a 3x3 convolution of layer2,
/// the classifier's weight and bias.
const SHAPES: [&[usize]; 5] = [&[64, 3, 7, 7], &[64], &[128, 64, 3, 3], &[10, 512], &[10]];
const STEPS: usize = 3;
/// Both sides compute the same f32 arithmetic in the same order (the kernels
/// are compiled without fused multiply-adds): what is left is the rounding
/// of a square root or a division, a few units in the last place.
pub const TOLERANCE: f64 = 1e-6;

type Build = fn(Vec<Var>, bool) -> Result<Box<dyn Optimizer>, OptimError>;

fn optimizers() -> [(&'static str, &'static str, Build); 4] {
    [
        ("sgd", "momentum 0.9, weight decay 1e-4", |vars, per_tensor| {
            let sgd = Sgd::new(vars, SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 1e-4, ..SgdConfig::default() })?;
            Ok(Box::new(if per_tensor { sgd.unfused() } else { sgd }))
        }),
        ("sgd", "Nesterov momentum 0.9", |vars, per_tensor| {
            let sgd = Sgd::new(vars, SgdConfig { lr: 0.1, momentum: 0.9, nesterov: true, ..SgdConfig::default() })?;
            Ok(Box::new(if per_tensor { sgd.unfused() } else { sgd }))
        }),
        ("adam", "PyTorch's defaults, weight decay 1e-4", |vars, per_tensor| {
            let adam = Adam::new(vars, AdamConfig { weight_decay: 1e-4, ..AdamConfig::default() })?;
            Ok(Box::new(if per_tensor { adam.unfused() } else { adam }))
        }),
        ("adamw", "weight decay 0.01, AMSGrad", |vars, per_tensor| {
            let adamw = AdamW::new(vars, AdamWConfig { amsgrad: true, ..AdamWConfig::default() })?;
            Ok(Box::new(if per_tensor { adamw.unfused() } else { adamw }))
        }),
    ]
}

/// Parameters and each step's gradients, drawn from a fixed seed.
fn draw() -> candle_core::Result<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(39);
    let normal = Normal::new(0.0f32, 1.0).map_err(candle_core::Error::wrap)?;
    let mut tensor = |shape: &[usize]| {
        let values: Vec<f32> = (0..shape.iter().product()).map(|_| normal.sample(&mut rng)).collect();
        Tensor::from_vec(values, shape, &Device::Cpu)
    };
    let params = SHAPES.iter().map(|s| tensor(s)).collect::<candle_core::Result<Vec<_>>>()?;
    let grads = (0..STEPS).map(|_| SHAPES.iter().map(|s| tensor(s)).collect()).collect::<candle_core::Result<Vec<_>>>()?;
    Ok((params, grads))
}

/// A gradient store holding exactly `grads` for `vars`.
fn grad_store(vars: &[Var], grads: &[Tensor], device: &Device) -> candle_core::Result<GradStore> {
    let mut loss = Tensor::zeros((), DType::F32, device)?;
    for var in vars {
        loss = (loss + var.as_tensor().sum_all()?)?;
    }
    let mut store = loss.backward()?;
    for (var, g) in vars.iter().zip(grads) {
        store.insert(var, g.to_device(device)?);
    }
    Ok(store)
}

/// The parameters after `STEPS` updates on `device`, flattened on the CPU.
fn run(build: Build, per_tensor: bool, device: &Device, params: &[Tensor], grads: &[Vec<Tensor>]) -> Result<Vec<f32>, OptimError> {
    let vars = params.iter().map(|p| Var::from_tensor(&p.to_device(device)?)).collect::<candle_core::Result<Vec<_>>>()?;
    let mut optimizer = build(vars.clone(), per_tensor)?;
    for step in grads {
        optimizer.step(&grad_store(&vars, step, device)?)?;
    }
    let flat = vars.iter().map(|v| v.as_tensor().flatten_all()?.to_device(&Device::Cpu)).collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&flat, 0)?.to_vec1()?)
}

/// One check per optimizer: on CUDA and on the reference the multi-tensor
/// update against the CPU's fused one, on the CPU the fused update against
/// the per-tensor ops.
pub fn check_updates(target: &CheckTarget) -> Vec<Check> {
    let shape = format!("{} tensors of ResNet-18's, {STEPS} steps", SHAPES.len());
    optimizers()
        .into_iter()
        .map(|(op, case, build)| {
            let compared = (|| -> Result<f64, OptimError> {
                let (params, grads) = draw()?;
                let ours = match target {
                    CheckTarget::Reference => crate::ops::on_reference(|| run(build, false, &Device::Cpu, &params, &grads))?,
                    _ => run(build, false, target.device(), &params, &grads)?,
                };
                let per_tensor = matches!(target, CheckTarget::Cpu);
                let reference = run(build, per_tensor, &Device::Cpu, &params, &grads)?;
                Ok(normalised_error(&ours, &reference))
            })();
            let (error, failure) = match compared {
                Ok(error) => (Some(error), None),
                Err(err) => (None, Some(err.to_string())),
            };
            Check {
                op,
                case: case.to_owned(),
                shape: shape.clone(),
                dtype: CheckedDtype::F32,
                pass: Pass::Step,
                ok: failure.is_none() && error.is_some_and(|e| e <= TOLERANCE),
                error,
                tolerance: TOLERANCE,
                failure,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fused_updates_match_the_per_tensor_ops_on_the_cpu() {
        let checks = check_updates(&CheckTarget::Cpu);
        assert_eq!(checks.len(), 4);
        for c in &checks {
            assert!(c.ok, "{c:?}");
        }
    }

    #[test]
    fn a_wrong_learning_rate_is_caught() {
        let (params, grads) = draw().unwrap();
        let [(_, _, sgd), ..] = optimizers();
        let ours = run(sgd, false, &Device::Cpu, &params, &grads).unwrap();
        let other = params.iter().map(|p| Var::from_tensor(p).unwrap()).collect::<Vec<_>>();
        let mut optimizer =
            Sgd::new(other.clone(), SgdConfig { lr: 0.1001, momentum: 0.9, weight_decay: 1e-4, ..SgdConfig::default() }).unwrap();
        for step in &grads {
            optimizer.step(&grad_store(&other, step, &Device::Cpu).unwrap()).unwrap();
        }
        let flat: Vec<Tensor> = other.iter().map(|v| v.as_tensor().flatten_all().unwrap()).collect();
        let wrong: Vec<f32> = Tensor::cat(&flat, 0).unwrap().to_vec1().unwrap();
        assert!(normalised_error(&wrong, &ours) > 100.0 * TOLERANCE);
    }
}
