//! Per-layer and per-stage costs of a [`ModelSpec`] for one input shape: a fold of the [`walk`].

use serde::Serialize;

use super::cost::Cost;
use super::lean_groups::{self as lean, Layers, Role};
use super::precision::Precision;
use super::rules::{self, Kernels};
use super::shape::Shape;
use super::spec::{Conv2d, Grouping, ModelSpec, Op, Stage};
use super::walk::{walk, Block, Fold, Shortcut, Site, STAGE_DEPTH};
use super::ModelError;

/// One row of a summary: a stage (depth 1), a block, or a leaf layer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Dotted name, torchvision style (`layer1.0.conv1`); a stage's row carries the stage name.
    pub path: String,
    pub kind: &'static str,
    pub depth: usize,
    pub stage: usize,
    pub output: Shape,
    pub cost: Cost,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageCost {
    pub name: String,
    pub input: Shape,
    pub output: Shape,
    /// Bytes of the stage's output per sample: what a checkpointed stage keeps.
    pub boundary_bytes: u64,
    pub cost: Cost,
}

/// Per-sample costs of a model for one input shape and precision.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCost {
    pub model: String,
    pub num_classes: usize,
    pub input: Shape,
    pub precision: Precision,
    pub layers: Layers,
    pub rows: Vec<Row>,
    pub stages: Vec<StageCost>,
    pub total: Cost,
    /// Every convolution, in forward order, with what reaches it.
    pub convs: Vec<ConvLayer>,
    /// Every attention, in forward order.
    pub attentions: Vec<AttentionLayer>,
    /// Every linear layer, in forward order.
    pub linears: Vec<LinearLayer>,
    /// Every transposed convolution, in forward order.
    pub transposed_convs: Vec<TransposedConvLayer>,
    /// The loss after the last stage (part of that stage's cost): what it
    /// keeps exists only from the start of backward, when the trainer
    /// computes it, until backward's root is dropped.
    pub loss: Cost,
}

impl ModelCost {
    /// Labels per sample: one for a classifier, one per pixel for a
    /// segmentation network (whose logits are a map).
    pub fn labels_per_sample(&self) -> u64 {
        self.stages.last().map_or(1, |stage| rules::labels_per_sample(stage.output))
    }
}

/// A transposed convolution of the model: its stage and sizes per sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TransposedConvLayer {
    pub stage: usize,
    /// Its input, `C x H x W`.
    pub input: [usize; 3],
    pub out_channels: usize,
    pub kernel: usize,
}

impl TransposedConvLayer {
    /// What our CPU transposed convolution allocates beyond its operands and
    /// result at `batch`, in each of its passes.
    pub fn host_scratch(&self, batch: u64, precision: Precision) -> crate::ops::ConvTransposeScratch {
        let [c, h, w] = self.input;
        // The walk has already checked every transposed convolution against its input.
        crate::ops::conv_transpose2d_scratch([batch as usize, c, h, w], self.out_channels, self.kernel, precision.compute_dtype())
            .unwrap_or_default()
    }
}

/// A linear layer of the model: its stage and sizes per sample (`rows` is
/// 1 for a vector, the tokens for a sequence).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LinearLayer {
    pub stage: usize,
    /// Per sample, what its backward holds beside its scratch (`Cost::backward_bytes`).
    pub backward_bytes: u64,
    pub rows: usize,
    pub in_features: usize,
    pub out_features: usize,
    /// What it reads and adds inside one op, beside its product (the lean layers).
    pub fused: crate::ops::Fused,
}

impl LinearLayer {
    /// What our CPU linear layer allocates beyond its operands and result at
    /// `batch`, in each of its passes.
    pub fn host_scratch(&self, batch: u64, precision: Precision) -> crate::ops::LinearScratch {
        let rows = batch as usize * self.rows;
        // The walk has already checked every linear layer against its input.
        crate::ops::fused_linear_scratch(self.fused, rows, self.in_features, self.out_features, precision.compute_dtype())
            .unwrap_or_default()
    }
}

/// An attention of the model: its stage and sizes per sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AttentionLayer {
    pub stage: usize,
    /// Per sample, what its backward holds beside its scratch (`Cost::backward_bytes`).
    pub backward_bytes: u64,
    pub tokens: usize,
    /// Features of its output (its input holds q, k and v: three times as many).
    pub dim: usize,
    pub heads: usize,
}

