//! Starting the kernel wrongly: clear errors and a non-zero exit.

mod common;

use std::process::Command;

fn run(args: &[&str]) -> (bool, String) {
    let output = Command::new(common::kernel_binary()).args(args).output().unwrap();
    (output.status.success(), String::from_utf8_lossy(&output.stderr).into_owned())
}

#[test]
fn a_missing_or_malformed_connection_file_is_named() {
    let (ok, err) = run(&["--connection-file", "/nonexistent/kernel-1.json"]);
    assert!(!ok);
    assert!(err.contains("cannot read connection file /nonexistent/kernel-1.json"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.json");
    std::fs::write(&file, "{\"shell_port\": \"x\"").unwrap();
    let (ok, err) = run(&["--connection-file", file.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("is not a valid Jupyter connection file"), "{err}");

    let (ok, err) = run(&[]);
    assert!(!ok);
    assert!(err.contains("--connection-file"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_port_in_use_is_reported() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut info = common::free_connection_info("k").await;
    info.shell_port = taken.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kernel.json");
    std::fs::write(&file, serde_json::to_string(&info).unwrap()).unwrap();
    let output = Command::new(common::kernel_binary())
        .args(["--connection-file", file.to_str().unwrap()])
        .env("VRAMLAB_CACHE_DIR", common::cache_dir())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains(&format!("cannot listen on the shell port 127.0.0.1:{}", info.shell_port)), "{err}");
}

#[test]
fn install_writes_a_kernelspec() {
    let prefix = tempfile::tempdir().unwrap();
    let output = Command::new(common::kernel_binary()).args(["install", "--prefix", prefix.path().to_str().unwrap()]).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let dir = prefix.path().join("share/jupyter/kernels/vramlab");
    let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("kernel.json")).unwrap()).unwrap();
    assert_eq!(spec["display_name"], "Rust (vramlab)");
    assert_eq!(spec["language"], "rust");
    assert_eq!(spec["interrupt_mode"], "message");
    assert_eq!(spec["argv"][1], "--connection-file");
    assert_eq!(spec["argv"][2], "{connection_file}");
    let lib = std::path::PathBuf::from(spec["env"]["VRAMLAB_LIB"].as_str().unwrap());
    assert!(lib.join("Cargo.toml").exists());
    for logo in ["logo-32x32.png", "logo-64x64.png", "logo-svg.svg"] {
        assert!(dir.join(logo).exists(), "{logo}");
    }
    let (ok, err) = run(&["install", "--user", "--prefix", "/tmp/x"]);
    assert!(!ok, "--user and --prefix conflict");
    assert!(err.contains("cannot be used with"), "{err}");
}
