//! Records the Rust toolchain version (kernel_info's language_info) and the
//! target triple (where the cell process finds the standard library), and
//! exports the allocation counters' symbol, through which the vramlab code
//! inside cell libraries finds this executable's counters, and candle's
//! tensor id counter, which every cell library's copy of candle then shares.
fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| v.split_whitespace().nth(1).map(str::to_owned))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=VRAMLAB_RUSTC_VERSION={version}");
    println!("cargo:rustc-env=VRAMLAB_TARGET={}", std::env::var("TARGET").unwrap_or_default());
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=vramlab_alloc_counters");
        // One tensor id counter for every copy of candle in the cell process (patches/candle-core).
        println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=candle_tensor_id_counter");
    }
}
