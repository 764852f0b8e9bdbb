use super::*;

fn cost(spec: &ModelSpec) -> ModelCost {
    analyze(spec, DEFAULT_INPUT, Precision::F32).unwrap()
}

#[test]
fn parameter_counts_match_the_reference_architectures() {
    assert_eq!(cost(&resnet18(1000)).total.params, 11_689_512);
    assert_eq!(cost(&resnet34(1000)).total.params, 21_797_672);
    assert_eq!(cost(&resnet50(1000)).total.params, 25_557_032);
    assert_eq!(cost(&efficientnet_b0(1000)).total.params, 5_288_548);
}

#[test]
fn parameters_scale_with_the_number_of_classes() {
    // Only the classifier changes: in_features x classes + classes.
    assert_eq!(
        cost(&resnet50(10)).total.params,
        25_557_032 - 2048 * 990 - 990
    );
    assert_eq!(
        cost(&efficientnet_b0(10)).total.params,
        5_288_548 - 1280 * 990 - 990
    );
    assert_eq!(
        cost(&resnet18(2)).total.params,
        11_689_512 - 512 * 998 - 998
    );
}

#[test]
fn resnet50_conv1_output_is_the_lessons_3_2_mb_per_sample() {
    let cost = cost(&resnet50(1000));
    let conv1 = cost.rows.iter().find(|r| r.path == "conv1").unwrap();
    assert_eq!(conv1.output, Shape::map(64, 112, 112));
    assert_eq!(conv1.output.elems() * 4, 3_211_264);
    assert_eq!(conv1.cost.saved_bytes, 3_211_264);
}

#[test]
fn stages_partition_the_model() {
    let cost = cost(&resnet50(1000));
    let names: Vec<&str> = cost.stages.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["stem", "layer1", "layer2", "layer3", "layer4", "head"]
    );
    let params: u64 = cost.stages.iter().map(|s| s.cost.params).sum();
    let saved: u64 = cost.stages.iter().map(|s| s.cost.saved_bytes).sum();
    assert_eq!(params, cost.total.params);
    assert_eq!(saved, cost.total.saved_bytes);
    assert_eq!(cost.stages[4].output, Shape::map(2048, 7, 7));
    assert_eq!(cost.stages[5].output, Shape::Flat { features: 1000 });
    // Leaf rows add up to the stage rows.
    let leaf_params: u64 = cost
        .rows
        .iter()
        .filter(|r| r.kind != "Stage" && !r.kind.contains("Block"))
        .map(|r| r.cost.params)
        .sum();
    assert_eq!(leaf_params, cost.total.params);
}

#[test]
fn buffers_are_the_batch_norm_running_statistics() {
    // Two buffers (running mean and variance) per batch-norm channel.
    let cost = cost(&resnet18(1000));
    let bn_channels: u64 = cost
        .rows
        .iter()
        .filter(|r| r.kind == "BatchNorm2d")
        .map(|r| r.output.channels() as u64)
        .sum();
    assert_eq!(cost.total.buffers, 2 * bn_channels);
    assert_eq!(bn_channels, 4800);
}

#[test]
fn resnet50_macs_are_about_4_1_giga() {
    let macs = cost(&resnet50(1000)).total.macs;
    assert!((4_080_000_000..4_150_000_000).contains(&macs), "{macs}");
}

#[test]
fn half_precision_shrinks_activations_but_not_batch_norm_internals() {
    let f32_cost = analyze(&resnet50(1000), DEFAULT_INPUT, Precision::F32).unwrap();
    let amp = analyze(&resnet50(1000), DEFAULT_INPUT, Precision::F16Amp).unwrap();
    let conv = |c: &ModelCost| {
        c.rows
            .iter()
            .find(|r| r.path == "layer1.0.conv2")
            .unwrap()
            .cost
            .saved_bytes
    };
    assert_eq!(conv(&amp) * 2, conv(&f32_cost));
    assert!(amp.rows.iter().any(|r| r.kind == "ToDtype"));
    assert_eq!(amp.total.params, f32_cost.total.params);
}

#[test]
fn activations_grow_with_the_square_of_resolution() {
    let at = |r| {
        analyze(&resnet18(1000), Shape::map(3, r, r), Precision::F32)
            .unwrap()
            .stages[1]
            .cost
            .saved_bytes
    };
    assert_eq!(at(448), 4 * at(224));
}

#[test]
fn too_small_an_input_names_the_layer_and_the_shape() {
    let err = analyze(&small_cnn(10), Shape::map(3, 1, 1), Precision::F32)
        .unwrap_err()
        .to_string();
    assert_eq!(err, "small_cnn: layer `pool1` (MaxPool2d) cannot take input 32x1x1: a 2x2 window (stride 2, padding 0) does not fit in 1 pixels");
}

#[test]
fn zoo_names_are_forgiving_and_errors_list_the_valid_ones() {
    assert_eq!(
        "ResNet-50".parse::<ModelName>().unwrap(),
        ModelName::Resnet50
    );
    assert_eq!(
        "efficientnet_b0".parse::<ModelName>().unwrap(),
        ModelName::EfficientnetB0
    );
    assert_eq!(
        "smallcnn".parse::<ModelName>().unwrap(),
        ModelName::SmallCnn
    );
    let err = model("vgg16", 1000).unwrap_err().to_string();
    assert_eq!(err, "unknown model `vgg16`; valid models: resnet18, resnet34, resnet50, efficientnet-b0, small-cnn");
    assert!(model("resnet50", 0).is_err());
}

#[test]
fn the_small_cnn_runs_on_a_tiny_input() {
    let cost = analyze(&small_cnn(10), Shape::map(3, 32, 32), Precision::F32).unwrap();
    assert_eq!(
        cost.stages.last().unwrap().output,
        Shape::Flat { features: 10 }
    );
    assert_eq!(
        cost.total.params,
        (32 * 27) + 64 + (64 * 32 * 9) + 128 + (128 * 64 * 9) + 256 + 128 * 10 + 10
    );
}
