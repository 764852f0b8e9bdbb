//! Vision transformers in torchvision's layout (`VisionTransformer`, as
//! `vit_b_16` builds it, at other sizes): patch embedding with a class token
//! and learned positions, `depth` encoder layers of pre-norm self-attention
//! and a GELU MLP, each with its residual add, a final layer-norm and the
//! class token's linear head. Each encoder layer is a stage, the unit of
//! checkpointing. The parameters carry torchvision's names in the files
//! (`weights.rs`); the tables name each encoder layer's two residual blocks
//! (`encoder_layer_0.attention`, `encoder_layer_0.feedforward`) and the
//! attention's parts (`in_proj`, `scores`, `out_proj`).

use super::spec::{Block, Layer, ModelSpec, Op, Shortcut, Stage};

/// torchvision's layer-norm epsilon in `VisionTransformer`.
const EPS: f64 = 1e-6;

/// A vision transformer's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VitSize {
    pub patch: usize,
    pub dim: usize,
    pub depth: usize,
    pub heads: usize,
    pub mlp: usize,
}

/// ViT-Ti/16 (DeiT-Tiny's sizes): 192 features, 12 layers of 3 heads, 5.7M parameters at 224 px.
pub const VIT_TINY: VitSize = VitSize { patch: 16, dim: 192, depth: 12, heads: 3, mlp: 768 };
/// ViT-S/16 (DeiT-Small's sizes): 384 features, 12 layers of 6 heads, 22M parameters at 224 px.
pub const VIT_SMALL: VitSize = VitSize { patch: 16, dim: 384, depth: 12, heads: 6, mlp: 1536 };

pub fn vit_tiny(num_classes: usize) -> ModelSpec {
    vit("vit_tiny", VIT_TINY, num_classes)
}

pub fn vit_small(num_classes: usize) -> ModelSpec {
    vit("vit_small", VIT_SMALL, num_classes)
}

pub fn vit(name: &str, size: VitSize, num_classes: usize) -> ModelSpec {
    let VitSize { patch, dim, depth, heads, mlp } = size;
    let mut stages = vec![Stage { name: "embedding".into(), layers: vec![Layer::new("conv_proj", Op::PatchEmbed { patch, dim })] }];
    for i in 0..depth {
        let prefix = format!("encoder_layer_{i}");
        let residual = |body| Block { body, shortcut: Shortcut::Identity, post: Vec::new() };
        let attention = residual(vec![
            Layer::new("ln_1", Op::LayerNorm { eps: EPS }),
            Layer::new("in_proj", Op::Linear { out_features: 3 * dim, bias: true }),
            Layer::new("scores", Op::Attention { heads }),
            Layer::new("out_proj", Op::Linear { out_features: dim, bias: true }),
        ]);
        let feedforward = residual(vec![
            Layer::new("ln_2", Op::LayerNorm { eps: EPS }),
            Layer::new("mlp.0", Op::Linear { out_features: mlp, bias: true }),
            Layer::new("mlp.1", Op::Gelu),
            Layer::new("mlp.3", Op::Linear { out_features: dim, bias: true }),
        ]);
        stages.push(Stage {
            name: format!("encoder_layer_{i}"),
            layers: vec![
                Layer::new(format!("{prefix}.attention"), Op::Block(attention)),
                Layer::new(format!("{prefix}.feedforward"), Op::Block(feedforward)),
            ],
        });
    }
    stages.push(Stage {
        name: "head".into(),
        layers: vec![
            Layer::new("encoder.ln", Op::LayerNorm { eps: EPS }),
            Layer::new("class_token_out", Op::ClassToken),
            Layer::new("heads.head", Op::Linear { out_features: num_classes, bias: true }),
        ],
    });
    ModelSpec { name: name.into(), num_classes, stages }
}
