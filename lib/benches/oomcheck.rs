//! Timing of the ledger: one estimate, the full fit check with its fix
//! search, and the whole `%oomcheck` report (table, chart and fixes) for
//! ResNet-50 at batch 32, 224x224, on an 8 GB card. Prints JSON (seconds).
//!
//!     cargo bench -p vramlab --bench oomcheck

use std::time::Instant;

use vramlab::gpus::Device;
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
    let device = Device::parse("rtx4060-laptop").expect("catalogue card");
    let argv: Vec<String> = ["resnet50", "--batch", "32", "--res", "224", "--gpu", "rtx4060-laptop"].map(String::from).into();
    let report = serde_json::json!({
        "estimate_resnet50_b32_224_s": time(200, || { estimate(&spec, &config, &device).expect("estimate"); }),
        "fit_check_with_fix_search_s": time(50, || { check(&spec, &config, &device).expect("check"); }),
        "oomcheck_report_bundle_s": time(20, || { vramlab::cli::oomcheck(&argv).expect("report"); }),
    });
    println!("{}", serde_json::to_string_pretty(&report).expect("json"));
}
