//! The analytic estimate: five bills and the peak found by walking the step.

use std::ops::Range;

use serde::Serialize;

use crate::dist;
use crate::gpus::{Card, CardKind};
use crate::models::{analyze_on, ConvLayer, Kernels, ModelCost, ModelSpec, Precision, F32_BYTES, MAX_BATCH};
use crate::ops::{ConvScratch, CUDNN_WORKSPACE_BYTES};

use super::bill::{line, Bill, BillKind, Line};
use super::levers::{Cards, OptimizerKind, Shard};
use super::plan::{StepPhase, StepPlan};
use super::step_config::{Mode, StepConfig};
use super::timeline::{Part, Parts, Peak, Phase, Recorder};
use super::LedgerError;

/// Bytes of one label: candle's cross-entropy takes u32 class indices.
const LABEL_BYTES: u64 = 4;
/// 8-bit Adam: one f32 scale per block of this many elements, per moment.
const BLOCK: u64 = 2048;
/// NCCL's receive buffers per channel of a ring, one per protocol, at its
/// defaults (`init.cc`): Simple `NCCL_BUFFSIZE` 4 MiB, LL128 4,915,200 B, LL 512 KiB.
const NCCL_CHANNEL_BYTES: u64 = (1 << 22) + 4_915_200 + (1 << 19);
/// The channels NCCL opens between PCIe-connected cards; NVLink systems open more.
const NCCL_CHANNELS: u64 = 2;
/// Open MPI's shared-memory transport per process (`btl_vader_segment_size`).
const MPI_SEGMENT_BYTES: u64 = 4 << 20;

/// What a step costs on a device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ledger {
    pub model: String,
    pub params: u64,
    pub config: StepConfig,
    pub device: Card,
    /// The five bills, in the lesson's order.
    pub bills: Vec<Bill>,
    pub timeline: Vec<Phase>,
    pub peak: Peak,
}

impl Ledger {
    pub fn bill(&self, kind: BillKind) -> &Bill {
        // `bills` always holds the five kinds in order.
        &self.bills[kind as usize]
    }

    /// What forward adds and keeps until backward: resident after the last
    /// forward phase less resident once the batch is copied.
    pub fn kept_by_forward(&self) -> u64 {
        let resident = |of: &dyn Fn(StepPhase) -> bool| self.timeline.iter().rfind(|p| of(p.phase)).map_or(0, |p| p.resident_bytes);
        resident(&StepPhase::is_forward).saturating_sub(resident(&|p| p == StepPhase::InputCopied))
    }

    /// Every line of every bill, as if all were resident at once (they aren't).
    pub fn sum_of_bills(&self) -> u64 {
        self.bills.iter().map(|b| b.bytes).sum()
    }
}

/// Costs one step of `spec` with `config` on `device`.
pub fn estimate(spec: &ModelSpec, config: &StepConfig, device: &Card) -> Result<Ledger, LedgerError> {
    let cards = config.levers.cards;
    for (what, value) in [("batch", config.batch), ("accumulation steps", config.levers.accumulation), ("cards", cards.count)] {
        if value == 0 {
            return Err(LedgerError::Zero { what });
        }
        if value > MAX_BATCH {
            return Err(LedgerError::TooLarge { what, value, max: MAX_BATCH });
        }
    }
    if !cards.several() && cards.shard != Shard::None {
        return Err(LedgerError::ShardOnOneCard(cards.shard.flag()));
    }
    if !cards.several() && cards.sync_batch_norm {
        return Err(LedgerError::SyncOnOneCard);
    }
    if cards.several() && config.mode == Mode::Inference {
        return Err(LedgerError::CardsInInference);
    }
    // A simulated card runs the step on our CPU kernels, a real one on the device passes.
    let kernels = match device.kind {
        CardKind::Cpu | CardKind::Simulated => Kernels::Host,
        CardKind::Catalogue | CardKind::Sized => Kernels::Device,
    };
    let cost = analyze_on(spec, config.input, config.levers.precision, config.levers.layers, kernels)?;
    let stage_names: Vec<&str> = cost.stages.iter().map(|s| s.name.as_str()).collect();
    let plan = StepPlan::of(&stage_names, config)?;
    let batch = config.batch as u64;
    let host_scratch = if device.is_cpu() { cost.convs.iter().map(|c| c.host_scratch(batch)).collect() } else { Vec::new() };
    let layer_scratch = if device.is_cpu() { layer_scratch(&cost, config, batch) } else { device_layer_scratch(&cost, config, batch) };
    let step = Step { cost: &cost, config, device, kernels, plan: &plan, batch, host_scratch, layer_scratch };
    let (bills, recorder) = match config.mode {
        Mode::Training => (step.training_bills(), step.walk_training()),
        Mode::Inference => (step.inference_bills(), step.walk_inference()),
    };
    let (timeline, peak) = recorder.finish();
    Ok(Ledger {
        model: spec.name.clone(),
        params: cost.total.params,
        config: config.clone(),
        device: device.clone(),
        bills,
        timeline,
        peak,
    })
}

