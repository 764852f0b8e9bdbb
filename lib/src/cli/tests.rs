use super::*;
use crate::ledger::{measure_flags, oomcheck_flags};

fn words(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_owned).collect()
}

fn assert_short_and_plain(message: &str) {
    assert!(!message.contains('\u{1b}'), "colour codes in {message:?}");
    assert!(!message.contains("backtrace") && !message.contains("panicked"), "{message}");
    assert!(message.lines().count() <= 6, "too long: {message}");
}

#[test]
fn summary_renders_a_table_in_html_and_text() {
    let bundle = summary(&words("resnet50 --input 32x3x224x224")).unwrap();
    let html = bundle.get("text/html").and_then(|v| v.as_str()).unwrap();
    assert!(html.contains("<table>") && html.contains("layer1.0.conv1"));
    let text = bundle.text();
    assert!(text.contains("25,557,032"), "{text}");
    // conv1 at batch 32: 32 x 3,211,264 bytes kept.
    assert!(text.lines().any(|l| l.trim_start().starts_with("conv1 ") && l.contains("102,760,448")), "{text}");
}

#[test]
fn summary_depth_folds_layers_and_eval_changes_the_memory_column() {
    let stages = summary(&words("resnet18 --depth 1")).unwrap();
    assert!(!stages.text().contains("layer1.0"));
    assert!(stages.text().contains("layer4"));
    let eval = summary(&words("resnet18 --eval")).unwrap();
    assert!(eval.text().contains("live in inference"));
    assert!(!eval.text().contains("CrossEntropyLoss"));
}

#[test]
fn oomcheck_reports_verdict_bills_chart_and_fixes() {
    let bundle = oomcheck(&words("resnet50 --batch 96 --res 224 --gpu rtx4060-laptop")).unwrap();
    let text = bundle.text();
    assert!(text.starts_with("DOES NOT FIT"), "{text}");
    for bill in
        ["1. parameters", "2. optimizer state", "3. activations", "4. input batch", "5. context and workspace", "fixes that peak under"]
    {
        assert!(text.contains(bill), "{bill} missing");
    }
    let html = bundle.get("text/html").and_then(|v| v.as_str()).unwrap();
    assert!(html.contains("<svg") && html.contains("DOES NOT FIT"));
}

#[test]
fn oomcheck_with_a_sweep_draws_peak_against_batch() {
    let bundle = oomcheck(&words("resnet18 --batch 16 --res 224 --gpu 4090 --sweep batch=8..64:8")).unwrap();
    let html = bundle.get("text/html").and_then(|v| v.as_str()).unwrap();
    assert!(html.contains("peak memory vs batch"));
    let text = bundle.text();
    assert!(text.contains("sweep on") && text.starts_with("FITS"), "{text}");
    assert!(!text.contains("1. parameters") && text.contains("the same command without --sweep"), "the sweep alone: {text}");
}

#[test]
fn unknown_models_list_the_valid_ones() {
    let err = summary(&words("vgg16")).unwrap_err().to_string();
    assert_short_and_plain(&err);
    assert!(err.contains("unknown model `vgg16`; valid models: resnet18, resnet34, resnet50, efficientnet-b0, small-cnn"), "{err}");
}

#[test]
fn bad_choices_name_the_valid_choices() {
    let err = oomcheck(&words("resnet50 --batch 32 --res 224 --opt lion")).unwrap_err().to_string();
    assert_short_and_plain(&err);
    assert!(err.contains("lion") && err.contains("sgd-momentum") && err.contains("adam8bit"), "{err}");
    let err = oomcheck(&words("resnet50 --batch 32 --res 224 --gpu rtx4091")).unwrap_err().to_string();
    assert_short_and_plain(&err);
    assert!(err.contains("closest: rtx4090"), "{err}");
    let err = oomcheck(&words("resnet50 --res 224")).unwrap_err().to_string();
    assert_short_and_plain(&err);
    assert!(err.contains("--batch"), "{err}");
    let err = oomcheck(&words("resnet50 --batch 32 --res 224 --ckpt layer9")).unwrap_err().to_string();
    assert_eq!(err, "cannot checkpoint `layer9`: no such stage; stages: stem, layer1, layer2, layer3, layer4, head");
    let err = oomcheck(&words("resnet50 --batch 0 --res 224")).unwrap_err().to_string();
    assert!(err.contains("at least 1"), "{err}");
}