impl AttentionLayer {
    /// What our CPU attention allocates beyond its operands, its result and
    /// what it keeps, at `batch`, in each of its passes, as `layers` run it.
    pub fn host_scratch(&self, batch: u64, precision: Precision, layers: Layers) -> crate::ops::AttentionScratch {
        let keeps = layers.attention_keeps();
        // The walk has already checked every attention's heads against its input.
        crate::ops::attention_scratch(batch as usize, self.tokens, self.dim, self.heads, precision.compute_dtype(), keeps)
            .unwrap_or_default()
    }
}

/// A convolution of the model, with its per-sample input and output.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ConvLayer {
    pub stage: usize,
    pub input: Shape,
    pub output: Shape,
    pub conv: Conv2d,
    /// Parameters of the model's layers before this one, in forward order.
    pub params_before: u64,
    /// Whether it takes the batch itself (the model's first layer): its
    /// backward makes no input gradient.
    pub reads_images: bool,
}

impl ConvLayer {
    /// Elements of the kernel.
    pub fn weights(&self) -> u64 {
        let Shape::Map { c, .. } = self.input else { return 0 };
        let per_group = match self.conv.grouping {
            Grouping::Dense => c,
            Grouping::Depthwise => 1,
        };
        (self.conv.out_channels * per_group * self.conv.kernel * self.conv.kernel) as u64
    }

    /// What our CPU convolution allocates beyond its operands at `batch`, in
    /// each of its passes.
    pub fn host_scratch(&self, batch: u64) -> crate::ops::ConvScratch {
        let Shape::Map { c, h, w } = self.input else { return crate::ops::ConvScratch::default() };
        let (groups, per_group) = match self.conv.grouping {
            Grouping::Dense => (1, c),
            Grouping::Depthwise => (c, 1),
        };
        let params = crate::ops::ConvParams { stride: self.conv.stride, padding: self.conv.padding, groups };
        let weight = [self.conv.out_channels, per_group, self.conv.kernel, self.conv.kernel];
        // The walk has already checked every conv against its input.
        crate::ops::conv2d_scratch([batch as usize, c, h, w], weight, params).unwrap_or_default()
    }
}

/// Computes per-sample costs of `spec` for `input` (C x H x W) at `precision`,
/// built from `layers`.
///
/// Under mixed precision a cast of the input opens the first stage; the
/// cross-entropy loss closes the last one (training keeps its tensors).
pub fn analyze(spec: &ModelSpec, input: Shape, precision: Precision, layers: Layers) -> Result<ModelCost, ModelError> {
    analyze_on(spec, input, precision, layers, Kernels::Host)
}

/// [`analyze`], with the transients of `kernels`: our CPU kernels', or the
/// device passes' (what each op keeps is the same).
pub fn analyze_on(spec: &ModelSpec, input: Shape, precision: Precision, layers: Layers, kernels: Kernels) -> Result<ModelCost, ModelError> {
    let mut costing = Costing {
        precision,
        kernels,
        layers,
        last_stage: spec.stages.len().saturating_sub(1),
        convs: Vec::new(),
        attentions: Vec::new(),
        linears: Vec::new(),
        transposed_convs: Vec::new(),
        loss: Cost::default(),
        params_seen: 0,
    };
    let mut rows = Vec::with_capacity(256);
    let mut stages = Vec::with_capacity(spec.stages.len());
    let mut total = Cost::default();
    for (stage, stage_rows) in walk(spec, input, precision, layers, kernels, &mut costing)? {
        total = total.then(stage.cost);
        rows.extend(stage_rows);
        stages.push(stage);
    }
    Ok(ModelCost {
        model: spec.name.clone(),
        num_classes: spec.num_classes,
        input,
        precision,
        layers,
        rows,
        stages,
        total,
        convs: costing.convs,
        attentions: costing.attentions,
        linears: costing.linears,
        transposed_convs: costing.transposed_convs,
        loss: costing.loss,
    })
}

/// The walk folded into costs and summary rows.
struct Costing {
    precision: Precision,
    kernels: Kernels,
    layers: Layers,
    last_stage: usize,
    convs: Vec<ConvLayer>,
    attentions: Vec<AttentionLayer>,
    linears: Vec<LinearLayer>,
    transposed_convs: Vec<TransposedConvLayer>,
    loss: Cost,
    params_seen: u64,
}

