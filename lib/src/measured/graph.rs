//! What forward keeps for backward, read off the autograd graph of a real
//! step: every storage a loss's graph holds alive, and among them those
//! backward reads, each counted once and put under the op that made it.
//!
//! In candle every op records the tensors it was computed from, so the graph
//! holds every intermediate until the loss is dropped, including those whose
//! backward needs only their shape (an add's inputs, a reshape's source).
//! Which ones backward reads follows candle's `backprop.rs`, op by op.

use std::collections::{HashMap, HashSet};

use candle_core::op::{BinaryOp, Op, ReduceOp, UnaryOp};
use candle_core::{Tensor, TensorId, Var};
use serde::Serialize;

/// The storages of one op's outputs that the graph holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeptByOp {
    /// The op (`conv2d`, `matmul`, `relu`, a custom op's own name), or
    /// `made outside the graph` for a constant the forward created.
    pub op: String,
    /// Storages it made that the graph holds.
    pub storages: usize,
    /// Bytes of those backward reads.
    pub read: u64,
    /// Bytes of all of them, read or only linked.
    pub held: u64,
}

/// The graph of one loss: what it holds beyond the parameters and the input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Kept {
    /// By op, the largest readers first.
    pub by_op: Vec<KeptByOp>,
}

impl Kept {
    /// Walks the graph of `loss`, leaving out the storages of the variables
    /// and of `input` (bills of their own).
    pub fn of(loss: &Tensor, input: &Tensor) -> Kept {
        let nodes = graph_nodes(loss);
        let input_storage = storage_key(input);
        let mut storages: HashMap<usize, Storage> = HashMap::new();
        let variable_storages: HashSet<usize> = nodes.iter().filter(|n| n.is_variable()).map(|n| storage_key(n)).collect();
        for node in &nodes {
            let key = storage_key(node);
            if node.is_variable() || key == input_storage || variable_storages.contains(&key) {
                continue;
            }
            let storage = storages.entry(key).or_insert_with(|| Storage { bytes: 0, maker: None, read: false });
            storage.bytes = storage.bytes.max(span_bytes(node));
            // A view (reshape, transpose, narrow) shares its source's storage: the op
            // that made the storage is the one whose arguments do not share it.
            let makes_it = node.op().as_ref().is_none_or(|op| args(op).iter().all(|arg| storage_key(arg) != key));
            if makes_it && storage.maker.is_none() {
                storage.maker = Some(op_name(node.op().as_ref()));
            }
        }
        for node in &nodes {
            let Some(op) = node.op() else { continue };
            let (read_args, reads_output) = read_by_backward(op);
            let read = read_args.into_iter().chain(reads_output.then_some(*node));
            for tensor in read {
                if let Some(storage) = storages.get_mut(&storage_key(tensor)) {
                    storage.read = true;
                }
            }
        }
        let mut by_op: Vec<KeptByOp> = Vec::new();
        for storage in storages.into_values() {
            let op = storage.maker.unwrap_or_else(|| op_name(None));
            let entry = match by_op.iter_mut().find(|k| k.op == op) {
                Some(entry) => entry,
                None => {
                    by_op.push(KeptByOp { op, storages: 0, read: 0, held: 0 });
                    by_op.last_mut().expect("just pushed")
                }
            };
            entry.storages += 1;
            entry.held += storage.bytes;
            if storage.read {
                entry.read += storage.bytes;
            }
        }
        by_op.sort_by(|a, b| (b.read, b.held, &a.op).cmp(&(a.read, a.held, &b.op)));
        Kept { by_op }
    }

    /// Bytes backward reads.
    pub fn read(&self) -> u64 {
        self.by_op.iter().map(|k| k.read).sum()
    }

    /// Bytes the graph holds.
    pub fn held(&self) -> u64 {
        self.by_op.iter().map(|k| k.held).sum()
    }
}

/// The variables `loss` depends on (the graph's leaves), once each: the
/// parameters a step updates.
pub fn graph_variables(loss: &Tensor) -> Vec<Var> {
    graph_nodes(loss).into_iter().filter(|n| n.is_variable()).filter_map(|n| Var::from_tensor(n).ok()).collect()
}

