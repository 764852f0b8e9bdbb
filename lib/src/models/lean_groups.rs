//! Which layers a network is made of, and where the lean ones group a
//! spec's layers into one op (`crate::ops::norm_act`, `norm_add_act`).
//!
//! The grouping is read off the spec, once, by the network (which builds
//! one module per group) and by the cost analysis (whose rules say what a
//! group keeps), so the two cannot disagree:
//!
//! - a batch-norm, the activation after it (if any) and the convolution
//!   (without bias) or max-pool after that (if any) are one op that keeps
//!   the batch-norm's input;
//! - a residual block whose body and projection each end in a batch-norm,
//!   and whose post layers are nothing or one activation, ends in one op
//!   that adds the two normalised tensors and activates;
//! - a GELU or a layer-norm and the linear layer after it are one op
//!   (`crate::ops::gelu_linear`, `norm_linear`) that keeps the GELU's or
//!   the layer-norm's input;
//! - a residual block whose body ends in a linear layer, with nothing after
//!   the add, adds its input inside that layer's op
//!   (`crate::ops::linear_residual`), so that the layer's output is never
//!   kept beside the sum.
//!
//! A batch-norm alone, with nothing of either kind after it, stays a plain
//! batch-norm: it would keep as much either way.

use serde::{Deserialize, Serialize};

use super::spec::{self, Op};
use crate::ops::{Activation, AttentionKeeps, Fused, Reads};

/// The layers a network is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Layers {
    /// One op per layer, each keeping what an ordinary autograd keeps.
    Plain,
    /// Batch-norm fused with what reads it: backward recomputes the
    /// normalised, activated tensor from the batch-norm's input.
    #[default]
    Lean,
}

impl Layers {
    /// What these layers are on `device`: the lean ops run on the CPU and,
    /// in a build with the cuda feature, on CUDA (through cuDNN); elsewhere
    /// they run the plain ops, keeping what those keep.
    pub fn on(self, device: &candle_core::Device) -> Layers {
        if device.is_cpu() || (cfg!(feature = "cuda") && device.is_cuda()) {
            self
        } else {
            Layers::Plain
        }
    }

    /// What attention keeps for backward in these layers: its probabilities
    /// (plain), or one statistic per row of its scores (lean).
    pub fn attention_keeps(self) -> AttentionKeeps {
        match self {
            Layers::Plain => AttentionKeeps::Probabilities,
            Layers::Lean => AttentionKeeps::RowStatistics,
        }
    }

    pub fn flag(self) -> &'static str {
        match self {
            Layers::Plain => "plain",
            Layers::Lean => "lean",
        }
    }
}

impl std::fmt::Display for Layers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} layers", self.flag())
    }
}

/// What a spec layer is inside the lean layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// An op of its own.
    Own,
    /// Inside a lean op, before its end: its output is never stored.
    Inside,
    /// The end of a lean op: it stores the op's output; `activated` where
    /// the op applies an activation before it.
    End { activated: bool },
    /// The activation a lean residual block's end applies: it stores the
    /// block's output; the block's sum carries the op's transients.
    Stored,
    /// A linear layer as one op with what it reads (the GELU or layer-norm
    /// before it, then `Inside`) and adds (its block's input).
    Linear(Fused),
}

/// Where a list of layers sits in a lean residual block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Place {
    /// Anywhere else: the list's groups alone.
    Open,
    /// The body or projection: the block's end takes the last batch-norm.
    Merged,
    /// The post layers: the block's end applies them.
    Post,
    /// The body of a residual block whose last linear layer adds the block's input.
    Streamed,
}

/// A lean op over layers of one list, by index: `bn`, then `act` and `then` where present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Group {
    pub bn: usize,
    pub act: Option<usize>,
    pub then: Option<usize>,
}

pub(super) fn activation(op: &Op) -> Option<Activation> {
    match op {
        Op::Relu => Some(Activation::Relu),
        Op::Silu => Some(Activation::Silu),
        _ => None,
    }
}

fn fusable_consumer(op: &Op) -> bool {
    matches!(op, Op::Conv2d(conv) if !conv.bias) || matches!(op, Op::MaxPool2d { .. })
}

