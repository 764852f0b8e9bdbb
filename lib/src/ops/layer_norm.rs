//! Layer-norm over the last dimension as one op, the vision transformer's
//! norm. The forward reads each row twice (mean and variance, then the
//! output) and keeps nothing but its operands: backward computes each row's
//! statistics again from the input, which the layer before keeps anyway,
//! where candle's elementwise ops would keep a dozen full-size
//! intermediates.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, D};
use rayon::prelude::*;

use super::cpu::floats::{f32_view, storage_from_f32};
use super::cuda::{self, layer_norm_backward, on_body, Body};
use super::{checked_gradients, uses_own_kernels, OpError};

const OP: &str = "layer_norm";

/// Rows a task normalises: the weight and bias gradients are summed per task, then across tasks.
pub(super) const ROWS: usize = 64;

/// `y = (x - mean) / sqrt(var + eps) * weight + bias` over `x`'s last
/// dimension, `weight` and `bias` holding one value per feature. `y` has
/// `x`'s dtype; the arithmetic is f32. In f32, f16 and bf16 it is our op, on
/// the CPU and on CUDA (our kernels, `lib/kernels/transformer.cu`, which take
/// the weight and bias in f32: half ones are cast first); elsewhere it is
/// composed from candle's operations (which keep their intermediates for
/// backward).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let features = x.dim(D::Minus1)?;
    for (what, t) in [("weight", weight), ("bias", bias)] {
        if t.dims() != [features] {
            Err(OpError::PerFeature { what, features, dims: t.dims().to_vec() })?
        }
    }
    if features == 0 {
        Err(OpError::Zero { op: OP, what: "the last dimension" })?
    }
    if !uses_own_kernels(x) {
        return composed(x, weight, bias, eps);
    }
    let (weight, bias) = match Body::of(x) {
        Some(_) => (weight.to_dtype(DType::F32)?, bias.to_dtype(DType::F32)?),
        None => (weight.clone(), bias.clone()),
    };
    x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, LayerNorm { eps: eps as f32, features })
}

pub(super) fn composed(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let centred = x32.broadcast_sub(&x32.mean_keepdim(D::Minus1)?)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let normalised = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
    let y = normalised.broadcast_mul(&weight.to_dtype(DType::F32)?)?.broadcast_add(&bias.to_dtype(DType::F32)?)?;
    y.to_dtype(x.dtype())
}

pub(super) struct LayerNorm {
    eps: f32,
    features: usize,
}

impl LayerNorm {
    pub(super) fn on_device(&self) -> cuda::LayerNorm {
        cuda::LayerNorm { features: self.features, eps: self.eps }
    }

    fn device_forward<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 3]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, 3>(OP, operands, |p, args| cuda::layer_norm_forward(p, self.on_device(), args))
    }
}

/// A row's mean and `1 / sqrt(var + eps)`, the variance from the centred values.
fn statistics(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = row.iter().sum::<f32>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        OP
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
            return self.device_forward::<cuda::Reference>([(s1, l1), (s2, l2), (s3, l3)]);
        }
        let x = f32_view(OP, s1, l1)?;
        let (weight, bias) = (f32_view(OP, s2, l2)?, f32_view(OP, s3, l3)?);
        let mut y = vec![0f32; x.len()];
        let d = self.features;
        y.par_chunks_mut(d * ROWS).zip(x.par_chunks(d * ROWS)).for_each(|(y, x)| {
            for (y, x) in y.chunks_mut(d).zip(x.chunks(d)) {
                normalise_row(x, &weight, &bias, self.eps, y);
            }
        });
        Ok((storage_from_f32(OP, y, s1.dtype())?, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.device_forward::<cuda::Cudnn>([(s1, l1), (s2, l2), (s3, l3)])
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dx, dweight, dbias] = self.gradients(x, weight, grad)?;
        let [dx, dweight, dbias] = checked_gradients(OP, [x, weight, bias], [Some(dx), Some(dweight), Some(dbias)])?;
        Ok((dx, dweight, dbias))
    }
}

impl LayerNorm {
    pub(super) fn new(features: usize, eps: f64) -> Self {
        LayerNorm { eps: eps as f32, features }
    }

    /// `layer_norm(x, weight, bias)` without a graph, on `x`'s body (the weight and bias f32).
    pub(super) fn normalised(&self, x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
        x.apply_op3_no_bwd(weight, bias, self)
    }

    /// The gradients of the input, weight and bias, in the input's and the weight's dtypes.
    pub(super) fn gradients(&self, x: &Tensor, weight: &Tensor, grad: &Tensor) -> Result<[Tensor; 3]> {
        let grad = grad.contiguous()?;
        if let Some(body) = Body::of(x) {
            return on_body!(body, layer_norm_backward(self.on_device(), x, weight, &grad));
        }
        let (dx, dweight, dbias) = {
            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = weight.storage_and_layout();
            let (gs, gl) = grad.storage_and_layout();
            let (Storage::Cpu(xs), Storage::Cpu(ws), Storage::Cpu(gs)) = (&*xs, &*ws, &*gs) else {
                Err(OpError::NotOnCpu { op: OP, device: format!("{:?}", x.device()) })?
            };
            let x32 = f32_view(OP, xs, xl)?;
            let (w32, g32) = (f32_view(OP, ws, wl)?, f32_view(OP, gs, gl)?);
            backward(&x32, &w32, &g32, self.features, self.eps)
        };
        let dx = Tensor::from_vec(dx, x.shape(), x.device())?.to_dtype(x.dtype())?;
        let dweight = Tensor::from_vec(dweight, weight.shape(), weight.device())?.to_dtype(weight.dtype())?;
        let dbias = Tensor::from_vec(dbias, weight.shape(), weight.device())?.to_dtype(weight.dtype())?;
        Ok([dx, dweight, dbias])
    }
}

