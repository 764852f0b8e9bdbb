//! SiLU, vectorised: the formulas candle's `silu` and its backward use,
//! with `e^x` computed by a polynomial the compiler turns into SIMD code
//! instead of one call of the C library's `expf` per element (a tenth of an
//! EfficientNet-B0 step). The slice functions are compiled for AVX-512, for
//! AVX2 with FMA and for the baseline, and pick one at run time; the lean
//! ops call them, and [`Silu`] is the plain layers' op, so that the two
//! paths compute the same values.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::floats::{f32_view, storage_from_f32};
use super::cpu::silu::{exp_of_negated, silu_backward, silu_in_place};
use super::cpu::CHUNK;
use super::cuda::{self, Reference};
use super::{checked_gradients, OpError};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

/// SiLU as a candle op on the CPU: computed in f32 and stored in the
/// input's dtype; backward keeps the input and the output, as candle's
/// `silu` does.
pub(super) struct Silu;

impl CustomOp1 for Silu {
    fn name(&self) -> &'static str {
        "silu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return cuda::forward::<Reference, 1>(self.name(), [(storage, layout)], |p, [x]| cuda::silu_forward(p, x));
        }
        let mut values = f32_view(self.name(), storage, layout)?.into_owned();
        values.par_chunks_mut(CHUNK).for_each(silu_in_place);
        Ok((storage_from_f32(self.name(), values, storage.dtype())?, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::forward::<cuda::Cudnn, 1>(self.name(), [(storage, layout)], |p, [x]| cuda::silu_forward(p, x))
    }

    fn bwd(&self, x: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let [dx] = checked_gradients(self.name(), [x], [Some(x.apply_op3_no_bwd(out, &grad.contiguous()?, &SiluGrad)?)])?;
        Ok(dx)
    }
}

/// `(x, silu(x), grad_out) -> grad_x`.
struct SiluGrad;

impl SiluGrad {
    fn on_device<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 3]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, 3>("silu-grad", operands, |p, [x, y, dy]| cuda::silu_backward(p, x, y, dy))
    }
}

impl CustomOp3 for SiluGrad {
    fn name(&self) -> &'static str {
        "silu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(s1, l1), (s2, l2), (s3, l3)]);
        }
        if s1.dtype() != s3.dtype() {
            Err(OpError::DTypeMismatch { op: self.name(), input: s1.dtype(), other: s3.dtype() })?
        }
        let (x, out) = (f32_view(self.name(), s1, l1)?, f32_view(self.name(), s2, l2)?);
        let mut grad = f32_view(self.name(), s3, l3)?.into_owned();
        grad.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).zip(out.par_chunks(CHUNK)).for_each(|((grad, x), out)| {
            let mut exp_neg = vec![0.0; x.len()];
            exp_of_negated(x, &mut exp_neg);
            silu_backward(grad, &exp_neg, out);
        });
        Ok((storage_from_f32(self.name(), grad, s3.dtype())?, l3.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2), (s3, l3)])
    }
}
