use std::time::Instant;

use super::*;
use crate::gpus::Card;
use crate::ledger::{estimate, Levers, OptimizerKind, StepConfig};
use crate::models::{resnet18, resnet50, small_cnn};

fn card(name: &str) -> Card {
    Card::parse(name).unwrap()
}

#[test]
fn small_jobs_fit_and_get_no_fixes() {
    let report = check(&small_cnn(10), &StepConfig::training(32, 64), &card("rtx4060-laptop")).unwrap();
    assert_eq!(report.verdict, Verdict::Fits);
    assert!(report.fixes.is_empty());
    assert!(report.verdict_line().starts_with("FITS: peak "), "{}", report.verdict_line());
}

#[test]
fn resnet50_batch_96_does_not_fit_a_laptop_and_every_fix_really_fits() {
    let device = card("rtx4060-laptop");
    let base = StepConfig::training(96, 224);
    let report = check(&resnet50(1000), &base, &device).unwrap();
    assert_eq!(report.verdict, Verdict::DoesNotFit);
    assert!(report.headroom_bytes < 0);
    assert!(report.verdict_line().starts_with("DOES NOT FIT"));
    assert!(report.fixes.len() >= 3, "{:#?}", report.fixes);
    for fix in &report.fixes {
        // Re-estimated independently: the fix's own numbers are honest.
        let again = estimate(&resnet50(1000), &fix.config, &device).unwrap();
        assert_eq!(again.peak.bytes, fix.peak_bytes, "{}", fix.change);
        assert!(fix.peak_bytes <= report.target_bytes && report.target_bytes < device.usable_bytes, "{}", fix.change);
        if fix.cost.effective_batch_kept {
            assert_eq!(fix.config.effective_batch(), 96, "{}", fix.change);
        }
    }
    let scores: Vec<f64> = report.fixes.iter().map(|f| f.score(&base)).collect();
    assert!(scores.windows(2).all(|w| w[0] <= w[1]), "{scores:?}");
}

/// Where one card cannot fit, the fixes offer the fewest cards of each
/// sharding stage that fit the same samples, each stage only where it
/// needs fewer cards than the stages below it, and rank them after the
/// levers that cost no hardware and risk nothing.
#[test]
fn several_cards_are_offered_at_their_fewest_for_each_stage_that_needs_fewer() {
    use crate::ledger::{Cards, OptimizerKind, Shard};
    let adamw =
        |batch| StepConfig { levers: Levers { optimizer: OptimizerKind::AdamW, ..Levers::default() }, ..StepConfig::training(batch, 224) };
    let cases = [
        (crate::models::vit_small(1000), StepConfig::training(16, 224), card("0.8GB")),
        (crate::models::vit_small(1000), adamw(8), card("0.7GB")),
        (crate::models::vit_small(1000), adamw(16), card("0.9GB")),
        (resnet50(1000), StepConfig::training(256, 224), card("rtx4060-laptop")),
        (
            resnet50(1000),
            StepConfig {
                levers: Levers { cards: Cards { count: 2, ..Cards::default() }, ..Levers::default() },
                ..StepConfig::training(64, 224)
            },
            card("2GiB"),
        ),
    ];
    let mut offered = 0;
    for (spec, base, device) in cases {
        let report = check(&spec, &base, &device).unwrap();
        assert_ne!(report.verdict, Verdict::Fits);
        let several: Vec<&Fix> = report.fixes.iter().filter(|f| f.kind == FixKind::SeveralCards).collect();
        assert!(!several.is_empty(), "{}: {:#?}", spec.name, report.fixes.iter().map(|f| &f.change).collect::<Vec<_>>());
        let samples = base.batch * base.levers.cards.count;
        for fix in &several {
            let cards = fix.config.levers.cards;
            assert_eq!(fix.config.batch * cards.count, samples, "{}", fix.change);
            assert_eq!(fix.config.effective_batch(), base.effective_batch());
            assert!(cards.count >= base.levers.cards.count && cards.shard >= base.levers.cards.shard, "{}", fix.change);
            assert!(fix.peak_bytes <= report.target_bytes);
            // The fewest: half the cards with the same stage do not fit.
            let half = cards.count / 2;
            if half >= 2.max(base.levers.cards.count) {
                let fewer = StepConfig {
                    batch: samples / half,
                    levers: Levers { cards: Cards { count: half, ..cards }, ..fix.config.levers.clone() },
                    ..fix.config.clone()
                };
                assert!(estimate(&spec, &fewer, &device).unwrap().peak.bytes > report.target_bytes, "{}", fix.change);
            }
            let cheaper = report.fixes.iter().take_while(|f| f.change != fix.change);
            assert!(cheaper.clone().all(|f| f.score(&base) <= fix.score(&base)));
            offered += 1;
        }
        let mut by_stage: Vec<(Shard, usize)> =
            several.iter().map(|f| (f.config.levers.cards.shard, f.config.levers.cards.count)).collect();
        by_stage.sort();
        assert!(by_stage.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 > w[1].1), "{by_stage:?}");
        // A free lever that fits ranks before any extra card.
        for free in report.fixes.iter().filter(|f| f.kind == FixKind::Checkpointing) {
            let first_card = report.fixes.iter().position(|f| f.kind == FixKind::SeveralCards).unwrap();
            assert!(report.fixes.iter().position(|f| f.change == free.change).unwrap() < first_card);
        }
    }
    assert!(offered >= 6, "{offered}");
}

