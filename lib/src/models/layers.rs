//! The trainable leaf layers a [`ModelSpec`](super::ModelSpec) is built from.
//!
//! Parameters are f32 `Var`s (the master weights). Under mixed precision each
//! layer casts its weights to the compute dtype with the differentiable
//! `to_dtype`, so gradients reach the f32 `Var`s; batch-norm runs in f32.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use rand::rngs::StdRng;
use rand::Rng;
use rand_distr::{Distribution, Normal, Uniform};

use super::spec::{Conv2d as ConvSpec, Grouping};
use crate::ops::{self, ConvParams};

/// How a forward pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Batch statistics and dropout (training) or running statistics (evaluation).
    pub train: bool,
    /// Whether batch-norm updates its running statistics. Off when a
    /// checkpointed segment is recomputed, so the statistics move once per step.
    pub update_stats: bool,
    /// The dtype convolutions and matmuls run in: f32, or f16/bf16 under mixed precision.
    pub compute: DType,
    /// Whether the pass records what backward needs. Candle tracks every op on
    /// a `Var`, so a forward over the weights as they are keeps every layer's
    /// output alive with the result; without gradients the layers read detached
    /// weights and each intermediate is freed once the next layer has used it.
    pub grad: bool,
}

impl Pass {
    pub fn train(compute: DType) -> Self {
        Pass { train: true, update_stats: true, compute, grad: true }
    }

    /// Inference: batch-norm on its running statistics, no gradients.
    pub fn eval(compute: DType) -> Self {
        Pass { train: false, update_stats: false, compute, grad: false }
    }

    /// A parameter or buffer as this pass reads it: tracked for backward, or detached.
    fn param(&self, var: &Var) -> Tensor {
        if self.grad {
            var.as_tensor().clone()
        } else {
            var.as_tensor().detach()
        }
    }

    /// The same pass, run again in backward: running statistics stay as they are.
    pub fn recompute(self) -> Self {
        Pass { update_stats: false, ..self }
    }
}

/// A named parameter or buffer, as it appears in a state dict (`layer1.0.conv1.weight`).
#[derive(Debug, Clone)]
pub struct Named {
    pub name: String,
    pub var: Var,
}

/// Where layers put their tensors while a network is built.
pub(crate) struct Builder<'a> {
    pub device: &'a Device,
    pub layers: super::lean_groups::Layers,
    pub rng: StdRng,
    pub params: Vec<Named>,
    pub buffers: Vec<Named>,
    /// `params.len()` after each stage was built.
    pub stage_ends: Vec<usize>,
}

impl Builder<'_> {
    fn tensor(&self, values: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_vec(values, shape, self.device)
    }

    fn param(&mut self, name: String, values: Vec<f32>, shape: &[usize]) -> Result<Var> {
        let var = Var::from_tensor(&self.tensor(values, shape)?)?;
        self.params.push(Named { name, var: var.clone() });
        Ok(var)
    }

    fn buffer(&mut self, name: String, tensor: Tensor) -> Result<Var> {
        let var = Var::from_tensor(&tensor)?;
        self.buffers.push(Named { name, var: var.clone() });
        Ok(var)
    }

    fn normal(&mut self, n: usize, std: f64) -> Result<Vec<f32>> {
        let dist = Normal::new(0.0, std).map_err(candle_core::Error::wrap)?;
        Ok((0..n).map(|_| dist.sample(&mut self.rng) as f32).collect())
    }

    fn uniform(&mut self, n: usize, bound: f64) -> Result<Vec<f32>> {
        let dist = Uniform::new_inclusive(-bound, bound).map_err(candle_core::Error::wrap)?;
        Ok((0..n).map(|_| dist.sample(&mut self.rng) as f32).collect())
    }

    pub fn seed_from(&mut self) -> u64 {
        self.rng.random()
    }
}

fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        Ok(t.clone())
    } else {
        t.to_dtype(dtype)
    }
}

#[derive(Debug)]
pub struct Conv {
    weight: Var,
    bias: Option<Var>,
    params: ConvParams,
}

