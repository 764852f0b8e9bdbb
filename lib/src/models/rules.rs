//! What one op costs in Candle 0.11.1, per sample.
//!
//! The saved-for-backward rule is Candle's, not PyTorch's: a tensor stays
//! alive while anything references it, and every op recorded for autograd
//! holds `Arc`s to its inputs until the loss (the root of the graph) is
//! dropped. Backward frees nothing it saved. So in training *every tensor
//! an op materialises* is kept, and each rule below lists those tensors for
//! the implementation the trainable networks use (`crate::ops` for
//! convolution, pooling and batch-norm; candle's own ops otherwise). Views (reshape of a
//! contiguous tensor, transpose, narrow, broadcast) cost nothing.
//!
//! Backward frees each node's incoming gradient once the node is done, and
//! stores the op's input gradient as the input's gradient
//! (`GradStore::accumulate`; a second gradient for the same input is added
//! into it): incoming gradient and input gradient are alive at once
//! (`backward_bytes`). Where an op's
//! gradient formula reads its forward input (ReLU, a gate), the
//! gradient it passes on is itself recorded in the graph and keeps every
//! temporary of that formula alive until the op before has used it; the rule
//! of such an op counts that op's backward too. Measured with the allocation
//! counters on single layers (b32, 32x32x32), above what the harness itself
//! holds (2x its input in f32, 4x in f16): conv, batch-norm, pooling and SiLU
//! (`ops::silu`) 0-0.6x their input, ReLU 2.25x, an x * gate product 2x in f32;
//! conv + batch-norm + ReLU 5.5x in f16.
//!
//! In inference there is no graph: an op's tensors die when the next op is
//! done with them, so `eval_live` is the op's input plus what it materialises
//! (an upper bound: some of its temporaries die earlier).

use super::cost::Cost;
use super::lean_groups::{Layers, Role};
use super::precision::{Precision, F32_BYTES};
use super::shape::Shape;
use super::spec::{Conv2d, Grouping, Op};
use crate::ops::Reads;

/// Whose transients the rules count. What an op keeps for backward is the
/// same on both (the device passes keep what the CPU kernels keep); what it
/// holds only while a pass runs is not: our CPU kernels compute in f32, so
/// a half operand is read through an f32 copy and the lean ops' maps are
/// f32, where the device passes (`ops/cuda/passes.rs`) read half operands as
/// they are and make the lean ops' maps in the maps' own type, and the
/// convolutions' scratch is cuDNN's one workspace, which the ledger counts
/// once per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// Our CPU kernels.
    #[default]
    Host,
    /// The device passes.
    Device,
}

/// Why a layer cannot take the shape that reaches it.
pub(crate) type Rejection = String;

/// A block is walked through its layers; it has no rule of its own.
pub(crate) const NOT_A_LEAF: &str = "a block is not a leaf op";

