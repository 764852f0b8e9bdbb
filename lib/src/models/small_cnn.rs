//! A small CNN for quick CPU runs: three conv-BN-ReLU stages, 2x2 max-pools
//! (kernel = stride, which Candle's max-pool backward supports), a linear head.

use super::spec::{Conv2d, Layer, ModelSpec, Op, Stage};

pub fn small_cnn(num_classes: usize) -> ModelSpec {
    let conv_stage = |i: usize, channels: usize, pool: bool| {
        let mut layers = vec![
            Layer::new(format!("conv{i}"), Op::Conv2d(Conv2d::new(channels, 3, 1, 1))),
            Layer::new(format!("bn{i}"), Op::BatchNorm2d),
            Layer::new(format!("relu{i}"), Op::Relu),
        ];
        if pool {
            layers.push(Layer::new(format!("pool{i}"), Op::MaxPool2d { kernel: 2, stride: 2, padding: 0 }));
        }
        Stage { name: format!("block{i}"), layers }
    };
    ModelSpec {
        name: "small_cnn".into(),
        num_classes,
        stages: vec![
            conv_stage(1, 32, true),
            conv_stage(2, 64, true),
            conv_stage(3, 128, false),
            Stage {
                name: "head".into(),
                layers: vec![
                    Layer::new("avgpool", Op::GlobalAvgPool),
                    Layer::new("flatten", Op::Flatten),
                    Layer::new("fc", Op::Linear { out_features: num_classes, bias: true }),
                ],
            },
        ],
    }
}