impl Conv {
    /// torchvision's init: Kaiming normal (fan-out, ReLU gain) for the kernel; a
    /// bias, where there is one, uniform in +-1/sqrt(fan-in) as PyTorch's default.
    pub(crate) fn new(b: &mut Builder, name: &str, spec: ConvSpec, in_channels: usize) -> Result<Self> {
        let groups = match spec.grouping {
            Grouping::Dense => 1,
            Grouping::Depthwise => in_channels,
        };
        let (o, cg, k) = (spec.out_channels, in_channels / groups, spec.kernel);
        let fan_out = (o / groups * k * k) as f64;
        let values = b.normal(o * cg * k * k, (2.0 / fan_out).sqrt())?;
        let weight = b.param(format!("{name}.weight"), values, &[o, cg, k, k])?;
        let bias = if spec.bias {
            let values = b.uniform(o, 1.0 / ((cg * k * k) as f64).sqrt())?;
            Some(b.param(format!("{name}.bias"), values, &[o])?)
        } else {
            None
        };
        Ok(Conv { weight, bias, params: ConvParams { stride: spec.stride, padding: spec.padding, groups } })
    }

    /// The kernel as this pass convolves with it.
    pub(super) fn kernel(&self, pass: Pass) -> Result<Tensor> {
        cast(&pass.param(&self.weight), pass.compute)
    }

    pub(super) fn params(&self) -> ConvParams {
        self.params
    }

    pub(super) fn has_bias(&self) -> bool {
        self.bias.is_some()
    }

    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let y = ops::conv2d(x, &self.kernel(pass)?, self.params)?;
        match &self.bias {
            Some(bias) => {
                let bias = cast(&pass.param(bias), pass.compute)?;
                y.broadcast_add(&bias.reshape((1, (), 1, 1))?)
            }
            None => Ok(y),
        }
    }
}

/// Batch-norm over channels with PyTorch's defaults (momentum 0.1, eps 1e-5,
/// unbiased running variance). Its arithmetic is f32 whatever the input dtype;
/// the output has the input's dtype, so mixed precision needs no casts around it.
#[derive(Debug)]
pub struct BatchNorm {
    weight: Var,
    bias: Var,
    running_mean: Var,
    running_var: Var,
    num_batches_tracked: Var,
}

impl BatchNorm {
    const MOMENTUM: f64 = 0.1;
    pub(super) const EPS: f64 = 1e-5;

    /// Weight and bias as this pass reads them.
    pub(super) fn affine(&self, pass: Pass) -> (Tensor, Tensor) {
        (pass.param(&self.weight), pass.param(&self.bias))
    }

    pub(crate) fn new(b: &mut Builder, name: &str, channels: usize) -> Result<Self> {
        let device = b.device.clone();
        Ok(BatchNorm {
            weight: b.param(format!("{name}.weight"), vec![1.0; channels], &[channels])?,
            bias: b.param(format!("{name}.bias"), vec![0.0; channels], &[channels])?,
            running_mean: b.buffer(format!("{name}.running_mean"), Tensor::zeros(channels, DType::F32, &device)?)?,
            running_var: b.buffer(format!("{name}.running_var"), Tensor::ones(channels, DType::F32, &device)?)?,
            num_batches_tracked: b.buffer(format!("{name}.num_batches_tracked"), Tensor::zeros((), DType::I64, &device)?)?,
        })
    }

    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        if pass.train {
            let out = ops::batch_norm_train(x, &pass.param(&self.weight), &pass.param(&self.bias), Self::EPS)?;
            if pass.update_stats {
                self.update_running_stats(&out.stats)?;
            }
            return Ok(out.y);
        }
        let channels = self.weight.dim(0)?;
        let per_channel = |t: &Tensor| t.reshape((1, channels, 1, 1));
        let std = (pass.param(&self.running_var) + Self::EPS)?.sqrt()?;
        let y = cast(x, DType::F32)?
            .broadcast_sub(&per_channel(&pass.param(&self.running_mean))?)?
            .broadcast_div(&per_channel(&std)?)?
            .broadcast_mul(&per_channel(&pass.param(&self.weight))?)?
            .broadcast_add(&per_channel(&pass.param(&self.bias))?)?;
        cast(&y, x.dtype())
    }

    /// PyTorch's update: momentum-weighted, with the unbiased batch variance.
    pub(super) fn update_running_stats(&self, out: &ops::BatchStatistics) -> Result<()> {
        let m = Self::MOMENTUM;
        let n = out.count as f64;
        let unbiased = (&out.var * (n / (n - 1.0)))?;
        self.running_mean.set(&((self.running_mean.as_tensor() * (1.0 - m))? + (&out.mean * m)?)?)?;
        self.running_var.set(&((self.running_var.as_tensor() * (1.0 - m))? + (unbiased * m)?)?)?;
        self.num_batches_tracked.set(&(self.num_batches_tracked.as_tensor() + 1.0)?)
    }
}

#[derive(Debug)]
pub struct Linear {
    weight: Var,
    bias: Option<Var>,
}

