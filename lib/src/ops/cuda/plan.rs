//! What the ops ask of cuDNN, as plain data computed on the host: each
//! descriptor's dimensions and strides, the grouped filter, the pooling
//! window, batch-norm's per-channel shape, the keys of the plan cache and the
//! choice of an algorithm within the workspace. The cuda feature's
//! `cudnn::device` turns these into descriptors and calls; everything here is
//! tested without a GPU.

use std::collections::HashMap;
use std::hash::Hash;

use candle_core::DType;

use super::super::conv_geometry::Geometry as ConvGeometry;
use super::super::pool::Geometry as PoolGeometry;
use super::super::OpError;

/// The element types our cuDNN calls take (f32 parameters and statistics
/// whatever the tensors' type, as cuDNN's batch-norm requires).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Element {
    F32,
    F16,
    Bf16,
}

impl Element {
    pub fn of(op: &'static str, dtype: DType) -> Result<Self, OpError> {
        match dtype {
            DType::F32 => Ok(Element::F32),
            DType::F16 => Ok(Element::F16),
            DType::BF16 => Ok(Element::Bf16),
            dtype => Err(OpError::UnsupportedDType { op, dtype }),
        }
    }

    /// The convolutions' math: tensor cores for half precision; for f32 the
    /// default, which lets cuDNN use TF32 tensor cores on Ampere and later,
    /// as PyTorch's default (`torch.backends.cudnn.allow_tf32 = True`) does.
    pub fn math(self) -> Math {
        match self {
            Element::F32 => Math::DefaultAllowingTf32,
            Element::F16 | Element::Bf16 => Math::TensorCores,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Math {
    DefaultAllowingTf32,
    TensorCores,
}

/// A 4-D tensor descriptor: `N x C x H x W` and its element strides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorDims {
    pub dims: [i32; 4],
    pub strides: [i32; 4],
}

impl TensorDims {
    /// A contiguous NCHW tensor; cuDNN takes `int` dimensions and strides, so
    /// a tensor of 2^31 elements or more is refused.
    pub fn packed(op: &'static str, [n, c, h, w]: [usize; 4]) -> Result<Self, OpError> {
        let elements = [n, c, h, w].iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let fits = |v: usize| i32::try_from(v).is_ok();
        match elements {
            Some(e) if fits(e) => {
                let i = |v: usize| v as i32;
                Ok(TensorDims { dims: [i(n), i(c), i(h), i(w)], strides: [i(c * h * w), i(h * w), i(w), 1] })
            }
            _ => Err(OpError::TooLargeForCudnn { op, dims: vec![n, c, h, w] }),
        }
    }

    /// One value per channel of a tensor of `channels` channels: batch-norm's
    /// scale, bias, mean and variance.
    pub fn per_channel(op: &'static str, channels: usize) -> Result<Self, OpError> {
        Self::packed(op, [1, channels, 1, 1])
    }

    pub fn elements(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }
}

/// A convolution's descriptors: input, grouped filter (`O x C/groups x K x
/// K`, so that a depthwise layer is one call), output, and the convolution's
/// padding, stride, dilation and group count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvDims {
    pub x: TensorDims,
    pub filter: [i32; 4],
    pub y: TensorDims,
    pub padding: [i32; 2],
    pub stride: [i32; 2],
    pub dilation: [i32; 2],
    pub groups: i32,
}

impl ConvDims {
    pub fn of(g: &ConvGeometry) -> Result<Self, OpError> {
        let op = "conv2d";
        let x = TensorDims::packed(op, [g.batch, g.channels, g.height, g.width])?;
        let y = TensorDims::packed(op, [g.batch, g.out_channels, g.out_h, g.out_w])?;
        let filter = TensorDims::packed(op, [g.out_channels, g.in_per_group(), g.kernel_h, g.kernel_w])?.dims;
        let (padding, stride) = (g.padding as i32, g.stride as i32);
        Ok(ConvDims { x, filter, y, padding: [padding; 2], stride: [stride; 2], dilation: [1, 1], groups: g.groups as i32 })
    }
}

/// A max-pool's descriptors: input, output, and the square window's size,
/// padding and stride.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolDims {
    pub x: TensorDims,
    pub y: TensorDims,
    pub window: [i32; 2],
    pub padding: [i32; 2],
    pub stride: [i32; 2],
}