struct Storage {
    bytes: u64,
    maker: Option<String>,
    read: bool,
}

/// Every tensor reachable from `loss` through the ops' arguments, once each.
fn graph_nodes(loss: &Tensor) -> Vec<&Tensor> {
    let mut seen: HashSet<TensorId> = HashSet::new();
    let mut nodes = Vec::new();
    let mut stack = vec![loss];
    while let Some(node) = stack.pop() {
        if !seen.insert(node.id()) {
            continue;
        }
        nodes.push(node);
        if let Some(op) = node.op() {
            stack.extend(args(op));
        }
    }
    nodes
}

/// One storage's identity: the address of the storage behind the tensor's lock.
fn storage_key(tensor: &Tensor) -> usize {
    let (storage, _) = tensor.storage_and_layout();
    std::ptr::from_ref(&*storage).addr()
}

/// Bytes of the storage a tensor reaches: the furthest element its layout
/// addresses. The tensor that made a storage reaches all of it, and the
/// graph holds that tensor whenever it holds a view of it.
fn span_bytes(tensor: &Tensor) -> u64 {
    let layout = tensor.layout();
    let dims = layout.dims();
    if dims.contains(&0) {
        return 0;
    }
    let last: usize = dims.iter().zip(layout.stride()).map(|(&d, &s)| (d - 1) * s).sum();
    ((layout.start_offset() + last + 1) * tensor.dtype().size_in_bytes()) as u64
}

/// The tensors an op holds.
fn args(op: &Op) -> Vec<&Tensor> {
    match op {
        Op::Binary(a, b, _)
        | Op::Matmul(a, b)
        | Op::Gather(a, b, _)
        | Op::IndexSelect(a, b, _)
        | Op::SliceScatter0(a, b, _)
        | Op::CustomOp2(a, b, _) => vec![a, b],
        Op::Scatter(a, b, c, _)
        | Op::ScatterAdd(a, b, c, _)
        | Op::IndexAdd(a, b, c, _)
        | Op::WhereCond(a, b, c)
        | Op::CustomOp3(a, b, c, _) => {
            vec![a, b, c]
        }
        Op::CustomOp4(a, b, c, d, _) => vec![a, b, c, d],
        Op::Conv1D { arg, kernel, .. }
        | Op::ConvTranspose1D { arg, kernel, .. }
        | Op::Conv2D { arg, kernel, .. }
        | Op::ConvTranspose2D { arg, kernel, .. } => vec![arg, kernel],
        Op::Cat(all, _) => all.iter().collect(),
        Op::Unary(a, _)
        | Op::Cmp(a, _)
        | Op::Reduce(a, _, _)
        | Op::AvgPool2D { arg: a, .. }
        | Op::MaxPool2D { arg: a, .. }
        | Op::UpsampleNearest1D { arg: a, .. }
        | Op::UpsampleNearest2D { arg: a, .. }
        | Op::UpsampleBilinear2D { arg: a, .. }
        | Op::Affine { arg: a, .. }
        | Op::ToDType(a)
        | Op::Copy(a)
        | Op::Broadcast(a)
        | Op::Narrow(a, ..)
        | Op::Reshape(a)
        | Op::ToDevice(a)
        | Op::Transpose(a, ..)
        | Op::Permute(a, _)
        | Op::Elu(a, _)
        | Op::Powf(a, _)
        | Op::CustomOp1(a, _) => vec![a],
    }
}

