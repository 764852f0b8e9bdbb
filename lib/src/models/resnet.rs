//! ResNet-18/34 (basic blocks) and ResNet-50 (bottlenecks), torchvision v1.5
//! layout: stride on the 3x3 conv, projection shortcuts only where the shape changes.

use super::spec::{Block, Conv2d, Layer, ModelSpec, Op, Shortcut, Stage};

#[derive(Debug, Clone, Copy)]
enum BlockKind {
    Basic,
    Bottleneck,
}

impl BlockKind {
    fn expansion(self) -> usize {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }
}

pub fn resnet18(num_classes: usize) -> ModelSpec {
    resnet("resnet18", BlockKind::Basic, [2, 2, 2, 2], num_classes)
}

pub fn resnet34(num_classes: usize) -> ModelSpec {
    resnet("resnet34", BlockKind::Basic, [3, 4, 6, 3], num_classes)
}

pub fn resnet50(num_classes: usize) -> ModelSpec {
    resnet("resnet50", BlockKind::Bottleneck, [3, 4, 6, 3], num_classes)
}

fn resnet(name: &str, kind: BlockKind, depths: [usize; 4], num_classes: usize) -> ModelSpec {
    let mut stages = vec![Stage {
        name: "stem".into(),
        layers: vec![
            Layer::new("conv1", Op::Conv2d(Conv2d::new(64, 7, 2, 3))),
            Layer::new("bn1", Op::BatchNorm2d),
            Layer::new("relu", Op::Relu),
            Layer::new("maxpool", Op::MaxPool2d { kernel: 3, stride: 2, padding: 1 }),
        ],
    }];
    let mut in_channels = 64;
    for (i, &depth) in depths.iter().enumerate() {
        let planes = 64 << i;
        let stage_name = format!("layer{}", i + 1);
        let layers = (0..depth)
            .map(|b| {
                let stride = if i > 0 && b == 0 { 2 } else { 1 };
                let block = block(kind, in_channels, planes, stride);
                in_channels = planes * kind.expansion();
                Layer::new(format!("{stage_name}.{b}"), Op::Block(block))
            })
            .collect();
        stages.push(Stage { name: stage_name, layers });
    }
    stages.push(Stage {
        name: "head".into(),
        layers: vec![
            Layer::new("avgpool", Op::GlobalAvgPool),
            Layer::new("flatten", Op::Flatten),
            Layer::new("fc", Op::Linear { out_features: num_classes, bias: true }),
        ],
    });
    ModelSpec { name: name.into(), num_classes, stages }
}

fn block(kind: BlockKind, in_channels: usize, planes: usize, stride: usize) -> Block {
    let out_channels = planes * kind.expansion();
    let body = match kind {
        BlockKind::Basic => vec![
            Layer::new("conv1", Op::Conv2d(Conv2d::new(planes, 3, stride, 1))),
            Layer::new("bn1", Op::BatchNorm2d),
            Layer::new("relu1", Op::Relu),
            Layer::new("conv2", Op::Conv2d(Conv2d::new(planes, 3, 1, 1))),
            Layer::new("bn2", Op::BatchNorm2d),
        ],
        BlockKind::Bottleneck => vec![
            Layer::new("conv1", Op::Conv2d(Conv2d::new(planes, 1, 1, 0))),
            Layer::new("bn1", Op::BatchNorm2d),
            Layer::new("relu1", Op::Relu),
            Layer::new("conv2", Op::Conv2d(Conv2d::new(planes, 3, stride, 1))),
            Layer::new("bn2", Op::BatchNorm2d),
            Layer::new("relu2", Op::Relu),
            Layer::new("conv3", Op::Conv2d(Conv2d::new(out_channels, 1, 1, 0))),
            Layer::new("bn3", Op::BatchNorm2d),
        ],
    };
    let shortcut = if stride != 1 || in_channels != out_channels {
        Shortcut::Projection(vec![Layer::new("0", Op::Conv2d(Conv2d::new(out_channels, 1, stride, 0))), Layer::new("1", Op::BatchNorm2d)])
    } else {
        Shortcut::Identity
    };
    Block { body, shortcut, post: vec![Layer::new("relu", Op::Relu)] }
}
