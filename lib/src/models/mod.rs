//! Models as data: one layer list per model, from which both the costs here
//! (shapes, parameters, saved-for-backward bytes, MACs, workspace) and the
//! trainable Candle module are derived.
//!
//! # The room
//!
//! A model as data (`ModelSpec`: stages of named layers, each an `Op`), the zoo, the per-op cost
//! rules (`rules.rs`), the analysis of a spec at an input shape, and `Network`, the same spec built
//! into candle modules (a `Pass` says train or eval, the compute dtype, and whether it records for
//! backward: an eval pass reads detached weights, so candle keeps no graph).
//!
//! A zoo function (`models/resnet.rs`, `efficientnet.rs`, `small_cnn.rs`, `vit.rs`, `unet.rs`)
//! returns a `ModelSpec`. The spec never stores input channels: each layer takes them from the
//! shape that reaches it, a feature map, a vector or a sequence of tokens (`Shape::Tokens`: a
//! vision transformer's patch embedding makes one; linear layers, layer-norm and GELU act on each
//! token; attention takes q, k and v side by side, as the in-projection before it makes them, and
//! its probabilities get a row of their own in the summary). A block merges its body with its input
//! by a residual add or, for a U-Net's skip (`Shortcut::Concat`), by concatenating the input before
//! the body's output along channels (the `cat` a row of its own); a U-Net's levels are blocks
//! nested in blocks, and `ConvTranspose2d` (stride = kernel) brings each back up. A model whose
//! logits are a map labels each pixel: `train::cross_entropy` averages over every pixel, evaluation
//! adds each class's IoU, and the ledger counts a label per pixel. One walk of the spec (`walk.rs`)
//! names the layers (torchvision's dotted paths), carries the shape through them with `rules.rs`
//! and refuses a shape a layer cannot take; `models::analyze` and `Network::new` are two folds of
//! it. The analysis keeps each op's rule (output shape, parameters, what autograd keeps, MACs,
//! workspace) and `ledger::estimate` turns that into bills for a `StepConfig`; the network makes
//! each leaf a candle module. So the prediction and the trained network cannot disagree about the
//! layers.
//!
//! The lean layers (`models::Layers`, the default) group a spec's layers into lean ops: `lean_groups.rs`
//! reads the groups off the spec once (a batch-norm, the activation after it, the conv or max-pool
//! after that; a residual block whose body and projection end in a batch-norm); the network builds
//! one module per group (`net.rs`'s `fuse`), and the walk gives each layer its role in a group,
//! which `rules::lean` turns into what it keeps (nothing inside a group, the output at its end) and
//! its transients. `Layers::Plain` walks the same spec one op per layer.
//!
//! `models/weights.rs` saves and loads a network under torchvision's names (EfficientNet's block
//! parts renamed on the way). `lib/tests/torchvision.rs` holds the networks to torchvision's: the
//! state dict `scripts/torchvision_reference.py` filled from an integer hash (exact in numpy and in
//! Rust) is built again in the test, loaded through safetensors, and the logits and gradients
//! compared with the float64 answer the script recorded, within a bound set by torchvision's own
//! float32 error.

mod analysis;
mod cost;
mod efficientnet;
mod layers;
mod lean_groups;
mod limits;
mod net;
mod precision;
mod resnet;
mod rules;
mod shape;
mod small_cnn;
mod spec;
mod summary;
mod unet;
mod vit;
mod walk;
mod weights;
mod zoo;

pub use analysis::{analyze, analyze_on, AttentionLayer, ConvLayer, LinearLayer, ModelCost, Row, StageCost, TransposedConvLayer};
pub use cost::{Cost, SMALL_TENSOR_ELEMS};
pub use efficientnet::efficientnet_b0;
pub use layers::{global_avg_pool, Named, Pass};
pub use lean_groups::Layers;
pub use limits::{MAX_BATCH, MAX_CHANNELS, MAX_CLASSES, MAX_SIDE};
pub use net::Network;
pub use precision::{Precision, F32_BYTES};
pub use resnet::{resnet18, resnet34, resnet50};
pub use rules::Kernels;
pub use shape::Shape;
pub use small_cnn::small_cnn;
pub use spec::{Block, Conv2d, Grouping, Layer, ModelSpec, Op, Shortcut, Stage};
pub use summary::{Summarize, Summary};
pub use unet::unet;
pub use vit::{vit, vit_small, vit_tiny, VitSize, VIT_SMALL, VIT_TINY};
pub use weights::{torchvision_names, Mismatch, WeightsError};
pub use zoo::{model, ModelName};

/// The input every zoo model is described for: one RGB image of 224 x 224.
pub const DEFAULT_INPUT: Shape = Shape::Map { c: 3, h: 224, w: 224 };

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unknown model `{name}`; valid models: {valid}")]
    UnknownModel { name: String, valid: String },
    #[error("{model} needs at least one class")]
    NoClasses { model: String },
    #[error("{model}: {what} {value} is over the largest vramlab takes, {max}")]
    TooLarge { model: String, what: &'static str, value: usize, max: usize },
    #[error("{model} cannot take an empty input ({input})")]
    EmptyInput { model: String, input: Shape },
    #[error("{model}: layer `{layer}` ({kind}) cannot take input {input}: {reason}")]
    Shape { model: String, layer: String, kind: &'static str, input: Shape, reason: String },
    #[error("{model}: cannot build layer `{layer}`: {source}")]
    Build {
        model: String,
        layer: String,
        // Boxed: candle's error would make every model result several times larger.
        source: Box<candle_core::Error>,
    },
}

#[cfg(test)]
mod tests;
