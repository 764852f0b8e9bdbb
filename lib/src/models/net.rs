//! A [`ModelSpec`] made trainable: the same layer list the ledger reads,
//! built into Candle modules with named parameters by a fold of the walk.

use std::fmt;

use candle_core::{Device, Result, Tensor};
use rand::SeedableRng;

use super::cost::Cost;
use super::layers::{
    global_avg_pool, BatchNorm, Builder, Conv, ConvTranspose, Dropout, LayerNorm, Linear, Named, Pass, PatchEmbed, SqueezeExcite,
};
use super::lean_groups::{self as lean, Layers};
use super::precision::Precision;
use super::rules::{self, Kernels};
use super::shape::Shape;
use super::spec::{self, ModelSpec, Op, Stage};
use super::walk::{walk, Block, Fold, Shortcut, Site};
use super::ModelError;
use crate::ops::{self, Activation, AttentionKeeps, Norm, Residual, Then};

#[derive(Debug)]
pub(super) enum Module {
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
    // Boxed: its generator is larger than every other module.
    Dropout(Box<Dropout>),
    Linear(Linear),
    /// A linear layer reading the GELU before it, as one op.
    GeluLinear(Linear),
    /// A layer-norm and the linear layer reading it, as one op.
    NormLinear(Box<(LayerNorm, Linear)>),
    /// A residual block whose last linear layer adds the block's input.
    Stream(Box<Stream>),
    SqueezeExcite(SqueezeExcite),
    LayerNorm(LayerNorm),
    Gelu,
    PatchEmbed(Box<PatchEmbed>),
    Attention {
        heads: usize,
        keeps: AttentionKeeps,
    },
    ClassToken,
    ConvTranspose(ConvTranspose),
    Block(Box<Block<Module>>),
    NormAct(Box<NormAct>),
    Merge(Box<Merge>),
}

/// A batch-norm, its activation and what reads it, as one lean op.
#[derive(Debug)]
pub(super) struct NormAct {
    bn: BatchNorm,
    act: Activation,
    then: Consumer,
}

#[derive(Debug)]
enum Consumer {
    Nothing,
    Conv(Conv),
    MaxPool { kernel: usize, stride: usize, padding: usize },
}

/// A residual block ending in one lean op: `act(bn(body(x)) + residual)`.
#[derive(Debug)]
pub(super) struct Merge {
    body: Vec<Module>,
    bn: BatchNorm,
    residual: MergeResidual,
    act: Activation,
}

#[derive(Debug)]
enum MergeResidual {
    Identity,
    /// The projection's layers before its batch-norm, and the batch-norm.
    Projection(Vec<Module>, BatchNorm),
}

/// A residual block whose last layer, a linear one, adds the block's input
/// to its output inside its op (reading its input through a GELU with `gelu`).
#[derive(Debug)]
pub(super) struct Stream {
    body: Vec<Module>,
    last: Linear,
    gelu: bool,
}

impl Stream {
    fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let h = sequential(&self.body, x, pass)?;
        self.last.forward_adding(&h, x, self.gelu, pass)
    }
}

/// Whether a pass records a graph, the only case in which the lean ops keep less.
fn records_graph(pass: Pass) -> bool {
    pass.train && pass.grad
}

impl NormAct {
    /// Without a graph, the plain ops one after the other, each input
    /// dropped once the next op has it, as a list of plain layers runs.
    fn forward_owned(&self, x: Tensor, pass: Pass) -> Result<Tensor> {
        if !records_graph(pass) {
            let normalised = self.bn.forward(&x, pass)?;
            drop(x);
            let a = self.act.forward(&normalised)?;
            drop(normalised);
            return match &self.then {
                Consumer::Nothing => Ok(a),
                Consumer::Conv(conv) => conv.forward(&a, pass),
                Consumer::MaxPool { kernel, stride, padding } => ops::max_pool2d(&a, *kernel, *stride, *padding),
            };
        }
        let (weight, bias) = self.bn.affine(pass);
        let norm = Norm { weight: &weight, bias: &bias, eps: BatchNorm::EPS };
        let kernel;
        let then = match &self.then {
            Consumer::Nothing => Then::Nothing,
            Consumer::Conv(conv) => {
                kernel = conv.kernel(pass)?;
                Then::Conv { weight: &kernel, params: conv.params() }
            }
            Consumer::MaxPool { kernel, stride, padding } => Then::MaxPool { kernel: *kernel, stride: *stride, padding: *padding },
        };
        let out = ops::norm_act(&x, norm, self.act, then)?;
        if pass.update_stats {
            for stats in &out.stats {
                self.bn.update_running_stats(stats)?;
            }
        }
        Ok(out.y)
    }
}