/// The arguments an op's backward reads (beyond their shapes), and whether
/// it reads the op's output, as candle 0.11's `backprop.rs` computes each
/// gradient. A custom op's backward is handed its arguments and output; what
/// it reads of them only it knows, so all count as read.
fn read_by_backward(op: &Op) -> (Vec<&Tensor>, bool) {
    match op {
        Op::Binary(a, b, BinaryOp::Mul | BinaryOp::Div) | Op::Matmul(a, b) => (vec![a, b], false),
        Op::Binary(a, b, BinaryOp::Maximum | BinaryOp::Minimum) => (vec![a, b], true),
        Op::Binary(_, _, BinaryOp::Add | BinaryOp::Sub) => (vec![], false),
        Op::WhereCond(condition, _, _) => (vec![condition], false),
        Op::Conv1D { arg, kernel, .. } | Op::Conv2D { arg, kernel, .. } | Op::ConvTranspose2D { arg, kernel, .. } => {
            (vec![arg, kernel], false)
        }
        Op::MaxPool2D { arg, .. } | Op::Reduce(arg, ReduceOp::Max | ReduceOp::Min, _) | Op::Elu(arg, _) => (vec![arg], true),
        Op::Gather(_, indexes, _)
        | Op::IndexSelect(_, indexes, _)
        | Op::Scatter(_, indexes, _, _)
        | Op::ScatterAdd(_, indexes, _, _)
        | Op::IndexAdd(_, indexes, _, _) => (vec![indexes], false),
        Op::Unary(arg, unary) => match unary {
            UnaryOp::Log
            | UnaryOp::Sin
            | UnaryOp::Cos
            | UnaryOp::Abs
            | UnaryOp::Recip
            | UnaryOp::Sqr
            | UnaryOp::Gelu
            | UnaryOp::GeluErf
            | UnaryOp::Erf
            | UnaryOp::Relu => (vec![arg], false),
            UnaryOp::Silu => (vec![arg], true),
            UnaryOp::Exp | UnaryOp::Tanh | UnaryOp::Sqrt => (vec![], true),
            UnaryOp::Neg | UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round | UnaryOp::Sign => (vec![], false),
        },
        Op::Powf(arg, _) => (vec![arg], false),
        Op::CustomOp1(..) | Op::CustomOp2(..) | Op::CustomOp3(..) | Op::CustomOp4(..) => (args(op), true),
        Op::ConvTranspose1D { .. }
        | Op::AvgPool2D { .. }
        | Op::UpsampleNearest1D { .. }
        | Op::UpsampleNearest2D { .. }
        | Op::UpsampleBilinear2D { .. }
        | Op::SliceScatter0(..)
        | Op::Cat(..)
        | Op::Broadcast(_)
        | Op::Reduce(_, ReduceOp::Sum | ReduceOp::ArgMin | ReduceOp::ArgMax, _)
        | Op::Cmp(..)
        | Op::ToDType(_)
        | Op::Copy(_)
        | Op::Affine { .. }
        | Op::Narrow(..)
        | Op::Reshape(_)
        | Op::ToDevice(_)
        | Op::Transpose(..)
        | Op::Permute(..) => (vec![], false),
    }
}

