use super::*;
use crate::gpus::Card;
use crate::models::{analyze, resnet18, resnet50, small_cnn, Layers, Precision, Shape};

fn laptop() -> Card {
    Card::parse("rtx4060-laptop").unwrap()
}

fn resnet50_at(batch: usize) -> Ledger {
    estimate(&resnet50(1000), &StepConfig::training(batch, 224), &laptop()).unwrap()
}

fn line(ledger: &Ledger, kind: BillKind, label_start: &str) -> u64 {
    ledger.bill(kind).lines.iter().find(|l| l.label.starts_with(label_start)).map(|l| l.bytes).unwrap_or(0)
}

#[test]
fn the_lessons_input_arithmetic_is_exact() {
    let one = resnet50_at(1);
    assert_eq!(line(&one, BillKind::InputBatch, "images"), 602_112);
    let batch = resnet50_at(32);
    assert_eq!(line(&batch, BillKind::InputBatch, "images"), 19_267_584);
    assert_eq!(line(&batch, BillKind::InputBatch, "labels"), 32 * 4);
}

#[test]
fn resnet50_weights_are_about_102_mb_and_adam_doubles_them() {
    let ledger = resnet50_at(32);
    assert_eq!(line(&ledger, BillKind::Parameters, "weights"), 102_228_128);
    assert_eq!(ledger.bill(BillKind::OptimizerState).bytes, 2 * 102_228_128);
    assert_eq!(line(&ledger, BillKind::Parameters, "gradients"), 102_228_128);
}

#[test]
fn halving_the_batch_halves_activations_and_saves_about_10_mb_of_input() {
    let (full, half) = (resnet50_at(32), resnet50_at(16));
    let act = |l: &Ledger| l.bill(BillKind::Activations).bytes;
    assert_eq!(act(&half) * 2, act(&full));
    let saved_input = full.bill(BillKind::InputBatch).bytes - half.bill(BillKind::InputBatch).bytes;
    assert_eq!(saved_input, 9_633_792 + 16 * 4);
    // Activations dwarf the input: the lesson's conclusion.
    assert!(act(&full) > 100 * full.bill(BillKind::InputBatch).bytes);
}

#[test]
fn optimizers_bill_what_they_keep() {
    let config = |optimizer| StepConfig { levers: Levers { optimizer, ..Levers::default() }, ..StepConfig::training(8, 224) };
    let state = |optimizer| estimate(&resnet50(1000), &config(optimizer), &laptop()).unwrap().bill(BillKind::OptimizerState).bytes;
    let weights = 102_228_128;
    assert_eq!(state(OptimizerKind::Sgd), 0);
    assert_eq!(state(OptimizerKind::SgdMomentum), weights);
    assert_eq!(state(OptimizerKind::AdamW), 2 * weights);
    let eight_bit = state(OptimizerKind::Adam8bit);
    assert!(eight_bit > weights / 2 && eight_bit < weights * 6 / 10, "{eight_bit}");
}

#[test]
fn the_peak_is_walked_not_summed() {
    let ledger = resnet50_at(32);
    assert!(ledger.peak.bytes < ledger.sum_of_bills());
    let from_phases = ledger.timeline.iter().map(|p| p.peak_bytes).max().unwrap();
    assert_eq!(ledger.peak.bytes, from_phases);
    let breakdown: u64 = ledger.peak.breakdown.iter().map(|l| l.bytes).sum();
    assert_eq!(breakdown, ledger.peak.bytes);
    // Without checkpointing backward is one candle call that frees nothing
    // the graph saved: the peak is in it.
    assert_eq!(ledger.peak.phase, "backward stem, layer1, layer2, layer3, layer4, head");
    // Split as a measurement splits it, the peak is the sum of its bills.
    assert_eq!(ledger.peak.composition().iter().sum::<u64>(), ledger.peak.bytes);
    // Every bill's lines add up to the bill.
    for bill in &ledger.bills {
        assert_eq!(bill.lines.iter().map(|l| l.bytes).sum::<u64>(), bill.bytes);
    }
}

#[test]
fn mixed_precision_adds_half_weight_copies_and_shrinks_conv_outputs() {
    let amp = StepConfig { levers: Levers { precision: Precision::F16Amp, ..Levers::default() }, ..StepConfig::training(32, 224) };
    let ledger = estimate(&resnet50(1000), &amp, &laptop()).unwrap();
    let copies = line(&ledger, BillKind::Activations, "f16 copies");
    assert!(copies > 0 && copies < 25_557_032 * 2);
    assert_eq!(line(&resnet50_at(32), BillKind::Activations, "f16 copies"), 0);
}

