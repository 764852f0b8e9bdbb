//! One forward and backward pass over a micro-batch, with activation
//! checkpointing by stages.
//!
//! Candle keeps a forward graph alive until its root is dropped and frees
//! nothing it saved during backward. So the network runs as segments: a run of
//! plain stages keeps its graph; a checkpointed stage keeps only its input, its
//! output is detached, and in backward it is run again from that input. Each
//! segment's graph is dropped as soon as its backward is done.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

use super::oom::checkpoint;
use crate::ledger::{Segment, StepPhase, StepPlan};
use crate::models::{Network, Pass};

/// What one micro-batch produced. The loss and the count of correct
/// predictions stay on the device (scalars) until the step has queued
/// everything: reading them between forward and backward would make the
/// host wait for the device there.
#[derive(Debug)]
pub struct Gradients {
    /// The unscaled mean loss of the micro-batch, an f32 scalar.
    pub loss: Tensor,
    /// Predictions whose arg-max logit is the label, a u32 scalar: samples,
    /// or pixels for segmentation.
    pub correct: Tensor,
    pub samples: usize,
    /// Labels in the micro-batch: one per sample, or one per pixel.
    pub labels: usize,
    /// Gradients of the network's parameters only, of `loss * loss_scale`.
    pub grads: GradStore,
}

/// Mean cross-entropy of `logits` against `labels` (u32), computed in f32:
/// `N x classes` logits against `N` labels, or, for segmentation, `N x
/// classes x H x W` against `N x H x W` labels, the mean over every pixel.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    check_labels(logits, labels)?;
    let logits = if logits.dtype() == DType::F32 { logits.clone() } else { logits.to_dtype(DType::F32)? };
    let log_probabilities = candle_nn::ops::log_softmax(&logits, 1)?;
    log_probabilities.gather(&labels.unsqueeze(1)?, 1)?.mean_all()?.neg()
}

/// That `labels` has the shape `logits` needs: theirs without the classes.
fn check_labels(logits: &Tensor, labels: &Tensor) -> Result<()> {
    let dims = logits.dims();
    let expected: Vec<usize> = dims.iter().enumerate().filter(|&(i, _)| i != 1).map(|(_, &d)| d).collect();
    if dims.len() < 2 || labels.dims() != expected.as_slice() {
        return Err(candle_core::Error::Msg(format!(
            "cross-entropy: logits {:?} need labels {:?} (one per {}), got {:?}",
            dims,
            expected,
            if dims.len() > 2 { "pixel" } else { "sample" },
            labels.dims()
        )));
    }
    Ok(())
}

/// Predictions whose arg-max logit is the label: samples, or pixels.
pub(crate) fn correct(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let predicted = logits.argmax(1)?;
    let hits = predicted.eq(&labels.to_dtype(predicted.dtype())?)?;
    hits.to_dtype(DType::U32)?.sum_all()
}

/// A segment's input in forward: the batch itself (no gradient wanted), or
/// the boundary with the segment before, which backward differentiates.
enum Input {
    Batch(Tensor),
    Boundary(Var),
    Attached(Tensor),
}

impl Input {
    fn tensor(&self) -> &Tensor {
        match self {
            Input::Batch(t) | Input::Attached(t) => t,
            Input::Boundary(v) => v.as_tensor(),
        }
    }
}

/// Whoever watches a training step (a meter reading memory between phases, a
/// live view): told as each phase of the step's plan ends, with the bytes of
/// parameter gradients the step holds then (the accumulated ones included).
/// A closure `|phase, gradient_bytes| ...` is one.
pub trait StepWatcher: Send {
    fn phase_ended(&mut self, phase: StepPhase, gradient_bytes: u64);
}

impl<F: FnMut(StepPhase, u64) + Send> StepWatcher for F {
    fn phase_ended(&mut self, phase: StepPhase, gradient_bytes: u64) {
        self(phase, gradient_bytes)
    }
}