#[test]
fn help_is_a_plain_bundle_not_an_error() {
    let help = oomcheck(&words("--help")).unwrap();
    assert!(help.text().contains("--sweep"));
    assert!(!help.text().contains('\u{1b}'));
}

#[test]
fn oomcheck_reports_the_loaders_host_memory_when_given_workers() {
    let bundle = oomcheck(&words("resnet18 --batch 32 --res 224 --workers 16 --prefetch 4 --host-ram 2GiB")).unwrap();
    let text = bundle.text();
    assert!(text.contains("HOST RAM AT RISK"), "{text}");
    assert!(text.contains("--workers 8") && text.contains("batches in flight"), "{text}");
    let (host, bills) = (text.find("HOST RAM AT RISK").unwrap(), text.find("1. parameters").unwrap());
    assert!(host < bills, "the host verdict the flags ask about comes before the card's bills: {text}");
    let without = oomcheck(&words("resnet18 --batch 32 --res 224")).unwrap();
    assert!(!without.text().contains("Host RAM"));
    let err = oomcheck(&words("resnet18 --batch 32 --res 224 --workers 2 --host-ram 32")).unwrap_err();
    assert!(err.0.contains("give a unit"), "{}", err.0);
    let err = oomcheck(&words("resnet18 --batch 32 --res 224 --workers 2 --source 4000")).unwrap_err();
    assert!(err.0.contains("WIDTHxHEIGHT"), "{}", err.0);
}

#[test]
fn oomcheck_host_counts_a_label_per_pixel_for_a_segmentation_model() {
    let unet = oomcheck(&words("unet --batch 16 --res 128 --workers 2 --prefetch 2 --source 640x480 --host")).unwrap().text().to_owned();
    assert!(unet.contains("with a label per pixel") && unet.contains("decoded photos and masks"), "{unet}");
    let resnet =
        oomcheck(&words("resnet18 --batch 16 --res 128 --workers 2 --prefetch 2 --source 640x480 --host")).unwrap().text().to_owned();
    assert!(!resnet.contains("label per pixel"), "{resnet}");
    let batch = |text: &str| text.lines().find(|l| l.starts_with("batches in flight")).map(str::to_owned);
    assert_ne!(batch(&unet), batch(&resnet), "a mask's labels add a quarter of the images' bytes to each batch");
}

#[test]
fn oomcheck_host_shows_the_loaders_part_alone() {
    let text =
        oomcheck(&words("resnet18 --batch 32 --res 224 --workers 16 --prefetch 4 --host-ram 2GiB --host")).unwrap().text().to_owned();
    assert!(text.starts_with("HOST RAM AT RISK") && text.contains("--workers 8"), "{text}");
    assert!(!text.contains("1. parameters") && !text.contains("fixes that peak"), "{text}");
    let err = oomcheck(&words("resnet18 --batch 32 --res 224 --host")).unwrap_err();
    assert!(err.0.contains("--workers"), "{}", err.0);
}

#[test]
fn absurd_configurations_are_refused_at_once_in_one_line() {
    for (line, expected) in [
        ("resnet50 --batch 4294967296 --res 65535", "batch 4294967296 is over the largest vramlab costs, 65536"),
        ("resnet50 --batch 32 --res 65535", "input height 65535 is over the largest vramlab takes, 16384"),
        ("resnet50 --batch 32 --res 224 --channels 100000", "input channels 100000"),
        ("resnet50 --batch 32 --res 224 --accum 99999999", "accumulation steps 99999999"),
        ("resnet50 --batch 32 --res 224 --classes 99999999999", "from 1 to 1048576"),
        ("resnet50 --batch 32 --res 224 --sweep batch=1..18446744073709551615:1", "at most 64"),
        ("resnet50 --batch 32 --res 224 --workers 100000", "from 0 to 1024"),
        ("resnet50 --batch 32 --res 224 --workers 2 --prefetch 4294967296", "from 1 to 1024"),
    ] {
        let error = oomcheck(&words(line)).expect_err(line).to_string();
        assert!(error.contains(expected), "{line}: {error}");
        assert_short_and_plain(&error);
    }
    let error = summary(&words("resnet50 --input 4294967296x3x65535x65535")).unwrap_err().to_string();
    assert!(error.contains("is over the largest"), "{error}");
    // The largest configuration allowed is costed exactly, without overflow, and found not to fit.
    let bundle = oomcheck(&words("resnet50 --batch 65536 --res 16384 --workers 1024 --prefetch 1024 --source 65535x65535")).unwrap();
    assert!(bundle.text().contains("DOES NOT FIT"), "{}", bundle.text());
}

