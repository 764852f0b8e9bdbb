use super::*;
use crate::gpus::Card;
use crate::oom::{FixKind, Verdict};
use crate::render::Render;

const MIB: u64 = 1 << 20;

/// A step whose every part grows by `per_sample` bytes of activations per
/// sample on top of 100 MiB of parameters and 200 MiB of Adam state.
fn step(batch: usize) -> StepReading {
    let (parameters, state, input) = (100 * MIB, 200 * MIB, batch as u64 * MIB);
    let activations = batch as u64 * 50 * MIB;
    let base = parameters + state + input;
    let part = |part, in_use, peak, gradients| PartReading { part, in_use, peak, gradients };
    StepReading {
        batch,
        parts: vec![
            part(StepPart::BatchMade, base, base, 0),
            part(StepPart::Forward, base + activations, base + activations + 10 * MIB, 0),
            part(
                StepPart::Backward,
                base + activations + parameters,
                base + activations + parameters + batch as u64 * 20 * MIB,
                parameters,
            ),
            part(StepPart::GraphDropped, base + parameters, base + parameters, parameters),
            part(StepPart::OptimizerStep, base + parameters, base + parameters + 5 * MIB, parameters),
        ],
        parameters,
        optimizer_state: state,
        input,
        kept: Kept {
            by_op: vec![KeptByOp { op: "conv2d".into(), storages: 3, read: batch as u64 * 30 * MIB, held: batch as u64 * 50 * MIB }],
        },
        kept_by_counters: activations,
    }
}

fn measured() -> Measured {
    Measured {
        sample: vec![3, 64, 64],
        device: "Cpu".into(),
        measured_with: "a test".into(),
        loss: Loss::CrossEntropy { classes: 10 },
        optimizer: OptimizerKind::Adam,
        steps: MEASURED_BATCHES.iter().map(|&b| step(b)).collect(),
        other_optimizers: vec![
            OptimizerReading { kind: OptimizerKind::Sgd, state: 0, update: 0 },
            OptimizerReading { kind: OptimizerKind::Adam8bit, state: 50 * MIB, update: 10 * MIB },
        ],
    }
}

#[test]
fn bills_are_lines_through_the_measured_steps_and_the_peak_moves_with_them() {
    let m = measured();
    let at_64 = m.peak_at(64, Scenario::default());
    assert_eq!(at_64.part, StepPart::Backward);
    assert_eq!(at_64.bills.parameters, 200 * MIB, "weights and their gradients, constant");
    assert_eq!(at_64.bills.optimizer_state, 200 * MIB);
    assert_eq!(at_64.bills.activations, 64 * 50 * MIB);
    assert_eq!(at_64.bills.input_batch, 64 * MIB);
    assert_eq!(at_64.bills.context_and_workspace, 64 * 20 * MIB);
    assert_eq!(m.peak_at(4, Scenario::default()), PartBills { part: StepPart::Backward, bills: Measured::bills(&m.steps[1], 2) });
    assert_eq!(m.kept_at(64).by_op[0].read, 64 * 30 * MIB);
    let sgd = m.peak_at(64, Scenario { optimizer: Some(&m.other_optimizers[0]), ..Scenario::default() });
    assert_eq!(at_64.bills.total() - sgd.bills.total(), 200 * MIB, "SGD keeps no state");
    let accumulated = m.peak_at(64, Scenario { accumulation: 2, ..Scenario::default() });
    assert_eq!(accumulated.bills.total() - at_64.bills.total(), 100 * MIB, "the accumulated gradients beside the new ones");
}

#[test]
fn a_card_gets_a_verdict_and_fixes_that_fit_it() {
    let report = ModuleReport::new("net", measured(), 128, Some(Card::parse("8GiB").unwrap()));
    let check = report.card.as_ref().unwrap();
    assert_eq!(check.verdict, Verdict::DoesNotFit);
    assert_eq!(check.peak_bytes, report.peak.bills.total() + crate::gpus::GENERIC_CONTEXT_BYTES);
    assert!(!check.fixes.is_empty());
    let target = crate::oom::target_bytes(&check.card);
    assert!(check.fixes.iter().all(|f| f.peak_bytes <= target), "{:?}", check.fixes);
    let accumulation = check.fixes.iter().find(|f| f.kind == FixKind::Accumulation).expect("a smaller batch fits");
    assert!(accumulation.change.starts_with("batch ") && accumulation.cost.effective_batch_kept, "{accumulation:?}");
    let text = report.bundle().text().to_owned();
    assert!(text.contains("DOES NOT FIT") && text.contains("extrapolated to batch 128 from steps measured at batches 2, 4, 8"), "{text}");
    assert!(text.contains("conv2d") && text.contains("read by backward"), "{text}");
    let fits = ModuleReport::new("net", measured(), 4, Some(Card::parse("80GiB").unwrap()));
    assert_eq!(fits.card.as_ref().unwrap().verdict, Verdict::Fits);
    assert!(fits.fixes_table().is_none() && fits.headline().contains("measured at batch 4"), "{}", fits.headline());
}