/// The output shape and cost of a leaf op (anything but a block), as
/// `layers` run it on `kernels`. An op that `reads_images` takes the batch
/// itself, which needs no gradient: its backward makes none for its input.
pub(crate) fn leaf(
    op: &Op,
    input: Shape,
    precision: Precision,
    layers: Layers,
    kernels: Kernels,
    reads_images: bool,
) -> Result<(Shape, Cost), Rejection> {
    let cb = precision.compute_bytes();
    // Whether a half operand is read through an f32 copy.
    let f32_copies = precision.is_mixed() && kernels == Kernels::Host;
    let in_bytes = input.elems() * cb;
    let mut cost = Cost::default();
    let output = match *op {
        Op::Conv2d(conv) => return conv2d(conv, input, precision, kernels, reads_images),
        // `ops::batch_norm_train` is one op: it materialises only its output
        // (in the input's dtype; its arithmetic is f32, so a half input is read
        // through an f32 copy and the f32 result is cast back: workspace).
        // Evaluation uses candle's elementwise ops: x - mean, / std, * weight, + bias.
        Op::BatchNorm2d => {
            let (c, e) = (map(input, "batch-norm")?.0, input.elems());
            cost.param_tensor(c as u64);
            cost.param_tensor(c as u64);
            cost.buffers = 2 * c as u64;
            cost.keep(in_bytes);
            if f32_copies {
                cost.workspace_bytes = 2 * e * F32_BYTES;
            }
            cost.backward_bytes = 2 * in_bytes + cost.workspace_bytes;
            cost.eval_live_bytes = in_bytes + 4 * e * F32_BYTES;
            input
        }
        // Unary ops keep their input (the previous op's output, already
        // counted) and their output is kept by whatever consumes it.
        Op::Relu => {
            cost.keep(in_bytes);
            // The chain the gradient carries (a u8 mask, its float copy and
            // the product) plus the batch-norm backward
            // that consumes it, which under AMP also holds f32 copies (6 more
            // bytes per element, measured).
            let amp_copies = if f32_copies { 6 * input.elems() } else { 0 };
            cost.backward_bytes = amp_copies + 4 * in_bytes + input.elems();
            cost.eval_live_bytes = 2 * in_bytes;
            input
        }
        // `ops::silu` is one op with a backward of its own: it materialises
        // its input gradient alone, as batch-norm's does; for a half input it
        // reads f32 copies of the input, the output and the incoming gradient,
        // the last becoming the gradient it casts back.
        Op::Silu => {
            cost.keep(in_bytes);
            let copies = if f32_copies { 3 * input.elems() * F32_BYTES } else { 0 };
            cost.backward_bytes = 2 * in_bytes + copies;
            cost.eval_live_bytes = 2 * in_bytes;
            input
        }
        // `ops::max_pool2d` pads inside the op and finds each window's maximum
        // again in backward: it keeps only its output.
        Op::MaxPool2d { kernel, stride, padding } => {
            let (c, h, w) = map(input, "max-pool")?;
            let (oh, ow) = (out_size(h, kernel, stride, padding)?, out_size(w, kernel, stride, padding)?);
            let out = Shape::map(c, oh, ow);
            cost.keep(out.elems() * cb);
            cost.backward_bytes = out.elems() * cb + in_bytes;
            cost.eval_live_bytes = in_bytes + out.elems() * cb;
            out
        }
        // A sum over H and W and a scale: two tiny tensors.
        Op::GlobalAvgPool => {
            let (c, _, _) = map(input, "global average pool")?;
            cost.keep(2 * c as u64 * cb);
            // The sum's gradient broadcast back over the map, made contiguous.
            cost.backward_bytes = in_bytes;
            cost.eval_live_bytes = in_bytes + 2 * c as u64 * cb;
            Shape::map(c, 1, 1)
        }
        // A reshape of a contiguous tensor is a view.
        Op::Flatten => {
            cost.eval_live_bytes = in_bytes;
            Shape::Flat { features: input.elems() as usize }
        }
        // candle-nn `ops::dropout`: a scaled mask and the product.
        Op::Dropout { .. } => {
            cost.keep(in_bytes);
            cost.keep(in_bytes);
            // Incoming gradient and the gradients of both factors.
            cost.backward_bytes = 3 * in_bytes;
            cost.eval_live_bytes = in_bytes;
            input
        }
        // `ops::linear`, one op for the product and the bias: it keeps its
        // input (the layer before's output) and materialises its output, per
        // vector or per token (a token sequence is one matrix of `tokens`
        // rows). Its gemm scratch and the f32 copies of half operands are the
        // ledger's (`ModelCost::linears`).
        Op::Linear { out_features, bias } => {
            let (rows, features, output) = match input {
                Shape::Flat { features } => (1, features, Shape::Flat { features: out_features }),
                Shape::Tokens { n, d } => (n, d, Shape::Tokens { n, d: out_features }),
                Shape::Map { .. } => return Err(format!("a linear layer needs a flat input or tokens, got a {input} map (flatten first)")),
            };
            let weights = (features * out_features) as u64;
            cost.param_tensor(weights);
            if bias {
                cost.param_tensor(out_features as u64);
            }
            cost.amp_copy_params = cost.params;
            cost.macs = rows as u64 * weights;
            let out = output.elems() * cb;
            cost.keep(out);
            cost.backward_bytes = out + in_bytes;
            cost.eval_live_bytes = in_bytes + cost.saved_bytes;
            output
        }
        // Pool (2 tiny), 1x1 conv + bias add (2 x squeeze), SiLU, 1x1 conv +
        // bias add (2 x C), sigmoid (C), then x * gate: one full-size tensor.
        Op::SqueezeExcite { squeeze_channels: sq } => {
            let (c, _, _) = map(input, "squeeze-excite")?;
            let (c64, sq64) = (c as u64, sq as u64);
            for tensor in [c64 * sq64, sq64, sq64 * c64, c64] {
                cost.param_tensor(tensor);
            }
            cost.amp_copy_params = cost.params;
            cost.macs = 2 * c64 * sq64;
            for small in [2 * c64, 2 * sq64, sq64, 2 * c64, c64] {
                cost.keep(small * cb);
            }
            cost.keep(in_bytes);
            cost.workspace_bytes = (c64 + sq64) * cb;
            cost.backward_bytes = 4 * in_bytes;
            cost.eval_live_bytes = in_bytes + cost.saved_bytes;
            input
        }
        // `ops::layer_norm` keeps only its operands (backward computes each
        // row's statistics again) and materialises its output. Its weight and
        // bias stay f32 under mixed precision (autocast runs layer-norm in
        // f32); a half input is read through an f32 copy and the f32 result
        // cast back. Backward: the incoming gradient and the f32 input
        // gradient, under mixed precision f32 copies of input and gradient
        // and the half result.
        Op::LayerNorm { .. } => {
            let features = match input {
                Shape::Flat { features } => features,
                Shape::Tokens { d, .. } => d,
                Shape::Map { .. } => return Err(format!("layer-norm normalises tokens or a vector, got a {input} map")),
            };
            let e = input.elems();
            cost.param_tensor(features as u64);
            cost.param_tensor(features as u64);
            cost.keep(in_bytes);
            if f32_copies {
                cost.workspace_bytes = 2 * e * F32_BYTES;
            }
            cost.backward_bytes = 2 * in_bytes + if f32_copies { 3 * e * F32_BYTES } else { 0 };
            cost.eval_live_bytes = 2 * in_bytes + cost.workspace_bytes;
            input
        }
        // `ops::gelu` keeps its input (the layer before's output) and
        // materialises its output; backward computes the derivative again
        // from the input. A half input is read through an f32 copy.
        Op::Gelu => {
            let e = input.elems();
            cost.keep(in_bytes);
            if f32_copies {
                cost.workspace_bytes = e * F32_BYTES;
            }
            cost.backward_bytes = 2 * in_bytes + if f32_copies { 2 * e * F32_BYTES } else { 0 };
            cost.eval_live_bytes = 2 * in_bytes + cost.workspace_bytes;
            input
        }
        // `ops::conv_transpose2d`, one op for the product and the bias: it
        // keeps its input (the layer before's output) and materialises its
        // output. Its per-sample gemm buffers and the f32 copies of half
        // operands are the ledger's (`ModelCost::transposed_convs`).
        Op::ConvTranspose2d { out_channels, kernel, bias } => {
            let (c, h, w) = map(input, "transposed convolution")?;
            if kernel == 0 {
                return Err("a transposed convolution needs a kernel of at least 1".to_owned());
            }
            let out = Shape::map(out_channels, h * kernel, w * kernel);
            cost.param_tensor((c * out_channels * kernel * kernel) as u64);
            if bias {
                cost.param_tensor(out_channels as u64);
            }
            cost.amp_copy_params = cost.params;
            cost.macs = out.elems() * c as u64;
            let out_bytes = out.elems() * cb;
            cost.keep(out_bytes);
            let input_gradient = if reads_images { 0 } else { in_bytes };
            cost.backward_bytes = out_bytes + input_gradient;
            cost.eval_live_bytes = in_bytes + out_bytes;
            out
        }
        Op::PatchEmbed { patch, dim } => return patch_embed(patch, dim, input, precision, kernels, reads_images),
        Op::Attention { heads } => return attention(heads, input, precision, layers, kernels),
        // A narrow of the first token, made contiguous for the linear layer
        // after it. Its gradient is a zero tensor of the input's size with
        // the token's gradient written in.
        Op::ClassToken => {
            let Shape::Tokens { d, .. } = input else {
                return Err(format!("the class token is taken from tokens, got {input}"));
            };
            cost.keep(d as u64 * cb);
            cost.backward_bytes = 2 * in_bytes;
            cost.eval_live_bytes = in_bytes + d as u64 * cb;
            Shape::Flat { features: d }
        }
        Op::Block(_) => return Err(NOT_A_LEAF.to_owned()),
    };
    Ok((output, cost))
}

