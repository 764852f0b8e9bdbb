//! The one walk of a [`ModelSpec`]: stages in order, the layers of each in
//! order, a block as body, then shortcut, then post. The walk names every
//! layer (torchvision's dotted paths), carries the shape from layer to layer
//! with the rules, and refuses a shape a layer cannot take; what a layer
//! becomes is a [`Fold`]'s to say. The network and the cost analysis are two
//! folds of this walk, so their names, shapes and blocks cannot disagree.

use super::cost::Cost;
use super::lean_groups::{self as lean, Layers, Place, Role};
use super::limits;
use super::precision::Precision;
use super::rules::{self, Kernels};
use super::shape::Shape;
use super::spec::{self, Layer, ModelSpec, Op, Stage};
use super::ModelError;

/// A stage's depth in a summary; its layers are one deeper, a block's layers one deeper than the block.
pub(super) const STAGE_DEPTH: usize = 1;

/// What a walk makes of a spec, from the leaves up.
pub(super) trait Fold {
    /// What a layer becomes: a module, a cost.
    type Layer;
    /// What a stage becomes.
    type Stage;

    /// A layer that is not a block, taking `site.input` and giving `output`;
    /// `cost` is its rule's at the walk's precision.
    fn leaf(&mut self, site: Site<'_>, output: Shape, cost: Cost) -> Result<Self::Layer, ModelError>;

    /// A block, its layers made. `merged` is what reaches the post layers
    /// (the body's output, plus the shortcut's if there is one, or the two
    /// concatenated).
    fn block(&mut self, site: Site<'_>, block: Block<Self::Layer>, merged: Shape, output: Shape) -> Result<Self::Layer, ModelError>;

    /// Stage `index`, its layers made.
    fn stage(&mut self, index: usize, stage: &Stage, input: Shape, layers: Vec<Self::Layer>, output: Shape) -> Self::Stage;
}

/// A block's layers as a fold made them: `post(body(x) + shortcut(x))`, or `post(cat(x, body(x)))`.
#[derive(Debug)]
pub(super) struct Block<T> {
    pub body: Vec<T>,
    pub shortcut: Shortcut<T>,
    pub post: Vec<T>,
}

#[derive(Debug)]
pub(super) enum Shortcut<T> {
    None,
    Identity,
    /// ResNet's `downsample`.
    Projection(Vec<T>),
    /// A U-Net's skip: `x` concatenated before the body's output.
    Concat,
}

/// Where a layer sits and what reaches it.
pub(super) struct Site<'a> {
    pub model: &'a str,
    pub layer: &'a Layer,
    /// Dotted, torchvision style: `layer1.0.downsample.0`.
    pub path: String,
    pub depth: usize,
    pub stage: usize,
    pub input: Shape,
    /// Elements of the tensors that enclosing blocks keep for their residual
    /// add or concatenation while this layer runs: a block's input during its
    /// body, its body's output during its projection.
    pub waiting: u64,
    /// Whether the layer takes the batch itself (the model's first layer),
    /// which needs no gradient.
    pub reads_images: bool,
    /// What the layer is inside the lean layers (`Own` in the plain ones).
    pub role: Role,
}

impl Site<'_> {
    pub(super) fn rejected(&self, reason: String) -> ModelError {
        ModelError::Shape { model: self.model.to_owned(), layer: self.path.clone(), kind: self.layer.kind(), input: self.input, reason }
    }

    fn check_residual(&self, body: Shape, shortcut: Shape) -> Result<(), ModelError> {
        if body == shortcut {
            return Ok(());
        }
        Err(self.rejected(format!("the residual add needs equal shapes, got {body} + {shortcut}")))
    }

    /// The shape of `cat(input, body)` along channels.
    fn concatenated(&self, body: Shape) -> Result<Shape, ModelError> {
        match (self.input, body) {
            (Shape::Map { c, h, w }, Shape::Map { c: cb, h: hb, w: wb }) if (h, w) == (hb, wb) => Ok(Shape::map(c + cb, h, w)),
            (input, body) => {
                Err(self.rejected(format!("the skip concatenation needs maps of one height and width, got {input} and {body}")))
            }
        }
    }

    /// The scope of the layers inside this block.
    fn inner<'p>(&self, prefix: &'p str, waiting: u64) -> Scope<'p> {
        Scope { prefix, depth: self.depth + 1, stage: self.stage, waiting }
    }
}

/// What the layers of one list share.
struct Scope<'p> {
    prefix: &'p str,
    depth: usize,
    stage: usize,
    waiting: u64,
}

