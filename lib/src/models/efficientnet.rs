//! EfficientNet-B0, torchvision layout: a 3x3 stem, seven stages of MBConv
//! blocks (expand 1x1, depthwise kxk, squeeze-excite, project 1x1), a 1x1
//! head conv to 1280 channels, pooling, dropout and the classifier.
//! Stochastic depth has no parameters and no memory of its own and is left out.

use super::spec::{Block, Conv2d, Layer, ModelSpec, Op, Shortcut, Stage};

/// (expand ratio, kernel, stride, output channels, repeats) of B0's seven stages.
const B0_STAGES: [(usize, usize, usize, usize, usize); 7] =
    [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)];

pub fn efficientnet_b0(num_classes: usize) -> ModelSpec {
    let mut stages = vec![Stage {
        name: "stem".into(),
        layers: vec![
            Layer::new("features.0.0", Op::Conv2d(Conv2d::new(32, 3, 2, 1))),
            Layer::new("features.0.1", Op::BatchNorm2d),
            Layer::new("features.0.2", Op::Silu),
        ],
    }];
    let mut in_channels = 32;
    for (i, &(expand, kernel, stride, out_channels, repeats)) in B0_STAGES.iter().enumerate() {
        let layers = (0..repeats)
            .map(|r| {
                let stride = if r == 0 { stride } else { 1 };
                let block = mbconv(in_channels, out_channels, expand, kernel, stride);
                in_channels = out_channels;
                Layer::new(format!("features.{}.{r}", i + 1), Op::Block(block))
            })
            .collect();
        stages.push(Stage { name: format!("stage{}", i + 1), layers });
    }
    stages.push(Stage {
        name: "head".into(),
        layers: vec![
            Layer::new("features.8.0", Op::Conv2d(Conv2d::new(1280, 1, 1, 0))),
            Layer::new("features.8.1", Op::BatchNorm2d),
            Layer::new("features.8.2", Op::Silu),
            Layer::new("avgpool", Op::GlobalAvgPool),
            Layer::new("flatten", Op::Flatten),
            Layer::new("classifier.0", Op::Dropout { p: 0.2 }),
            Layer::new("classifier.1", Op::Linear { out_features: num_classes, bias: true }),
        ],
    });
    ModelSpec { name: "efficientnet_b0".into(), num_classes, stages }
}

fn mbconv(in_channels: usize, out_channels: usize, expand: usize, kernel: usize, stride: usize) -> Block {
    let hidden = in_channels * expand;
    let mut body = Vec::with_capacity(9);
    if expand != 1 {
        body.push(Layer::new("expand", Op::Conv2d(Conv2d::new(hidden, 1, 1, 0))));
        body.push(Layer::new("expand_bn", Op::BatchNorm2d));
        body.push(Layer::new("expand_act", Op::Silu));
    }
    body.push(Layer::new("depthwise", Op::Conv2d(Conv2d::depthwise(hidden, kernel, stride))));
    body.push(Layer::new("depthwise_bn", Op::BatchNorm2d));
    body.push(Layer::new("depthwise_act", Op::Silu));
    body.push(Layer::new("se", Op::SqueezeExcite { squeeze_channels: (in_channels / 4).max(1) }));
    body.push(Layer::new("project", Op::Conv2d(Conv2d::new(out_channels, 1, 1, 0))));
    body.push(Layer::new("project_bn", Op::BatchNorm2d));
    let shortcut = if stride == 1 && in_channels == out_channels { Shortcut::Identity } else { Shortcut::None };
    Block { body, shortcut, post: Vec::new() }
}
