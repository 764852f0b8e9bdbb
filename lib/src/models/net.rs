//! A [`ModelSpec`] made trainable: the same layer list the ledger reads,
//! built into Candle modules with named parameters by a fold of the walk.

use std::fmt;

use candle_core::{Device, Result, Tensor};
use rand::SeedableRng;

use super::cost::Cost;
use super::layers::{global_avg_pool, BatchNorm, Builder, Conv, Dropout, Linear, Named, Pass, SqueezeExcite};
use super::precision::Precision;
use super::rules;
use super::shape::Shape;
use super::spec::{ModelSpec, Op, Stage};
use super::walk::{walk, Block, Fold, Shortcut, Site};
use super::ModelError;
use crate::ops;

#[derive(Debug)]
pub(super) enum Module {
    Conv(Conv),
    BatchNorm(BatchNorm),
    Relu,
    Silu,
    MaxPool { kernel: usize, stride: usize, padding: usize },
    GlobalAvgPool,
    Flatten,
    // Boxed: its generator is larger than every other module.
    Dropout(Box<Dropout>),
    Linear(Linear),
    SqueezeExcite(SqueezeExcite),
    Block(Box<Block<Module>>),
}

impl Module {
    fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        match self {
            Module::Conv(conv) => conv.forward(x, pass),
            Module::BatchNorm(bn) => bn.forward(x, pass),
            Module::Relu => x.relu(),
            Module::Silu => x.silu(),
            Module::MaxPool { kernel, stride, padding } => ops::max_pool2d(x, *kernel, *stride, *padding),
            Module::GlobalAvgPool => global_avg_pool(x),
            Module::Flatten => x.flatten_from(1),
            Module::Dropout(dropout) => dropout.forward(x, pass),
            Module::Linear(linear) => linear.forward(x, pass),
            Module::SqueezeExcite(se) => se.forward(x, pass),
            Module::Block(block) => {
                let body = sequential(&block.body, x, pass)?;
                let merged = match &block.shortcut {
                    Shortcut::None => body,
                    Shortcut::Identity => (body + x)?,
                    Shortcut::Projection(projection) => (body + sequential(projection, x, pass)?)?,
                };
                sequential(&block.post, &merged, pass)
            }
        }
    }
}

fn sequential(modules: &[Module], x: &Tensor, pass: Pass) -> Result<Tensor> {
    let mut x = x.clone();
    for module in modules {
        x = module.forward(&x, pass)?;
    }
    Ok(x)
}

/// A trainable network: stages of modules, f32 parameters and batch-norm buffers,
/// named as in torchvision's state dicts.
pub struct Network {
    spec: ModelSpec,
    input: Shape,
    device: Device,
    stages: Vec<Vec<Module>>,
    params: Vec<Named>,
    buffers: Vec<Named>,
}

impl fmt::Debug for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Network")
            .field("model", &self.spec.name)
            .field("input", &self.input)
            .field("parameters", &self.param_count())
            .finish()
    }
}

impl Network {
    /// Builds `spec` for one sample of `input` (`C x H x W`), with parameters
    /// initialised as torchvision does from a generator seeded with `seed`.
    pub fn new(spec: &ModelSpec, input: Shape, device: &Device, seed: u64) -> std::result::Result<Self, ModelError> {
        let mut builder = Builder { device, rng: rand::rngs::StdRng::seed_from_u64(seed), params: Vec::new(), buffers: Vec::new() };
        // Shapes do not depend on the precision; the costs go unused.
        let stages = walk(spec, input, Precision::F32, &mut builder)?;
        Ok(Network { spec: spec.clone(), input, device: device.clone(), stages, params: builder.params, buffers: builder.buffers })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The per-sample input shape the network was built for.
    pub fn input(&self) -> Shape {
        self.input
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Logits (in the compute dtype) for a batch `N x C x H x W`.
    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let mut x = self.enter(x, pass)?;
        for stage in 0..self.stages.len() {
            x = self.forward_stage(stage, &x, pass)?;
        }
        Ok(x)
    }

    /// The input cast to the compute dtype: what the first stage takes.
    pub fn enter(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        if x.dtype() == pass.compute {
            Ok(x.clone())
        } else {
            x.to_dtype(pass.compute)
        }
    }

    /// Runs stage `index` alone: the unit of activation checkpointing.
    pub fn forward_stage(&self, index: usize, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let stage = self
            .stages
            .get(index)
            .ok_or_else(|| candle_core::Error::Msg(format!("{} has {} stages, no stage {index}", self.spec.name, self.stages.len())))?;
        sequential(stage, x, pass)
    }

    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    pub fn stage_names(&self) -> Vec<&str> {
        self.spec.stage_names()
    }

    /// Trainable parameters, in the order of the layer list.
    pub fn params(&self) -> &[Named] {
        &self.params
    }

    /// Batch-norm running statistics and counters: saved, not trained.
    pub fn buffers(&self) -> &[Named] {
        &self.buffers
    }

    pub fn vars(&self) -> Vec<candle_core::Var> {
        self.params.iter().map(|p| p.var.clone()).collect()
    }

    pub fn param_count(&self) -> u64 {
        self.params.iter().map(|p| p.var.elem_count() as u64).sum()
    }

    /// Bytes of the f32 parameters, read off the tensors.
    pub fn param_bytes(&self) -> u64 {
        self.params.iter().map(|p| (p.var.elem_count() * p.var.dtype().size_in_bytes()) as u64).sum()
    }

    pub fn buffer_bytes(&self) -> u64 {
        self.buffers.iter().map(|b| (b.var.elem_count() * b.var.dtype().size_in_bytes()) as u64).sum()
    }
}

impl Fold for Builder<'_> {
    type Layer = Module;
    type Stage = Vec<Module>;

    fn leaf(&mut self, site: Site<'_>, _output: Shape, _cost: Cost) -> std::result::Result<Module, ModelError> {
        let (name, input) = (site.path.as_str(), site.input);
        let module = match &site.layer.op {
            Op::Conv2d(conv) => Conv::new(self, name, *conv, input.channels()).map(Module::Conv),
            Op::BatchNorm2d => BatchNorm::new(self, name, input.channels()).map(Module::BatchNorm),
            Op::Relu => Ok(Module::Relu),
            Op::Silu => Ok(Module::Silu),
            Op::MaxPool2d { kernel, stride, padding } => Ok(Module::MaxPool { kernel: *kernel, stride: *stride, padding: *padding }),
            Op::GlobalAvgPool => Ok(Module::GlobalAvgPool),
            Op::Flatten => Ok(Module::Flatten),
            Op::Dropout { p } => Ok(Module::Dropout(Box::new(Dropout::new(self, *p)))),
            Op::Linear { out_features, bias } => Linear::new(self, name, input.channels(), *out_features, *bias).map(Module::Linear),
            Op::SqueezeExcite { squeeze_channels } => {
                SqueezeExcite::new(self, name, input.channels(), *squeeze_channels).map(Module::SqueezeExcite)
            }
            Op::Block(_) => return Err(site.rejected(rules::NOT_A_LEAF.to_owned())),
        };
        module.map_err(|source| ModelError::Build { model: site.model.to_owned(), layer: site.path.clone(), source: Box::new(source) })
    }

    fn block(&mut self, _site: Site<'_>, block: Block<Module>, _merged: Shape, _output: Shape) -> Module {
        Module::Block(Box::new(block))
    }

    fn stage(&mut self, _index: usize, _stage: &Stage, _input: Shape, layers: Vec<Module>, _output: Shape) -> Vec<Module> {
        layers
    }
}
