//! Candle's wider ecosystem in cells, as a learner brings it: candle-transformers' vision models,
//! added with `:dep`, build on the library's patched candle-core (one candle, so a tensor made
//! through `vramlab::candle` goes into their forward), train, and are measured by the magics; a
//! step that fails inside candle reads as one line. The `:dep` cell loads the library first, so the
//! crate resolves against the library's candle: its first build, with the library already built in
//! the cache, is the crate and its own 11 dependencies, about a minute and a half on 2 cores (over 3
//! minutes more when candle was built again for it alone). `--nocapture` prints what each model's forward keeps for backward,
//! the figures BENCHMARKS.md sets beside the lean layers'.

mod common;

use common::Kernel;
use jupyter_protocol::ReplyStatus;

/// Each model as a cell builds it, and the input it is measured at: the sizes of the zoo's
/// networks in `%summary MODEL --batch 8 --res 64`, so the two can be set side by side.
const MODELS: [(&str, &str, &str); 7] = [
    ("resnet18", "resnet::resnet18(10, vb.pp(\"resnet18\"))?", "8x3x64x64"),
    ("resnet50", "resnet::resnet50(10, vb.pp(\"resnet50\"))?", "8x3x64x64"),
    ("efficientnet_b0", "efficientnet::EfficientNet::new(vb.pp(\"efficientnet\"), efficientnet::MBConvConfig::b0(), 10)?", "8x3x64x64"),
    ("convnext_atto", "convnext::convnext(&convnext::Config::atto(), 10, vb.pp(\"convnext\"))?", "8x3x64x64"),
    ("mobilenetv4_small", "mobilenetv4::mobilenetv4(&mobilenetv4::Config::small(), 10, vb.pp(\"mobilenetv4\"))?", "8x3x64x64"),
    // ViT-Tiny's shape (the zoo's vit-tiny): 192 features, 12 layers of 3 heads, an MLP of 768.
    ("vit_tiny", "{ let model = vit::Model::new(&vit::Config { hidden_size: 192, num_hidden_layers: 12, num_attention_heads: 3, intermediate_size: 768, image_size: 64, ..vit::Config::vit_base_patch16_224() }, 10, vb.pp(\"vit\"))?; vramlab::candle_nn::func(move |xs| model.forward(xs)) }", "8x3x64x64"),
    // candle-transformers 0.11.1's DINOv2 concatenates its one class token with the batch's
    // patches, so it runs one image at a time; at 224 pixels it resizes its 37 x 37 position
    // embeddings to 16 x 16 (nearest upsampling by 16/37, whose backward the patched candle has).
    ("dinov2_small", "dinov2::vit_small(vb.pp(\"dinov2\"))?", "1x3x224x224"),
];