impl Costing {
    fn bytes(&self, elems: u64) -> u64 {
        elems * self.precision.compute_bytes()
    }
}

/// A layer's cost and its rows: its own, then those of the layers inside it.
#[derive(Default)]
struct Costed {
    cost: Cost,
    rows: Vec<Row>,
}

impl Costed {
    fn chain(layers: Vec<Costed>) -> Costed {
        let mut chained = Costed::default();
        for layer in layers {
            chained.cost = chained.cost.then(layer.cost);
            chained.rows.extend(layer.rows);
        }
        chained
    }
}

impl Row {
    fn at(site: Site<'_>, output: Shape, cost: Cost) -> Row {
        Row { path: site.path, kind: site.layer.kind(), depth: site.depth, stage: site.stage, output, cost }
    }
}

impl Costing {
    /// The attention's score matrix as a line of its own after its layer:
    /// `heads x tokens x tokens` per sample, what the plain layers keep of it
    /// (the softmax probabilities) or the lean ones (one f32 log-sum-exp per
    /// row; backward computes the probabilities again).
    fn scores(&self, site: &Site<'_>, heads: usize, tokens: usize) -> Row {
        let kind = match self.layers {
            Layers::Plain => "Softmax (kept)",
            Layers::Lean => "Softmax (recomputed)",
        };
        let saved = self.layers.attention_keeps().bytes(1, tokens, heads, self.precision.compute_dtype());
        let cost = Cost { saved_bytes: saved, largest_tensor_bytes: saved, ..Cost::default() };
        let parent = site.path.rsplit_once('.').map_or("", |(parent, _)| parent);
        Row {
            path: if parent.is_empty() { "softmax".to_owned() } else { format!("{parent}.softmax") },
            kind,
            depth: site.depth,
            stage: site.stage,
            output: Shape::map(heads, tokens, tokens),
            cost,
        }
    }
}

impl Fold for Costing {
    type Layer = Costed;
    type Stage = (StageCost, Vec<Row>);

    fn leaf(&mut self, site: Site<'_>, output: Shape, mut cost: Cost) -> Result<Costed, ModelError> {
        // In inference, what enclosing blocks keep for their residual add is
        // alive while the layer runs.
        cost.eval_live_bytes += self.bytes(site.waiting);
        // The layers whose host scratch the ledger asks their op for, and
        // attention's score matrix as a row of its own.
        let (stage, input, params_before, reads_images) = (site.stage, site.input, self.params_seen, site.reads_images);
        let backward_bytes = cost.backward_bytes;
        let conv = |conv, output| ConvLayer { stage, input, output, conv, params_before, reads_images };
        let mut scores = None;
        match (&site.layer.op, input) {
            (Op::Conv2d(c), _) => self.convs.push(conv(*c, output)),
            (&Op::PatchEmbed { patch, dim }, Shape::Map { h, w, .. }) => {
                self.convs.push(conv(Conv2d::new(dim, patch, patch, 0), Shape::map(dim, h / patch, w / patch)));
            }
            (&Op::Attention { heads }, Shape::Tokens { n, .. }) => {
                self.attentions.push(AttentionLayer { stage, backward_bytes, tokens: n, dim: output.channels(), heads });
                scores = Some(self.scores(&site, heads, n));
            }
            (&Op::Linear { out_features, .. }, _) => {
                let rows = if let Shape::Tokens { n, .. } = input { n } else { 1 };
                let fused = match site.role {
                    Role::Linear(fused) => fused,
                    _ => crate::ops::Fused::default(),
                };
                self.linears.push(LinearLayer { stage, backward_bytes, rows, in_features: input.channels(), out_features, fused });
            }
            (&Op::ConvTranspose2d { out_channels, kernel, .. }, Shape::Map { c, h, w }) => {
                self.transposed_convs.push(TransposedConvLayer { stage, input: [c, h, w], out_channels, kernel });
            }
            _ => {}
        }
        self.params_seen += cost.params;
        let mut rows = vec![Row::at(site, output, cost)];
        rows.extend(scores);
        Ok(Costed { cost, rows })
    }

