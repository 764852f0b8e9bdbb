"""The CUDA build on a real GPU (skipped, saying why, on a machine without
one), and the GPU script's refusals, which need no GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts/gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

CUDA_BINARY = pathlib.Path(os.environ.get("VRAMLAB_CUDA_BINARY", ROOT / ".gpu" / "vramlab"))


def gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


@pytest.fixture
def cuda_vramlab():
    if not gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L finds none)")
    if not CUDA_BINARY.is_file():
        pytest.skip(f"no CUDA build of vramlab at {CUDA_BINARY}: scripts/build_cuda.sh makes it")

    def run(*args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, LD_LIBRARY_PATH=gpu_check.library_path())
        return subprocess.run([str(CUDA_BINARY), *args], capture_output=True, text=True, env=env, timeout=300)

    return run


def test_the_smoke_test_passes_on_the_gpu_with_its_pool_probes(cuda_vramlab):
    done = cuda_vramlab("smoke", "--device", "cuda", "--json")
    report = json.loads(done.stdout)
    failed = [f"{c['name']}: {c['figure']}" for c in report["checks"] if not c["passed"]]
    assert done.returncode == 0 and not failed, failed or done.stderr
    assert any("CUDA pool" in c["name"] for c in report["checks"]), report


def test_a_resnet18_step_on_the_gpu_is_measured_from_the_pool(cuda_vramlab):
    done = cuda_vramlab("measure", "--device", "cuda", "--model", "resnet18", "--batch", "16", "--res", "64", "--json")
    assert done.returncode == 0, done.stderr
    comparison = json.loads(done.stdout)
    assert "CUDA pool" in comparison["measured_with"], comparison["measured_with"]
    assert comparison["measured"]["context_and_workspace"] > 0, "the driver's bytes outside the pool are part of the peak"
    assert abs(comparison["measured_peak"] / comparison["predicted_peak"] - 1) <= 0.10, comparison


def script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_the_gpu_script_refuses_a_missing_binary_and_names_the_build(tmp_path):
    done = script("--binary", str(tmp_path / "vramlab"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "no vramlab binary at" in done.stderr and "scripts/build_cuda.sh" in done.stderr, done.stderr


def test_the_gpu_script_refuses_a_budget_of_nothing_and_unknown_parts(tmp_path):
    done = script("--budget", "0", "--out", str(tmp_path))
    assert done.returncode == 2 and "--budget" in done.stderr, done.stderr
    done = script("--only", "everything", "--out", str(tmp_path))
    assert done.returncode == 2 and "invalid choice: 'everything'" in done.stderr, done.stderr


def test_the_gpu_script_needs_a_python_with_pytorch(tmp_path):
    if subprocess.run([sys.executable, "-c", "import torch, torchvision"], capture_output=True).returncode == 0:
        pytest.skip("this python has PyTorch: the refusal cannot be seen here")
    binary = tmp_path / "vramlab"
    binary.write_text("")
    done = script("--binary", str(binary), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "has no PyTorch and torchvision" in done.stderr, done.stderr


def test_the_report_prints_every_table_of_a_kept_run():
    run = ROOT / "benchmarks/h200-2026-12-04"
    report = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_report.py"), str(run)], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    text = report.stdout
    for title in ["Machine", "Smoke test", "Predicted against measured", "Step time", "Host to device"]:
        assert f"#### {title}" in text, title
    measured = json.loads((run / "measure.json").read_text())
    assert all(f"| {row['label']} |" in text for row in measured), "a row per measured configuration"
    assert "NVIDIA H200" in text and "| resnet18 b32@224 | " in text


def test_the_report_refuses_a_missing_folder(tmp_path):
    report = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_report.py"), str(tmp_path / "none")], capture_output=True, text=True)
    assert report.returncode == 2 and "gpu_check" in report.stderr