/// Every fix's flags, as `%oomcheck` prints them, parse back to the fix's own configuration.
#[test]
fn every_fix_flag_round_trips_through_the_parser() {
    use clap::Parser;
    let mut fixes = 0;
    for line in [
        "resnet50 --batch 96 --res 224",
        "resnet50 --batch 64 --res 224 --layers plain",
        "resnet18 --batch 128 --res 64 --opt adam --gpu 768MiB",
        "efficientnet-b0 --batch 96 --res 224 --channels 1 --amp f16 --gpu 3GiB",
        "resnet34 --batch 64 --res 320 --ckpt layer1,layer2 --accum 2 --opt sgd-momentum --gpu 3GiB",
        "vit-small --batch 16 --res 224 --gpu 0.8GB",
        "resnet50 --batch 64 --res 224 --cards 2 --shard optimizer --bucket-mb 10 --gpu 2GiB",
    ] {
        let args = OomcheckArgs::try_parse_from(std::iter::once("oomcheck").chain(line.split_whitespace())).unwrap();
        let report = crate::oom::check(&args.model_spec().unwrap(), &args.step_config(), &args.card.gpu).unwrap();
        assert!(!report.fixes.is_empty(), "{line}: no fixes to check");
        for fix in &report.fixes {
            let flags = oomcheck_flags(&fix.config).expect("oomcheck's fixes keep a square input");
            let again = format!("oomcheck {} {flags}", args.model_words());
            let parsed = OomcheckArgs::try_parse_from(again.split_whitespace()).unwrap_or_else(|e| panic!("{again}: {e}"));
            assert_eq!(parsed.step_config(), fix.config, "{line}: `{flags}` does not describe the fix {}", fix.change);
            fixes += 1;
        }
    }
    assert!(fixes >= 8, "{fixes}");
}

#[test]
fn every_precision_and_optimizer_flag_parses_back_to_itself() {
    use clap::ValueEnum;
    for precision in crate::models::Precision::value_variants() {
        assert_eq!(crate::models::Precision::from_str(precision.flag(), false), Ok(*precision));
    }
    for kind in crate::ledger::OptimizerKind::value_variants() {
        assert_eq!(crate::ledger::OptimizerKind::from_str(kind.flag(), false), Ok(*kind));
    }
    let err = oomcheck(&words("resnet18 --batch 32 --res 224 --amp f32")).unwrap_err();
    assert!(err.0.contains("[possible values: f16, bf16]"), "{}", err.0);
}

#[test]
fn measure_flags_parse_back_to_the_step_they_describe() {
    use clap::Parser;
    let base = crate::ledger::StepConfig::training(48, 96);
    let configs = [
        base.clone(),
        crate::ledger::StepConfig {
            levers: crate::ledger::Levers { precision: crate::models::Precision::F16Amp, accumulation: 3, ..base.levers.clone() },
            ..base.clone()
        },
        crate::ledger::StepConfig {
            levers: crate::ledger::Levers {
                optimizer: crate::ledger::OptimizerKind::Adam8bit,
                checkpointing: crate::ledger::Checkpointing::Segments(vec!["layer2".into(), "layer3".into()]),
                ..base.levers.clone()
            },
            ..base.clone()
        },
    ];
    for config in configs {
        let flags = measure_flags(&config, 7).unwrap();
        let line = format!("measure --model resnet18 {flags}");
        let args = MeasureArgs::try_parse_from(line.split_whitespace()).unwrap_or_else(|e| panic!("{line}: {e}"));
        let setup = &args.setup;
        assert_eq!((setup.batch, setup.res, setup.classes()), (48, 96, 7), "{line}");
        assert_eq!(setup.levers(), config.levers, "{line}");
    }
    let grey = crate::ledger::StepConfig { input: crate::models::Shape::map(1, 96, 96), ..base.clone() };
    assert_eq!(measure_flags(&grey, 7), None, "measure reads RGB only");
    assert_eq!(oomcheck_flags(&grey).as_deref(), Some("--batch 48 --res 96 --channels 1 --opt adam"));
    let wide = crate::ledger::StepConfig { input: crate::models::Shape::map(3, 96, 128), ..base };
    assert_eq!(oomcheck_flags(&wide), None, "--res cannot say a wide input");
}