/// The lean ops of a list of layers, in order. `skip_last` leaves the last
/// layer out (a batch-norm a residual block's end takes).
pub(super) fn groups(layers: &[spec::Layer], skip_last: bool) -> Vec<Group> {
    let end = if skip_last { layers.len().saturating_sub(1) } else { layers.len() };
    let op = |i: usize| (i < end).then(|| &layers[i].op);
    let mut found = Vec::new();
    let mut i = 0;
    while i < end {
        if !matches!(layers[i].op, Op::BatchNorm2d) {
            i += 1;
            continue;
        }
        let act = op(i + 1).and_then(activation).map(|_| i + 1);
        let next = act.map_or(i + 1, |a| a + 1);
        let then = op(next).filter(|o| fusable_consumer(o)).map(|_| next);
        if act.is_some() || then.is_some() {
            found.push(Group { bn: i, act, then });
        }
        i = then.or(act).unwrap_or(i) + 1;
    }
    found
}

/// The layers of a list that the linear layer after each reads inside one
/// op: the index of each, and what the linear layer reads.
pub(super) fn read_by_linears(layers: &[spec::Layer]) -> Vec<(usize, Reads)> {
    let reads = |op: &Op| match op {
        Op::Gelu => Some(Reads::Gelu),
        Op::LayerNorm { .. } => Some(Reads::Norm),
        _ => None,
    };
    let pairs = layers.windows(2).enumerate();
    pairs.filter(|(_, pair)| matches!(pair[1].op, Op::Linear { .. })).filter_map(|(i, pair)| Some((i, reads(&pair[0].op)?))).collect()
}

/// Whether a residual block adds its input inside its body's last linear
/// layer: an identity shortcut, a body that ends in a linear layer (which
/// reads no layer-norm), and nothing after the add.
pub(super) fn streams(block: &spec::Block) -> bool {
    let ops: Vec<&Op> = block.body.iter().map(|layer| &layer.op).collect();
    matches!(block.shortcut, spec::Shortcut::Identity)
        && block.post.is_empty()
        && matches!(ops.as_slice(), [.., Op::Linear { .. }])
        && !matches!(ops.as_slice(), [.., Op::LayerNorm { .. }, Op::Linear { .. }])
}

/// The role of each layer of a list under [`groups`] and [`read_by_linears`], with [`streams`] read off the block for `Place::Streamed`.
pub(super) fn roles(layers: &[spec::Layer], place: Place) -> Vec<Role> {
    if place == Place::Post {
        return vec![Role::Stored; layers.len()];
    }
    let skip_last = place == Place::Merged;
    let mut roles = vec![Role::Own; layers.len()];
    for g in groups(layers, skip_last) {
        let last = g.then.or(g.act).unwrap_or(g.bn);
        for i in [Some(g.bn), g.act, g.then].into_iter().flatten() {
            roles[i] = if i == last { Role::End { activated: g.act.is_some() } } else { Role::Inside };
        }
    }
    if skip_last {
        if let Some(last) = roles.last_mut() {
            *last = Role::Inside;
        }
    }
    for (read, reads) in read_by_linears(layers) {
        if roles[read] == Role::Own && roles[read + 1] == Role::Own {
            (roles[read], roles[read + 1]) = (Role::Inside, Role::Linear(Fused { reads, adds_residual: false }));
        }
    }
    if place == Place::Streamed {
        match roles.last_mut() {
            Some(Role::Linear(fused)) => fused.adds_residual = true,
            Some(last @ Role::Own) => *last = Role::Linear(Fused { reads: Reads::Input, adds_residual: true }),
            _ => {}
        }
    }
    roles
}

/// How a residual block ends in the lean layers, when one op can end it:
/// the activation of its post layers (`Identity` when there are none).
pub(super) fn merge(block: &spec::Block) -> Option<Activation> {
    let ends_in_norm = |layers: &[spec::Layer]| matches!(layers.last(), Some(l) if matches!(l.op, Op::BatchNorm2d));
    let residual = match &block.shortcut {
        spec::Shortcut::None | spec::Shortcut::Concat => false,
        spec::Shortcut::Identity => true,
        spec::Shortcut::Projection(layers) => ends_in_norm(layers),
    };
    if !residual || !ends_in_norm(&block.body) {
        return None;
    }
    match block.post.as_slice() {
        [] => Some(Activation::Identity),
        [one] => activation(&one.op),
        _ => None,
    }
}
