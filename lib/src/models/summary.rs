//! A torchinfo-like view of a model's costs for one batch.

use serde::Serialize;

use crate::render::{Bundle, Render, Table};
use crate::units::{grouped, human, si};

use super::analysis::{analyze, ModelCost};
use super::lean_groups::Layers;
use super::precision::{Precision, F32_BYTES};
use super::shape::Shape;
use super::spec::ModelSpec;
use super::ModelError;

/// Per-layer costs of a model for a batch, in training or inference.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub batch: usize,
    pub training: bool,
    pub cost: ModelCost,
}

impl Summary {
    pub fn new(
        spec: &ModelSpec,
        batch: usize,
        input: Shape,
        precision: Precision,
        layers: Layers,
        training: bool,
    ) -> Result<Summary, ModelError> {
        super::limits::check(&spec.name, "batch", batch, super::MAX_BATCH)?;
        if batch == 0 {
            return Err(ModelError::EmptyInput { model: spec.name.clone(), input });
        }
        Ok(Summary { batch, training, cost: analyze(spec, input, precision, layers)? })
    }

    /// Rows down to `depth` (1: stages, 2: blocks, 3: every layer); deeper
    /// layers are folded into the row above them.
    pub fn table(&self, depth: usize) -> Table {
        let b = self.batch as u64;
        let total = &self.cost.total;
        let memory_column = if self.training { "saved for backward" } else { "live in inference" };
        let mut table = Table::new(["layer", "type", "output shape", "params", memory_column, "MACs"])
            .title(format!(
                "{} | input {} x {} | {} | {}",
                self.cost.model, self.batch, self.cost.input, self.cost.precision, self.cost.layers
            ))
            .right_align(&[3, 4, 5]);
        for row in self.cost.rows.iter().filter(|r| r.depth <= depth.max(1)) {
            if !self.training && row.kind == "CrossEntropyLoss" {
                continue;
            }
            let memory = if self.training { row.cost.saved_bytes } else { row.cost.eval_live_bytes };
            table.push_row([
                format!("{}{}", "  ".repeat(row.depth - 1), row.path),
                row.kind.to_owned(),
                format!("{}x{}", self.batch, row.output),
                grouped(row.cost.params),
                grouped(b * memory),
                si(b * row.cost.macs),
            ]);
        }
        let memory_total = if self.training { total.saved_bytes } else { total.eval_live_bytes };
        table
            .footer(["total".to_owned(), String::new(), String::new(), grouped(total.params), grouped(b * memory_total), si(b * total.macs)])
            .note(format!(
                "Parameters {} ({} in f32); batch-norm buffers {} ({}).",
                grouped(total.params),
                human(total.params * F32_BYTES),
                grouped(total.buffers),
                human(total.buffers * F32_BYTES)
            ))
            .note(if self.training {
                let what = match self.cost.layers {
                    Layers::Plain => "every tensor the forward makes",
                    Layers::Lean => {
                        "with the lean layers, each batch-norm's input and each lean op's output, and of attention one \
                         statistic per row of its scores instead of the probabilities; backward recomputes the rest"
                    }
                };
                format!("Saved for backward: {}, what Candle's autograd keeps alive until the loss is dropped ({what}).", human(b * total.saved_bytes))
            } else {
                format!("Inference keeps no graph: the column is each layer's input, output and temporaries, alive one layer at a time; the largest is {}.", human(b * total.eval_live_bytes))
            })
            .note(format!(
                "Largest scratch of one layer on the CPU (a convolution's im2col columns and gemm output, or a lean op's f32 \
                 working map): {}; on a card, convolutions share cuDNN's one 64 MiB workspace instead.",
                human(b * total.workspace_bytes)
            ))
    }
}

/// A model built in a cell, as `%summary VARIABLE` sees it: its spec, the
/// input it was built for, and the arithmetic it trains in.
pub trait Summarize {
    fn summary_spec(&self) -> &ModelSpec;
    fn summary_input(&self) -> Shape;
    fn summary_precision(&self) -> Precision {
        Precision::F32
    }
    /// The layers the model runs.
    fn summary_layers(&self) -> Layers;
}

impl Summarize for super::Network {
    fn summary_spec(&self) -> &ModelSpec {
        self.spec()
    }

    fn summary_input(&self) -> Shape {
        self.input()
    }

    fn summary_layers(&self) -> Layers {
        self.layers()
    }
}

crate::render::shown_as_bundles!(Summary);

impl Render for Summary {
    fn bundle(&self) -> Bundle {
        self.table(3).bundle()
    }
}