/// One row normalised into `y`: `(x - mean) * rstd * weight + bias`.
pub(super) fn normalise_row(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, y: &mut [f32]) {
    let (mean, rstd) = statistics(x, eps);
    for (((y, &x), &w), &b) in y.iter_mut().zip(x).zip(weight).zip(bias) {
        *y = (x - mean) * rstd * w + b;
    }
}

/// The input, weight and bias gradients: with `x̂ = (x - mean) * rstd` and
/// `g = grad * weight`, `dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))`,
/// `dweight = Σ grad * x̂` and `dbias = Σ grad` over the rows.
fn backward(x: &[f32], weight: &[f32], grad: &[f32], d: usize, eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dx = vec![0f32; x.len()];
    let partial = dx
        .par_chunks_mut(d * ROWS)
        .zip(x.par_chunks(d * ROWS))
        .zip(grad.par_chunks(d * ROWS))
        .map(|((dx, x), grad)| {
            let (mut dweight, mut dbias) = (vec![0f32; d], vec![0f32; d]);
            for ((dx, x), grad) in dx.chunks_mut(d).zip(x.chunks(d)).zip(grad.chunks(d)) {
                let (mean, rstd) = statistics(x, eps);
                let (mut sum_g, mut sum_gx) = (0f32, 0f32);
                for i in 0..d {
                    let normalised = (x[i] - mean) * rstd;
                    let g = grad[i] * weight[i];
                    sum_g += g;
                    sum_gx += g * normalised;
                    dweight[i] += grad[i] * normalised;
                    dbias[i] += grad[i];
                }
                let (mean_g, mean_gx) = (sum_g / d as f32, sum_gx / d as f32);
                for i in 0..d {
                    let normalised = (x[i] - mean) * rstd;
                    dx[i] = rstd * (grad[i] * weight[i] - mean_g - normalised * mean_gx);
                }
            }
            (dweight, dbias)
        })
        .reduce(
            || (vec![0f32; d], vec![0f32; d]),
            |(mut w, mut b), (w2, b2)| {
                w.iter_mut().zip(&w2).for_each(|(a, b)| *a += b);
                b.iter_mut().zip(&b2).for_each(|(a, c)| *a += c);
                (w, b)
            },
        );
    (dx, partial.0, partial.1)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::ops::tests::randn;

    fn reference(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
        composed(x, w, b, 1e-6).unwrap()
    }

    fn close(a: &Tensor, b: &Tensor, tolerance: f32) {
        let (a, b) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
        let scale = b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1e-12);
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff <= tolerance * scale, "differ by {diff} of {scale}");
    }

    #[test]
    fn forward_and_gradients_match_the_composed_layer_norm() {
        for dims in [vec![3usize, 5, 7], vec![2, 197, 192], vec![1, 1, 1], vec![130, 64]] {
            let d = *dims.last().unwrap();
            let x = Var::from_tensor(&randn(&dims).affine(2.0, 0.5).unwrap()).unwrap();
            let w = Var::from_tensor(&randn(&[d]).affine(0.3, 1.0).unwrap()).unwrap();
            let b = Var::from_tensor(&randn(&[d]).affine(0.3, 0.0).unwrap()).unwrap();
            let probe = randn(&dims);
            let ours = layer_norm(&x, &w, &b, 1e-6).unwrap();
            let theirs = reference(&x, &w, &b);
            close(&ours, &theirs, 1e-5);
            let g1 = (ours * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (theirs * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &w, &b] {
                close(g1.get(v).unwrap(), g2.get(v).unwrap(), 1e-4);
            }
        }
    }

    #[test]
    fn half_input_gives_half_output_close_to_f32() {
        let x = randn(&[4, 9, 48]);
        let (w, b) = (Tensor::ones(48, DType::F32, &Device::Cpu).unwrap(), Tensor::zeros(48, DType::F32, &Device::Cpu).unwrap());
        let half = layer_norm(&x.to_dtype(DType::F16).unwrap(), &w, &b, 1e-6).unwrap();
        assert_eq!(half.dtype(), DType::F16);
        close(&half, &layer_norm(&x, &w, &b, 1e-6).unwrap(), 2e-3);
    }

    #[test]
    fn a_weight_of_the_wrong_size_is_refused_by_name() {
        let x = Tensor::zeros((2, 3, 8), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::ones(7, DType::F32, &Device::Cpu).unwrap();
        let err = layer_norm(&x, &w, &w, 1e-6).unwrap_err().to_string();
        assert!(err.contains("layer_norm: weight must hold one value per feature (8), got shape [7]"), "{err}");
    }
}
