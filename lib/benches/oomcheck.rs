//! Timing of the ledger on an 8 GB card: one estimate of ResNet-50 at batch
//! 32, 224x224, and for batch 64 (which does not fit, so the fixes are
//! searched) the fit check and the whole `%oomcheck` report (table, chart and
//! fixes). Prints JSON (seconds).
//!
//!     cargo bench -p vramlab --bench oomcheck

use std::time::Instant;

use vramlab::gpus::Card;
use vramlab::ledger::{estimate, StepConfig};
use vramlab::models::ModelName;
use vramlab::oom::check;

fn p50(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn time(repeats: usize, mut f: impl FnMut()) -> serde_json::Value {
    f();
    let samples: Vec<f64> = (0..repeats)
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed().as_secs_f64()
        })
        .collect();
    let max = samples.iter().copied().fold(0.0, f64::max);
    serde_json::json!({"p50": p50(samples), "max": max, "repeats": repeats})
}

fn main() {
    let spec = ModelName::Resnet50.spec(1000);
    let config = StepConfig::training(32, 224);
    let too_big = StepConfig::training(64, 224);
    let device = Card::parse("rtx4060-laptop").expect("catalogue card");
    let fixes = check(&spec, &too_big, &device).expect("check").fixes.len();
    assert!(fixes > 0, "batch 64 must not fit, or no fixes are searched");
    let argv: Vec<String> = ["resnet50", "--batch", "64", "--res", "224", "--gpu", "rtx4060-laptop"].map(String::from).into();
    let report = serde_json::json!({
        "estimate_resnet50_b32_224_s": time(200, || { estimate(&spec, &config, &device).expect("estimate"); }),
        "fixes_found_for_b64": fixes,
        "fit_check_with_fix_search_b64_s": time(50, || { check(&spec, &too_big, &device).expect("check"); }),
        "oomcheck_report_bundle_b64_s": time(20, || { vramlab::cli::oomcheck(&argv).expect("report"); }),
    });
    println!("{}", serde_json::to_string_pretty(&report).expect("json"));
}
