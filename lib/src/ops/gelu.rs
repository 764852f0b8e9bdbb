//! GELU with the error function, `x/2 (1 + erf(x / sqrt 2))`, the vision
//! transformer's activation (PyTorch's `nn.GELU()`), as one op: it keeps its
//! input for backward, which computes the derivative again from it, where
//! candle's `gelu_erf` keeps the input and the output and its backward
//! records eight full-size intermediates.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use multiversion::multiversion;
use rayon::prelude::*;

use super::cpu::floats::{f32_view, storage_from_f32};
use super::cpu::silu::exp;
use super::cpu::CHUNK;
use super::cuda::{self, Reference};
use super::{checked_gradients, uses_own_kernels, OpError};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

/// In f32, f16 and bf16 our op (computed in f32, rounded once), on the CPU
/// and on CUDA (our kernel, `lib/kernels/transformer.cu`); elsewhere
/// candle's `gelu_erf`.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if !uses_own_kernels(x) {
        return x.gelu_erf();
    }
    x.contiguous()?.apply_op1(Gelu)
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return cuda::forward::<Reference, 1>(self.name(), [(storage, layout)], |p, [x]| cuda::gelu_forward(p, x));
        }
        let mut values = f32_view(self.name(), storage, layout)?.into_owned();
        values.par_chunks_mut(CHUNK).for_each(gelu_in_place);
        Ok((storage_from_f32(self.name(), values, storage.dtype())?, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::forward::<cuda::Cudnn, 1>(self.name(), [(storage, layout)], |p, [x]| cuda::gelu_forward(p, x))
    }

    fn bwd(&self, x: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let [dx] = checked_gradients(self.name(), [x], [Some(x.apply_op2_no_bwd(&grad.contiguous()?, &GeluGrad)?)])?;
        Ok(dx)
    }
}

/// `(x, grad_out) -> grad_x`.
struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "gelu-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return cuda::forward::<Reference, 2>(self.name(), [(s1, l1), (s2, l2)], |p, [x, dy]| cuda::gelu_backward(p, x, dy));
        }
        if s1.dtype() != s2.dtype() {
            Err(OpError::DTypeMismatch { op: self.name(), input: s1.dtype(), other: s2.dtype() })?
        }
        let x = f32_view(self.name(), s1, l1)?;
        let mut grad = f32_view(self.name(), s2, l2)?.into_owned();
        grad.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(grad, x)| gelu_backward(grad, x));
        Ok((storage_from_f32(self.name(), grad, s2.dtype())?, l2.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::forward::<cuda::Cudnn, 2>(self.name(), [(s1, l1), (s2, l2)], |p, [x, dy]| cuda::gelu_backward(p, x, dy))
    }
}

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2 pi)`, the standard normal density at 0.
const NORMAL_DENSITY_AT_0: f32 = 0.398_942_3;

#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
pub(super) fn gelu_in_place(values: &mut [f32]) {
    for v in values {
        *v *= normal_cdf_and_gaussian(*v).0;
    }
}

/// `out[i] = gelu(x[i])`: one pass where a copy and [`gelu_in_place`] would take two.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
pub(super) fn gelu_into(x: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o = x * normal_cdf_and_gaussian(x).0;
    }
}

/// `grad[i] *= Φ(x) + x φ(x)`, GELU's derivative.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
pub(super) fn gelu_backward(grad: &mut [f32], x: &[f32]) {
    for (g, &x) in grad.iter_mut().zip(x) {
        let (cdf, gaussian) = normal_cdf_and_gaussian(x);
        *g *= cdf + x * NORMAL_DENSITY_AT_0 * gaussian;
    }
}

/// `Φ(x)`, the standard normal distribution, through `erf(x / sqrt 2)`
/// within 1.5e-7 (Abramowitz and Stegun 7.1.26), and `e^(-x^2 / 2)`, which
/// that formula computes on the way and the density is a multiple of: one
/// exponential for both, without a branch or a call, so that the loops over
/// it vectorise.
#[inline(always)]
fn normal_cdf_and_gaussian(x: f32) -> (f32, f32) {
    let a = (x * FRAC_1_SQRT_2).abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t * (0.254_829_6 + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152_1 + t * 1.061_405_4))));
    let gaussian = exp(-a * a);
    let erf = (1.0 - poly * gaussian).copysign(x);
    (0.5 * (1.0 + erf), gaussian)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::ops::tests::randn;

    #[test]
    fn gelu_and_its_gradient_match_candles_gelu_erf() {
        let x: Vec<f32> = (0..8193).map(|i| (i as f32 - 4096.0) * 0.003).collect();
        let x = Var::from_vec(x, 8193, &Device::Cpu).unwrap();
        let ours = gelu(&x).unwrap();
        let theirs = x.gelu_erf().unwrap();
        let diff = (&ours - &theirs).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        // Values reach 12.3, where one f32 ulp is 9.5e-7.
        assert!(diff < 1e-6, "forward differs by {diff}");
        let g1 = ours.sum_all().unwrap().backward().unwrap();
        let g2 = theirs.sum_all().unwrap().backward().unwrap();
        let (g1, g2) = (g1.get(&x).unwrap(), g2.get(&x).unwrap());
        let diff = (g1 - g2).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        // candle's backward rounds 1/sqrt(2 pi) to 0.398942.
        assert!(diff < 2e-6, "gradient differs by {diff}");
    }

    #[test]
    fn half_input_gives_half_output() {
        let x = (randn(&[3, 50]) * 2.0).unwrap();
        let half = gelu(&x.to_dtype(DType::F16).unwrap()).unwrap();
        assert_eq!(half.dtype(), DType::F16);
        let diff =
            (half.to_dtype(DType::F32).unwrap() - gelu(&x).unwrap()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-2, "{diff}");
    }
}