struct Step<'a> {
    cost: &'a ModelCost,
    config: &'a StepConfig,
    device: &'a Card,
    kernels: Kernels,
    plan: &'a StepPlan,
    batch: u64,
    /// On the CPU, what each of `cost.convs` allocates beyond its operands
    /// (none on a device, whose convolutions share cuDNN's one workspace).
    host_scratch: Vec<ConvScratch>,
    /// What each attention and linear layer allocates beyond its operands,
    /// result and what it keeps: on the CPU score buffers, gemm's packing and
    /// f32 copies of half operands; on a device the attentions' buffers of
    /// one batch element (cuBLAS's own workspace aside).
    layer_scratch: Vec<LayerScratch>,
}

/// A layer's scratch, each pass's the most it holds at once, and, where its
/// backward scratch meets only that layer's own backward temporaries (an
/// attention's, a linear layer's), those per sample. A transposed
/// convolution's meets the stage's largest (measured on the U-Net in half
/// precision, whose up-convolutions' scratch outlasts their own pass).
struct LayerScratch {
    stage: usize,
    forward: u64,
    backward: u64,
    own_temporaries: Option<u64>,
}

/// The largest of DDP's buckets ([`dist::buckets`]) over the parameters
/// of `cost`'s `stages`, counted a layer at a time where the trainer
/// counts a tensor at a time: a bucket can end between a layer's weight
/// and its bias there, a few channels' worth.
pub(crate) fn largest_bucket(cost: &ModelCost, stages: Range<usize>, cap: u64) -> u64 {
    let rows = &cost.rows;
    let layers: Vec<u64> = rows
        .iter()
        .enumerate()
        .filter(|&(i, row)| rows.get(i + 1).is_none_or(|next| next.depth <= row.depth) && stages.contains(&row.stage))
        .map(|(_, row)| row.cost.params * F32_BYTES)
        .filter(|&bytes| bytes > 0)
        .collect();
    dist::buckets(&layers, cap).into_iter().map(|bucket| layers[bucket].iter().sum()).max().unwrap_or(0)
}

fn layer_scratch(cost: &ModelCost, config: &StepConfig, batch: u64) -> Vec<LayerScratch> {
    let attentions = cost.attentions.iter().map(|a| {
        let scratch = a.host_scratch(batch, config.levers.precision, config.levers.layers);
        LayerScratch { stage: a.stage, forward: scratch.forward, backward: scratch.backward, own_temporaries: Some(a.backward_bytes) }
    });
    let linears = cost.linears.iter().map(|l| {
        let scratch = l.host_scratch(batch, config.levers.precision);
        let backward = scratch.input_gradient.max(scratch.weight_gradient).max(scratch.bias_gradient);
        LayerScratch { stage: l.stage, forward: scratch.forward, backward, own_temporaries: Some(l.backward_bytes) }
    });
    let transposed_convs = cost.transposed_convs.iter().map(|t| {
        let scratch = t.host_scratch(batch, config.levers.precision);
        let backward = scratch.input_gradient.max(scratch.weight_gradient).max(scratch.bias_gradient);
        LayerScratch { stage: t.stage, forward: scratch.forward, backward, own_temporaries: None }
    });
    attentions.chain(linears).chain(transposed_convs).collect()
}

/// The attentions' scratch on a device, where the device passes walk the
/// batch one element at a time (`ops::attention_device_scratch`); the
/// linear layers and up-convolutions hold none beyond their results there.
fn device_layer_scratch(cost: &ModelCost, config: &StepConfig, batch: u64) -> Vec<LayerScratch> {
    let keeps = config.levers.layers.attention_keeps();
    let dtype = config.levers.precision.compute_dtype();
    cost.attentions
        .iter()
        .map(|a| {
            // The walk has already checked every attention's heads against its input.
            let scratch = crate::ops::attention_device_scratch(batch as usize, a.tokens, a.dim, a.heads, dtype, keeps).unwrap_or_default();
            LayerScratch { stage: a.stage, forward: scratch.forward, backward: scratch.backward, own_temporaries: Some(a.backward_bytes) }
        })
        .collect()
}

