//! The `vramlab` binary, driven as a user would.

use std::process::{Command, Output};

use serde_json::Value;

fn vramlab(args: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vramlab")).args(args.split_whitespace()).output().expect("the vramlab binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json(args: &str) -> Value {
    let out = vramlab(args);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("valid JSON")
}

fn u(value: &Value) -> u64 {
    value.as_u64().unwrap_or_else(|| panic!("not a byte count: {value}"))
}

#[test]
fn summary_prints_a_table_with_totals() {
    let out = vramlab("summary resnet50 --input 32x3x224x224 --depth 2");
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with("resnet50 | input 32 x 3x224x224 | f32"), "{text}");
    assert!(text.contains("layer3.5") && !text.contains("layer3.5.conv1"), "depth 2 shows blocks only");
    let total = text.lines().find(|l| l.starts_with("total")).expect("a totals row");
    assert!(total.contains("25,557,032"), "{total}");
}

#[test]
fn summary_json_has_per_layer_costs() {
    let value = json("summary efficientnet-b0 --json");
    assert_eq!(u(&value["cost"]["total"]["params"]), 5_288_548);
    let rows = value["cost"]["rows"].as_array().unwrap();
    assert!(rows.iter().any(|r| r["kind"] == "SqueezeExcitation"));
}

#[test]
fn oomcheck_text_has_the_verdict_bills_and_fixes() {
    let out = vramlab("oomcheck resnet50 --batch 128 --res 224 --gpu rtx4060-laptop");
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with("DOES NOT FIT: peak "), "{text}");
    assert!(text.contains("102,228,128"), "fp32 weights of ResNet-50");
    assert!(text.contains("77,070,336"), "batch 128 of 224x224x3 f32");
    assert!(text.contains("fixes that peak under"));
}

#[test]
fn oomcheck_json_bills_sum_and_the_peak_adds_up() {
    let value = json("oomcheck resnet50 --batch 32 --res 224 --opt adamw --gpu a100-80gb --json");
    let report = &value["report"];
    assert_eq!(report["verdict"], "fits");
    let ledger = &report["ledger"];
    let bills = ledger["bills"].as_array().unwrap();
    assert_eq!(bills.len(), 5);
    let mut all = 0;
    for bill in bills {
        let lines: u64 = bill["lines"].as_array().unwrap().iter().map(|l| u(&l["bytes"])).sum();
        assert_eq!(lines, u(&bill["bytes"]), "{}", bill["kind"]);
        all += u(&bill["bytes"]);
    }
    let peak = u(&ledger["peak"]["bytes"]);
    let breakdown: u64 = ledger["peak"]["breakdown"].as_array().unwrap().iter().map(|l| u(&l["bytes"])).sum();
    assert_eq!(breakdown, peak);
    assert!(peak <= all, "the walked peak never exceeds every bill at once");
    let timeline_max = ledger["timeline"].as_array().unwrap().iter().map(|p| u(&p["peak_bytes"])).max().unwrap();
    assert_eq!(timeline_max, peak);
    let optimizer = bills.iter().find(|b| b["kind"] == "optimizer_state").unwrap();
    assert_eq!(u(&optimizer["bytes"]), 2 * 102_228_128);
    let usable = u(&ledger["device"]["usable_bytes"]);
    assert_eq!(u(&report["headroom_bytes"]) as i64, usable as i64 - peak as i64);
}

#[test]
fn oomcheck_json_fixes_fit_and_the_sweep_crosses_the_card() {
    let value = json("oomcheck resnet50 --batch 128 --res 224 --sweep batch=16..128:16 --json");
    let target = u(&value["report"]["target_bytes"]);
    let fixes = value["report"]["fixes"].as_array().unwrap();
    assert!(!fixes.is_empty());
    for fix in fixes {
        assert!(u(&fix["peak_bytes"]) <= target, "{}", fix["change"]);
    }
    let points = value["sweep"]["points"].as_array().unwrap();
    assert_eq!(points.iter().map(|p| p["value"].as_u64().unwrap()).collect::<Vec<_>>(), [16, 32, 48, 64, 80, 96, 112, 128]);
    assert_eq!(points.first().unwrap()["verdict"], "fits");
    assert_eq!(points.last().unwrap()["verdict"], "does_not_fit");
}