impl Scope<'_> {
    fn path(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }
}

/// Walks `spec` for one sample of `input`, costing the leaves at `precision`
/// as `layers` run them on `kernels`.
pub(super) fn walk<F: Fold>(
    spec: &ModelSpec,
    input: Shape,
    precision: Precision,
    layers: Layers,
    kernels: Kernels,
    fold: &mut F,
) -> Result<Vec<F::Stage>, ModelError> {
    limits::check_input(&spec.name, input)?;
    if input.elems() == 0 {
        return Err(ModelError::EmptyInput { model: spec.name.clone(), input });
    }
    let mut walker = Walker { model: &spec.name, precision, layers, kernels, fold, leaves: 0 };
    let mut shape = input;
    let mut stages = Vec::with_capacity(spec.stages.len());
    for (index, stage) in spec.stages.iter().enumerate() {
        let scope = Scope { prefix: "", depth: STAGE_DEPTH + 1, stage: index, waiting: 0 };
        let (layers, output) = walker.layers(&stage.layers, scope, shape, Place::Open)?;
        stages.push(walker.fold.stage(index, stage, shape, layers, output));
        shape = output;
    }
    Ok(stages)
}

struct Walker<'a, F> {
    model: &'a str,
    precision: Precision,
    layers: Layers,
    kernels: Kernels,
    fold: &'a mut F,
    /// Leaves walked so far.
    leaves: usize,
}

impl<'a, F: Fold> Walker<'a, F> {
    fn layers(&mut self, layers: &'a [Layer], scope: Scope<'_>, input: Shape, place: Place) -> Result<(Vec<F::Layer>, Shape), ModelError> {
        let roles = match self.layers {
            Layers::Plain => vec![Role::Own; layers.len()],
            Layers::Lean => lean::roles(layers, place),
        };
        let mut shape = input;
        let mut made = Vec::with_capacity(layers.len());
        for (layer, role) in layers.iter().zip(roles) {
            let site = Site {
                model: self.model,
                layer,
                path: scope.path(&layer.name),
                depth: scope.depth,
                stage: scope.stage,
                input: shape,
                waiting: scope.waiting,
                reads_images: self.leaves == 0,
                role,
            };
            let (one, output) = match &layer.op {
                Op::Block(block) => self.block(block, site)?,
                op => {
                    self.leaves += 1;
                    let reads_images = site.reads_images;
                    let (output, cost) = rules::leaf(op, shape, self.precision, self.layers, self.kernels, reads_images)
                        .map_err(|reason| site.rejected(reason))?;
                    let cost = rules::lean(role, op, shape, output, self.precision, self.kernels, cost);
                    (self.fold.leaf(site, output, cost)?, output)
                }
            };
            made.push(one);
            shape = output;
        }
        Ok((made, shape))
    }

    fn block(&mut self, block: &'a spec::Block, site: Site<'a>) -> Result<(F::Layer, Shape), ModelError> {
        let input = site.input;
        let keeps_input = !matches!(block.shortcut, spec::Shortcut::None);
        let lean_layers = self.layers == Layers::Lean;
        let (inner, post_place) = match (lean_layers && lean::merge(block).is_some(), lean_layers && lean::streams(block)) {
            (true, _) => (Place::Merged, Place::Post),
            (false, true) => (Place::Streamed, Place::Open),
            (false, false) => (Place::Open, Place::Open),
        };
        let body_waiting = site.waiting + if keeps_input { input.elems() } else { 0 };
        let (body, mut merged) = self.layers(&block.body, site.inner(&site.path, body_waiting), input, inner)?;
        let shortcut = match &block.shortcut {
            spec::Shortcut::None => Shortcut::None,
            spec::Shortcut::Concat => {
                merged = site.concatenated(merged)?;
                Shortcut::Concat
            }
            spec::Shortcut::Identity => {
                site.check_residual(merged, input)?;
                Shortcut::Identity
            }
            spec::Shortcut::Projection(layers) => {
                let prefix = format!("{}.downsample", site.path);
                let scope = site.inner(&prefix, site.waiting + merged.elems());
                let (made, projected) = self.layers(layers, scope, input, inner)?;
                site.check_residual(merged, projected)?;
                Shortcut::Projection(made)
            }
        };
        let (post, output) = self.layers(&block.post, site.inner(&site.path, site.waiting), merged, post_place)?;
        let made = self.fold.block(site, Block { body, shortcut, post }, merged, output)?;
        Ok((made, output))
    }
}