/// A spec saved as JSON, in a directory that lives as long as the test.
fn spec_file(spec: &crate::models::ModelSpec) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("net.json");
    std::fs::write(&path, serde_json::to_string(spec).unwrap()).unwrap();
    (dir, path.to_str().unwrap().to_owned())
}

#[test]
fn a_spec_file_gets_the_report_of_the_zoo_model_it_describes() {
    let zoo = oomcheck(&words("resnet18 --batch 128 --res 224 --gpu 2GiB --classes 10")).unwrap();
    let (_dir, path) = spec_file(&crate::models::ModelName::Resnet18.spec(10));
    let spec = oomcheck(&words(&format!("--spec {path} --batch 128 --res 224 --gpu 2GiB"))).unwrap();
    assert_eq!(spec.text(), zoo.text());
    assert!(spec.text().contains("fixes that peak under"), "{}", spec.text());
    let table = summary(&words(&format!("--spec {path} --input 8x3x64x64"))).unwrap();
    assert!(table.text().contains("layer4"), "{}", table.text());
    let both = oomcheck(&words(&format!("resnet18 --spec {path} --batch 8 --res 64"))).unwrap_err().to_string();
    assert!(both.contains("--spec") && both.contains("cannot be used with"), "{both}");
    assert_short_and_plain(&both);
}