#[test]
fn accumulation_adds_an_accumulator_and_shrinks_activations() {
    let plain = resnet50_at(32);
    let accum = StepConfig { batch: 8, levers: Levers { accumulation: 4, ..Levers::default() }, ..StepConfig::training(32, 224) };
    let ledger = estimate(&resnet50(1000), &accum, &laptop()).unwrap();
    assert_eq!(line(&ledger, BillKind::Parameters, "accumulated"), 102_228_128);
    assert_eq!(ledger.bill(BillKind::Activations).bytes * 4, plain.bill(BillKind::Activations).bytes);
    assert!(ledger.peak.bytes < plain.peak.bytes);
}

#[test]
fn checkpointing_lowers_the_peak_and_names_unknown_stages() {
    let plain = resnet50_at(32);
    let ckpt = StepConfig { levers: Levers { checkpointing: Checkpointing::Stages, ..Levers::default() }, ..StepConfig::training(32, 224) };
    let ledger = estimate(&resnet50(1000), &ckpt, &laptop()).unwrap();
    // Forward keeps only the stage boundaries, about a tenth of the activations;
    // the peak falls less, as a stage's recomputation and its backward come back
    // (with the lean layers, which keep little to begin with, by a sixth).
    assert!(ledger.kept_by_forward() * 9 < plain.kept_by_forward(), "{} vs {}", ledger.kept_by_forward(), plain.kept_by_forward());
    assert!(ledger.peak.bytes * 6 < plain.peak.bytes * 5, "{} vs {}", ledger.peak.bytes, plain.peak.bytes);
    let bad = StepConfig {
        levers: Levers { checkpointing: Checkpointing::Segments(vec!["layer9".into()]), ..Levers::default() },
        ..StepConfig::training(32, 224)
    };
    let err = estimate(&resnet50(1000), &bad, &laptop()).unwrap_err().to_string();
    assert_eq!(err, "cannot checkpoint `layer9`: no such stage; stages: stem, layer1, layer2, layer3, layer4, head");
}

#[test]
fn inference_keeps_no_graph_gradients_or_state() {
    let eval = StepConfig { mode: Mode::Inference, ..StepConfig::training(32, 224) };
    let ledger = estimate(&resnet50(1000), &eval, &laptop()).unwrap();
    assert_eq!(ledger.bill(BillKind::OptimizerState).bytes, 0);
    assert_eq!(line(&ledger, BillKind::Parameters, "gradients"), 0);
    // Beyond what both hold from the start (the context and cuDNN's workspace).
    let shared = ledger
        .bill(BillKind::ContextAndWorkspace)
        .lines
        .iter()
        .filter(|l| l.label.contains("context") || l.label.contains("cuDNN"))
        .map(|l| l.bytes)
        .sum::<u64>();
    let training = resnet50_at(32).peak.bytes - shared;
    assert!((ledger.peak.bytes - shared) * 3 < training, "{} vs {training}", ledger.peak.bytes - shared);
}

#[test]
fn context_comes_from_the_device() {
    let cpu = estimate(&small_cnn(10), &StepConfig::training(8, 32), &Card::parse("cpu").unwrap()).unwrap();
    assert_eq!(cpu.peak.breakdown.iter().find(|l| l.part == Part::Context), None);
    let gpu = estimate(&resnet18(10), &StepConfig::training(8, 64), &Card::parse("8GiB").unwrap()).unwrap();
    assert_eq!(line(&gpu, BillKind::ContextAndWorkspace, "CUDA context"), crate::gpus::GENERIC_CONTEXT_BYTES);
}

#[test]
fn zero_batch_and_non_square_inputs() {
    let zero = estimate(&resnet18(10), &StepConfig::training(0, 64), &laptop()).unwrap_err();
    assert_eq!(zero.to_string(), "batch must be at least 1");
    let wide = StepConfig { input: Shape::map(3, 64, 128), ..StepConfig::training(2, 64) };
    assert_eq!(line(&estimate(&resnet18(10), &wide, &laptop()).unwrap(), BillKind::InputBatch, "images"), 2 * 3 * 64 * 128 * 4);
}