impl PoolDims {
    pub fn of(g: &PoolGeometry) -> Result<Self, OpError> {
        let op = "max_pool2d";
        let x = TensorDims::packed(op, [g.batch, g.channels, g.height, g.width])?;
        let y = TensorDims::packed(op, [g.batch, g.channels, g.out_h, g.out_w])?;
        let (k, p, s) = (g.kernel as i32, g.padding as i32, g.stride as i32);
        Ok(PoolDims { x, y, window: [k; 2], padding: [p; 2], stride: [s; 2] })
    }
}

/// A spatial batch-norm's descriptors: the maps and the per-channel values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NormDims {
    pub x: TensorDims,
    pub per_channel: TensorDims,
}

impl NormDims {
    pub fn of(op: &'static str, [n, c, h, w]: [usize; 4]) -> Result<Self, OpError> {
        Ok(NormDims { x: TensorDims::packed(op, [n, c, h, w])?, per_channel: TensorDims::per_channel(op, c)? })
    }
}

/// cuDNN's running variance is the unbiased one (divided by `count - 1`,
/// `count` values per channel); this factor turns it into the biased
/// variance our statistics report.
pub fn biased_from_unbiased(count: usize) -> f64 {
    (count as f64 - 1.0) / count as f64
}

/// One of the algorithms cuDNN's heuristics return for a convolution pass,
/// in their order: whether it can run this problem, and its workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<A> {
    pub algo: A,
    pub supported: bool,
    pub workspace: u64,
}

/// The algorithm a pass runs with, and the workspace it uses of the device's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice<A> {
    pub algo: A,
    pub workspace: u64,
    /// Where it stood in the heuristics' order (0: their first choice).
    pub rank: usize,
}

/// The first of the heuristics' candidates, in their order, that supports
/// the problem and fits in `cap` bytes of workspace; `None` when none does.
pub fn choose<A: Copy>(candidates: &[Candidate<A>], cap: u64) -> Option<Choice<A>> {
    candidates.iter().enumerate().find(|(_, c)| c.supported && c.workspace <= cap).map(|(rank, c)| Choice {
        algo: c.algo,
        workspace: c.workspace,
        rank,
    })
}

/// The three passes of a convolution, each with its own algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvPass {
    Forward,
    InputGradient,
    WeightGradient,
}

impl ConvPass {
    #[cfg(feature = "cuda")]
    pub fn name(self) -> &'static str {
        match self {
            ConvPass::Forward => "forward",
            ConvPass::InputGradient => "input gradient",
            ConvPass::WeightGradient => "weight gradient",
        }
    }
}

/// What a plan is cached under: the pass, the shapes and the element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvKey {
    pub pass: ConvPass,
    pub dims: ConvDims,
    pub element: Element,
}

/// Plans made once per key and kept: descriptors are created and algorithms
/// searched only the first time a shape is seen, so a step after the first
/// creates none. `made` counts the plans made, for the tests and the report.
#[derive(Debug)]
pub struct PlanCache<K, P> {
    plans: HashMap<K, P>,
    made: usize,
}

impl<K: Eq + Hash, P> Default for PlanCache<K, P> {
    fn default() -> Self {
        PlanCache { plans: HashMap::new(), made: 0 }
    }
}

impl<K: Eq + Hash + Copy, P> PlanCache<K, P> {
    /// The plan for `key`, made by `make` the first time.
    pub fn get_or_make<E>(&mut self, key: K, make: impl FnOnce(&K) -> Result<P, E>) -> Result<&P, E> {
        if !self.plans.contains_key(&key) {
            let plan = make(&key)?;
            self.made += 1;
            self.plans.insert(key, plan);
        }
        Ok(&self.plans[&key])
    }

    pub fn made(&self) -> usize {
        self.made
    }

    #[cfg(feature = "cuda")]
    pub fn plans(&self) -> impl Iterator<Item = (&K, &P)> {
        self.plans.iter()
    }
}
