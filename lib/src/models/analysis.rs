//! Walking a [`ModelSpec`] with an input shape: per-layer and per-stage costs.

use serde::Serialize;

use super::cost::Cost;
use super::precision::Precision;
use super::rules;
use super::shape::Shape;
use super::spec::{Block, Layer, ModelSpec, Op, Shortcut};
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
    pub rows: Vec<Row>,
    pub stages: Vec<StageCost>,
    pub total: Cost,
}

/// Computes per-sample costs of `spec` for `input` (C x H x W) at `precision`.
///
/// Under mixed precision a cast of the input opens the first stage; the
/// cross-entropy loss closes the last one (training keeps its tensors).
pub fn analyze(
    spec: &ModelSpec,
    input: Shape,
    precision: Precision,
) -> Result<ModelCost, ModelError> {
    super::limits::check_input(&spec.name, input)?;
    if input.elems() == 0 {
        return Err(ModelError::EmptyInput {
            model: spec.name.clone(),
            input,
        });
    }
    let mut walker = Walker {
        model: &spec.name,
        precision,
        rows: Vec::with_capacity(256),
    };
    let mut stages = Vec::with_capacity(spec.stages.len());
    let mut shape = input;
    let mut total = Cost::default();
    let last = spec.stages.len().saturating_sub(1);
    for (index, stage) in spec.stages.iter().enumerate() {
        let stage_row = walker.rows.len();
        walker.rows.push(Row {
            path: stage.name.clone(),
            kind: "Stage",
            depth: 1,
            stage: index,
            output: shape,
            cost: Cost::default(),
        });
        let mut cost = Cost::default();
        if index == 0 && precision.is_mixed() {
            let cast = rules::input_cast(shape, precision);
            walker.push(
                format!("input.to_{}", precision.flag()),
                "ToDtype",
                2,
                index,
                shape,
                cast,
            );
            cost = cost.then(cast);
        }
        let stage_input = shape;
        let (out, layers_cost) = walker.layers(&stage.layers, "", 2, index, shape, 0)?;
        cost = cost.then(layers_cost);
        shape = out;
        if index == last {
            let loss = rules::cross_entropy(shape.channels(), precision);
            walker.push(
                "loss".to_owned(),
                "CrossEntropyLoss",
                2,
                index,
                Shape::Flat { features: 1 },
                loss,
            );
            cost = cost.then(loss);
        }
        walker.rows[stage_row].output = shape;
        walker.rows[stage_row].cost = cost;
        let boundary_bytes = shape.elems() * precision.compute_bytes();
        stages.push(StageCost {
            name: stage.name.clone(),
            input: stage_input,
            output: shape,
            boundary_bytes,
            cost,
        });
        total = total.then(cost);
    }
    Ok(ModelCost {
        model: spec.name.clone(),
        num_classes: spec.num_classes,
        input,
        precision,
        rows: walker.rows,
        stages,
        total,
    })
}

struct Walker<'a> {
    model: &'a str,
    precision: Precision,
    rows: Vec<Row>,
}

impl Walker<'_> {
    fn push(
        &mut self,
        path: String,
        kind: &'static str,
        depth: usize,
        stage: usize,
        output: Shape,
        cost: Cost,
    ) {
        self.rows.push(Row {
            path,
            kind,
            depth,
            stage,
            output,
            cost,
        });
    }

    /// Walks layers in sequence. `held` is what enclosing blocks keep alive
    /// for their residual add while these layers run (it matters in inference).
    fn layers(
        &mut self,
        layers: &[Layer],
        prefix: &str,
        depth: usize,
        stage: usize,
        input: Shape,
        held: u64,
    ) -> Result<(Shape, Cost), ModelError> {
        let mut shape = input;
        let mut cost = Cost::default();
        for layer in layers {
            let path = if prefix.is_empty() {
                layer.name.clone()
            } else {
                format!("{prefix}.{}", layer.name)
            };
            let (out, layer_cost) = match &layer.op {
                Op::Block(block) => self.block(block, layer, path, depth, stage, shape, held)?,
                op => {
                    let (out, mut leaf) =
                        rules::leaf(op, shape, self.precision).map_err(|reason| {
                            ModelError::Shape {
                                model: self.model.to_owned(),
                                layer: path.clone(),
                                kind: layer.kind(),
                                input: shape,
                                reason,
                            }
                        })?;
                    leaf.eval_live_bytes += held;
                    self.push(path, layer.kind(), depth, stage, out, leaf);
                    (out, leaf)
                }
            };
            shape = out;
            cost = cost.then(layer_cost);
        }
        Ok((shape, cost))
    }

    #[allow(clippy::too_many_arguments)]
    fn block(
        &mut self,
        block: &Block,
        layer: &Layer,
        path: String,
        depth: usize,
        stage: usize,
        input: Shape,
        held: u64,
    ) -> Result<(Shape, Cost), ModelError> {
        let row = self.rows.len();
        self.push(
            path.clone(),
            layer.kind(),
            depth,
            stage,
            input,
            Cost::default(),
        );
        let input_bytes = input.elems() * self.precision.compute_bytes();
        let keeps_input = !matches!(block.shortcut, Shortcut::None);
        let body_held = held + if keeps_input { input_bytes } else { 0 };
        let (body_out, mut cost) =
            self.layers(&block.body, &path, depth + 1, stage, input, body_held)?;
        let merged = match &block.shortcut {
            Shortcut::None => body_out,
            shortcut => {
                let (short_out, short_cost) = match shortcut {
                    Shortcut::Projection(layers) => self.layers(
                        layers,
                        &format!("{path}.downsample"),
                        depth + 1,
                        stage,
                        input,
                        held + body_out.elems() * self.precision.compute_bytes(),
                    )?,
                    _ => (input, Cost::default()),
                };
                if short_out != body_out {
                    return Err(ModelError::Shape {
                        model: self.model.to_owned(),
                        layer: path,
                        kind: layer.kind(),
                        input,
                        reason: format!(
                            "the residual add needs equal shapes, got {body_out} + {short_out}"
                        ),
                    });
                }
                // The residual add materialises its sum; in backward the
                // shortcut's gradient waits while the body's backward runs.
                let mut add = Cost::default();
                let out_bytes = body_out.elems() * self.precision.compute_bytes();
                add.keep(out_bytes);
                add.backward_bytes = 3 * out_bytes;
                add.eval_live_bytes = held + 3 * out_bytes;
                cost.backward_bytes += out_bytes;
                cost = cost.then(short_cost).then(add);
                body_out
            }
        };
        let (out, post) = self.layers(&block.post, &path, depth + 1, stage, merged, held)?;
        cost = cost.then(post);
        self.rows[row].output = out;
        self.rows[row].cost = cost;
        Ok((out, cost))
    }
}