/// `PatchEmbed`: the patches' convolution without bias (`ops::conv2d`,
/// `conv2d`'s rule), its output made tokens (a transpose, copied
/// contiguous), the bias added, the class token put before them (`cat`,
/// which first copies the class token broadcast over the batch) and the
/// positions added: four more tensors of the tokens' size, all kept.
fn patch_embed(
    patch: usize,
    dim: usize,
    input: Shape,
    precision: Precision,
    kernels: Kernels,
    reads_images: bool,
) -> Result<(Shape, Cost), Rejection> {
    let (_, h, w) = map(input, "patch embedding")?;
    if patch == 0 || h < patch || w < patch {
        return Err(format!("a {patch}x{patch} patch does not fit in {h}x{w} pixels"));
    }
    let (_, mut cost) = conv2d(Conv2d::new(dim, patch, patch, 0), input, precision, kernels, reads_images)?;
    let patches = (h / patch) * (w / patch);
    let tokens = patches + 1;
    let (dim64, cb) = (dim as u64, precision.compute_bytes());
    cost.param_tensor(dim64);
    cost.param_tensor(dim64);
    cost.param_tensor(tokens as u64 * dim64);
    cost.amp_copy_params = cost.params;
    let grid = patches as u64 * dim64 * cb;
    let sequence = tokens as u64 * dim64 * cb;
    cost.keep(grid);
    cost.keep(grid);
    cost.keep(dim64 * cb);
    cost.keep(sequence);
    cost.keep(sequence);
    cost.backward_bytes = cost.backward_bytes.max(3 * sequence);
    cost.eval_live_bytes = input.elems() * cb + cost.saved_bytes + cost.workspace_bytes;
    Ok((Shape::Tokens { n: tokens, d: dim }, cost))
}

