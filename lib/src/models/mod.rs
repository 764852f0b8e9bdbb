//! Models as data: one layer list per model, from which both the costs here
//! (shapes, parameters, saved-for-backward bytes, MACs, workspace) and the
//! trainable Candle module are derived.

mod analysis;
mod cost;
mod efficientnet;
mod layers;
mod lean;
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
pub use lean::Layers;
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