    fn block(&mut self, site: Site<'_>, block: Block<Costed>, merged: Shape, output: Shape) -> Result<Costed, ModelError> {
        let first_backward = block.body.first().map_or(0, |layer| layer.cost.backward_bytes);
        let body = Costed::chain(block.body);
        let (mut cost, mut inner) = (body.cost, body.rows);
        let shortcut = match block.shortcut {
            Shortcut::None => None,
            Shortcut::Identity => Some(Costed::default()),
            Shortcut::Projection(layers) => Some(Costed::chain(layers)),
            Shortcut::Concat => {
                // `cat` materialises the merged map. Its gradient is copied
                // into one for the skip and one for the body (candle makes a
                // view its gradient's own tensor); the skip's waits while
                // the body's backward runs, then the body's first layer's
                // input gradient is added to it, a third tensor of the input's size.
                let mut cat = Cost::default();
                let (out_bytes, in_bytes) = (self.bytes(merged.elems()), self.bytes(site.input.elems()));
                cat.keep(out_bytes);
                cat.backward_bytes = 2 * out_bytes;
                cat.eval_live_bytes = self.bytes(site.waiting) + 2 * out_bytes;
                cost.backward_bytes = (cost.backward_bytes + in_bytes).max(first_backward + 2 * in_bytes);
                cost = cost.then(cat);
                let path = format!("{}.cat", site.path);
                inner.push(Row { path, kind: "Concat", depth: site.depth + 1, stage: site.stage, output: merged, cost: cat });
                None
            }
        };
        // A lean block's end stores one tensor: its activation's output
        // (counted there), or the sum itself when no activation follows.
        let merged_into = match &site.layer.op {
            Op::Block(spec) if self.layers == Layers::Lean => lean::merge(spec),
            _ => None,
        };
        // A lean block whose last linear layer adds its input: the sum is that layer's output.
        let streamed = matches!(&site.layer.op, Op::Block(spec) if self.layers == Layers::Lean && lean::streams(spec));
        if let Some(shortcut) = shortcut {
            // The residual add materialises its sum; in backward the
            // shortcut's gradient waits while the body's backward runs.
            let mut add = Cost::default();
            let out_bytes = self.bytes(merged.elems());
            if !streamed && matches!(merged_into, None | Some(crate::ops::Activation::Identity)) {
                add.keep(out_bytes);
            }
            add.backward_bytes = out_bytes;
            if merged_into.is_some() {
                let projected = !shortcut.rows.is_empty();
                let activated = !matches!(merged_into, Some(crate::ops::Activation::Identity));
                (add.workspace_bytes, add.backward_bytes) = rules::lean_merge(merged, self.precision, self.kernels, projected, activated);
            }
            add.eval_live_bytes = self.bytes(site.waiting) + 3 * out_bytes;
            cost.backward_bytes += out_bytes;
            cost = cost.then(shortcut.cost).then(add);
            inner.extend(shortcut.rows);
        }
        let post = Costed::chain(block.post);
        cost = cost.then(post.cost);
        inner.extend(post.rows);
        let mut rows = Vec::with_capacity(1 + inner.len());
        rows.push(Row::at(site, output, cost));
        rows.extend(inner);
        Ok(Costed { cost, rows })
    }

    fn stage(&mut self, index: usize, stage: &Stage, input: Shape, layers: Vec<Costed>, output: Shape) -> (StageCost, Vec<Row>) {
        let own_row = |path: String, kind, output, cost| Row { path, kind, depth: STAGE_DEPTH + 1, stage: index, output, cost };
        let mut inner = Vec::with_capacity(layers.len() + 2);
        let mut cost = Cost::default();
        if index == 0 && self.precision.is_mixed() {
            let cast = rules::input_cast(input, self.precision);
            let path = format!("input.to_{}", self.precision.flag());
            inner.push(own_row(path, "ToDtype", input, cast));
            cost = cost.then(cast);
        }
        let layers = Costed::chain(layers);
        cost = cost.then(layers.cost);
        inner.extend(layers.rows);
        if index == self.last_stage {
            let loss = rules::cross_entropy(output, self.precision);
            self.loss = loss;
            inner.push(own_row("loss".to_owned(), "CrossEntropyLoss", Shape::Flat { features: 1 }, loss));
            cost = cost.then(loss);
        }
        let mut rows = Vec::with_capacity(1 + inner.len());
        rows.push(Row { path: stage.name.clone(), kind: "Stage", depth: STAGE_DEPTH, stage: index, output, cost });
        rows.extend(inner);
        let stage_cost = StageCost { name: stage.name.clone(), input, output, boundary_bytes: self.bytes(output.elems()), cost };
        (stage_cost, rows)
    }
}
