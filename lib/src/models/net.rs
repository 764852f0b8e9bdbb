//! A [`ModelSpec`] made trainable: the same layer list the ledger reads,
//! built into Candle modules with named parameters.

use std::fmt;

use candle_core::{DType, Device, Result, Tensor};
use rand::SeedableRng;

use super::layers::{
    global_avg_pool, BatchNorm, Builder, Conv, Dropout, Linear, Named, Pass, SqueezeExcite,
};
use super::precision::Precision;
use super::rules;
use super::shape::Shape;
use super::spec::{Block as BlockSpec, Layer, ModelSpec, Op, Shortcut as ShortcutSpec};
use super::ModelError;
use crate::ops;

#[derive(Debug)]
enum Module {
    Conv(Conv),
    BatchNorm(BatchNorm),
    Relu,
    Silu,
    MaxPool {
        kernel: usize,
        stride: usize,
        padding: usize,
    },
    GlobalAvgPool,
    Flatten,
    Dropout(Dropout),
    Linear(Linear),
    SqueezeExcite(SqueezeExcite),
    Block(Box<Block>),
}

#[derive(Debug)]
struct Block {
    body: Vec<Module>,
    shortcut: Option<Vec<Module>>,
    residual: bool,
    post: Vec<Module>,
}

impl Module {
    fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        match self {
            Module::Conv(conv) => conv.forward(x, pass),
            Module::BatchNorm(bn) => bn.forward(x, pass),
            Module::Relu => x.relu(),
            Module::Silu => x.silu(),
            Module::MaxPool {
                kernel,
                stride,
                padding,
            } => ops::max_pool2d(x, *kernel, *stride, *padding),
            Module::GlobalAvgPool => global_avg_pool(x),
            Module::Flatten => x.flatten_from(1),
            Module::Dropout(dropout) => dropout.forward(x, pass),
            Module::Linear(linear) => linear.forward(x, pass),
            Module::SqueezeExcite(se) => se.forward(x, pass),
            Module::Block(block) => {
                let body = sequential(&block.body, x, pass)?;
                let merged = match (&block.shortcut, block.residual) {
                    (Some(projection), _) => (body + sequential(projection, x, pass)?)?,
                    (None, true) => (body + x)?,
                    (None, false) => body,
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
        super::limits::check_input(&spec.name, input)?;
        if input.elems() == 0 {
            return Err(ModelError::EmptyInput {
                model: spec.name.clone(),
                input,
            });
        }
        let mut builder = Builder {
            device,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            params: Vec::new(),
            buffers: Vec::new(),
        };
        let mut shape = input;
        let mut stages = Vec::with_capacity(spec.stages.len());
        for stage in &spec.stages {
            let (modules, out) = build_layers(&mut builder, &spec.name, "", &stage.layers, shape)?;
            stages.push(modules);
            shape = out;
        }
        Ok(Network {
            spec: spec.clone(),
            input,
            device: device.clone(),
            stages,
            params: builder.params,
            buffers: builder.buffers,
        })
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
        let stage = self.stages.get(index).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "{} has {} stages, no stage {index}",
                self.spec.name,
                self.stages.len()
            ))
        })?;
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
        self.params
            .iter()
            .map(|p| (p.var.elem_count() * p.var.dtype().size_in_bytes()) as u64)
            .sum()
    }

    pub fn buffer_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .map(|b| (b.var.elem_count() * b.var.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// The dtype a [`Precision`] runs convolutions and matmuls in.
    pub fn compute_dtype(precision: Precision) -> DType {
        match precision {
            Precision::F32 => DType::F32,
            Precision::F16Amp => DType::F16,
            Precision::Bf16Amp => DType::BF16,
        }
    }
}

fn build_layers(
    b: &mut Builder,
    model: &str,
    prefix: &str,
    layers: &[Layer],
    input: Shape,
) -> std::result::Result<(Vec<Module>, Shape), ModelError> {
    let mut shape = input;
    let mut modules = Vec::with_capacity(layers.len());
    for layer in layers {
        let name = format!("{prefix}{}", layer.name);
        let (module, out) = build_layer(b, model, &name, layer, shape)?;
        modules.push(module);
        shape = out;
    }
    Ok((modules, shape))
}

fn build_layer(
    b: &mut Builder,
    model: &str,
    name: &str,
    layer: &Layer,
    input: Shape,
) -> std::result::Result<(Module, Shape), ModelError> {
    let rejected = |reason: String| ModelError::Shape {
        model: model.to_owned(),
        layer: name.to_owned(),
        kind: layer.kind(),
        input,
        reason,
    };
    let candle = |err: candle_core::Error| ModelError::Build {
        model: model.to_owned(),
        layer: name.to_owned(),
        source: err,
    };
    let module = match &layer.op {
        Op::Conv2d(conv) => Module::Conv(Conv::new(b, name, *conv, input.channels()).map_err(candle)?),
        Op::BatchNorm2d => Module::BatchNorm(BatchNorm::new(b, name, input.channels()).map_err(candle)?),
        Op::Relu => Module::Relu,
        Op::Silu => Module::Silu,
        Op::MaxPool2d {
            kernel,
            stride,
            padding,
        } => Module::MaxPool {
            kernel: *kernel,
            stride: *stride,
            padding: *padding,
        },
        Op::GlobalAvgPool => Module::GlobalAvgPool,
        Op::Flatten => Module::Flatten,
        Op::Dropout { p } => Module::Dropout(Dropout::new(b, *p)),
        Op::Linear { out_features, bias } => Module::Linear(
            Linear::new(b, name, input.channels(), *out_features, *bias).map_err(candle)?,
        ),
        Op::SqueezeExcite { squeeze_channels } => Module::SqueezeExcite(
            SqueezeExcite::new(b, name, input.channels(), *squeeze_channels).map_err(candle)?,
        ),
        Op::Block(block) => return build_block(b, model, name, block, input),
    };
    let (out, _) = rules::leaf(&layer.op, input, Precision::F32).map_err(rejected)?;
    Ok((module, out))
}

fn build_block(
    b: &mut Builder,
    model: &str,
    name: &str,
    block: &BlockSpec,
    input: Shape,
) -> std::result::Result<(Module, Shape), ModelError> {
    let (body, body_out) = build_layers(b, model, &format!("{name}."), &block.body, input)?;
    let (shortcut, residual) = match &block.shortcut {
        ShortcutSpec::None => (None, false),
        ShortcutSpec::Identity => (None, true),
        ShortcutSpec::Projection(layers) => {
            let (modules, _) =
                build_layers(b, model, &format!("{name}.downsample."), layers, input)?;
            (Some(modules), true)
        }
    };
    let (post, out) = build_layers(b, model, &format!("{name}."), &block.post, body_out)?;
    Ok((
        Module::Block(Box::new(Block {
            body,
            shortcut,
            residual,
            post,
        })),
        out,
    ))
}