/// `ops::attention` over `tokens x 3d`: it materialises its output, and
/// keeps either the softmax probabilities (`heads x tokens x tokens`, the
/// plain layers, as PyTorch's math attention) or one f32 log-sum-exp per
/// row (the lean layers, as memory-efficient attention: backward computes
/// the probabilities again from q and k). Its per-thread score buffers are
/// the ledger's (`ModelCost::attentions`), as are the device passes' (one
/// batch element's scores at a time).
fn attention(heads: usize, input: Shape, precision: Precision, layers: Layers, kernels: Kernels) -> Result<(Shape, Cost), Rejection> {
    let Shape::Tokens { n, d: qkv } = input else {
        return Err(format!("attention takes tokens (q, k and v side by side), got {input}"));
    };
    if heads == 0 || qkv % (3 * heads) != 0 {
        return Err(format!("{qkv} features are not q, k and v of {heads} heads each"));
    }
    let d = qkv / 3;
    let (cb, n64) = (precision.compute_bytes(), n as u64);
    let output = Shape::Tokens { n, d };
    let mut cost = Cost { macs: 2 * n64 * n64 * d as u64, ..Cost::default() };
    cost.keep(output.elems() * cb);
    cost.keep(layers.attention_keeps().bytes(1, n, heads, precision.compute_dtype()));
    if precision.is_mixed() && kernels == Kernels::Host {
        cost.workspace_bytes = (input.elems() + output.elems()) * F32_BYTES;
    }
    cost.backward_bytes = (output.elems() + input.elems()) * cb;
    cost.eval_live_bytes = input.elems() * cb + output.elems() * cb + cost.workspace_bytes;
    Ok((output, cost))
}

/// A leaf's cost as the lean layers run it (`crate::ops::norm_act`), from
/// its plain cost. Inside a lean op a batch-norm or activation stores
/// nothing: the op keeps the batch-norm's input, which the layer before
/// already counts. The op's end stores the output as its plain rule says;
/// its transients are f32 buffers of the normalised map (`input`): forward,
/// the activated map handed to the convolution or pool; backward, besides
/// the incoming gradient, the recomputed map with the gradient the consumer
/// hands back, and for a max-pool the activated map too (the pool finds
/// each window's maximum in it again). Under mixed precision the op also
/// reads f32 copies of the half input and gradient. Measured on the stem's
/// batch-norm + ReLU + max-pool (ResNet-18 b16@64, small CNN b32@32):
/// 13.0 MiB in f32 and 17.5 MiB in f16 for a map of 1M values, as this rule says.
///
/// The device passes make those maps in the maps' own type and read half
/// operands as they are; they hold, forward, the activated map where a
/// convolution or pool reads it; backward, besides the incoming gradient,
/// the recomputed map, its activation and the activation's input gradient
/// (where there is an activation: cuDNN's activation backward reads both
/// maps) or the gradient the consumer hands back, and for a max-pool its
/// output pooled again from the recomputed map (cuDNN's pooling backward
/// finds each window's maximum by comparing the two); then the batch-norm's
/// input gradient beside the activation's. Measured on the reference
/// primitives (`fused_norm_tests`).
///
/// A linear layer that reads the GELU or layer-norm before it
/// (`crate::ops::gelu_linear`, `norm_linear`) keeps what the linear layer
/// keeps, and the GELU or layer-norm nothing: its output is made again in
/// backward. On the CPU the GELU's transients are the op's scratch
/// (`ModelCost::linears`), as are the layer-norm's forward, and its backward
/// runs the plain ops (the layer-norm again, the product's gradients, the
/// layer-norm's backward: its input gradient beside the product's, with f32
/// copies of the half input, gradient and result). The device passes hold
/// one map of the input more beside the linear layer's buffers, forward and
/// backward (measured on the reference primitives: `linear_tests`, and
/// `on_the_device` below). One that adds its block's input keeps only the
/// sum, its output (the block's add keeps nothing more).
pub(crate) fn lean(role: Role, op: &Op, input: Shape, output: Shape, precision: Precision, kernels: Kernels, cost: Cost) -> Cost {
    let cb = precision.compute_bytes();
    let (map, out) = (input.elems(), output.elems());
    let pools = matches!(op, Op::MaxPool2d { .. });
    match (role, kernels) {
        (Role::Own, _) => cost,
        (Role::Linear(fused), kernels) => {
            let transformed = match (fused.reads, kernels) {
                (Reads::Input, _) | (Reads::Gelu, Kernels::Host) => 0,
                _ => map * cb,
            };
            // The layer-norm's backward beside the product's input gradient,
            // and, on the host, its f32 copies of half operands.
            let normalised_gradient = match (fused.reads, kernels) {
                (Reads::Norm, Kernels::Host) => map * cb + if precision.is_mixed() { 3 * map * F32_BYTES } else { 0 },
                _ => 0,
            };
            Cost {
                workspace_bytes: cost.workspace_bytes + transformed,
                backward_bytes: cost.backward_bytes + transformed + normalised_gradient,
                ..cost
            }
        }
        (Role::Inside, _) => Cost { saved_bytes: 0, largest_tensor_bytes: 0, workspace_bytes: 0, backward_bytes: 0, ..cost },
        (Role::Stored, _) => Cost { workspace_bytes: 0, backward_bytes: 0, ..cost },
        (Role::End { .. }, Kernels::Host) => {
            let half_copies = if precision.is_mixed() { (map + out) * F32_BYTES } else { 0 };
            Cost {
                workspace_bytes: cost.workspace_bytes + map * F32_BYTES + half_copies,
                backward_bytes: out * cb + if pools { 3 } else { 2 } * map * F32_BYTES + half_copies,
                ..cost
            }
        }
        (Role::End { activated }, Kernels::Device) => {
            // The op ends in a convolution or a pool, which reads the activated map.
            let consumed = matches!(op, Op::Conv2d(_) | Op::MaxPool2d { .. });
            let handed_on = if consumed { map * cb } else { 0 };
            let maps = 1 + u64::from(activated) + u64::from(activated || consumed);
            let pooled_again = if pools { out * cb } else { 0 };
            Cost { workspace_bytes: cost.workspace_bytes + handed_on, backward_bytes: out * cb + maps * map * cb + pooled_again, ..cost }
        }
    }
}