#[test]
fn halving_the_batch_from_the_command_line() {
    let bill = |batch: u32, kind: &str| {
        let value = json(&format!("oomcheck resnet50 --batch {batch} --res 224 --json"));
        let bills = value["report"]["ledger"]["bills"].as_array().unwrap().clone();
        u(&bills.iter().find(|b| b["kind"] == kind).unwrap()["bytes"])
    };
    assert_eq!(bill(16, "activations") * 2, bill(32, "activations"));
    let input_saved = bill(32, "input_batch") - bill(16, "input_batch");
    assert!((9_000_000..11_000_000).contains(&input_saved), "{input_saved}");
}

#[test]
fn usage_errors_are_short_plain_and_name_the_choices() {
    for (args, expected) in [
        ("oomcheck resnet50 --batch 32 --res 224 --amp f8", "[possible values: f16, bf16]"),
        ("oomcheck resnet50 --batch 32 --res 224 --gpu rtx4091", "closest: rtx4090"),
        ("oomcheck vgg --batch 32 --res 224", "valid models: resnet18, resnet34, resnet50, efficientnet-b0, small-cnn"),
        ("oomcheck resnet50 --batch 32 --res 224 --ckpt layer7", "stages: stem, layer1, layer2, layer3, layer4, head"),
        ("oomcheck resnet50 --batch 32 --res 224 --sweep depth=1..3", "unknown axis `depth`"),
        ("summary resnet50 --input 32x3", "expected BATCHxCxHxW"),
    ] {
        let out = vramlab(args);
        assert_eq!(out.status.code(), Some(2), "{args}");
        let message = stderr(&out);
        assert!(message.contains(expected), "{args}: {message}");
        assert!(!message.contains('\u{1b}') && !message.contains("panicked") && !message.contains("backtrace"), "{message}");
        assert!(message.lines().count() <= 6, "{message}");
        assert!(stdout(&out).is_empty());
    }
}

#[test]
fn help_succeeds() {
    let out = vramlab("oomcheck --help");
    assert!(out.status.success());
    assert!(stdout(&out).contains("--sweep"));
}

#[test]
fn an_absurd_configuration_is_a_one_line_error() {
    let out = vramlab("oomcheck resnet50 --batch 4294967296 --res 65535");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("batch 4294967296 is over the largest vramlab costs, 65536"), "{err}");
    let out = vramlab("measure --model resnet18 --batch 4294967296 --res 64");
    assert!(!out.status.success());
    assert!(stderr(&out).contains("batch 4294967296 is over the largest"), "{}", stderr(&out));
    // Within the bounds but beyond this host: refused before the images are made.
    let out = vramlab("measure --model resnet18 --batch 65536 --res 1024");
    assert!(!out.status.success());
    assert!(stderr(&out).contains("the host has") && stderr(&out).contains("available"), "{}", stderr(&out));
}

#[test]
fn a_bad_budget_is_a_one_line_error_naming_it() {
    for (budget, says) in [
        ("0", "give a unit"),
        ("-1GiB", "-1GiB"),
        ("nonsense", "nonsense"),
        ("rtx9999", "rtx9999"),
        ("200MiB", "leaves nothing for training"),
    ] {
        let out = vramlab(&format!("measure --model small-cnn --batch 2 --res 32 --budget={budget}"));
        assert_eq!(out.status.code(), Some(2), "{budget}: {}", stderr(&out));
        let err = stderr(&out);
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains(&format!("budget `{budget}`")) && err.contains(says), "{err}");
    }
}