impl Linear {
    /// PyTorch's default init: weight and bias uniform in +-1/sqrt(in_features).
    pub(crate) fn new(b: &mut Builder, name: &str, in_features: usize, out_features: usize, bias: bool) -> Result<Self> {
        let bound = 1.0 / (in_features as f64).sqrt();
        let values = b.uniform(out_features * in_features, bound)?;
        let weight = b.param(format!("{name}.weight"), values, &[out_features, in_features])?;
        let bias = if bias {
            let values = b.uniform(out_features, bound)?;
            Some(b.param(format!("{name}.bias"), values, &[out_features])?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// `x` is `N x in` or, for tokens, `N x tokens x in` (`ops::linear`).
    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let (w, bias) = self.params(pass)?;
        ops::linear(x, &w, bias.as_ref())
    }

    /// `forward(gelu(x))` as one op that keeps `x` (`ops::gelu_linear`).
    pub fn forward_through_gelu(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let (w, bias) = self.params(pass)?;
        ops::gelu_linear(x, &w, bias.as_ref())
    }

    /// `forward(x) + residual`, or `forward(gelu(x)) + residual` with
    /// `gelu`, as one op (`ops::linear_residual`, `gelu_linear_residual`).
    pub fn forward_adding(&self, x: &Tensor, residual: &Tensor, gelu: bool, pass: Pass) -> Result<Tensor> {
        let (w, bias) = self.params(pass)?;
        match gelu {
            true => ops::gelu_linear_residual(x, &w, bias.as_ref(), residual),
            false => ops::linear_residual(x, &w, bias.as_ref(), residual),
        }
    }

    /// The weight and bias in the pass's compute dtype.
    fn params(&self, pass: Pass) -> Result<(Tensor, Option<Tensor>)> {
        let w = cast(&pass.param(&self.weight), pass.compute)?;
        let bias = self.bias.as_ref().map(|b| cast(&pass.param(b), pass.compute)).transpose()?;
        Ok((w, bias))
    }
}

/// A transposed convolution whose stride is its kernel
/// (`ops::conv_transpose2d`), weight in PyTorch's `in x out x k x k` layout,
/// with PyTorch's default init: weight and bias uniform in +-1/sqrt(fan-in),
/// fan-in being `out x k x k` for a transposed convolution.
#[derive(Debug)]
pub struct ConvTranspose {
    weight: Var,
    bias: Option<Var>,
    kernel: usize,
}

impl ConvTranspose {
    pub(crate) fn new(b: &mut Builder, name: &str, in_channels: usize, out_channels: usize, kernel: usize, bias: bool) -> Result<Self> {
        let fan_in = out_channels * kernel * kernel;
        let bound = 1.0 / (fan_in as f64).sqrt();
        let values = b.uniform(in_channels * fan_in, bound)?;
        let weight = b.param(format!("{name}.weight"), values, &[in_channels, out_channels, kernel, kernel])?;
        let bias = if bias {
            let values = b.uniform(out_channels, bound)?;
            Some(b.param(format!("{name}.bias"), values, &[out_channels])?)
        } else {
            None
        };
        Ok(ConvTranspose { weight, bias, kernel })
    }

    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let w = cast(&pass.param(&self.weight), pass.compute)?;
        let bias = self.bias.as_ref().map(|b| cast(&pass.param(b), pass.compute)).transpose()?;
        ops::conv_transpose2d(x, &w, bias.as_ref(), self.kernel)
    }
}

/// Layer-norm over the last dimension (`ops::layer_norm`), PyTorch's init
/// (weight 1, bias 0). Its weight and bias stay f32 under mixed precision.
#[derive(Debug)]
pub struct LayerNorm {
    weight: Var,
    bias: Var,
    eps: f64,
}

impl LayerNorm {
    pub(crate) fn new(b: &mut Builder, name: &str, features: usize, eps: f64) -> Result<Self> {
        let weight = b.param(format!("{name}.weight"), vec![1.0; features], &[features])?;
        let bias = b.param(format!("{name}.bias"), vec![0.0; features], &[features])?;
        Ok(LayerNorm { weight, bias, eps })
    }

    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        ops::layer_norm(x, &pass.param(&self.weight), &pass.param(&self.bias), self.eps)
    }

    /// `linear.forward(self.forward(x))` as one op that keeps `x` (`ops::norm_linear`).
    pub fn read_by(&self, linear: &Linear, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let (w, bias) = linear.params(pass)?;
        ops::norm_linear(x, &pass.param(&self.weight), &pass.param(&self.bias), self.eps, &w, bias.as_ref())
    }
}