/// The transients of a lean residual block's end (`crate::ops::norm_add_act`)
/// over the `merged` map: `(workspace, backward)`. Forward, the f32 sum (the
/// projection's normalised map is made a plane at a time beside it).
/// Backward, besides the incoming
/// gradient, f32 maps: the sum's gradient and batch-norm's input gradient per
/// normalised input. Under mixed precision, f32 copies of the half inputs and
/// gradient. Measured: ResNet-50 b4@64 (identity blocks of 1 MiB maps in
/// f32), 4.2-4.3 MiB with the shortcut's gradient, where this rule says 4;
/// b8@224, whose peak is the first (projected) block's, 97.7 MiB of context
/// and workspace against 98.
///
/// The device passes hold, forward, the projection's normalised map beside
/// the sum (the sum is the output, activated in place); backward, besides
/// the incoming gradient, the sum recomputed and the activation's gradient
/// (where there is an activation), then each normalised input's gradient,
/// all in the maps' own type. Measured on the reference primitives (`fused_norm_tests`).
pub(crate) fn lean_merge(merged: Shape, precision: Precision, kernels: Kernels, projected: bool, activated: bool) -> (u64, u64) {
    let (cb, map) = (precision.compute_bytes(), merged.elems());
    let norms = if projected { 2 } else { 1 };
    match kernels {
        Kernels::Host => {
            let half_copies = if precision.is_mixed() { 3 * map * F32_BYTES } else { 0 };
            let workspace = map * F32_BYTES + half_copies;
            let backward = map * cb + (1 + norms) * map * F32_BYTES + half_copies;
            (workspace, backward)
        }
        Kernels::Device => {
            let workspace = if projected { map * cb } else { 0 };
            let activation_gradient = u64::from(activated);
            (workspace, map * cb * (1 + activation_gradient + norms))
        }
    }
}

/// `ops::conv2d` (the rule we use for every device): the output is kept (the
/// autograd op keeps input and kernel, already counted). On the host,
/// im2col column buffers, bounded per thread, are the workspace, counted
/// here as one sample's `(Hout*Wout, Cin*k*k)` matrix and its result (the
/// ledger asks the kernel for the real figure); a depthwise conv is a
/// direct loop with no columns; in half precision both kinds read an f32
/// copy of the input and write an f32 result before the cast back. On a
/// device the scratch is cuDNN's one workspace, counted once. A bias adds a
/// broadcast_add output.
fn conv2d(conv: Conv2d, input: Shape, precision: Precision, kernels: Kernels, reads_images: bool) -> Result<(Shape, Cost), Rejection> {
    let cb = precision.compute_bytes();
    let (c, h, w) = map(input, "conv2d")?;
    let k = conv.kernel;
    let (oh, ow) = (out_size(h, k, conv.stride, conv.padding)?, out_size(w, k, conv.stride, conv.padding)?);
    let cin_per_group = match conv.grouping {
        Grouping::Dense => c,
        Grouping::Depthwise if conv.out_channels == c => 1,
        Grouping::Depthwise => return Err(format!("a depthwise conv keeps its {c} channels, but the spec asks for {}", conv.out_channels)),
    };
    let out = Shape::map(conv.out_channels, oh, ow);
    let (e, spatial) = (out.elems(), (oh * ow) as u64);
    let weights = (conv.out_channels * cin_per_group * k * k) as u64;
    let mut cost = Cost { macs: e * (cin_per_group * k * k) as u64, ..Cost::default() };
    cost.param_tensor(weights);
    if conv.bias {
        cost.param_tensor(conv.out_channels as u64);
    }
    cost.amp_copy_params = cost.params;
    cost.keep(e * cb);
    cost.workspace_bytes = match (conv.grouping, kernels) {
        (_, Kernels::Device) => 0,
        (Grouping::Dense, Kernels::Host) => (spatial * (cin_per_group * k * k) as u64 + e) * cb,
        (Grouping::Depthwise, Kernels::Host) if precision.is_mixed() => (input.elems() + e) * F32_BYTES,
        (Grouping::Depthwise, Kernels::Host) => 0,
    };
    if conv.bias {
        cost.keep(e * cb);
    }
    let input_gradient = if reads_images { 0 } else { input.elems() };
    cost.backward_bytes = (e + input_gradient) * cb;
    cost.eval_live_bytes = input.elems() * cb + cost.saved_bytes + cost.workspace_bytes;
    Ok((out, cost))
}

/// Mixed precision casts the f32 batch to half once, at the model's entry.
pub(crate) fn input_cast(input: Shape, precision: Precision) -> Cost {
    let mut cost = Cost::default();
    cost.keep(input.elems() * precision.compute_bytes());
    cost.eval_live_bytes = input.elems() * (F32_BYTES + precision.compute_bytes());
    cost
}