/// On this machine every check passes, each with the figure behind it; the
/// table names every check, and a device this build cannot open is a usage error.
#[test]
fn smoke_passes_here_with_a_figure_for_every_check() {
    let report = json("smoke --json");
    let checks = report["checks"].as_array().unwrap();
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    for wanted in
        ["loader", "f32", "f16 mixed precision", "accumulation", "checkpointing", "below the predicted peak", "above the predicted peak"]
    {
        assert!(names.iter().any(|n| n.contains(wanted)), "no check of {wanted}: {names:?}");
    }
    for check in checks {
        assert_eq!(check["passed"], Value::Bool(true), "{check}");
        assert!(!check["figure"].as_str().unwrap().is_empty(), "{check}");
    }
    if !cfg!(feature = "cuda") {
        let out = vramlab("smoke --device cuda");
        assert_eq!(out.status.code(), Some(2));
        assert!(stderr(&out).contains("CUDA device 0: this vramlab was built without the cuda feature"), "{}", stderr(&out));
    }
}

/// `measure` and `bench train` take the device too; a build without CUDA
/// says so, and the simulated budget is refused on a GPU, where the card is the budget.
#[test]
fn measure_and_bench_name_a_device_they_cannot_open() {
    if cfg!(feature = "cuda") {
        return;
    }
    for command in ["measure", "bench train"] {
        let out = vramlab(&format!("{command} --model small-cnn --batch 2 --res 32 --device cuda"));
        assert_eq!(out.status.code(), Some(2), "{command}: {}", stderr(&out));
        assert!(stderr(&out).contains("built without the cuda feature"), "{command}: {}", stderr(&out));
    }
    let out = vramlab("measure --model small-cnn --batch 2 --res 32 --device cuda --budget 8GiB");
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--budget simulates a card on the CPU"), "{}", stderr(&out));
    let out = vramlab("measure --model small-cnn --batch 2 --res 32 --device tpu");
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("possible values: cpu, cuda"), "{}", stderr(&out));
    let comparison = json("measure --model small-cnn --batch 2 --res 32 --device cpu --json");
    assert!(comparison["measured_with"].as_str().unwrap().contains("allocation counters"), "{comparison}");
    assert!(comparison["device"].as_str().unwrap().starts_with("cpu"), "{comparison}");
}

/// Every op in both dtypes at the smallest sizes, each check within its
/// dtype's tolerance, exit status 0.
#[test]
fn check_ops_passes_here_at_small_sizes() {
    let report = json("check-ops --device cpu --json --batch 2 --res 32");
    let checks = report["checks"].as_array().unwrap();
    assert_eq!(u(&report["passed"]) as usize, checks.len());
    assert_eq!(u(&report["failed"]), 0);
    for op in ["conv2d", "batch_norm_train", "max_pool2d", "silu", "norm_act", "norm_add_act"] {
        for dtype in ["f32", "f16"] {
            assert!(checks.iter().any(|c| c["op"] == op && c["dtype"] == dtype), "no {op} in {dtype}");
        }
    }
    for pass in ["forward", "grad_input", "grad_weight", "grad_norm", "grad_residual", "grad_residual_norm"] {
        assert!(checks.iter().any(|c| c["pass"] == pass), "no {pass}");
    }
    for check in checks {
        let (error, tolerance) = (check["error"].as_f64().unwrap(), check["tolerance"].as_f64().unwrap());
        assert!(check["ok"] == Value::Bool(true) && error <= tolerance, "{check}");
    }
}

/// A size out of range, or `--device cuda` in a build without the feature,
/// is a one-line usage error.
#[test]
fn check_ops_refuses_what_it_cannot_run() {
    let out = vramlab("check-ops --batch 1");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(stderr(&out).trim_end(), "error: check-ops: --batch 1 is outside 2..=8");
    if !cfg!(feature = "cuda") {
        let out = vramlab("check-ops --device cuda");
        assert_eq!(out.status.code(), Some(2));
        let err = stderr(&out);
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains("CUDA device 0: this vramlab was built without the cuda feature"), "{err}");
        assert!(stdout(&out).is_empty());
    }
}
