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
use crate::ledger::Checkpointing;
use crate::models::{Network, Pass};

/// Which stages recompute their activations in backward, resolved for one network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointPlan {
    checkpointed: Vec<bool>,
}

impl CheckpointPlan {
    /// Resolves a policy (none, every stage but the head, or named stages) against `net`.
    pub fn new(net: &Network, policy: &Checkpointing) -> std::result::Result<Self, crate::ledger::LedgerError> {
        Ok(CheckpointPlan {
            checkpointed: policy.resolve_names(&net.stage_names())?,
        })
    }

    pub fn none(net: &Network) -> Self {
        CheckpointPlan {
            checkpointed: vec![false; net.num_stages()],
        }
    }

    pub fn is_checkpointed(&self, stage: usize) -> bool {
        self.checkpointed.get(stage).copied().unwrap_or(false)
    }

    /// Consecutive plain stages form one segment; each checkpointed stage is its own.
    fn segments(&self) -> Vec<Segment> {
        let mut segments: Vec<Segment> = Vec::new();
        for (stage, &checkpointed) in self.checkpointed.iter().enumerate() {
            match segments.last_mut() {
                Some(last) if !checkpointed && !last.checkpointed => last.end = stage + 1,
                _ => segments.push(Segment {
                    start: stage,
                    end: stage + 1,
                    checkpointed,
                }),
            }
        }
        segments
    }
}

#[derive(Debug, Clone, Copy)]
struct Segment {
    start: usize,
    end: usize,
    checkpointed: bool,
}

/// What one micro-batch produced.
#[derive(Debug)]
pub struct Gradients {
    /// The unscaled mean loss of the micro-batch.
    pub loss: f32,
    /// Samples whose arg-max logit is the label.
    pub correct: usize,
    pub samples: usize,
    /// Gradients of the network's parameters only, of `loss * loss_scale`.
    pub grads: GradStore,
}

/// Mean cross-entropy of `logits` against `labels` (u32), computed in f32.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let logits = if logits.dtype() == DType::F32 {
        logits.clone()
    } else {
        logits.to_dtype(DType::F32)?
    };
    candle_nn::loss::cross_entropy(&logits, labels)
}

fn correct(logits: &Tensor, labels: &Tensor) -> Result<usize> {
    let predicted = logits.argmax(1)?;
    let hits = predicted.eq(&labels.to_dtype(predicted.dtype())?)?;
    Ok(hits.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()? as usize)
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

/// Forward and backward of `images` through `net`, the loss multiplied by
/// `loss_scale` before backward (loss scaling, accumulation). Gradients of
/// every parameter are returned; nothing is applied.
pub fn forward_backward(
    net: &Network,
    images: &Tensor,
    labels: &Tensor,
    pass: Pass,
    plan: &CheckpointPlan,
    loss_scale: f64,
) -> Result<Gradients> {
    forward_backward_watched(net, images, labels, pass, plan, loss_scale, &mut |_, _| {})
}

/// [`forward_backward`], calling `phase` with the name of each phase as it
/// ends (the ledger's names: `forward layer1`, `backward layer4`, ...) and the
/// bytes of parameter gradients collected so far, so a probe can read memory
/// between phases.
pub fn forward_backward_watched(
    net: &Network,
    images: &Tensor,
    labels: &Tensor,
    pass: Pass,
    plan: &CheckpointPlan,
    loss_scale: f64,
    phase: &mut dyn FnMut(&str, u64),
) -> Result<Gradients> {
    let segments = plan.segments();
    let mut inputs: Vec<Input> = Vec::with_capacity(segments.len());
    let mut graphs: Vec<Option<Tensor>> = Vec::with_capacity(segments.len());
    let mut x = Input::Batch(net.enter(images, pass)?);
    let stage_names = net.stage_names();
    let forward_name = |stage: usize| {
        let what = if stage + 1 == stage_names.len() { " and loss" } else { "" };
        format!("forward {}{what}", stage_names[stage])
    };
    // A simulated device budget fails the step at the end of the phase that crossed it.
    let mut forward_phase = |stage: usize| {
        let name = forward_name(stage);
        phase(&name, 0);
        checkpoint(|| name)
    };
    for (i, segment) in segments.iter().enumerate() {
        let out = run(net, segment, x.tensor(), pass, &mut forward_phase)?;
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
        } else {
            graphs.push(Some(out.clone()));
            Input::Attached(out)
        };
        inputs.push(std::mem::replace(&mut x, next));
    }
    drop(x);

    let mut grads = GradStore::default();
    let mut grad_out: Option<Tensor> = None;
    let (mut loss, mut hits) = (0.0, 0);
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
                let mut recomputed = |stage: usize| checkpoint(|| format!("backward {}, recomputing its forward", stage_names[stage]));
                let out = run(net, segment, &tracked, pass.recompute(), &mut recomputed)?;
                (tracked, out)
            }
        };
        let root = match grad_out.take() {
            None => {
                let l = cross_entropy(&out, labels)?;
                loss = l.to_scalar::<f32>()?;
                hits = correct(&out.detach(), labels)?;
                (l * loss_scale)?
            }
            Some(g) => {
                let g = g.to_dtype(out.dtype())?;
                (out * g)?.sum_all()?.to_dtype(DType::F32)?
            }
        };
        let mut segment_grads = root.backward()?;
        drop(root);
        for named in net.params() {
            if let Some(g) = segment_grads.remove(named.var.as_tensor()) {
                grads.insert(named.var.as_tensor(), g);
            }
        }
        if i > 0 {
            grad_out = Some(segment_grads.remove(&input_tensor).ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "no gradient reached the input of stage {}",
                    segment.start
                ))
            })?);
        }
        drop(segment_grads);
        let name = format!("backward {}", stage_names[segment.start..segment.end].join(", "));
        phase(&name, grad_bytes(&grads, net));
        checkpoint(|| name)?;
    }
    Ok(Gradients {
        loss,
        correct: hits,
        samples: images.dim(0)?,
        grads,
    })
}

fn run(
    net: &Network,
    segment: &Segment,
    x: &Tensor,
    pass: Pass,
    stage_done: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<Tensor> {
    let mut x = x.clone();
    for stage in segment.start..segment.end {
        x = net.forward_stage(stage, &x, pass)?;
        stage_done(stage)?;
    }
    Ok(x)
}

/// Bytes of the parameter gradients in `grads`.
pub(crate) fn grad_bytes(grads: &GradStore, net: &Network) -> u64 {
    net.params()
        .iter()
        .filter_map(|p| grads.get(p.var.as_tensor()))
        .map(|g| (g.elem_count() * g.dtype().size_in_bytes()) as u64)
        .sum()
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