/// `train::cross_entropy` over a sample's `logits` (a vector of classes, or
/// a map of them per pixel), in f32: candle-nn's `log_softmax` over the
/// classes (max, tiny; x - max, exp, sum, tiny; log, tiny; x - log-sum: three
/// tensors of the logits' size) and the gather of each label's log-probability
/// (one value per vector or pixel), plus an f32 copy of half logits under
/// mixed precision.
pub(crate) fn cross_entropy(logits: Shape, precision: Precision) -> Cost {
    let mut cost = Cost::default();
    let bytes = logits.elems() * F32_BYTES;
    if precision.is_mixed() {
        cost.keep(bytes);
    }
    for _ in 0..3 {
        cost.keep(bytes);
    }
    cost.keep(labels_per_sample(logits) * F32_BYTES);
    cost
}

/// Labels per sample for `logits`: one for a vector of classes, one per
/// pixel for a map of them.
pub(crate) fn labels_per_sample(logits: Shape) -> u64 {
    match logits {
        Shape::Map { h, w, .. } => (h * w) as u64,
        Shape::Flat { .. } | Shape::Tokens { .. } => 1,
    }
}

fn map(input: Shape, what: &str) -> Result<(usize, usize, usize), Rejection> {
    match input {
        Shape::Map { c, h, w } => Ok((c, h, w)),
        Shape::Flat { .. } => Err(format!("{what} needs a C x H x W map, got a flat vector of {input}")),
        Shape::Tokens { .. } => Err(format!("{what} needs a C x H x W map, got {input}")),
    }
}