/// A vision transformer's entry as torchvision's `VisionTransformer` has it:
/// the patches' projection (weight truncated normal with std sqrt(1 /
/// fan-in), bias 0), the class token (0) and the positions (normal, std
/// 0.02), sized for the input the network is built for. All four sit under
/// the layer's name (`conv_proj.class_token`); the files use torchvision's
/// (`class_token`, `encoder.pos_embedding`).
#[derive(Debug)]
pub struct PatchEmbed {
    weight: Var,
    bias: Var,
    class_token: Var,
    positions: Var,
    patch: usize,
}

impl PatchEmbed {
    pub(crate) fn new(b: &mut Builder, name: &str, channels: usize, patch: usize, dim: usize, tokens: usize) -> Result<Self> {
        let fan_in = channels * patch * patch;
        let std = (1.0 / fan_in as f64).sqrt();
        let values = b.normal(dim * fan_in, std)?.into_iter().map(|v| v.clamp(-2.0 * std as f32, 2.0 * std as f32)).collect();
        let weight = b.param(format!("{name}.weight"), values, &[dim, channels, patch, patch])?;
        let bias = b.param(format!("{name}.bias"), vec![0.0; dim], &[dim])?;
        let class_token = b.param(format!("{name}.class_token"), vec![0.0; dim], &[1, 1, dim])?;
        let values = b.normal(tokens * dim, 0.02)?;
        let positions = b.param(format!("{name}.pos_embedding"), values, &[1, tokens, dim])?;
        Ok(PatchEmbed { weight, bias, class_token, positions, patch })
    }

    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let param = |v: &Var| cast(&pass.param(v), pass.compute);
        let p = ConvParams { stride: self.patch, padding: 0, groups: 1 };
        let grid = ops::conv2d(x, &param(&self.weight)?, p)?;
        let (n, dim, gh, gw) = grid.dims4()?;
        let patches = grid.reshape((n, dim, gh * gw))?.transpose(1, 2)?.contiguous()?.broadcast_add(&param(&self.bias)?)?;
        let class = param(&self.class_token)?.broadcast_as((n, 1, dim))?.contiguous()?;
        Tensor::cat(&[&class, &patches], 1)?.broadcast_add(&param(&self.positions)?)
    }
}

/// torchvision's `SqueezeExcitation`: pool, 1x1 conv, SiLU, 1x1 conv, sigmoid gate.
#[derive(Debug)]
pub struct SqueezeExcite {
    reduce: Conv,
    expand: Conv,
}

impl SqueezeExcite {
    pub(crate) fn new(b: &mut Builder, name: &str, channels: usize, squeeze: usize) -> Result<Self> {
        let conv = |out_channels| ConvSpec { out_channels, kernel: 1, stride: 1, padding: 0, grouping: Grouping::Dense, bias: true };
        Ok(SqueezeExcite {
            reduce: Conv::new(b, &format!("{name}.fc1"), conv(squeeze), channels)?,
            expand: Conv::new(b, &format!("{name}.fc2"), conv(channels), squeeze)?,
        })
    }

    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let pooled = global_avg_pool(x)?;
        let squeezed = ops::silu(&self.reduce.forward(&pooled, pass)?)?;
        let gate = candle_nn::ops::sigmoid(&self.expand.forward(&squeezed, pass)?)?;
        x.broadcast_mul(&gate)
    }
}

/// Mean over height and width, keeping them as 1 x 1.
pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
    x.mean_keepdim(D::Minus1)?.mean_keepdim(D::Minus2)
}

/// Inverted dropout with its own seeded generator, so a run is reproducible.
#[derive(Debug)]
pub struct Dropout {
    p: f64,
    rng: std::sync::Mutex<StdRng>,
}

impl Dropout {
    pub(crate) fn new(b: &mut Builder, p: f64) -> Self {
        use rand::SeedableRng;
        Dropout { p, rng: std::sync::Mutex::new(StdRng::seed_from_u64(b.seed_from())) }
    }

    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        if !pass.train || self.p == 0.0 {
            return Ok(x.clone());
        }
        let keep = 1.0 - self.p;
        let mask: Vec<f32> = {
            let mut rng = self.rng.lock().map_err(|_| candle_core::Error::Msg("dropout generator poisoned".into()))?;
            (0..x.elem_count()).map(|_| if rng.random::<f64>() < keep { (1.0 / keep) as f32 } else { 0.0 }).collect()
        };
        let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
        x.mul(&mask)
    }
}
