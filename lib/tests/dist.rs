//! Several processes under `mpirun -np 2`: the step they compute together
//! is one process's step on all their samples, and a process that dies
//! stops the others.
#![cfg(feature = "mpi")]

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn mpirun(args: &str) -> Command {
    let mut command = Command::new("mpirun");
    command
        .args(["-np", "2"])
        .arg(env!("CARGO_BIN_EXE_vramlab"))
        .args(args.split_whitespace())
        // Open MPI refuses root unless told; CI runs as root.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // One thread a process: two processes on two cores.
        .env("RAYON_NUM_THREADS", "1");
    command
}

fn run(args: &str) -> Output {
    mpirun(args).output().expect("mpirun runs (Open MPI: scripts/setup.sh installs it)")
}

#[test]
fn two_processes_on_half_batches_compute_one_process_step_on_the_whole() {
    for (optimizer, shard) in
        [("sgd-momentum", "none"), ("adamw", "none"), ("sgd-momentum", "optimizer"), ("adamw", "optimizer"), ("adamw", "gradients")]
    {
        let line = format!("check-dist --model vit-tiny --batch 4 --res 32 --cards 2 --shard {shard} --opt {optimizer} --steps 3 --json");
        let out = run(&line);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{line}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let found: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{line}: {e}: {stdout}"));
        // The same sums in the same order: the same bits.
        assert_eq!(found["alone"], "in_parts");
        assert_eq!(found["difference"]["max"], 0.0, "{line}: {found}");
        assert_eq!(found["steps"], 3);
        let spread = found["losses_spread"].as_array().unwrap();
        assert_eq!(spread.len(), 3);
        assert!(found["one_forward"]["max"].as_f64().unwrap() < 2.0 * 0.01 * 3.0, "{line}: {found}");
    }
}

/// Batch-norm synchronised: one process's step on the whole batch in one
/// forward, its statistics the whole batch's. The sums run in another
/// order, so the weights agree to rounding under SGD. Adam's first step
/// moves every weight by the learning rate whatever its gradient's size,
/// so a gradient near zero, whose sign the rounding decides, moves it one
/// way or the other: AdamW is held to two steps' size a step (the learning
/// rate is 0.01).
#[test]
fn two_processes_with_synchronised_batch_norm_compute_one_process_step_in_one_forward() {
    let cases = [
        ("small-cnn", 3, 0, "sgd-momentum", "none", 1e-5),
        ("small-cnn", 3, 0, "sgd-momentum", "optimizer", 1e-5),
        ("small-cnn", 3, 0, "adamw", "none", 2.0 * 0.01 * 3.0),
        ("small-cnn", 3, 0, "adamw", "gradients", 2.0 * 0.01 * 3.0),
        // A residual block's batch-norms merged with its sum; seed 1, whose
        // images flip no ReLU or max-pool between the two orders of the sums.
        ("resnet18", 1, 1, "sgd-momentum", "none", 1e-5),
    ];
    for (model, steps, seed, optimizer, shard, tolerance) in cases {
        let line = format!(
            "check-dist --model {model} --batch 4 --res 32 --cards 2 --shard {shard} --opt {optimizer} --steps {steps} --seed {seed} --sync-bn --tolerance {tolerance} --json"
        );
        let out = run(&line);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{line}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let found: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{line}: {e}: {stdout}"));
        assert_eq!(found["alone"], "one_forward", "{line}: {found}");
        assert_eq!(found["sync_batch_norm"], true);
        assert!(found["difference"]["max"].as_f64().unwrap() <= tolerance, "{line}: {found}");
    }
}

#[test]
fn batch_norm_and_a_count_that_is_not_the_launched_one_are_refused() {
    let out = run("check-dist --model resnet18 --batch 4 --res 32 --cards 2 --steps 1");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("resnet18 has batch-norm") && stderr.contains("--sync-bn") && stderr.contains("vit-tiny"), "{stderr}");
    let out = run("check-dist --model vit-tiny --batch 4 --res 32 --cards 3 --steps 1");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--cards 3 takes 3 processes, and this run has 2: launch it with `mpirun -np 3`"), "{stderr}");
    let out = run("check-dist --model vit-tiny --batch 4 --res 32 --cards 2 --shard parameters --steps 1");
    assert!(String::from_utf8_lossy(&out.stderr).contains("ZeRO-3"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The processes of a run under `mpirun` whose parent is `launcher`.
fn children(launcher: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // The parent's pid is the second field after the parenthesised name.
        let parent = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)).and_then(|p| p.parse::<u32>().ok());
        if parent == Some(launcher) && stat.contains("(vramlab)") {
            found.push(pid);
        }
    }
    found
}

