//! A small U-Net for segmentation (Ronneberger et al., with batch-norm after
//! each convolution): a double convolution at full resolution, then nested
//! levels, each pooling by 2, convolving twice at twice the channels, running
//! the level below, up-convolving back (a 2x2 transposed convolution) and
//! fusing the result with its own input, concatenated, by a double
//! convolution; a 1x1 convolution gives each pixel's class logits. Each level
//! is a block whose skip concatenates, so the names nest as the levels do
//! (`down1.down2.up`): `scripts/unet_twin.py` writes the same network in
//! PyTorch under the same names. Stages: `inc`, the levels (`body`) and
//! `head`.

use super::spec::{Block, Conv2d, Layer, ModelSpec, Op, Shortcut, Stage};

/// Channels at full resolution and at each level below it.
pub const CHANNELS: [usize; 4] = [16, 32, 64, 128];

pub fn unet(num_classes: usize) -> ModelSpec {
    let inc = double_conv("inc", CHANNELS[0]);
    let body = vec![level(1, &CHANNELS)];
    let head = vec![Layer::new("outc", Op::Conv2d(Conv2d { bias: true, ..Conv2d::new(num_classes, 1, 1, 0) }))];
    let stages = [("inc", inc), ("body", body), ("head", head)];
    ModelSpec {
        name: "unet".into(),
        num_classes,
        stages: stages.into_iter().map(|(name, layers)| Stage { name: name.into(), layers }).collect(),
    }
}

/// Two 3x3 convolutions to `channels`, each with batch-norm and ReLU, named
/// `prefix.0` to `prefix.5` as a PyTorch `Sequential` names them.
fn double_conv(prefix: &str, channels: usize) -> Vec<Layer> {
    let conv = || Op::Conv2d(Conv2d::new(channels, 3, 1, 1));
    [conv(), Op::BatchNorm2d, Op::Relu, conv(), Op::BatchNorm2d, Op::Relu]
        .into_iter()
        .enumerate()
        .map(|(i, op)| Layer::new(format!("{prefix}.{i}"), op))
        .collect()
}

/// Level `l` (1-based) of `channels`: its block `down{l}` takes the map of
/// level `l - 1` and gives one of the same size and channels.
fn level(l: usize, channels: &[usize]) -> Layer {
    let (c, below) = (channels[l - 1], channels[l]);
    let mut body = vec![Layer::new("pool", Op::MaxPool2d { kernel: 2, stride: 2, padding: 0 })];
    body.extend(double_conv("conv", below));
    if l + 1 < channels.len() {
        body.push(level(l + 1, channels));
    }
    body.push(Layer::new("up", Op::ConvTranspose2d { out_channels: c, kernel: 2, bias: true }));
    let block = Block { body, shortcut: Shortcut::Concat, post: double_conv("fuse", c) };
    Layer::new(format!("down{l}"), Op::Block(block))
}