impl Merge {
    fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        let z = sequential(&self.body, x, pass)?;
        let projected = match &self.residual {
            MergeResidual::Identity => None,
            MergeResidual::Projection(layers, bn) => Some((sequential(layers, x, pass)?, bn)),
        };
        if !records_graph(pass) {
            let body = self.bn.forward(&z, pass)?;
            drop(z);
            let residual = match projected {
                None => x.clone(),
                Some((zd, bn)) => bn.forward(&zd, pass)?,
            };
            return self.act.forward(&(body + residual)?);
        }
        let (weight, bias) = self.bn.affine(pass);
        let side = projected.as_ref().map(|(_, bn)| bn.affine(pass));
        let norm = Norm { weight: &weight, bias: &bias, eps: BatchNorm::EPS };
        let residual = match (&projected, &side) {
            (Some((zd, _)), Some((w, b))) => Residual::Norm(zd, Norm { weight: w, bias: b, eps: BatchNorm::EPS }),
            _ => Residual::Identity(x),
        };
        let out = ops::norm_add_act(&z, norm, residual, self.act)?;
        if pass.update_stats {
            let norms = std::iter::once(&self.bn).chain(projected.as_ref().map(|(_, bn)| *bn));
            for (bn, stats) in norms.zip(&out.stats) {
                bn.update_running_stats(stats)?;
            }
        }
        Ok(out.y)
    }
}

/// `modules`, made from `layers` one for one, with the lean groups of
/// `layers` made into one module each. `skip_last` leaves the last module
/// out of any group (a residual block's end takes it).
fn fuse(layers: &[spec::Layer], modules: Vec<Module>, skip_last: bool) -> Vec<Module> {
    let mut slots: Vec<Option<Module>> = modules.into_iter().map(Some).collect();
    for (read, _) in lean::read_by_linears(layers) {
        let [first, second] = &mut slots[read..read + 2] else { continue };
        *second = match (first.take(), second.take()) {
            (Some(Module::Gelu), Some(Module::Linear(linear))) => Some(Module::GeluLinear(linear)),
            (Some(Module::LayerNorm(norm)), Some(Module::Linear(linear))) => Some(Module::NormLinear(Box::new((norm, linear)))),
            (taken, other) => {
                *first = taken;
                other
            }
        };
    }
    for g in lean::groups(layers, skip_last).iter().rev() {
        let last = g.then.or(g.act).unwrap_or(g.bn).min(slots.len().saturating_sub(1));
        let taken: Vec<Module> = slots[g.bn..=last].iter_mut().filter_map(Option::take).collect();
        match group(taken) {
            Ok(module) => slots[g.bn] = Some(module),
            Err(unchanged) => slots.splice(g.bn..g.bn + unchanged.len(), unchanged.into_iter().map(Some)).for_each(drop),
        }
    }
    slots.into_iter().flatten().collect()
}

/// A batch-norm, then an activation, a consumer or both, as one module;
/// anything else back as it came.
fn group(taken: Vec<Module>) -> std::result::Result<Module, Vec<Module>> {
    let norm_act = |bn, act, then| Module::NormAct(Box::new(NormAct { bn, act, then }));
    match taken.len() {
        2 => match <[Module; 2]>::try_from(taken)? {
            [Module::BatchNorm(bn), next] => match activation_of(&next) {
                Some(act) => Ok(norm_act(bn, act, Consumer::Nothing)),
                None => match consumer(next) {
                    Ok(then) => Ok(norm_act(bn, Activation::Identity, then)),
                    Err(next) => Err(vec![Module::BatchNorm(bn), next]),
                },
            },
            other => Err(other.into()),
        },
        3 => match <[Module; 3]>::try_from(taken)? {
            [Module::BatchNorm(bn), a, next] => match activation_of(&a) {
                Some(act) => match consumer(next) {
                    Ok(then) => Ok(norm_act(bn, act, then)),
                    Err(next) => Err(vec![Module::BatchNorm(bn), a, next]),
                },
                None => Err(vec![Module::BatchNorm(bn), a, next]),
            },
            other => Err(other.into()),
        },
        _ => Err(taken),
    }
}

/// What reads a lean op's activation: a convolution without bias or a max-pool.
fn consumer(m: Module) -> std::result::Result<Consumer, Module> {
    match m {
        Module::Conv(conv) if !conv.has_bias() => Ok(Consumer::Conv(conv)),
        Module::MaxPool { kernel, stride, padding } => Ok(Consumer::MaxPool { kernel, stride, padding }),
        other => Err(other),
    }
}