#[test]
fn a_process_that_dies_stops_the_others_within_seconds() {
    let mut launcher = mpirun("check-dist --model vit-tiny --batch 4 --res 32 --cards 2 --steps 100000")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let ranks = loop {
        let ranks = children(launcher.id());
        if ranks.len() == 2 || started.elapsed() > Duration::from_secs(30) {
            break ranks;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(ranks.len(), 2, "mpirun started {ranks:?}");
    // Let both reach their steps, then kill one.
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: kill with a pid and a signal number.
    assert_eq!(unsafe { libc::kill(ranks[1] as i32, libc::SIGKILL) }, 0);
    let killed = Instant::now();
    let status = loop {
        if let Some(status) = launcher.try_wait().unwrap() {
            break status;
        }
        if killed.elapsed() > Duration::from_secs(60) {
            launcher.kill().unwrap();
            panic!("the other process still runs a minute after one died");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success());
    assert!(stderr.contains("exited on signal 9"), "{stderr}");
    assert!(children(launcher.id()).is_empty());
}

/// Each process's measured step beside its card's ledger, for ResNet-18 and
/// ViT-Tiny at each stage that runs: the peaks within 5%, ZeRO-1's
/// optimizer state per process half of DDP's, and ZeRO-2's peak under
/// ZeRO-1's, its gradients divided as each stage's backward ends.
#[test]
fn each_process_measures_what_its_cards_ledger_predicts() {
    for model in ["resnet18 --batch 8 --res 64", "vit-tiny --batch 4 --res 64"] {
        let (mut optimizer_state, mut peaks) = (Vec::new(), Vec::new());
        for shard in ["none", "optimizer", "gradients"] {
            let line = format!("measure --model {model} --cards 2 --shard {shard} --opt adamw --json");
            let out = run(&line);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{line}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
            let ranks: Vec<serde_json::Value> =
                stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
            let mut seen: Vec<u64> = ranks.iter().map(|r| r["rank"].as_u64().unwrap()).collect();
            seen.sort();
            assert_eq!(seen, [0, 1], "{line}: one result a process");
            for rank in &ranks {
                let step = &rank["result"];
                let (predicted, measured) = (step["predicted_peak"].as_f64().unwrap(), step["measured_peak"].as_f64().unwrap());
                assert!(
                    (measured / predicted - 1.0).abs() < 0.05,
                    "{line}, rank {}: predicted {predicted}, measured {measured}",
                    rank["rank"]
                );
                assert!(step["label"].as_str().unwrap().contains("one of 2 cards"), "{}", step["label"]);
            }
            optimizer_state.push(ranks[0]["result"]["measured"]["optimizer_state"].as_f64().unwrap());
            peaks.push(ranks[0]["result"]["measured_peak"].as_f64().unwrap());
        }
        let halved = optimizer_state[1] / optimizer_state[0];
        assert!((halved - 0.5).abs() < 0.02, "{model}: ZeRO-1 keeps {halved} of DDP's optimizer state");
        assert!(peaks[2] < peaks[1], "{model}: ZeRO-2 peaks at {} B, ZeRO-1 at {} B", peaks[2], peaks[1]);
    }
}

/// `vramlab train` under `mpirun -np 2`: each process trains on its part of
/// every epoch of a folder, and rank 0 alone writes the report; without
/// mpirun the same flags say how to launch it.
#[test]
fn two_processes_train_from_a_folder_and_rank_0_reports() {
    let folder = tempfile::tempdir().unwrap();
    let root = folder.path().join("leaves");
    let synth = Command::new(env!("CARGO_BIN_EXE_vramlab"))
        .args(["synth", "--out", root.to_str().unwrap(), "--images", "96", "--size", "64x64"])
        .output()
        .unwrap();
    assert!(synth.status.success(), "{}", String::from_utf8_lossy(&synth.stderr));
    let line = format!(
        "train --root {} --model small-cnn --res 32 --epochs 2 --batch 8 --cards 2 --workers 1 --no-baseline --json",
        root.display()
    );
    let out = run(&line);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{line}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("one report, rank 0's: {e}: {stdout}"));
    assert_eq!(report["config"]["cards"]["count"], 2);
    assert_eq!(report["epochs"].as_array().unwrap().len(), 2);
    assert!(report["val_accuracy"].as_f64().unwrap().is_finite());
    let alone = Command::new(env!("CARGO_BIN_EXE_vramlab")).args(line.split_whitespace()).output().unwrap();
    assert_eq!(alone.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&alone.stderr);
    assert!(stderr.starts_with("error: --cards 2 takes 2 processes, and this run has 1"), "{stderr}");
}