fn out_size(size: usize, kernel: usize, stride: usize, padding: usize) -> Result<usize, Rejection> {
    let padded = size + 2 * padding;
    if padded < kernel || stride == 0 {
        return Err(format!("a {kernel}x{kernel} window (stride {stride}, padding {padding}) does not fit in {size} pixels"));
    }
    Ok((padded - kernel) / stride + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_output_and_params_follow_the_usual_formulas() {
        let (out, cost) = conv2d(Conv2d::new(64, 7, 2, 3), Shape::map(3, 224, 224), Precision::F32, Kernels::Host, false).unwrap();
        assert_eq!(out, Shape::map(64, 112, 112));
        assert_eq!(cost.params, 64 * 3 * 7 * 7);
        assert_eq!(cost.saved_bytes, 112 * 112 * 64 * 4);
        assert_eq!(cost.macs, 112 * 112 * 64 * 3 * 49);
        assert_eq!(cost.workspace_bytes, (112 * 112 * 3 * 49 + 112 * 112 * 64) * 4);
    }

    #[test]
    fn depthwise_conv_keeps_its_output_once() {
        let (out, cost) = conv2d(Conv2d::depthwise(32, 3, 1), Shape::map(32, 10, 10), Precision::F32, Kernels::Host, false).unwrap();
        assert_eq!(out, Shape::map(32, 10, 10));
        assert_eq!(cost.params, 32 * 9);
        assert_eq!(cost.saved_bytes, 3200 * 4);
    }

    #[test]
    fn fused_batch_norm_keeps_only_its_output() {
        let input = Shape::map(8, 4, 4);
        let (_, f32_cost) = leaf(&Op::BatchNorm2d, input, Precision::F32, Layers::Plain, Kernels::Host, false).unwrap();
        assert_eq!(f32_cost.saved_bytes, 128 * 4);
        let (_, amp) = leaf(&Op::BatchNorm2d, input, Precision::F16Amp, Layers::Plain, Kernels::Host, false).unwrap();
        assert_eq!(amp.saved_bytes, 128 * 2);
        assert_eq!(amp.workspace_bytes, 2 * 128 * 4);
        assert_eq!((amp.params, amp.buffers), (16, 16));
    }

    #[test]
    fn attention_keeps_its_probabilities_or_one_statistic_per_row() {
        let input = Shape::Tokens { n: 197, d: 3 * 192 };
        let (out, plain) = leaf(&Op::Attention { heads: 3 }, input, Precision::F32, Layers::Plain, Kernels::Host, false).unwrap();
        assert_eq!(out, Shape::Tokens { n: 197, d: 192 });
        assert_eq!(plain.saved_bytes, (197 * 192 + 3 * 197 * 197) * 4);
        let (_, lean) = leaf(&Op::Attention { heads: 3 }, input, Precision::F32, Layers::Lean, Kernels::Host, false).unwrap();
        assert_eq!(lean.saved_bytes, (197 * 192 + 3 * 197) * 4);
        assert_eq!(lean.macs, 2 * 197 * 197 * 192);
        let err = leaf(&Op::Attention { heads: 5 }, input, Precision::F32, Layers::Lean, Kernels::Host, false).unwrap_err();
        assert_eq!(err, "576 features are not q, k and v of 5 heads each");
    }

    #[test]
    fn a_patch_embedding_makes_tokens_and_a_linear_layer_reads_them() {
        let (tokens, cost) =
            leaf(&Op::PatchEmbed { patch: 16, dim: 192 }, Shape::map(3, 224, 224), Precision::F32, Layers::Lean, Kernels::Host, true)
                .unwrap();
        assert_eq!(tokens, Shape::Tokens { n: 197, d: 192 });
        assert_eq!(cost.params, 192 * 3 * 16 * 16 + 192 + 192 + 197 * 192);
        let (out, linear) =
            leaf(&Op::Linear { out_features: 768, bias: true }, tokens, Precision::F32, Layers::Lean, Kernels::Host, false).unwrap();
        assert_eq!(out, Shape::Tokens { n: 197, d: 768 });
        assert_eq!(linear.macs, 197 * 192 * 768);
        let err = leaf(&Op::PatchEmbed { patch: 16, dim: 192 }, Shape::map(3, 8, 8), Precision::F32, Layers::Lean, Kernels::Host, true)
            .unwrap_err();
        assert_eq!(err, "a 16x16 patch does not fit in 8x8 pixels");
        let err = leaf(&Op::LayerNorm { eps: 1e-6 }, Shape::map(3, 8, 8), Precision::F32, Layers::Lean, Kernels::Host, false).unwrap_err();
        assert!(err.contains("layer-norm normalises tokens or a vector"), "{err}");
    }

    #[test]
    fn too_small_inputs_and_wrong_ranks_are_rejected() {
        let err = conv2d(Conv2d::new(8, 3, 1, 0), Shape::map(3, 2, 2), Precision::F32, Kernels::Host, false).unwrap_err();
        assert!(err.contains("does not fit in 2 pixels"), "{err}");
        let err =
            leaf(&Op::Linear { out_features: 10, bias: true }, Shape::map(4, 2, 2), Precision::F32, Layers::Lean, Kernels::Host, false)
                .unwrap_err();
        assert!(err.contains("flatten first"), "{err}");
    }
}

/// The device rules of the lean ops against what their device passes
/// allocate, run on the reference primitives: forward, the transients
/// beyond the output and the statistics kept; backward, beyond the incoming
/// gradient (candle's), what the rule counts, up to the batch-norms'
/// parameter gradients, which the rule leaves to the gradients' bill (the
/// convolution's weight gradient is taken off the measure for the same reason).
#[cfg(test)]
mod on_the_device {
    use candle_core::{DType, Device, Tensor, Var};

    use super::*;
    use crate::models::lean_groups::Role;
    use crate::ops::{self, Activation, ConvParams, Norm, Residual, Then};

    const BATCH: usize = 2;
    const CHANNELS: usize = 8;
    const SIDE: usize = 6;

    fn tensor(dims: &[usize], dtype: DType, seed: u64) -> Var {
        let len = dims.iter().product::<usize>();
        let values: Vec<f32> = (0..len).map(|i| (((i as u64 * 7919 + seed * 104729) % 997) as f32 / 997.0 - 0.45) * 3.0).collect();
        Var::from_tensor(&Tensor::from_vec(values, dims, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap()
    }

    fn bytes(t: &Tensor) -> u64 {
        (t.elem_count() * t.dtype().size_in_bytes()) as u64
    }

    /// `(forward transients, backward bytes beyond the incoming gradient and
    /// the weight gradient)`, measured.
    fn measured(forward: impl FnOnce() -> Tensor, weight_gradient: u64) -> (u64, u64) {
        let (y, used) = ops::on_reference(|| ops::reference_allocations(forward));
        let forward = used.peak - bytes(&y) - used.left as u64;
        let (_, backward) = ops::on_reference(|| ops::reference_allocations(|| y.sum_all().unwrap().backward().unwrap()));
        (forward, backward.peak - weight_gradient)
    }

    fn assert_counted(what: &str, measured: u64, rule: u64, parameter_gradients: u64) {
        assert!((rule..=rule + parameter_gradients).contains(&measured), "{what}: {measured} measured, {rule} counted");
    }

    /// The lean transformer block's linear ops on a sequence of 9 tokens of
    /// 16 features to 24: forward, the GELU's or layer-norm's map beside the
    /// output; backward, beyond the incoming gradient, the input gradient
    /// and, for the GELU, the product's gradient before GELU's backward, up to
    /// the weight and bias gradients. (`norm_linear`'s backward runs the plain
    /// ops, whose results are candle's storages between its passes: its
    /// passes' own buffers stay within the rule.)
    fn the_fused_linears_allocate_what_their_device_rule_counts(precision: Precision, dtype: DType) {
        use crate::ops::{Fused, Reads};
        let (tokens, features, outputs) = (9, 16, 24);
        let input = Shape::Tokens { n: tokens, d: features };
        let x = tensor(&[BATCH, tokens, features], dtype, 6);
        let (weight, bias) = (tensor(&[outputs, features], dtype, 7), tensor(&[outputs], dtype, 8));
        let residual = tensor(&[BATCH, tokens, outputs], dtype, 9);
        let (norm_weight, norm_bias) = (tensor(&[features], DType::F32, 10), tensor(&[features], DType::F32, 11));
        let parameter_gradients = bytes(weight.as_tensor()) + bytes(bias.as_tensor());
        let linear = Op::Linear { out_features: outputs, bias: true };
        for (reads, adds_residual) in [(Reads::Gelu, false), (Reads::Gelu, true), (Reads::Input, true), (Reads::Norm, false)] {
            let what = format!("linear reading {reads:?}, residual {adds_residual}, {precision:?}");
            let (output, cost) = leaf(&linear, input, precision, Layers::Lean, Kernels::Device, false).unwrap();
            let rule = lean(Role::Linear(Fused { reads, adds_residual }), &linear, input, output, precision, Kernels::Device, cost);
            let (w, b, r) = (weight.as_tensor(), Some(bias.as_tensor()), residual.as_tensor());
            let forward = || match (reads, adds_residual) {
                (Reads::Gelu, false) => ops::gelu_linear(x.as_tensor(), w, b).unwrap(),
                (Reads::Gelu, true) => ops::gelu_linear_residual(x.as_tensor(), w, b, r).unwrap(),
                (Reads::Input, _) => ops::linear_residual(x.as_tensor(), w, b, r).unwrap(),
                (Reads::Norm, _) => ops::norm_linear(x.as_tensor(), norm_weight.as_tensor(), norm_bias.as_tensor(), 1e-6, w, b).unwrap(),
            };
            let (forward, backward) = measured(forward, 0);
            let incoming = BATCH as u64 * output.elems() * precision.compute_bytes();
            assert_eq!(forward, BATCH as u64 * rule.workspace_bytes, "{what}: forward");
            let counted = BATCH as u64 * rule.backward_bytes - incoming;
            if reads == Reads::Norm {
                assert!(backward <= counted + 2 * features as u64 * 4, "{what}: {backward} measured, {counted} counted");
            } else {
                assert_counted(&what, backward, counted, parameter_gradients);
            }
        }
    }

    #[test]
    fn the_lean_ops_allocate_what_their_device_rule_counts() {
        let input = Shape::map(CHANNELS, SIDE, SIDE);
        let conv = Conv2d::new(16, 3, 1, 1);
        let pool = (3, 2, 1);
        for (precision, dtype) in [(Precision::F32, DType::F32), (Precision::F16Amp, DType::F16)] {
            let z = tensor(&[BATCH, CHANNELS, SIDE, SIDE], dtype, 1);
            let (weight, bias) = (tensor(&[CHANNELS], DType::F32, 2), tensor(&[CHANNELS], DType::F32, 3));
            let conv_weight = tensor(&[16, CHANNELS, 3, 3], dtype, 4);
            let norm = Norm { weight: weight.as_tensor(), bias: bias.as_tensor(), eps: 1e-5 };
            let params = 2 * CHANNELS as u64 * 4;
            for act in [Activation::Relu, Activation::Identity] {
                let activated = act != Activation::Identity;
                let cases: [(Op, Then<'_>, u64); 3] = [
                    (
                        Op::Conv2d(conv),
                        Then::Conv { weight: conv_weight.as_tensor(), params: ConvParams { stride: 1, padding: 1, groups: 1 } },
                        bytes(conv_weight.as_tensor()),
                    ),
                    (
                        Op::MaxPool2d { kernel: pool.0, stride: pool.1, padding: pool.2 },
                        Then::MaxPool { kernel: pool.0, stride: pool.1, padding: pool.2 },
                        0,
                    ),
                    (if activated { Op::Relu } else { Op::BatchNorm2d }, Then::Nothing, 0),
                ];
                for (op, then, weight_gradient) in cases {
                    let what = format!("{op:?} after {act:?}, {precision:?}");
                    let (output, cost) = leaf(&op, input, precision, Layers::Lean, Kernels::Device, false).unwrap();
                    let rule = lean(Role::End { activated }, &op, input, output, precision, Kernels::Device, cost);
                    let (forward, backward) = measured(|| ops::norm_act(z.as_tensor(), norm, act, then).unwrap().y, weight_gradient);
                    let incoming = BATCH as u64 * output.elems() * precision.compute_bytes();
                    assert_eq!(forward, BATCH as u64 * rule.workspace_bytes, "{what}: forward");
                    assert_counted(&what, backward, BATCH as u64 * rule.backward_bytes - incoming, params);
                }
            }
            the_fused_linears_allocate_what_their_device_rule_counts(precision, dtype);
            for (projected, act) in [(false, Activation::Relu), (true, Activation::Relu), (false, Activation::Identity)] {
                let x = tensor(&[BATCH, CHANNELS, SIDE, SIDE], dtype, 5);
                let side = Norm { weight: weight.as_tensor(), bias: bias.as_tensor(), eps: 1e-5 };
                let residual = if projected { Residual::Norm(x.as_tensor(), side) } else { Residual::Identity(x.as_tensor()) };
                let (workspace, rule_backward) = lean_merge(input, precision, Kernels::Device, projected, act != Activation::Identity);
                let norms = if projected { 2 } else { 1 };
                let (forward, backward) = measured(|| ops::norm_add_act(z.as_tensor(), norm, residual, act).unwrap().y, 0);
                let what = format!("norm_add_act projected {projected} {act:?}, {precision:?}");
                let incoming = BATCH as u64 * input.elems() * precision.compute_bytes();
                assert_eq!(forward, BATCH as u64 * workspace, "{what}: forward");
                assert_counted(&what, backward, BATCH as u64 * rule_backward - incoming, norms * params);
            }
        }
    }
}