impl Step<'_> {
    fn weights(&self) -> u64 {
        self.cost.total.params * F32_BYTES
    }

    fn cards(&self) -> Cards {
        self.config.levers.cards
    }

    /// The weights this card keeps between stages: all of them, or under
    /// ZeRO-3 its part.
    fn own_weights(&self) -> u64 {
        self.cards().part_of(self.weights(), Shard::Parameters)
    }

    /// Stage `i`'s weights, gathered under ZeRO-3 from the other cards
    /// for its forward and kept, as the AMP copies are, by its graph.
    fn gathered(&self, i: usize) -> u64 {
        if self.cards().several() && self.cards().shard == Shard::Parameters {
            self.cost.stages[i].cost.params * F32_BYTES
        } else {
            0
        }
    }

    /// The most weights gathered at once: every stage whose graph is kept,
    /// and the largest checkpointed one while it is recomputed.
    fn most_gathered(&self) -> u64 {
        let stages = 0..self.cost.stages.len();
        let kept: u64 = stages.clone().filter(|&i| !self.plan.is_checkpointed(i)).map(|i| self.gathered(i)).sum();
        kept + stages.filter(|&i| self.plan.is_checkpointed(i)).map(|i| self.gathered(i)).max().unwrap_or(0)
    }

    /// What an exchange of the gradients (or the updated weights) of
    /// `stages` holds at once: the largest bucket made of them, the bucket
    /// received, and on the host Open MPI's own copy while it sums them (its
    /// ring all-reduce's, measured); NCCL sums inside its ring buffers.
    fn bucket(&self, stages: Range<usize>) -> u64 {
        let copies = if self.kernels == Kernels::Host { 3 } else { 2 };
        if self.cards().several() {
            copies * largest_bucket(self.cost, stages, self.cards().bucket_bytes)
        } else {
            0
        }
    }

    /// Gradients a backward segment makes whole: exchanged at its end
    /// where the cards reduce during backward.
    fn segment_gradients(&self, stages: Range<usize>) -> u64 {
        self.cost.stages[stages].iter().map(|s| s.cost.params * F32_BYTES).sum()
    }

    /// Whether each backward segment's gradients are divided among the
    /// cards once it is done (ZeRO-2 and ZeRO-3 reducing during backward).
    fn scatters_gradients(&self) -> bool {
        self.plan.reduces_in_backward() && self.cards().shard >= Shard::Gradients
    }

    /// The collective library's own buffers on each card: NCCL's rings on
    /// a device, Open MPI's shared memory on the host.
    fn collective_line(&self) -> Line {
        if !self.cards().several() {
            line("no collective on one card", 0)
        } else if self.kernels == Kernels::Host {
            line(
                "Open MPI's shared-memory segment (btl_vader_segment_size; mapped, so the allocation counters do not see it)",
                MPI_SEGMENT_BYTES,
            )
        } else {
            line(
                format!(
                    "NCCL's ring buffers: {NCCL_CHANNELS} channels x (4 MiB simple + 4.7 MiB LL128 + 0.5 MiB LL), its defaults between \
                     PCIe cards (NVLink systems open more channels)"
                ),
                NCCL_CHANNELS * NCCL_CHANNEL_BYTES,
            )
        }
    }

    fn amp_copies(&self, params: u64) -> u64 {
        if self.config.levers.precision.is_mixed() {
            params * self.config.levers.precision.compute_bytes()
        } else {
            0
        }
    }

    /// The batch's labels: one per sample, or one per pixel for segmentation.
    fn labels(&self) -> u64 {
        self.batch * self.cost.labels_per_sample() * LABEL_BYTES
    }

    fn images(&self) -> u64 {
        self.batch * self.cost.input.elems() * F32_BYTES
    }

    /// The optimizer state this card keeps: all of it, or from ZeRO-1 on its part.
    fn optimizer_state(&self) -> Vec<Line> {
        let cards = self.cards();
        let lines = self.whole_optimizer_state();
        if cards.shard < Shard::Optimizer {
            return lines;
        }
        let part = |l: Line| line(format!("{}, this card's 1/{}", l.label, cards.count), cards.part_of(l.bytes, Shard::Optimizer));
        lines.into_iter().map(part).collect()
    }

    fn whole_optimizer_state(&self) -> Vec<Line> {
        let params = self.cost.total.params;
        match self.config.levers.optimizer {
            OptimizerKind::Sgd => vec![],
            OptimizerKind::SgdMomentum => vec![line("momentum buffer (f32)", params * F32_BYTES)],
            OptimizerKind::Adam | OptimizerKind::AdamW => {
                vec![line("first moment m (f32)", params * F32_BYTES), line("second moment v (f32)", params * F32_BYTES)]
            }
            OptimizerKind::Adam8bit => {
                let small = self.cost.total.small_tensor_params;
                let large = params - small;
                let blocks = large / BLOCK + self.cost.total.large_tensors;
                vec![
                    line("m and v, 8-bit (1 B each)", 2 * large),
                    line("block scales (f32, per 2048 values)", 2 * blocks * F32_BYTES),
                    line("m and v of small tensors (f32)", 2 * small * F32_BYTES),
                ]
            }
        }
    }

    /// The update's temporaries, per element of the largest tensor it
    /// updates at once: a whole tensor, or at most this card's part.
    fn optimizer_temporaries(&self) -> u64 {
        let params = self.cards().part_of(self.cost.total.params, Shard::Optimizer);
        self.config.levers.optimizer.step_temporary_bytes(self.device.is_cpu()) * self.cost.total.largest_param_elems.min(params)
    }

    fn context_line(&self) -> Line {
        if self.device.is_cpu() {
            line("no CUDA context on the host", 0)
        } else {
            line("CUDA context, kernels, cuBLAS (estimated per generation; an H200's measured 689 MiB)", self.device.context_bytes)
        }
    }

    /// What stage `i` holds between its forward and its backward. A
    /// checkpointed first stage under mixed precision also keeps the half
    /// copy of the images it is recomputed from.
    /// What stage `i` holds from its forward until its backward: all it
    /// keeps, the loss's tensors aside (the trainer computes the loss when
    /// backward starts), or, checkpointed, its output.
    fn held(&self, i: usize) -> u64 {
        let stage = &self.cost.stages[i];
        self.batch
            * if !self.plan.is_checkpointed(i) {
                self.saved_in_forward(i)
            } else if self.keeps_half_images(i) {
                stage.boundary_bytes + stage.input.elems() * self.config.levers.precision.compute_bytes()
            } else {
                stage.boundary_bytes
            }
    }

    /// What stage `i`'s forward keeps: the last stage's without the loss.
    fn saved_in_forward(&self, i: usize) -> u64 {
        let saved = self.cost.stages[i].cost.saved_bytes;
        if i + 1 == self.cost.stages.len() {
            saved - self.cost.loss.saved_bytes
        } else {
            saved
        }
    }

    /// The copy of its input that a checkpointed stage `i` is recomputed
    /// from when the stage before kept its graph (a `Var` made of it).
    fn recompute_input_copy(&self, i: usize) -> u64 {
        if i > 0 && self.plan.is_checkpointed(i) && !self.plan.is_checkpointed(i - 1) {
            self.batch * self.cost.stages[i - 1].boundary_bytes
        } else {
            0
        }
    }

    fn keeps_half_images(&self, i: usize) -> bool {
        i == 0 && self.plan.is_checkpointed(i) && self.config.levers.precision.is_mixed()
    }

    /// The largest conv workspace of the step, for its bill line. A device's
    /// is cuDNN's one workspace, allocated whole at the first convolution
    /// and kept, and the largest attention's buffers of one batch element;
    /// the host's convolutions cut the batch into chunks, and theirs is what
    /// the largest pass of any of them allocates on all busy threads at once
    /// (columns, stacked images, gemm's packing).
    fn workspace(&self) -> u64 {
        let layers = self.layer_scratch.iter().map(|l| l.forward.max(l.backward));
        if self.device.is_cpu() {
            self.host_scratch.iter().map(ConvScratch::most).chain(layers).max().unwrap_or(0)
        } else {
            self.device_workspace() + layers.max().unwrap_or(0)
        }
    }

    /// cuDNN's workspace on a device, resident from the first convolution
    /// on (none on the host, or for a model without convolutions).
    fn device_workspace(&self) -> u64 {
        if self.device.is_cpu() || self.cost.convs.is_empty() {
            0
        } else {
            CUDNN_WORKSPACE_BYTES
        }
    }

    /// The host convolutions' scratch while stage `i` runs forward.
    fn forward_workspace(&self, i: usize) -> u64 {
        let convs = self.host_convs(i).map(|(_, scratch)| scratch.forward);
        convs.chain(self.host_layers(i).map(|l| l.forward)).max().unwrap_or(0)
    }

    /// The host layers' scratch while stage `i` runs backward, beyond the
    /// stage's largest backward temporaries (`temporaries`, for the batch):
    /// an attention's or linear layer's scratch meets its own temporaries,
    /// which may be fewer.
    fn backward_workspace(&self, i: usize, temporaries: u64) -> u64 {
        let beyond = |l: &LayerScratch| match l.own_temporaries {
            Some(own) => (l.backward + self.batch * own).saturating_sub(temporaries),
            None => l.backward,
        };
        self.host_layers(i).map(beyond).max().unwrap_or(0)
    }

    fn host_layers(&self, i: usize) -> impl Iterator<Item = &LayerScratch> {
        self.layer_scratch.iter().filter(move |l| l.stage == i)
    }

    /// The moments inside the host convolutions' backward passes in stage
    /// `i`: the gradients made so far (the conv's own among them, being
    /// summed), the incoming gradient and the one being made, and the
    /// conv's scratch. The scratch is freed before candle adds the result
    /// into its gradient store, so it never meets the backward rules'
    /// temporaries.
    fn host_conv_backward<'a>(&'a self, i: usize, live: &'a Parts, root: u64) -> impl Iterator<Item = Parts> + 'a {
        let stage_start: u64 = self.cost.stages[..i].iter().map(|s| s.cost.params).sum();
        self.host_convs(i).map(move |(c, scratch)| {
            let mut during = *live;
            during.remove(Part::Gradients, (c.params_before - stage_start) * F32_BYTES);
            let precision = self.config.levers.precision;
            let input_gradient = if c.reads_images { 0 } else { c.input.elems() };
            let gradients = (input_gradient + c.output.elems()) * precision.compute_bytes();
            during.add(Part::BackwardTemporaries, self.batch * gradients + root);
            // The weight gradient is summed in f32 beside the pass's scratch,
            // then under mixed precision cast to half beside itself.
            let half_copy = if precision.is_mixed() { c.weights() * precision.compute_bytes() } else { 0 };
            let weight_gradient = c.weights() * F32_BYTES + scratch.weight_gradient.max(half_copy);
            let input_scratch = if c.reads_images { 0 } else { scratch.input_gradient };
            during.add(Part::Workspace, input_scratch.max(weight_gradient));
            during
        })
    }

    /// Stage `i`'s convolutions with their host scratch (none on a device).
    fn host_convs(&self, i: usize) -> impl Iterator<Item = (&ConvLayer, &ConvScratch)> {
        self.cost.convs.iter().zip(&self.host_scratch).filter(move |(c, _)| c.stage == i)
    }

    /// Per element of a weight, beyond its f32 gradient, while backward makes
    /// that gradient. Our convolution returns it contiguous on both devices:
    /// in f32 it is the gradient; under AMP the f32 gradient is a copy of
    /// the half one.
    fn weight_gradient_temporary_bytes(&self) -> u64 {
        let precision = self.config.levers.precision;
        if precision.is_mixed() {
            precision.compute_bytes()
        } else {
            0
        }
    }

    /// Under AMP the loss scaler unscales each gradient into a new tensor
    /// and checks it for inf/NaN before the step: two f32 copies of the
    /// largest gradient at most (measured).
    fn unscale_temporaries(&self) -> u64 {
        if self.config.levers.precision.is_mixed() {
            2 * self.cost.total.largest_param_elems * F32_BYTES
        } else {
            0
        }
    }

    fn largest_recompute(&self) -> u64 {
        (0..self.cost.stages.len())
            .filter(|&i| self.plan.is_checkpointed(i))
            .map(|i| self.batch * self.cost.stages[i].cost.saved_bytes)
            .max()
            .unwrap_or(0)
    }

    fn backward_temporaries(&self) -> u64 {
        self.batch * self.cost.total.backward_bytes
    }

    fn training_bills(&self) -> Vec<Bill> {
        let c = self.config;
        let half = c.levers.precision.flag();
        let cards = c.levers.cards;
        let of_cards = |label: &str, from: Shard| {
            if cards.several() && cards.shard >= from {
                format!("{label}, this card's 1/{}", cards.count)
            } else {
                label.to_owned()
            }
        };
        let gradients = cards.part_of(self.weights(), Shard::Gradients);
        let mut params = vec![
            line(of_cards("weights (f32 master copy)", Shard::Parameters), self.own_weights()),
            line("weights gathered for the stages that run (ZeRO-3), kept by their graphs until their backward", self.most_gathered()),
            line("batch-norm running statistics", self.cost.total.buffers * F32_BYTES),
            line(
                match cards.shard {
                    Shard::Gradients if self.plan.all_reduces() => {
                        format!("gradients (f32), whole until reduced, then this card's 1/{}", cards.count)
                    }
                    _ => of_cards("gradients (f32)", Shard::Gradients),
                },
                if cards.shard == Shard::Gradients && self.plan.all_reduces() { self.weights() } else { gradients },
            ),
            line(
                format!("accumulated gradients (f32, {} micro-batches)", c.levers.accumulation),
                if c.levers.accumulation > 1 { gradients } else { 0 },
            ),
        ];
        if self.scatters_gradients() {
            let largest = self.plan.segments().iter().map(|s| self.segment_gradients(s.stages())).max().unwrap_or(0);
            params.insert(
                4,
                line(
                    "a backward stage's gradients, whole until they are reduced to their cards",
                    largest - cards.part_of(largest, Shard::Gradients),
                ),
            );
        }
        let mut activations: Vec<Line> = self
            .cost
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let what = if self.keeps_half_images(i) {
                    "checkpointed: keeps its output and the half images"
                } else if self.plan.is_checkpointed(i) {
                    "checkpointed: keeps its output"
                } else {
                    "saved for backward"
                };
                line(format!("{}: {what}", s.name), self.held(i))
            })
            .collect();
        activations.push(line(
            format!("{half} copies of conv/linear weights, kept by the graph (AMP)"),
            self.amp_copies(self.cost.total.amp_copy_params),
        ));
        activations.push(line("recompute of the largest checkpointed stage", self.largest_recompute()));
        vec![
            Bill::new(BillKind::Parameters, params),
            Bill::new(BillKind::OptimizerState, self.optimizer_state()),
            Bill::new(BillKind::Activations, activations),
            Bill::new(BillKind::InputBatch, self.input_lines(true)),
            Bill::new(
                BillKind::ContextAndWorkspace,
                vec![
                    self.context_line(),
                    line(self.workspace_label(), self.workspace()),
                    line("backward temporaries (the largest layer's gradients and scratch)", self.backward_temporaries()),
                    line(
                        format!("{} step temporaries (or AMP's unscaling, the larger)", c.levers.optimizer),
                        self.optimizer_temporaries().max(self.unscale_temporaries()),
                    ),
                    self.collective_line(),
                    line(self.bucket_label(), self.bucket(0..self.cost.stages.len())),
                ],
            ),
        ]
    }

    fn bucket_label(&self) -> String {
        let exchanged = match self.cards().shard {
            Shard::None => "gradients all-reduced",
            Shard::Optimizer => "gradients all-reduced, then the updated weights gathered",
            Shard::Gradients => "gradients reduced, then the updated weights gathered",
            Shard::Parameters => "gradients reduce-scattered",
        };
        let held =
            if self.kernels == Kernels::Host { "three buckets: made, received and MPI's sum" } else { "two buckets, made and received" };
        format!("{held} ({exchanged}, {} each)", crate::units::human(self.cards().bucket_bytes))
    }

    fn workspace_label(&self) -> &'static str {
        if self.device.is_cpu() && !self.cost.attentions.is_empty() {
            "conv and attention scratch (im2col columns and gemm buffers, or attention's score buffers)"
        } else if self.device.is_cpu() {
            "conv workspace (the largest conv's im2col columns and gemm buffers)"
        } else if !self.cost.attentions.is_empty() {
            "cuDNN workspace (one per device) and attention's buffers (one image's scores at a time)"
        } else {
            "cuDNN workspace (one per device, made at the first convolution)"
        }
    }

    fn input_lines(&self, training: bool) -> Vec<Line> {
        let input = self.cost.input;
        let mut lines = vec![line(format!("images (f32, {} x {input})", self.batch), self.images())];
        if training {
            lines.push(line("labels (u32)", self.labels()));
            let more = self.config.levers.accumulation as u64 - 1;
            lines.push(line(
                format!("the step's {more} other micro-batches (the trainer takes them together)"),
                more * (self.images() + self.labels()),
            ));
        }
        lines
    }

    fn inference_bills(&self) -> Vec<Bill> {
        let precision = self.config.levers.precision;
        vec![
            Bill::new(
                BillKind::Parameters,
                vec![line("weights (f32)", self.weights()), line("batch-norm running statistics", self.cost.total.buffers * F32_BYTES)],
            ),
            Bill::new(BillKind::OptimizerState, vec![]),
            Bill::new(
                BillKind::Activations,
                vec![line(
                    format!(
                        "largest live set: one layer's input, output, temporaries ({})",
                        if precision == Precision::F32 { "f32" } else { precision.flag() }
                    ),
                    self.batch * self.cost.total.eval_live_bytes,
                )],
            ),
            Bill::new(BillKind::InputBatch, self.input_lines(false)),
            Bill::new(
                BillKind::ContextAndWorkspace,
                vec![
                    self.context_line(),
                    line(self.workspace_label(), self.device_workspace()),
                    line("largest weight cast (AMP)", self.amp_copies(self.cost.total.largest_param_elems)),
                ],
            ),
        ]
    }

    /// Training: candle keeps every saved tensor until the loss is dropped, so
    /// without checkpointing nothing is freed during backward; with
    /// checkpointing the trainer runs backward segment by segment (NOTES:
    /// detach, recompute from `Var::from_tensor(input)`) and drops each
    /// segment's graph when its backward is done. The graph is dropped before
    /// the optimizer step. With accumulation the step shown is a later
    /// micro-batch, when the accumulated gradients already exist.
    fn walk_training(&self) -> Recorder<'_> {
        let c = self.config;
        let stages = &self.cost.stages;
        let mut rec = Recorder::new(self.plan);
        let mut live = Parts::default();
        let none = Parts::default();
        live.set(Part::Context, self.context_line().bytes);
        live.set(Part::Collective, self.collective_line().bytes);
        live.set(Part::Workspace, self.device_workspace());
        live.set(Part::Weights, self.own_weights());
        live.set(Part::Buffers, self.cost.total.buffers * F32_BYTES);
        live.set(Part::OptimizerState, self.optimizer_state().iter().map(|l| l.bytes).sum());
        if c.levers.accumulation > 1 {
            live.set(Part::AccumulatedGradients, c.levers.cards.part_of(self.weights(), Shard::Gradients));
        }
        rec.phase(StepPhase::Loaded, &live, &none);
        let micro_batches = c.levers.accumulation as u64;
        live.set(Part::Images, micro_batches * self.images());
        live.set(Part::Labels, micro_batches * self.labels());
        rec.phase(StepPhase::InputCopied, &live, &none);

        for (i, stage) in stages.iter().enumerate() {
            let amp = self.amp_copies(stage.cost.amp_copy_params);
            let mut transient = Parts::default();
            transient.set(Part::Workspace, self.forward_workspace(i));
            live.add(Part::AmpWeightCopies, amp);
            live.add(Part::GatheredWeights, self.gathered(i));
            live.add(Part::Activations, self.held(i));
            // A checkpointed stage's graph lives until its output is detached,
            // just after the phase ends.
            let graph = if self.plan.is_checkpointed(i) { self.batch * self.saved_in_forward(i) - self.held(i) } else { 0 };
            live.add(Part::Recompute, graph);
            rec.phase(StepPhase::Forward { stage: i }, &live, &transient);
            live.remove(Part::Recompute, graph);
            if self.plan.is_checkpointed(i) {
                live.remove(Part::AmpWeightCopies, amp);
                live.remove(Part::GatheredWeights, self.gathered(i));
            }
        }

        for (index, segment) in self.plan.segments().iter().enumerate().rev() {
            let phase = StepPhase::Backward { segment: index };
            // The phase's highest point: one of its stages' backward, with
            // that stage's transients on top of what is resident by then.
            let mut highest = live;
            // Below the head, backward starts from the product of the
            // segment's output and the gradient that reached it: the product
            // (kept by the root) and the gradient of the gradient's factor
            // (left in the store, that factor being no node of the graph)
            // stay until the segment is done; the output's own is used up.
            // Where backward is split between plain stages (on several
            // cards), it starts from that gradient as it is
            // (`Tensor::backward_with`), and holds nothing more.
            let root = if self.plan.starts_from_gradient(index) {
                0
            } else if segment.end < stages.len() {
                2 * self.batch * stages[segment.end - 1].boundary_bytes
            } else if self.plan.is_checkpointed(segment.end - 1) {
                0
            } else {
                self.batch * self.cost.loss.saved_bytes
            };
            for i in segment.stages().rev() {
                let stage = &stages[i];
                if self.plan.is_checkpointed(i) {
                    // Recomputed from the segment's input (a Var copy when the
                    // stage before kept a graph), alive while its backward runs.
                    live.set(Part::Recompute, self.batch * stage.cost.saved_bytes + self.recompute_input_copy(i));
                    live.add(Part::AmpWeightCopies, self.amp_copies(stage.cost.amp_copy_params));
                    live.add(Part::GatheredWeights, self.gathered(i));
                }
                let mut transient = Parts::default();
                transient.set(Part::BackwardTemporaries, self.batch * stage.cost.backward_bytes + root);
                transient.set(Part::Workspace, self.backward_workspace(i, self.batch * stage.cost.backward_bytes));
                live.add(Part::Gradients, stage.cost.params * F32_BYTES);
                // The stage's largest weight gradient is made before the
                // gradients of the layers that precede it.
                let mut at_largest_weight = live;
                at_largest_weight.remove(Part::Gradients, stage.cost.params_before_largest * F32_BYTES);
                at_largest_weight.add(Part::BackwardTemporaries, stage.cost.largest_param_elems * self.weight_gradient_temporary_bytes());
                // The stage's largest backward runs before the gradients of
                // the layers that precede it are made.
                let mut at_largest_backward = live;
                at_largest_backward.remove(Part::Gradients, stage.cost.params_before_largest_backward * F32_BYTES);
                let moments =
                    [at_largest_weight, at_largest_backward.plus(&transient)].into_iter().chain(self.host_conv_backward(i, &live, root));
                for during in moments {
                    if during.total() > highest.total() {
                        highest = during;
                    }
                }
            }
            // The trainer drops each segment's graph with its backward's root,
            // before the phase ends; the last segment's output (the logits)
            // is still borrowed by the loss then.
            let last = segment.end == stages.len();
            // The gradient that came in is freed with the segment's graph;
            // the one at its input waits for the segment below.
            let passed = match segment.start {
                0 => 0,
                start => self.batch * stages[start - 1].boundary_bytes,
            };
            live.set(Part::PassedGradient, passed);
            // Where the cards reduce during backward, the segment's
            // gradients are exchanged once its graph is dropped, a bucket at
            // a time; under ZeRO-2 and ZeRO-3 this card keeps its part.
            let whole = if self.plan.reduces_in_backward() { self.segment_gradients(segment.stages()) } else { 0 };
            let scattered = whole - c.levers.cards.part_of(whole, Shard::Gradients);
            if last {
                let mut resident = live;
                resident.remove(Part::Gradients, scattered);
                rec.phase_during(phase, &resident, highest);
            }
            for i in segment.stages() {
                live.remove(Part::Activations, self.held(i));
                live.remove(Part::AmpWeightCopies, self.amp_copies(stages[i].cost.amp_copy_params));
                live.remove(Part::GatheredWeights, self.gathered(i));
            }
            // The copy a recomputed segment made of its input is dropped
            // only after the phase ends, with the trainer's handle on it.
            live.set(Part::Recompute, self.recompute_input_copy(segment.start));
            let mut scattering = live;
            scattering.add(Part::Bucket, if whole > 0 { self.bucket(segment.stages()) } else { 0 });
            if scattering.total() > highest.total() {
                highest = scattering;
            }
            live.remove(Part::Gradients, scattered);
            if !last {
                rec.phase_during(phase, &live, highest);
            }
            live.set(Part::Recompute, 0);
        }
        live.set(Part::Activations, 0);
        live.set(Part::AmpWeightCopies, 0);
        rec.phase(StepPhase::GraphDropped, &live, &none);

        if c.levers.accumulation > 1 {
            let mut transient = Parts::default();
            transient.set(Part::OptimizerTemporaries, self.cost.total.largest_param_elems * F32_BYTES);
            live.set(Part::Gradients, 0);
            rec.phase(StepPhase::Accumulated, &live, &transient);
        }
        if self.plan.all_reduces() {
            // ZeRO-2 keeps this card's part of the reduced gradients.
            let mut during = live;
            during.add(Part::Bucket, self.bucket(0..stages.len()));
            live.remove(Part::Gradients, self.weights() - c.levers.cards.part_of(self.weights(), Shard::Gradients));
            rec.phase_during(StepPhase::GradientsReduced, &live, during);
        }
        let mut transient = Parts::default();
        transient.set(Part::OptimizerTemporaries, self.optimizer_temporaries().max(self.unscale_temporaries()));
        rec.phase(StepPhase::OptimizerStep, &live, &transient);
        if self.plan.gathers_updated_weights() {
            let mut transient = Parts::default();
            transient.set(Part::Bucket, self.bucket(0..stages.len()));
            rec.phase(StepPhase::WeightsGathered, &live, &transient);
        }
        for part in [Part::Gradients, Part::AccumulatedGradients, Part::Images, Part::Labels] {
            live.set(part, 0);
        }
        rec.phase(StepPhase::StepDone, &live, &none);
        rec
    }

    /// Inference: no graph; each stage's tensors die as the next layer runs,
    /// so only one layer's live set (its input, output, temporaries) and the
    /// current stage boundary exist at a time.
    fn walk_inference(&self) -> Recorder<'_> {
        let mut rec = Recorder::new(self.plan);
        let mut live = Parts::default();
        live.set(Part::Context, self.context_line().bytes);
        live.set(Part::Workspace, self.device_workspace());
        live.set(Part::Weights, self.weights());
        live.set(Part::Buffers, self.cost.total.buffers * F32_BYTES);
        rec.phase(StepPhase::Loaded, &live, &Parts::default());
        live.set(Part::Images, self.images());
        rec.phase(StepPhase::InputCopied, &live, &Parts::default());
        for (index, stage) in self.cost.stages.iter().enumerate() {
            // The live set includes the stage's input, so the previous boundary is not added again.
            let mut during = live;
            during.set(Part::Activations, self.batch * stage.cost.eval_live_bytes);
            during.set(Part::AmpWeightCopies, self.amp_copies(stage.cost.largest_param_elems));
            live.set(Part::Activations, self.batch * stage.boundary_bytes);
            rec.phase_during(StepPhase::Forward { stage: index }, &live, during);
        }
        rec
    }
}
