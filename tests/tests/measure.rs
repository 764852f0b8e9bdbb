//! The ledger's prediction against real training steps: twelve
//! configurations (models x batch x f32/f16 x checkpointing x optimizer x
//! accumulation) run by `vramlab measure --json`, every allocation counted.
//!
//! Each peak must be within 5% of the prediction and each bill (the peak's
//! composition) within 10% of its prediction; a bill predicted empty must
//! measure under 64 KiB. `--nocapture` prints the table that BENCHMARKS.md
//! shows.

mod common;

use std::process::Command;

const MIB: f64 = (1 << 20) as f64;
const PEAK_TOLERANCE: f64 = 5.0;
const BILL_TOLERANCE: f64 = 10.0;
const EMPTY_BILL_SLACK: f64 = 64.0 * 1024.0;
const BILLS: [&str; 5] = ["parameters", "optimizer_state", "activations", "input_batch", "context_and_workspace"];

const MATRIX: [(&str, u32, u32, &[&str]); 12] = [
    ("small-cnn", 32, 32, &[]),
    ("small-cnn", 32, 32, &["--amp", "f16", "--opt", "adam"]),
    ("resnet18", 16, 64, &[]),
    ("resnet18", 16, 64, &["--opt", "adam", "--ckpt", "stages"]),
    ("resnet18", 16, 64, &["--amp", "f16", "--opt", "adam"]),
    ("resnet18", 8, 64, &["--accum", "4"]),
    ("resnet18", 16, 64, &["--amp", "f16", "--opt", "adamw", "--ckpt", "layer1,layer2"]),
    ("resnet34", 8, 64, &["--opt", "adam"]),
    ("resnet50", 4, 64, &[]),
    ("resnet50", 4, 64, &["--amp", "f16", "--opt", "adam8bit", "--ckpt", "stages"]),
    ("efficientnet-b0", 8, 64, &["--opt", "adam"]),
    ("efficientnet-b0", 8, 64, &["--amp", "f16", "--ckpt", "stages"]),
];

fn measure(model: &str, batch: u32, res: u32, extra: &[&str]) -> serde_json::Value {
    let binary = common::kernel_binary().with_file_name("vramlab");
    let output = Command::new(&binary)
        .args(["measure", "--model", model, "--batch", &batch.to_string(), "--res", &res.to_string(), "--json"])
        .args(extra)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", binary.display()));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap()
}

fn percent(predicted: f64, measured: f64) -> f64 {
    (measured - predicted) / predicted * 100.0
}

#[test]
fn predicted_memory_matches_measured_training_steps() {
    println!("| configuration | peak predicted | peak measured | peak | parameters | optimizer state | activations | input batch | context and workspace |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut misses = Vec::new();
    for (model, batch, res, extra) in MATRIX {
        let result = measure(model, batch, res, extra);
        let label = format!("{model} b{batch}@{res} {}", if extra.is_empty() { "f32 sgd-momentum".to_owned() } else { extra.join(" ") });
        let number = |key: &str| result[key].as_u64().unwrap_or_else(|| panic!("{label}: no {key} in {result}")) as f64;
        let (predicted_peak, measured_peak) = (number("predicted_peak"), number("measured_peak"));
        let peak_error = percent(predicted_peak, measured_peak);
        if peak_error.abs() > PEAK_TOLERANCE {
            misses.push(format!("{label}: peak {peak_error:+.1}%"));
        }
        let mut cells = Vec::new();
        for bill in BILLS {
            let p = result["predicted"][bill].as_u64().unwrap() as f64;
            let m = result["measured"][bill].as_u64().unwrap() as f64;
            let within = if p > 0.0 { percent(p, m).abs() <= BILL_TOLERANCE } else { m < EMPTY_BILL_SLACK };
            if !within {
                misses.push(format!("{label}: {bill} predicted {:.1} MiB, measured {:.1} MiB", p / MIB, m / MIB));
            }
            cells.push(if p > 0.0 {
                format!("{:.1} / {:.1} MiB ({:+.1}%)", p / MIB, m / MIB, percent(p, m))
            } else {
                format!("0 / {:.1} MiB", m / MIB)
            });
        }
        println!(
            "| {label} | {:.1} MiB | {:.1} MiB | {peak_error:+.1}% | {} |",
            predicted_peak / MIB,
            measured_peak / MIB,
            cells.join(" | ")
        );
    }
    assert!(misses.is_empty(), "outside tolerance:\n{}", misses.join("\n"));
}

/// On a simulated 256 MiB card, the batch the ledger says fits trains and
/// the one it says does not fails with CUDA's out-of-memory error.
#[test]
fn the_simulated_budget_fails_where_the_ledger_says_it_will() {
    const BUDGET: f64 = 256.0 * MIB;
    let binary = common::kernel_binary().with_file_name("vramlab");
    for batch in [24u32, 32] {
        let predicted = measure("resnet18", batch, 64, &[])["predicted_peak"].as_u64().unwrap() as f64;
        let fits = predicted < BUDGET;
        assert!((predicted - BUDGET).abs() > 0.05 * BUDGET, "batch {batch} is too close to the budget to judge");
        let output = Command::new(&binary)
            .args(["measure", "--model", "resnet18", "--batch", &batch.to_string(), "--res", "64", "--budget", "256MiB"])
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.success(), fits, "batch {batch}, predicted {:.0} MiB: {err}", predicted / MIB);
        if !fits {
            assert!(err.contains("out of memory (simulated device budget, CPU): tried to allocate"), "{err}");
            assert!(err.contains("budget 256 MiB"), "{err}");
        }
    }
}