fn activation_of(m: &Module) -> Option<Activation> {
    match m {
        Module::Relu => Some(Activation::Relu),
        Module::Silu => Some(Activation::Silu),
        _ => None,
    }
}

impl Module {
    fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        match self {
            Module::Conv(conv) => conv.forward(x, pass),
            Module::BatchNorm(bn) => bn.forward(x, pass),
            Module::Relu => x.relu(),
            Module::Silu => ops::silu(x),
            Module::MaxPool { kernel, stride, padding } => ops::max_pool2d(x, *kernel, *stride, *padding),
            Module::GlobalAvgPool => global_avg_pool(x),
            Module::Flatten => x.flatten_from(1),
            Module::Dropout(dropout) => dropout.forward(x, pass),
            Module::Linear(linear) => linear.forward(x, pass),
            Module::GeluLinear(linear) => linear.forward_through_gelu(x, pass),
            Module::NormLinear(pair) => pair.0.read_by(&pair.1, x, pass),
            Module::Stream(stream) => stream.forward(x, pass),
            Module::SqueezeExcite(se) => se.forward(x, pass),
            Module::LayerNorm(norm) => norm.forward(x, pass),
            Module::Gelu => ops::gelu(x),
            Module::PatchEmbed(embed) => embed.forward(x, pass),
            Module::Attention { heads, keeps } => ops::attention(x, *heads, *keeps),
            Module::ClassToken => x.narrow(1, 0, 1)?.squeeze(1)?.contiguous(),
            Module::ConvTranspose(conv) => conv.forward(x, pass),
            Module::NormAct(group) => group.forward_owned(x.clone(), pass),
            Module::Merge(merge) => merge.forward(x, pass),
            Module::Block(block) => {
                let body = sequential(&block.body, x, pass)?;
                let merged = match &block.shortcut {
                    Shortcut::None => body,
                    Shortcut::Identity => (body + x)?,
                    Shortcut::Projection(projection) => (body + sequential(projection, x, pass)?)?,
                    Shortcut::Concat => Tensor::cat(&[x, &body], 1)?,
                };
                sequential(&block.post, &merged, pass)
            }
        }
    }
}

fn sequential(modules: &[Module], x: &Tensor, pass: Pass) -> Result<Tensor> {
    let mut x = x.clone();
    for module in modules {
        x = match module {
            Module::NormAct(group) => group.forward_owned(x, pass)?,
            module => module.forward(&x, pass)?,
        };
    }
    Ok(x)
}

/// A trainable network: stages of modules, f32 parameters and batch-norm buffers,
/// named as in torchvision's state dicts.
pub struct Network {
    spec: ModelSpec,
    input: Shape,
    device: Device,
    layers: Layers,
    stages: Vec<Vec<Module>>,
    params: Vec<Named>,
    buffers: Vec<Named>,
    /// Where each stage's parameters end in `params`: a stage's are the
    /// ones after the stage before's.
    stage_ends: Vec<usize>,
}

impl fmt::Debug for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Network")
            .field("model", &self.spec.name)
            .field("input", &self.input)
            .field("layers", &self.layers)
            .field("parameters", &self.param_count())
            .finish()
    }
}

impl Network {
    /// Builds `spec` for one sample of `input` (`C x H x W`), with parameters
    /// initialised as torchvision does from a generator seeded with `seed`,
    /// from the lean layers where `device` has them (the CPU, and CUDA in a
    /// build with the cuda feature) and the plain ones elsewhere.
    pub fn new(spec: &ModelSpec, input: Shape, device: &Device, seed: u64) -> std::result::Result<Self, ModelError> {
        Self::with_layers(spec, input, device, seed, Layers::Lean)
    }

    /// [`Network::new`] from the layers asked for; the lean ones are
    /// plain on a device without their kernels (see [`Layers::on`]).
    pub fn with_layers(
        spec: &ModelSpec,
        input: Shape,
        device: &Device,
        seed: u64,
        layers: Layers,
    ) -> std::result::Result<Self, ModelError> {
        let layers = layers.on(device);
        let mut builder = Builder {
            device,
            layers,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            params: Vec::new(),
            buffers: Vec::new(),
            stage_ends: Vec::new(),
        };
        // Shapes do not depend on the precision; the costs go unused.
        let stages = walk(spec, input, Precision::F32, layers, Kernels::Host, &mut builder)?;
        Ok(Network {
            spec: spec.clone(),
            input,
            device: device.clone(),
            layers,
            stages,
            params: builder.params,
            buffers: builder.buffers,
            stage_ends: builder.stage_ends,
        })
    }

