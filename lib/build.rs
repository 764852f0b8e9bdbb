//! Fingerprints the sources of the ledger's rules for a card's step (the
//! models' keep rules, the ledger, the ops and their CUDA passes, the card
//! catalogue, the kernels) as `VRAMLAB_DEVICE_RULES`, which a GPU run records
//! beside what it measured (`ledger::validation`).
//!
//! With the cuda feature, compiles the hand-written CUDA kernels
//! (`kernels/*.cu`: the multi-tensor optimizer updates, the transformer's GELU and layer-norm) to PTX for the
//! compute capability in `CUDA_COMPUTE_CAP`, as candle-kernels compiles its
//! own; the library embeds the PTX and loads it on the device at first use.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: &[&str] = &["optim", "transformer"];

/// Where the rules a card's predicted step follows are written.
const DEVICE_RULES: &[&str] = &["src/models", "src/ledger", "src/ops", "src/gpus.rs", "kernels"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    fingerprint_device_rules();
    for name in KERNELS {
        println!("cargo:rerun-if-changed=kernels/{name}.cu");
    }
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".to_owned());
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_owned());
    for name in KERNELS {
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-fmad=false", &format!("-arch=compute_{cap}"), "-o"])
            .arg(&ptx)
            .arg(format!("kernels/{name}.cu"))
            .status()
            .unwrap_or_else(|e| panic!("cannot run {nvcc} for kernels/{name}.cu (the cuda feature needs nvcc on PATH or in NVCC): {e}"));
        assert!(status.success(), "{nvcc} failed on kernels/{name}.cu");
    }
}

/// FNV-1a over each file's path and contents, in path order.
fn fingerprint_device_rules() {
    let mut files = Vec::new();
    for root in DEVICE_RULES {
        println!("cargo:rerun-if-changed={root}");
        collect(&PathBuf::from(root), &mut files);
    }
    files.sort();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for file in &files {
        let contents = std::fs::read(file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        for byte in file.to_string_lossy().bytes().chain(contents) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    println!("cargo:rustc-env=VRAMLAB_DEVICE_RULES={hash:016x}");
}

fn collect(path: &PathBuf, files: &mut Vec<PathBuf>) {
    if path.is_dir() {
        let entries = std::fs::read_dir(path).unwrap_or_else(|e| panic!("cannot list {}: {e}", path.display()));
        for entry in entries {
            collect(&entry.expect("a directory entry").path(), files);
        }
    } else {
        files.push(path.clone());
    }
}
