use super::*;
use crate::gpus::Card;
use crate::models::{resnet18, resnet50, small_cnn, Precision, Shape};

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