    /// The layers the network runs: what the ledger must cost.
    pub fn layers(&self) -> Layers {
        self.layers
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

    /// The indices in [`Network::params`] of the parameters of `stages`.
    pub fn stage_params(&self, stages: std::ops::Range<usize>) -> std::ops::Range<usize> {
        let end_of = |stage: usize| if stage == 0 { 0 } else { self.stage_ends.get(stage - 1).copied().unwrap_or(self.params.len()) };
        end_of(stages.start)..end_of(stages.end)
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

    fn leaf(&mut self, site: Site<'_>, output: Shape, _cost: Cost) -> std::result::Result<Module, ModelError> {
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
            Op::LayerNorm { eps } => LayerNorm::new(self, name, input.channels(), *eps).map(Module::LayerNorm),
            Op::Gelu => Ok(Module::Gelu),
            Op::PatchEmbed { patch, dim } => {
                let tokens = match output {
                    Shape::Tokens { n, .. } => n,
                    _ => return Err(site.rejected("a patch embedding's output is tokens".to_owned())),
                };
                PatchEmbed::new(self, name, input.channels(), *patch, *dim, tokens).map(|e| Module::PatchEmbed(Box::new(e)))
            }
            Op::Attention { heads } => Ok(Module::Attention { heads: *heads, keeps: self.layers.attention_keeps() }),
            Op::ClassToken => Ok(Module::ClassToken),
            Op::ConvTranspose2d { out_channels, kernel, bias } => {
                ConvTranspose::new(self, name, input.channels(), *out_channels, *kernel, *bias).map(Module::ConvTranspose)
            }
            Op::Block(_) => return Err(site.rejected(rules::NOT_A_LEAF.to_owned())),
        };
        module.map_err(|source| ModelError::Build { model: site.model.to_owned(), layer: site.path.clone(), source: Box::new(source) })
    }

    fn block(&mut self, site: Site<'_>, block: Block<Module>, _merged: Shape, _output: Shape) -> std::result::Result<Module, ModelError> {
        let Op::Block(spec) = &site.layer.op else {
            return Err(site.rejected("a block's layers came without its spec".to_owned()));
        };
        if self.layers == Layers::Plain {
            return Ok(Module::Block(Box::new(block)));
        }
        let Block { body, shortcut, post } = block;
        if lean::streams(spec) {
            let mut body = fuse(&spec.body, body, false);
            let (last, gelu) = match body.pop() {
                Some(Module::Linear(last)) => (last, false),
                Some(Module::GeluLinear(last)) => (last, true),
                _ => return Err(site.rejected("the lean layers expected a linear layer at the end of the body".to_owned())),
            };
            return Ok(Module::Stream(Box::new(Stream { body, last, gelu })));
        }
        let Some(act) = lean::merge(spec) else {
            let shortcut = match (shortcut, &spec.shortcut) {
                (Shortcut::Projection(layers), spec::Shortcut::Projection(specs)) => Shortcut::Projection(fuse(specs, layers, false)),
                (shortcut, _) => shortcut,
            };
            let (body, post) = (fuse(&spec.body, body, false), fuse(&spec.post, post, false));
            return Ok(Module::Block(Box::new(Block { body, shortcut, post })));
        };
        let unmerged = || site.rejected("the lean layers expected a batch-norm at the end of the body and the projection".to_owned());
        let split = |mut layers: Vec<Module>| match layers.pop() {
            Some(Module::BatchNorm(bn)) => Ok((layers, bn)),
            _ => Err(unmerged()),
        };
        let (body, bn) = split(fuse(&spec.body, body, true))?;
        let residual = match (shortcut, &spec.shortcut) {
            (Shortcut::Projection(layers), spec::Shortcut::Projection(specs)) => {
                let (layers, bn) = split(fuse(specs, layers, true))?;
                MergeResidual::Projection(layers, bn)
            }
            (Shortcut::Identity, _) => MergeResidual::Identity,
            _ => return Err(unmerged()),
        };
        // The post layers are the activation `act` stands for, or none.
        drop(post);
        Ok(Module::Merge(Box::new(Merge { body, bn, residual, act })))
    }

    fn stage(&mut self, _index: usize, stage: &Stage, _input: Shape, layers: Vec<Module>, _output: Shape) -> Vec<Module> {
        self.stage_ends.push(self.params.len());
        match self.layers {
            Layers::Plain => layers,
            Layers::Lean => fuse(&stage.layers, layers, false),
        }
    }
}
