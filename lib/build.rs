//! With the cuda feature, compiles the hand-written CUDA kernels
//! (`kernels/*.cu`: the multi-tensor optimizer updates, the transformer's GELU and layer-norm) to PTX for the
//! compute capability in `CUDA_COMPUTE_CAP`, as candle-kernels compiles its
//! own; the library embeds the PTX and loads it on the device at first use.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: &[&str] = &["optim", "transformer"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
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