#[test]
fn tables_and_charts_render() {
    let ledger = resnet50_at(32);
    let text = ledger.table().to_string();
    assert!(text.contains("102,228,128"), "{text}");
    assert!(text.contains("peak, during \"backward stem, layer1"), "{text}");
    assert!(ledger.timeline_table().to_string().contains("<- peak"));
    let svg = ledger.chart().to_svg().unwrap();
    assert!(svg.contains("3. activations"));
    // Adam's temporaries come after backward's peak: the bar says so beside the bill.
    assert!(svg.contains("at the peak (bill 195 MiB)"), "{svg}");
}

#[test]
fn a_card_holds_cudnn_s_one_workspace_from_the_start_and_the_host_none() {
    let config = StepConfig::training(8, 64);
    let gpu = estimate(&resnet18(10), &config, &Card::parse("8GiB").unwrap()).unwrap();
    assert_eq!(line(&gpu, BillKind::ContextAndWorkspace, "cuDNN workspace"), crate::ops::CUDNN_WORKSPACE_BYTES);
    let loaded = &gpu.timeline[0];
    assert_eq!(
        loaded.resident_bytes,
        crate::gpus::GENERIC_CONTEXT_BYTES
            + crate::ops::CUDNN_WORKSPACE_BYTES
            + line(&gpu, BillKind::Parameters, "weights")
            + line(&gpu, BillKind::Parameters, "batch-norm")
            + gpu.bill(BillKind::OptimizerState).bytes
    );
    // The workspace does not grow with the batch, as an im2col's would.
    let large = estimate(&resnet18(10), &StepConfig::training(64, 64), &Card::parse("8GiB").unwrap()).unwrap();
    assert_eq!(line(&large, BillKind::ContextAndWorkspace, "cuDNN workspace"), crate::ops::CUDNN_WORKSPACE_BYTES);
    let cpu = estimate(&resnet18(10), &config, &Card::parse("cpu").unwrap()).unwrap();
    assert!(cpu.bill(BillKind::ContextAndWorkspace).lines.iter().all(|l| !l.label.contains("cuDNN")));
    let eval = StepConfig { mode: Mode::Inference, ..config };
    let inference = estimate(&resnet18(10), &eval, &Card::parse("8GiB").unwrap()).unwrap();
    assert_eq!(line(&inference, BillKind::ContextAndWorkspace, "cuDNN workspace"), crate::ops::CUDNN_WORKSPACE_BYTES);
}

fn on_cards(count: usize, shard: Shard, checkpointing: Checkpointing, device: &Card) -> Ledger {
    let mut config = StepConfig::training(16, 224);
    config.levers.checkpointing = checkpointing;
    config.levers.cards = Cards { count, shard, ..Cards::default() };
    estimate(&resnet50(1000), &config, device).unwrap()
}

