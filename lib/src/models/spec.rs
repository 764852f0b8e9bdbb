//! A model as data: stages of named layers, each an [`Op`].
//!
//! The spec never stores input channels: each layer takes them from the shape
//! that reaches it, so one description serves any input (3 or 1 channels,
//! 64 or 512 pixels) and any number of classes. One walk of the list
//! (`walk.rs`) serves both its uses: the costs and the trainable network.

use serde::{Deserialize, Serialize};

/// A whole network: stages in order (for ResNet `stem`, `layer1`..`layer4`, `head`).
///
/// Stages are the unit of activation checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub name: String,
    pub num_classes: usize,
    pub stages: Vec<Stage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    pub name: String,
    pub layers: Vec<Layer>,
}

/// A named op; names follow torchvision where one exists (`layer1.0.conv1`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    pub name: String,
    pub op: Op,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    Conv2d(Conv2d),
    /// Batch-norm over channels, with affine weight and bias and running statistics.
    BatchNorm2d,
    Relu,
    Silu,
    /// Max-pool; a non-zero padding pads with -inf before pooling.
    MaxPool2d {
        kernel: usize,
        stride: usize,
        padding: usize,
    },
    /// Average over height and width: `C x H x W -> C x 1 x 1`.
    GlobalAvgPool,
    Flatten,
    Dropout {
        p: f64,
    },
    Linear {
        out_features: usize,
        bias: bool,
    },
    /// `x * sigmoid(conv1x1(silu(conv1x1(avgpool(x)))))`, convs with bias.
    SqueezeExcite {
        squeeze_channels: usize,
    },
    /// Layer-norm over the last dimension (each token's features, or a
    /// vector's), with affine weight and bias.
    LayerNorm {
        eps: f64,
    },
    /// GELU with the error function (PyTorch's `nn.GELU()`).
    Gelu,
    /// A vision transformer's entry: `patch x patch` patches, each projected
    /// to `dim` features by a strided convolution with bias, a learned class
    /// token before them and learned positions added:
    /// `C x H x W -> (1 + (H/patch)(W/patch)) tokens x dim`.
    PatchEmbed {
        patch: usize,
        dim: usize,
    },
    /// Multi-head self-attention's core, `softmax(q kᵀ / √dh) v` per head:
    /// `tokens x 3d` (q, k and v side by side, as an in-projection gives
    /// them) to `tokens x d`.
    Attention {
        heads: usize,
    },
    /// A transformer's class token, the first: `tokens x d -> d`.
    ClassToken,
    /// A transposed convolution whose stride is its kernel (windows that
    /// neither overlap nor leave gaps, a U-Net's up-convolution):
    /// `C x H x W -> out_channels x kH x kW`.
    ConvTranspose2d {
        out_channels: usize,
        kernel: usize,
        bias: bool,
    },
    /// A block: `post(body(x) + shortcut(x))`, `post(body(x))` without a
    /// shortcut, or `post(cat(x, body(x)))` with a concatenating one.
    Block(Block),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conv2d {
    pub out_channels: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
    pub grouping: Grouping,
    pub bias: bool,
}

impl Conv2d {
    /// A dense convolution without bias (the conv of a conv-BN pair).
    pub fn new(out_channels: usize, kernel: usize, stride: usize, padding: usize) -> Self {
        Conv2d { out_channels, kernel, stride, padding, grouping: Grouping::Dense, bias: false }
    }

    /// A depthwise convolution: one filter per channel, `out_channels` = input channels.
    pub fn depthwise(channels: usize, kernel: usize, stride: usize) -> Self {
        Conv2d { out_channels: channels, kernel, stride, padding: (kernel - 1) / 2, grouping: Grouping::Depthwise, bias: false }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Grouping {
    Dense,
    /// `groups` = input channels.
    Depthwise,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Block {
    pub body: Vec<Layer>,
    pub shortcut: Shortcut,
    pub post: Vec<Layer>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shortcut {
    /// No residual connection.
    None,
    /// `x` is added unchanged.
    Identity,
    /// `x` goes through these layers first (ResNet's downsample).
    Projection(Vec<Layer>),
    /// `x` and the body's output are concatenated along channels, `x` first
    /// (a U-Net's skip connection).
    Concat,
}

impl Layer {
    pub fn new(name: impl Into<String>, op: Op) -> Self {
        Layer { name: name.into(), op }
    }

    /// The type name shown in summaries (`Conv2d`, `BatchNorm2d`, ...).
    pub fn kind(&self) -> &'static str {
        match &self.op {
            Op::Conv2d(c) if c.grouping == Grouping::Depthwise => "Conv2d (depthwise)",
            Op::Conv2d(_) => "Conv2d",
            Op::BatchNorm2d => "BatchNorm2d",
            Op::Relu => "ReLU",
            Op::Silu => "SiLU",
            Op::MaxPool2d { .. } => "MaxPool2d",
            Op::GlobalAvgPool => "AdaptiveAvgPool2d",
            Op::Flatten => "Flatten",
            Op::Dropout { .. } => "Dropout",
            Op::Linear { .. } => "Linear",
            Op::SqueezeExcite { .. } => "SqueezeExcitation",
            Op::LayerNorm { .. } => "LayerNorm",
            Op::Gelu => "GELU",
            Op::PatchEmbed { .. } => "PatchEmbedding",
            Op::Attention { .. } => "ScaledDotProductAttention",
            Op::ClassToken => "ClassToken",
            Op::ConvTranspose2d { .. } => "ConvTranspose2d",
            Op::Block(b) if matches!(b.shortcut, Shortcut::None) => "Block",
            Op::Block(b) if matches!(b.shortcut, Shortcut::Concat) => "SkipBlock",
            Op::Block(_) => "ResidualBlock",
        }
    }
}

impl ModelSpec {
    pub fn stage_names(&self) -> Vec<&str> {
        self.stages.iter().map(|s| s.name.as_str()).collect()
    }
}