/// An op's name as the tables show it.
fn op_name(op: Option<&Op>) -> String {
    let Some(op) = op else { return "made outside the graph".to_owned() };
    let name = match op {
        Op::Binary(_, _, b) => match b {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
        },
        Op::Unary(_, u) => match u {
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Abs => "abs",
            UnaryOp::Neg => "neg",
            UnaryOp::Recip => "recip",
            UnaryOp::Sqr => "sqr",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluErf => "gelu_erf",
            UnaryOp::Erf => "erf",
            UnaryOp::Relu => "relu",
            UnaryOp::Silu => "silu",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Floor => "floor",
            UnaryOp::Ceil => "ceil",
            UnaryOp::Round => "round",
            UnaryOp::Sign => "sign",
        },
        Op::Cmp(..) => "cmp",
        Op::Reduce(_, r, _) => match r {
            ReduceOp::Sum => "sum",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::ArgMin => "argmin",
            ReduceOp::ArgMax => "argmax",
        },
        Op::Matmul(..) => "matmul",
        Op::Gather(..) => "gather",
        Op::Scatter(..) => "scatter",
        Op::ScatterAdd(..) => "scatter_add",
        Op::IndexSelect(..) => "index_select",
        Op::IndexAdd(..) => "index_add",
        Op::WhereCond(..) => "where_cond",
        Op::Conv1D { .. } => "conv1d",
        Op::ConvTranspose1D { .. } => "conv_transpose1d",
        Op::Conv2D { .. } => "conv2d",
        Op::ConvTranspose2D { .. } => "conv_transpose2d",
        Op::AvgPool2D { .. } => "avg_pool2d",
        Op::MaxPool2D { .. } => "max_pool2d",
        Op::UpsampleNearest1D { .. } => "upsample_nearest1d",
        Op::UpsampleNearest2D { .. } => "upsample_nearest2d",
        Op::UpsampleBilinear2D { .. } => "upsample_bilinear2d",
        Op::Cat(..) => "cat",
        Op::Affine { .. } => "affine",
        Op::ToDType(_) => "to_dtype",
        Op::Copy(_) => "copy",
        Op::Broadcast(_) => "broadcast",
        Op::Narrow(..) => "narrow",
        Op::SliceScatter0(..) => "slice_scatter",
        Op::Reshape(_) => "reshape",
        Op::ToDevice(_) => "to_device",
        Op::Transpose(..) => "transpose",
        Op::Permute(..) => "permute",
        Op::Elu(..) => "elu",
        Op::Powf(..) => "powf",
        Op::CustomOp1(_, c) => c.name(),
        Op::CustomOp2(_, _, c) => c.name(),
        Op::CustomOp3(_, _, _, c) => c.name(),
        Op::CustomOp4(_, _, _, _, c) => c.name(),
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    #[test]
    fn counts_each_storage_once_under_its_maker_and_knows_what_backward_reads() {
        let dev = Device::Cpu;
        let w = Var::ones((8, 16), DType::F32, &dev).unwrap();
        let x = Tensor::ones((4, 8), DType::F32, &dev).unwrap();
        // matmul keeps x and w (not ours) and makes h; relu reads h; the add's
        // output h2 is only linked; the reshape is a view of h2; mean reads nothing.
        let h = x.matmul(w.as_tensor()).unwrap();
        let r = h.relu().unwrap();
        let h2 = (&r + 1.0).unwrap().broadcast_add(&r).unwrap();
        let loss = h2.reshape(64).unwrap().sum_all().unwrap();
        let kept = Kept::of(&loss, &x);
        let row = |op: &str| kept.by_op.iter().find(|k| k.op == op).cloned();
        let f32x64 = 64 * 4;
        assert_eq!(row("matmul"), Some(KeptByOp { op: "matmul".into(), storages: 1, read: f32x64, held: f32x64 }));
        assert_eq!(row("relu"), Some(KeptByOp { op: "relu".into(), storages: 1, read: 0, held: f32x64 }));
        assert_eq!(row("affine"), Some(KeptByOp { op: "affine".into(), storages: 1, read: 0, held: f32x64 }));
        // The broadcast add made h2; the reshape shares its storage and is not counted again.
        assert_eq!(row("add").map(|k| (k.storages, k.held)), Some((1, f32x64)));
        assert!(row("reshape").is_none(), "{:?}", kept.by_op);
        assert_eq!(graph_variables(&loss).len(), 1);
        assert_eq!(kept.read(), f32x64);
        assert!(kept.by_op[0].op == "matmul", "the largest reader first: {:?}", kept.by_op);
    }

    #[test]
    fn views_count_their_whole_storage_and_leaves_are_left_out() {
        let dev = Device::Cpu;
        let w = Var::ones((6, 10), DType::F32, &dev).unwrap();
        let x = Tensor::ones((6, 10), DType::F32, &dev).unwrap();
        let y = (w.as_tensor() * &x).unwrap();
        // A narrow view of y: y's whole storage is held once.
        let loss = y.narrow(1, 2, 3).unwrap().sqr().unwrap().sum_all().unwrap();
        let kept = Kept::of(&loss, &x);
        let mul = kept.by_op.iter().find(|k| k.op == "mul").unwrap();
        assert_eq!((mul.storages, mul.held, mul.read), (1, 60 * 4, 60 * 4), "sqr reads the view, so the storage is read");
        assert!(kept.by_op.iter().all(|k| k.op != "narrow"));
    }
}