#[test]
fn a_bad_spec_file_is_named_with_what_is_wrong() {
    let missing = oomcheck(&words("--spec /nonexistent/net.json --batch 8 --res 64")).unwrap_err().to_string();
    assert!(missing.contains("cannot read the spec /nonexistent/net.json"), "{missing}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("not-a-spec.json");
    std::fs::write(&path, r#"{"name": "x"}"#).unwrap();
    let wrong = oomcheck(&words(&format!("--spec {} --batch 8 --res 64", path.display()))).unwrap_err().to_string();
    assert!(wrong.contains("is not a model spec"), "{wrong}");
    assert_short_and_plain(&wrong);
    let neither = oomcheck(&words("--batch 8 --res 64")).unwrap_err().to_string();
    assert!(neither.contains("MODEL") || neither.contains("--spec"), "{neither}");
}

#[test]
fn a_network_built_in_a_cell_gets_the_zoo_report_for_its_own_input() {
    use crate::models::{ModelName, Network, Shape};
    let spec = ModelName::Resnet18.spec(10);
    let net = Network::new(&spec, Shape::map(3, 64, 64), &candle_core::Device::Cpu, 0).unwrap();
    let ours = oomcheck_of(&net, &["--batch", "256", "--gpu", "4GiB"]).unwrap();
    let zoo = oomcheck(&words("resnet18 --batch 256 --res 64 --gpu 4GiB --classes 10")).unwrap();
    assert_eq!(ours.text(), zoo.text());
    let larger = oomcheck_of(&net, &["--batch", "256", "--res", "224", "--gpu", "4GiB", "--sweep", "batch=8..64:8"]).unwrap();
    assert!(larger.text().contains("sweep on"), "{}", larger.text());
    for view in ["--brief", "--fixes"] {
        let ours = oomcheck_of(&net, &["--batch", "256", "--gpu", "4GiB", "--cards", "2", view]).unwrap();
        let zoo = oomcheck(&words(&format!("resnet18 --batch 256 --res 64 --gpu 4GiB --classes 10 --cards 2 {view}"))).unwrap();
        assert_eq!(ours.text(), zoo.text(), "{view}");
        assert!(!ours.text().contains("1. parameters"), "{view}: no bills");
    }
    let err = oomcheck_of(&net, &["--batch", "0"]).unwrap_err().to_string();
    assert!(err.contains("--batch"), "{err}");
    assert_short_and_plain(&err);
}

#[test]
fn a_trainer_is_checked_with_its_own_levers() {
    use crate::ledger::OptimizerKind;
    use crate::models::{ModelName, Network, Precision, Shape};
    use crate::train::{OptimizerConfig, TrainConfig, Trainer};
    let net = Network::new(&ModelName::SmallCnn.spec(10), Shape::map(3, 32, 32), &candle_core::Device::Cpu, 0).unwrap();
    let config = TrainConfig {
        precision: Precision::F16Amp,
        accumulation: 4,
        optimizer: OptimizerConfig::for_kind(OptimizerKind::AdamW, 1e-3),
        ..TrainConfig::default()
    };
    let trainer = Trainer::new(net, config).unwrap();
    let ours = oomcheck_of(&trainer, &["--batch", "32", "--gpu", "2GiB"]).unwrap();
    let zoo = oomcheck(&words("small-cnn --batch 32 --res 32 --amp f16 --opt adamw --accum 4 --gpu 2GiB --classes 10")).unwrap();
    assert_eq!(ours.text(), zoo.text());
    let overridden = oomcheck_of(&trainer, &["--batch", "32", "--gpu", "2GiB", "--opt", "sgd", "--accum", "1"]).unwrap();
    let plain_sgd = oomcheck(&words("small-cnn --batch 32 --res 32 --amp f16 --opt sgd --gpu 2GiB --classes 10")).unwrap();
    assert_eq!(overridden.text(), plain_sgd.text());
}

#[test]
fn synth_writes_masks_beside_the_photos_or_alone_for_photos_already_written() {
    let dir = tempfile::tempdir().unwrap();
    let (out, masks) = (dir.path().join("leaves"), dir.path().join("leaves_masks"));
    let argv = |extra: &str| words(&format!("--out {} --images 24 --size 64x48 --masks {} {extra}", out.display(), masks.display()));
    let both = parse::<SynthArgs>("synth", &argv("")).unwrap().unwrap().run().unwrap();
    let manifest = both.manifest.clone().unwrap();
    assert_eq!(manifest.entries.len(), 24);
    for entry in &manifest.entries {
        assert!(masks.join(&entry.path).with_extension("png").is_file(), "{}", entry.path.display());
    }
    let json = serde_json::to_value(&both).unwrap();
    assert!(json["entries"].is_array() && json["masks"]["lesion_pixels"].is_array(), "{json}");
    let args = parse::<SynthArgs>("synth", &argv("")).unwrap().unwrap();
    assert!(both.text(&args).contains("leaves_masks") && both.text(&args).contains("lesion"));

    std::fs::remove_dir_all(&masks).unwrap();
    let alone = parse::<SynthArgs>("synth", &argv("--masks-only")).unwrap().unwrap().run().unwrap();
    assert_eq!((alone.manifest, alone.masks), (None, both.masks));
    assert!(masks.join(&manifest.entries[0].path).with_extension("png").is_file());

    let other = parse::<SynthArgs>("synth", &argv("--masks-only --seed 7")).unwrap().unwrap().run().unwrap_err().to_string();
    assert!(other.contains("manifest.csv") && other.contains("other settings"), "{other}");
    let err = parse::<SynthArgs>("synth", &words(&format!("--out {} --masks-only", out.display())));
    assert!(err.unwrap_err().0.contains("--masks"));
    let plain = parse::<SynthArgs>("synth", &words(&format!("--out {} --images 24 --size 32x32", dir.path().join("plain").display())))
        .unwrap()
        .unwrap();
    let json = serde_json::to_value(plain.run().unwrap()).unwrap();
    assert_eq!(json.as_object().unwrap().keys().collect::<Vec<_>>(), ["entries"], "without --masks the JSON is the manifest, as before");
}

#[test]
fn brief_oomcheck_shows_the_verdict_and_one_line_per_fix() {
    let args = |line: &str| parse::<OomcheckArgs>("oomcheck", &line.split_whitespace().map(str::to_owned).collect::<Vec<_>>());
    let over = run_oomcheck(&args("resnet50 --batch 128 --res 224 --gpu rtx4060-laptop --brief").unwrap().unwrap()).unwrap();
    let text = over.bundle().text().to_owned();
    assert!(text.starts_with("DOES NOT FIT"), "{text}");
    assert!(!text.contains("1. parameters"), "the bills are not part of the brief view:\n{text}");
    let fixes: Vec<&str> =
        text.lines().filter(|line| line.split_once(". ").is_some_and(|(rank, _)| rank.parse::<usize>().is_ok())).collect();
    assert_eq!(fixes.len(), over.report.fixes.len(), "{text}");
    assert!(fixes[0].starts_with(&format!("1. {}: peak ", over.report.fixes[0].change)), "{text}");
    let fits = run_oomcheck(&args("resnet50 --batch 128 --res 224 --gpu rtx4060-laptop --amp bf16 --brief").unwrap().unwrap()).unwrap();
    let text = fits.bundle().text().to_owned();
    assert!(text.starts_with("FITS: peak"), "{text}");
    assert!(!text.contains("Fixes that peak"), "{text}");
    let clash = args("resnet50 --batch 128 --res 224 --brief --sweep batch=8..16").unwrap_err();
    assert!(clash.0.contains("--sweep"), "{}", clash.0);
}

#[test]
fn oomcheck_with_fixes_shows_the_verdict_and_the_fixes_table_alone() {
    let args = |line: &str| parse::<OomcheckArgs>("oomcheck", &line.split_whitespace().map(str::to_owned).collect::<Vec<_>>());
    let over = run_oomcheck(&args("resnet50 --batch 128 --res 224 --gpu rtx4060-laptop --fixes").unwrap().unwrap()).unwrap();
    let text = over.bundle().text().to_owned();
    let full = run_oomcheck(&args("resnet50 --batch 128 --res 224 --gpu rtx4060-laptop").unwrap().unwrap()).unwrap();
    let table = over.report.fixes_table().to_string().trim_end().to_owned();
    assert!(text.starts_with("DOES NOT FIT") && text.contains(&table), "{text}");
    assert!(full.bundle().text().contains(&table), "the same table as the whole report's");
    assert!(!text.contains("1. parameters") && !text.contains("step timeline"), "no bills, no timeline:\n{text}");
    let fits = run_oomcheck(&args("resnet50 --batch 128 --res 224 --gpu rtx4060-laptop --amp bf16 --fixes").unwrap().unwrap()).unwrap();
    assert!(!fits.bundle().text().contains("fixes that peak"), "{}", fits.bundle().text());
    let clash = args("resnet50 --batch 128 --res 224 --fixes --brief").unwrap_err();
    assert!(clash.0.contains("--brief"), "{}", clash.0);
}

#[test]
fn the_lever_flags_read_the_same_in_every_command_over_each_commands_base() {
    use crate::ledger::{Cards, Checkpointing, Levers, OptimizerKind, Shard};
    use crate::models::{Layers, Precision};
    use clap::Parser;
    let pulled = " --amp f16 --opt adamw --accum 2 --ckpt layer1,layer2 --layers plain";
    let expected = Levers {
        precision: Precision::F16Amp,
        optimizer: OptimizerKind::AdamW,
        accumulation: 2,
        checkpointing: Checkpointing::Segments(vec!["layer1".into(), "layer2".into()]),
        layers: Layers::Plain,
        cards: Cards::default(),
    };
    let oomcheck =
        |flags: &str| parse::<OomcheckArgs>("oomcheck", &words(&format!("resnet18 --batch 8 --res 64{flags}"))).unwrap().unwrap();
    let measure = |flags: &str| {
        MeasureArgs::try_parse_from(format!("measure --model resnet18 --batch 8 --res 64{flags}").split_whitespace()).unwrap()
    };
    let learn = |flags: &str| LearnArgs::try_parse_from(format!("train --root data{flags}").split_whitespace()).unwrap().config();
    assert_eq!(oomcheck(pulled).step_config().levers, expected);
    assert_eq!(measure(pulled).setup.levers(), expected);
    let learned = learn(pulled);
    assert_eq!(
        (learned.precision, learned.optimizer.kind(), learned.accumulation, &learned.checkpointing, learned.layers),
        (expected.precision, expected.optimizer, expected.accumulation, &expected.checkpointing, expected.layers)
    );
    // A flag left out keeps the command's base: the lesson's levers, with SGD and momentum where real steps are timed.
    assert_eq!(oomcheck("").step_config().levers, Levers::default());
    assert_eq!(measure("").setup.levers(), Levers { optimizer: OptimizerKind::SgdMomentum, ..Levers::default() });
    assert_eq!(learn("").optimizer.kind(), OptimizerKind::Adam);
    // One flag changes one lever.
    assert_eq!(oomcheck(" --accum 4").step_config().levers, Levers { accumulation: 4, ..Levers::default() });
    let err = oomcheck_err("resnet18 --batch 8 --res 64 --accum 0");
    assert!(err.contains("--accum") && err.contains("at least 1"), "{err}");
    // The cards are levers of the same group; only the commands that cost a step take more than one.
    let cards = " --cards 4 --shard gradients --bucket-mb 50 --sync-bn";
    let spread = Cards { count: 4, shard: Shard::Gradients, bucket_bytes: 50 << 20, sync_batch_norm: true };
    assert_eq!(oomcheck(cards).step_config().levers, Levers { cards: spread, ..Levers::default() });
    assert_eq!(
        oomcheck(cards).step_config().levers.flags(crate::ledger::Mode::Training),
        " --opt adam --cards 4 --shard gradients --sync-bn --bucket-mb 50"
    );
    let refused = measure(cards).setup.levers.on_one_card("segmentation").unwrap_err();
    assert_eq!(refused, "--cards 4: segmentation runs in one process, on one card");
    let learner = LearnArgs::try_parse_from("train --root data --shard optimizer".split_whitespace()).unwrap();
    assert_eq!(learner.levers.on_one_card("x").unwrap_err(), "--shard optimizer divides among several cards: add --cards 2 or more");
    assert_eq!(measure(" --cards 1").setup.levers.on_one_card("x"), Ok(()));
    let err = measure(" --sync-bn").setup.levers.on_one_card("x").unwrap_err();
    assert_eq!(err, "--sync-bn sums batch-norm's statistics over several cards: add --cards 2 or more");
    let err = oomcheck_err("resnet18 --batch 8 --res 64 --shard everything");
    assert!(err.contains("--shard") && err.contains("optimizer"), "{err}");
}

fn oomcheck_err(line: &str) -> String {
    parse::<OomcheckArgs>("oomcheck", &words(line)).unwrap_err().0
}

#[test]
fn oomcheck_on_several_cards_shows_one_cards_bills_at_each_stage_beside_one_card() {
    let text = oomcheck(&words("resnet50 --batch 32 --res 224 --cards 4 --shard gradients")).unwrap().text().to_owned();
    assert!(text.contains("batch 32 at 3x224x224, f32, Adam, one of 4 cards, ZeRO-2"), "{text}");
    let table = text.split("one of 4 cards, batch 32 on each, at each sharding stage").nth(1).expect("the stages' table");
    let header = table.lines().nth(1).unwrap();
    for column in ["1 card, batch 128", "DDP", "ZeRO-1", "ZeRO-2 (this)", "ZeRO-3"] {
        assert!(header.contains(column), "{header}");
    }
    assert!(table.lines().any(|l| l.starts_with("peak (% of card)")) && table.lines().any(|l| l.starts_with("verdict")), "{table}");
    let one = oomcheck(&words("resnet50 --batch 32 --res 224")).unwrap().text().to_owned();
    assert!(!one.contains("sharding stage"), "one card has no stages' table");
    // Synchronised batch-norm costs what each card's own does; the one card beside it has nothing to synchronise.
    let synced = oomcheck(&words("resnet50 --batch 32 --res 224 --cards 4 --shard gradients --sync-bn")).unwrap().text().to_owned();
    assert!(synced.contains("one of 4 cards, ZeRO-2, batch-norm synchronised"), "{synced}");
    let stages = |text: &str| -> Vec<String> {
        let table = text.split("at each sharding stage").nth(1).unwrap_or_default().lines();
        table.take_while(|l| !l.starts_with("verdict")).map(str::to_owned).collect()
    };
    assert!(stages(&synced).len() > 2);
    assert_eq!(stages(&synced), stages(&text));
}