/// ResNet-50's 25.6 M parameters over four cards: each stage divides what
/// it says by four (the flat state padded to a multiple of four), and
/// leaves the activations of each card's own batch as they are.
#[test]
fn each_sharding_stage_divides_what_it_says_among_the_cards() {
    let card = laptop();
    let alone = on_cards(1, Shard::None, Checkpointing::None, &card);
    let weights = line(&alone, BillKind::Parameters, "weights");
    let quarter = weights.div_ceil(4);
    let adam = alone.bill(BillKind::OptimizerState).bytes;
    let stages: Vec<Ledger> = Shard::ALL.into_iter().map(|s| on_cards(4, s, Checkpointing::None, &card)).collect();
    for ledger in &stages {
        assert_eq!(ledger.bill(BillKind::Activations), alone.bill(BillKind::Activations), "each card's batch is the config's");
        assert_eq!(ledger.bill(BillKind::InputBatch), alone.bill(BillKind::InputBatch));
        assert_eq!(ledger.config.effective_batch(), 64);
    }
    let [ddp, zero1, zero2, zero3] = &stages[..] else { unreachable!() };
    assert_eq!(ddp.bill(BillKind::Parameters), alone.bill(BillKind::Parameters), "DDP keeps everything");
    assert_eq!(ddp.bill(BillKind::OptimizerState), alone.bill(BillKind::OptimizerState));
    assert_eq!(zero1.bill(BillKind::OptimizerState).bytes, 2 * (weights.div_ceil(4)), "ZeRO-1: a quarter of Adam's two moments");
    assert_eq!(zero1.bill(BillKind::OptimizerState).bytes * 4, adam);
    assert_eq!(line(zero1, BillKind::Parameters, "gradients"), weights, "ZeRO-1 keeps whole gradients");
    assert_eq!(line(zero2, BillKind::Parameters, "gradients (f32), this card's 1/4"), quarter, "ZeRO-2 reduces during backward");
    let layer4 = 4 * line(zero2, BillKind::Parameters, "a backward stage's gradients") / 3;
    assert_eq!(layer4, 4 * 14_964_736, "the largest stage's gradients whole, less this card's part");
    assert_eq!(line(zero2, BillKind::Parameters, "weights (f32 master copy)"), weights);
    assert_eq!(line(zero3, BillKind::Parameters, "weights (f32 master copy), this card's 1/4"), quarter);
    assert_eq!(
        line(zero3, BillKind::Parameters, "weights gathered"),
        weights,
        "without checkpointing every stage's graph keeps its gathered weights"
    );

    // The cards' own lines: NCCL's rings and the largest bucket, made
    // and received, on a card.
    let context = |l: &Ledger| l.bill(BillKind::ContextAndWorkspace).bytes;
    let bucket = super::estimate::largest_bucket(
        &analyze(&resnet50(1000), Shape::map(3, 224, 224), Precision::F32, Layers::Lean).unwrap(),
        0..6,
        25 << 20,
    );
    assert!(bucket > 24 << 20 && bucket <= 25 << 20, "{bucket}");
    assert_eq!(context(ddp) - context(&alone), 2 * 9_633_792 + 2 * bucket, "NCCL's rings, a bucket made and one received");
    assert!(line(ddp, BillKind::ContextAndWorkspace, "NCCL's ring buffers") == 2 * 9_633_792);
    let host = on_cards(2, Shard::None, Checkpointing::None, &Card::host().unwrap());
    assert_eq!(line(&host, BillKind::ContextAndWorkspace, "Open MPI's shared-memory segment"), 4 << 20);

    // Checkpointed, each stage's peak is below the one before's: ZeRO-2
    // divides each stage's gradients as its backward ends, and ZeRO-3
    // gathers only the recomputed stage's weights. Without checkpointing
    // ZeRO-3's gathered weights outlive forward.
    let checkpointed: Vec<Ledger> = Shard::ALL.into_iter().map(|s| on_cards(4, s, Checkpointing::Stages, &card)).collect();
    let peaks: Vec<u64> = checkpointed.iter().map(|l| l.peak.bytes).collect();
    assert!(peaks[1] < peaks[0] && peaks[2] < peaks[1] && peaks[3] < peaks[2], "{peaks:?}");
    let after_backward = |l: &Ledger| l.timeline.iter().find(|p| p.phase == StepPhase::GraphDropped).unwrap().resident_bytes;
    assert_eq!(
        after_backward(&checkpointed[1]) - after_backward(&checkpointed[2]),
        weights - quarter,
        "ZeRO-2 has freed three quarters of the gradients by the end of backward"
    );
    assert!(zero3.peak.bytes > zero2.peak.bytes, "{} vs {}", zero3.peak.bytes, zero2.peak.bytes);
    // Backward a stage at a time drops each stage's graph as its backward
    // ends, which frees more than the buckets and NCCL's rings add.
    assert!(ddp.peak.bytes < alone.peak.bytes, "{} vs {}", ddp.peak.bytes, alone.peak.bytes);
}