#[tokio::test(flavor = "multi_thread")]
async fn candle_transformers_vision_models_train_and_are_measured_in_cells() {
    let mut kernel = Kernel::start().await;
    let dep = kernel.execute(":dep candle-transformers = \"=0.11.1\"").await;
    assert_eq!(dep.reply.status, ReplyStatus::Ok, "{:?}", dep.error());

    let mut build = String::from(
        "use vramlab::candle::{DType, Device, Tensor};\n\
         use vramlab::candle_nn::{Module, Optimizer, VarBuilder, VarMap};\n\
         use candle_transformers::models::{convnext, dinov2, efficientnet, mobilenetv4, resnet, vit};\n\
         let varmap = VarMap::new();\n\
         let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);\n",
    );
    for (name, code, _) in MODELS {
        build.push_str(&format!("let {name} = {code};\n"));
    }
    let built = kernel.execute(&build).await;
    assert_eq!(built.reply.status, ReplyStatus::Ok, "{:?}", built.error());

    // candle-transformers' ResNet-18 trains: its stem pools 3x3 with stride 2.
    let trained = kernel
        .execute(
            "let own = VarMap::new();\n\
             let net = resnet::resnet18(10, VarBuilder::from_varmap(&own, DType::F32, &Device::Cpu))?;\n\
             let mut adamw = vramlab::candle_nn::AdamW::new(own.all_vars(), Default::default())?;\n\
             let xs = Tensor::randn(0f32, 1., (4, 3, 64, 64), &Device::Cpu)?;\n\
             let ys = Tensor::new(&[0u32, 1, 2, 3], &Device::Cpu)?;\n\
             let mut losses = Vec::new();\n\
             for _ in 0..3 {\n\
                 let loss = vramlab::candle_nn::loss::cross_entropy(&net.forward(&xs)?, &ys)?;\n\
                 adamw.backward_step(&loss)?;\n\
                 losses.push(loss.to_scalar::<f32>()?);\n\
             }\n\
             losses.iter().filter(|l| l.is_finite()).count()",
        )
        .await;
    assert_eq!(trained.result_text().as_deref(), Some("3"), "three AdamW steps: {:?}", trained.error());

    // Every model's weights take a gradient: none is cut off by an op without a backward. Not
    // weights: a batch-norm's running statistics (variables of the VarMap too), and the norms
    // MobileNetV4 builds before it finds that a block has no depthwise convolution there.
    let untouched = kernel
        .execute(
            "let mut untouched = Vec::new();\n\
             for (prefix, model) in [(\"resnet18.\", &resnet18 as &dyn Module), (\"resnet50.\", &resnet50), (\"efficientnet.\", &efficientnet_b0), (\"convnext.\", &convnext_atto), (\"mobilenetv4.\", &mobilenetv4_small), (\"vit.\", &vit_tiny), (\"dinov2.\", &dinov2_small)] {\n\
                 let side = if prefix == \"dinov2.\" { 224 } else { 64 };\n\
                 let images = Tensor::randn(0f32, 1., (1, 3, side, side), &Device::Cpu)?;\n\
                 let grads = model.forward(&images)?.sqr()?.mean_all()?.backward()?;\n\
                 let data = varmap.data().lock().unwrap();\n\
                 let orphan = |name: &str| name.rsplit_once(\".bn.\").is_some_and(|(stem, _)| !data.contains_key(&format!(\"{stem}.conv.weight\")));\n\
                 untouched.extend(data.iter().filter(|(name, var)| name.starts_with(prefix) && !name.contains(\"running_\") && !orphan(name) && grads.get(var.as_tensor()).is_none()).map(|(name, _)| name.clone()));\n\
             }\n\
             untouched.sort();\n\
             format!(\"{untouched:?}\")",
        )
        .await;
    assert_eq!(untouched.result_text().as_deref(), Some("\"[]\""), "weights without a gradient: {:?}", untouched.error());

    // Steps that fail inside candle: one line that names what failed and the sizes, no backtrace.
    for (step, names) in [
        ("vramlab::candle_nn::loss::cross_entropy(&net.forward(&xs)?, &Tensor::new(&[0u32, 1], &Device::Cpu)?)?", ["(4)", "(2)"]),
        ("net.forward(&xs)?.matmul(&Tensor::zeros((5, 2), DType::F32, &Device::Cpu)?)?", ["matmul", "[5, 2]"]),
    ] {
        let failed = kernel.execute(step).await;
        let error = failed.error().unwrap_or_else(|| panic!("{step} fails"));
        assert!(error.evalue.lines().count() <= 2, "{}", error.evalue);
        assert!(names.iter().all(|n| error.evalue.contains(n)), "names {names:?}: {}", error.evalue);
        assert!(!error.evalue.contains("backtrace") && !error.evalue.contains("<unknown>"), "{}", error.evalue);
    }

    for (name, _, input) in MODELS {
        let summary = kernel.execute(&format!("%summary {name} --input {input}")).await;
        assert_eq!(summary.reply.status, ReplyStatus::Ok, "%summary {name}: {:?}", summary.error());
        let text = summary.result_text().unwrap();
        assert!(text.contains("measured") && text.contains("What forward keeps for backward"), "{name}: {text}");
        let kept = text.lines().find(|l| l.starts_with("all ")).unwrap_or_default();
        let peak = text.lines().find(|l| l.starts_with("peak ")).unwrap_or_default();
        println!(
            "{name} {input}: {}\n    {}",
            peak.split_whitespace().collect::<Vec<_>>().join(" "),
            kept.split_whitespace().collect::<Vec<_>>().join(" ")
        );

        let check = kernel.execute(&format!("%oomcheck {name} --input {input} --gpu rtx4060-laptop")).await;
        assert_eq!(check.reply.status, ReplyStatus::Ok, "%oomcheck {name}: {:?}", check.error());
        let text = check.result_text().unwrap();
        assert!(text.contains("FITS") && text.contains("RTX 4060"), "{name}: {text}");
    }

    // DINOv2 at a batch of 8 fails in candle-transformers' own forward: said in one line.
    let batched = kernel.execute("%summary dinov2_small --input 8x3x224x224").await;
    let error = batched.error().expect("candle-transformers' DINOv2 takes one image at a time");
    assert!(error.evalue.contains("forward failed") && error.evalue.contains("cat"), "{}", error.evalue);
    assert!(!error.evalue.contains("backtrace") && !error.evalue.contains("<unknown>"), "{}", error.evalue);
    let kept = kernel.execute("losses.len() + varmap.all_vars().len()").await;
    assert!(kept.result_text().is_some(), "the variables survive: {:?}", kept.error());
}