#[test]
fn the_lean_layers_fit_resnet50_batch_64_on_a_laptop_where_the_plain_ones_do_not() {
    let device = card("rtx4060-laptop");
    let lean = check(&resnet50(1000), &StepConfig::training(64, 224), &device).unwrap();
    let plain =
        StepConfig { levers: Levers { layers: crate::models::Layers::Plain, ..Levers::default() }, ..StepConfig::training(64, 224) };
    let plain = check(&resnet50(1000), &plain, &device).unwrap();
    assert_eq!((lean.verdict, plain.verdict), (Verdict::Fits, Verdict::DoesNotFit));
    assert!(!plain.fixes.is_empty());
}

#[test]
fn accumulation_keeps_the_effective_batch_and_largest_batch_does_not() {
    let device = card("rtx4060-laptop");
    let report = check(&resnet50(1000), &StepConfig::training(96, 224), &device).unwrap();
    let accum = report.fixes.iter().find(|f| f.kind == FixKind::Accumulation).unwrap();
    assert_eq!(accum.config.batch * accum.config.levers.accumulation, 96);
    assert!(accum.config.levers.accumulation > 1);
    let largest = report.fixes.iter().find(|f| f.kind == FixKind::LargestBatch).unwrap();
    assert!(!largest.cost.effective_batch_kept);
    // The largest batch is the boundary: one more sample no longer fits.
    let next = StepConfig { batch: largest.config.batch + 1, ..largest.config.clone() };
    assert!(estimate(&resnet50(1000), &next, &device).unwrap().peak.bytes > report.target_bytes);
}

#[test]
fn adam_fixes_appear_only_for_adam() {
    let device = card("t4");
    let sgd = StepConfig { levers: Levers { optimizer: OptimizerKind::Sgd, ..Levers::default() }, ..StepConfig::training(256, 224) };
    let report = check(&resnet50(1000), &sgd, &device).unwrap();
    assert_ne!(report.verdict, Verdict::Fits);
    assert!(report.fixes.iter().all(|f| f.kind != FixKind::Adam8bit && f.kind != FixKind::Sgd));
    // A T4 has no bf16: mixed precision is f16 there.
    if let Some(amp) = report.fixes.iter().find(|f| f.kind == FixKind::MixedPrecision) {
        assert_eq!(amp.change, "f16 mixed precision");
    }
}

#[test]
fn when_no_single_lever_fits_the_levers_are_combined() {
    let device = card("2.75GiB");
    let report = check(&resnet50(1000), &StepConfig::training(16, 1024), &device).unwrap();
    assert_eq!(report.verdict, Verdict::DoesNotFit);
    for fix in &report.fixes {
        assert!(fix.peak_bytes <= report.target_bytes);
    }
    assert!(report.fixes.iter().any(|f| f.kind == FixKind::Combined), "{:#?}", report.fixes.iter().map(|f| &f.change).collect::<Vec<_>>());
}

#[test]
fn tight_fits_get_fixes_too() {
    let base = StepConfig::training(16, 224);
    let peak = estimate(&resnet18(1000), &base, &card("8GiB")).unwrap().peak.bytes;
    // A card just 5% larger than the peak.
    let device = Card::sized(peak + peak / 20);
    let report = check(&resnet18(1000), &base, &device).unwrap();
    assert_eq!(report.verdict, Verdict::Tight);
    assert!(!report.fixes.is_empty());
}

#[test]
fn sweeps_grow_with_batch_and_cross_the_card() {
    let device = card("rtx4060-laptop");
    let plan: SweepSpec = "batch=16..128:16".parse().unwrap();
    let result = sweep(&resnet50(1000), &StepConfig::training(32, 224), &device, &plan).unwrap();
    assert_eq!(result.points.len(), 8);
    assert!(result.points.windows(2).all(|w| w[0].peak_bytes < w[1].peak_bytes));
    assert_eq!(result.points[0].verdict, Verdict::Fits);
    assert_eq!(result.points[7].verdict, Verdict::DoesNotFit);
    assert!(result.chart().to_svg().unwrap().contains("usable"));
}

#[test]
fn the_full_resnet50_fix_search_is_fast() {
    let device = card("rtx4060-laptop");
    let base = StepConfig::training(96, 224);
    let start = Instant::now();
    let report = check(&resnet50(1000), &base, &device).unwrap();
    let elapsed = start.elapsed();
    assert!(!report.fixes.is_empty());
    eprintln!("resnet50 fit check with fix search: {elapsed:?}");
    // The target is 50 ms in release; leave room for a busy machine and debug builds.
    assert!(elapsed.as_millis() < if cfg!(debug_assertions) { 2000 } else { 250 }, "{elapsed:?}");
}