/// The phases the cards add are where their exchange happens: each
/// stage's backward exchanges its gradients (after backward when
/// accumulating), ZeRO-1 and ZeRO-2 gather the updated weights after the
/// step, ZeRO-3 gathers inside forward and backward.
#[test]
fn the_cards_exchange_in_the_phases_their_stage_names() {
    let card = laptop();
    let names = |shard, accumulation| {
        let mut config = StepConfig::training(16, 224);
        config.levers.cards = Cards { count: 2, shard, ..Cards::default() };
        config.levers.accumulation = accumulation;
        estimate(&resnet50(1000), &config, &card).unwrap().timeline.into_iter().map(|p| p.name).collect::<Vec<_>>()
    };
    let gathered = "updated weights gathered from 2 cards".to_owned();
    let backward = |names: &[String], exchanged: &str| {
        let stages =
            ["head", "layer4", "layer3", "layer2", "layer1", "stem"].map(|stage| format!("backward {stage}, gradients {exchanged}"));
        names.iter().filter(|n| n.starts_with("backward")).eq(stages.iter())
    };
    let (ddp, zero1, zero2, zero3) =
        (names(Shard::None, 1), names(Shard::Optimizer, 1), names(Shard::Gradients, 1), names(Shard::Parameters, 1));
    assert!(backward(&ddp, "all-reduced") && !ddp.contains(&gathered), "{ddp:?}");
    assert!(backward(&zero1, "all-reduced") && zero1.contains(&gathered), "{zero1:?}");
    assert!(backward(&zero2, "reduced to their cards") && zero2.contains(&gathered), "{zero2:?}");
    assert!(backward(&zero3, "reduce-scattered") && !zero3.contains(&gathered), "{zero3:?}");
    assert!(zero1.contains(&"Adam step on this card's part".to_owned()));
    // Accumulating, the cards wait for the micro-batches' sum, then reduce it at once.
    let (ddp, zero2) = (names(Shard::None, 2), names(Shard::Gradients, 2));
    assert!(
        ddp.contains(&"gradients all-reduced over 2 cards".to_owned())
            && ddp.contains(&"backward stem, layer1, layer2, layer3, layer4, head".to_owned()),
        "{ddp:?}"
    );
    assert!(zero2.contains(&"gradients reduced over 2 cards, this card's part kept".to_owned()), "{zero2:?}");
    for shard in Shard::ALL {
        let ledger = on_cards(2, shard, Checkpointing::Segments(vec!["layer2".into()]), &card);
        assert!(ledger.timeline.iter().all(|p| p.peak_bytes >= p.resident_bytes), "{shard:?}");
        assert_eq!(ledger.peak.breakdown.iter().map(|l| l.bytes).sum::<u64>(), ledger.peak.bytes);
        let last = ledger.timeline.last().unwrap();
        assert_eq!(last.resident_bytes, ledger.timeline[0].resident_bytes, "{shard:?}: the step ends where it began");
    }
}

#[test]
fn impossible_card_settings_are_named() {
    let mut config = StepConfig::training(8, 64);
    config.levers.cards.shard = Shard::Optimizer;
    let err = estimate(&resnet18(10), &config, &laptop()).unwrap_err().to_string();
    assert_eq!(err, "--shard optimizer divides among several cards: add --cards 2 or more");
    config.levers.cards = Cards { count: 2, ..Cards::default() };
    config.mode = Mode::Inference;
    assert!(estimate(&resnet18(10), &config, &laptop()).unwrap_err().to_string().contains("for inference each card runs its own copy"));
    config.mode = Mode::Training;
    config.levers.cards.count = 0;
    assert_eq!(estimate(&resnet18(10), &config, &laptop()).unwrap_err().to_string(), "cards must be at least 1");
}

/// The ledger fills DDP's buckets a layer at a time, the trainer a tensor
/// at a time: on every zoo model, at three bucket sizes, each stage's
/// largest bucket and the whole network's agree to within a layer's bias
/// (under 1% on each; within 2% here).
#[test]
fn the_ledger_fills_the_buckets_the_trainer_fills() {
    use crate::models::{ModelName, Network};
    let input = Shape::map(3, 32, 32);
    for name in ModelName::ALL {
        let spec = name.spec(10);
        let net = Network::new(&spec, input, &candle_core::Device::Cpu, 0).unwrap();
        let cost = analyze(&spec, input, Precision::F32, Layers::Lean).unwrap();
        let bytes: Vec<u64> = net.params().iter().map(|p| p.var.elem_count() as u64 * 4).collect();
        let stages = net.num_stages();
        for cap in [64 << 10, 1 << 20, 25 << 20] {
            for range in (0..stages).map(|s| s..s + 1).chain(std::iter::once(0..stages)) {
                let params = &bytes[net.stage_params(range.clone())];
                let trainer = crate::dist::buckets(params, cap).into_iter().map(|b| params[b].iter().sum::<u64>()).max().unwrap_or(0);
                let ledger = super::estimate::largest_bucket(&cost, range.clone(), cap);
                assert!(
                    ledger.abs_diff(trainer) <= trainer / 50,
                    "{} {range:?}, {cap} B buckets: ledger {ledger}, trainer {trainer}",
                    spec.name
                );
            }
        }
    }
}