/// A step's walk through its plan, the one place each phase's end goes: it
/// is remembered (an out-of-memory error names the phase after it), told to
/// the watchers (those of the last micro-batch only: the earlier ones repeat
/// it, and the ledger predicts one), and, where the phase allocates (each
/// stage's forward and recomputation, each segment's backward, the optimizer
/// step), checked against the simulated budget, which fails the step there.
pub(crate) struct PhaseWalk<'a, 'w> {
    plan: &'a StepPlan,
    watchers: &'a mut [&'w mut dyn StepWatcher],
    /// Whether this micro-batch's phases go to the watchers.
    told: bool,
    /// Gradient bytes accumulated by the micro-batches before this one.
    accumulated: u64,
    last: Option<StepPhase>,
}

impl<'a, 'w> PhaseWalk<'a, 'w> {
    pub(crate) fn new(plan: &'a StepPlan, watchers: &'a mut [&'w mut dyn StepWatcher]) -> Self {
        PhaseWalk { plan, watchers, told: true, accumulated: 0, last: None }
    }

    /// The next micro-batch starts, the last of the step or not, with
    /// `accumulated` gradient bytes from those before it.
    pub(crate) fn micro_batch(&mut self, last: bool, accumulated: u64) {
        self.told = last;
        self.accumulated = accumulated;
    }

    /// `phase` ended with `gradient_bytes` held in all.
    pub(crate) fn ended(&mut self, phase: StepPhase, gradient_bytes: u64) -> Result<()> {
        self.last = Some(phase);
        if self.told {
            for watcher in self.watchers.iter_mut() {
                watcher.phase_ended(phase, gradient_bytes);
            }
        }
        match phase {
            StepPhase::Forward { .. } | StepPhase::Backward { .. } | StepPhase::OptimizerStep => checkpoint(self.plan, phase),
            _ => Ok(()),
        }
    }

    /// A phase of this micro-batch's forward and backward ended, with
    /// `collected` gradient bytes of its own.
    fn pass_ended(&mut self, phase: StepPhase, collected: u64) -> Result<()> {
        self.ended(phase, self.accumulated + collected)
    }

    /// A checkpointed stage ran again in backward: checked against the
    /// budget, not a phase of its own.
    fn recomputed(&mut self, stage: usize) -> Result<()> {
        checkpoint(self.plan, StepPhase::Recompute { stage })
    }

    /// The last phase that ended.
    pub(crate) fn last(&self) -> Option<StepPhase> {
        self.last
    }
}

/// Forward and backward of `images` through `net`, the loss multiplied by
/// `loss_scale` before backward (loss scaling, accumulation). Gradients of
/// every parameter are returned; nothing is applied. A simulated budget fails
/// it at the end of the phase that crossed it.
pub fn forward_backward(
    net: &Network,
    images: &Tensor,
    labels: &Tensor,
    pass: Pass,
    plan: &StepPlan,
    loss_scale: f64,
) -> Result<Gradients> {
    forward_backward_walked(net, images, labels, pass, loss_scale, &mut PhaseWalk::new(plan, &mut []), &mut |_, _| Ok(()))
}

/// [`forward_backward`], each phase's end going to `walk`, and each
/// segment's gradients, once its backward is done and its graph dropped,
/// to `segment_done` (with every gradient made so far) before the phase
/// ends.
pub(crate) fn forward_backward_walked(
    net: &Network,
    images: &Tensor,
    labels: &Tensor,
    pass: Pass,
    loss_scale: f64,
    walk: &mut PhaseWalk<'_, '_>,
    segment_done: &mut dyn FnMut(&mut GradStore, &Segment) -> Result<()>,
) -> Result<Gradients> {
    let plan = walk.plan;
    let segments = plan.segments();
    let mut inputs: Vec<Input> = Vec::with_capacity(segments.len());
    let mut graphs: Vec<Option<Tensor>> = Vec::with_capacity(segments.len());
    let mut x = Input::Batch(net.enter(images, pass)?);
    for (i, segment) in segments.iter().enumerate() {
        let out = run(net, segment, x.tensor(), pass, &mut |stage| walk.pass_ended(StepPhase::Forward { stage }, 0))?;
        let last = i + 1 == segments.len();
        let next = if segment.checkpointed && !last {
            graphs.push(None);
            Input::Boundary(Var::from_tensor(&out.detach())?)
        } else if segment.checkpointed {
            graphs.push(None);
            Input::Attached(out.detach())
        } else if !last && segments[i + 1].checkpointed {
            graphs.push(Some(out.clone()));
            Input::Attached(out.detach())
        } else if !last {
            // Two plain segments: the one below starts from a leaf over
            // this one's output, which this segment's graph keeps.
            graphs.push(Some(out.clone()));
            Input::Boundary(Var::sharing(&out))
        } else {
            graphs.push(Some(out.clone()));
            Input::Attached(out)
        };
        inputs.push(std::mem::replace(&mut x, next));
    }
    drop(x);

    let mut grads = GradStore::default();
    let mut grad_out: Option<Tensor> = None;
    let mut scored = None;
    for (i, segment) in segments.iter().enumerate().rev() {
        let input = inputs.pop().ok_or_else(|| candle_core::Error::Msg("segment input missing".into()))?;
        let (input_tensor, out) = match graphs.pop().flatten() {
            Some(out) => (input.tensor().clone(), out),
            None => {
                let tracked = match &input {
                    Input::Batch(t) => t.clone(),
                    Input::Boundary(v) => v.as_tensor().clone(),
                    Input::Attached(t) => Var::from_tensor(t)?.as_tensor().clone(),
                };
                let out = run(net, segment, &tracked, pass.recompute(), &mut |stage| walk.recomputed(stage))?;
                (tracked, out)
            }
        };
        let split = plan.starts_from_gradient(i);
        let (root, from) = match grad_out.take() {
            None => {
                let l = cross_entropy(&out, labels)?;
                scored = Some((l.detach(), correct(&out.detach(), labels)?));
                ((l * loss_scale)?, None)
            }
            Some(g) if split => {
                let g = g.to_dtype(out.dtype())?;
                (out, Some(g))
            }
            Some(g) => {
                let g = g.to_dtype(out.dtype())?;
                ((out * g)?.sum_all()?.to_dtype(DType::F32)?, None)
            }
        };
        let mut segment_grads = match from {
            Some(g) => root.backward_with(&g)?,
            None => root.backward()?,
        };
        drop(root);
        for named in net.params() {
            // Candle's own backward ops (ReLU, the residual add, the linear layer)
            // build a parameter's gradient from tensors of the graph, and the
            // gradient would keep the whole graph alive until it is dropped.
            if let Some(g) = segment_grads.remove(named.var.as_tensor()) {
                grads.insert(named.var.as_tensor(), g.detach());
            }
        }
        if i > 0 {
            grad_out = Some(
                segment_grads
                    .remove(&input_tensor)
                    .ok_or_else(|| candle_core::Error::Msg(format!("no gradient reached the input of stage {}", segment.start)))?,
            );
        }
        drop(segment_grads);
        segment_done(&mut grads, segment)?;
        walk.pass_ended(StepPhase::Backward { segment: i }, grad_bytes(&grads, net))?;
    }
    let (loss, correct) = scored.ok_or_else(|| candle_core::Error::Msg("the last segment computed no loss".into()))?;
    Ok(Gradients { loss, correct, samples: images.dim(0)?, labels: labels.elem_count(), grads })
}

fn run(net: &Network, segment: &Segment, x: &Tensor, pass: Pass, stage_done: &mut dyn FnMut(usize) -> Result<()>) -> Result<Tensor> {
    let mut x = x.clone();
    for stage in segment.stages() {
        x = net.forward_stage(stage, &x, pass)?;
        stage_done(stage)?;
    }
    Ok(x)
}

/// Bytes of the parameter gradients in `grads`.
pub(crate) fn grad_bytes(grads: &GradStore, net: &Network) -> u64 {
    net.params().iter().filter_map(|p| grads.get(p.var.as_tensor())).map(|g| (g.elem_count() * g.dtype().size_in_bytes()) as u64).sum()
}

/// Adds `grads` (one micro-batch's) into `total`, parameter by parameter.
pub fn accumulate(total: &mut GradStore, net: &Network, mut grads: GradStore) -> Result<()> {
    for named in net.params() {
        let param = named.var.as_tensor();
        if let Some(g) = grads.remove(param) {
            let sum = match total.remove(param) {
                Some(previous) => (previous + g)?,
                None => g,
            };
            total.insert(param, sum);
        }
    }
    Ok(())
}
