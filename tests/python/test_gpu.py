"""The CUDA build on a real GPU (skipped, saying why, on a machine without
one), and the GPU script itself, which needs no GPU: its refusals, a
rehearsal of the whole run on the CPU with the release build, and, with fake
binaries, that a run loses nothing (a check-ops mismatch, a kill mid-part, a
rerun with a new build, a request at the end of the budget)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import lzma
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts/gpu_check.py"
SHELL_SCRIPT = ROOT / "scripts/gpu_check.sh"
REPORT = ROOT / "scripts/gpu_report.py"


def load_module(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_module("gpu_check", SCRIPT)
gpu_report = load_module("gpu_report", REPORT)
RELEASE_BINARY = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "vramlab"
HAS_TORCH = subprocess.run([sys.executable, "-c", "import torch, torchvision"], capture_output=True).returncode == 0

CUDA_BINARY = pathlib.Path(os.environ.get("VRAMLAB_CUDA_BINARY", pathlib.Path(os.environ.get("GPU_DIST", ROOT / ".gpu")) / "vramlab"))


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


def test_the_gpu_script_needs_a_python_with_pytorch_on_cuda(tmp_path):
    if HAS_TORCH:
        pytest.skip("this python has PyTorch: the refusal cannot be seen here")
    binary = tmp_path / "vramlab"
    binary.write_text("")
    done = script("--device", "cuda", "--binary", str(binary), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "has no PyTorch and torchvision" in done.stderr, done.stderr


def report_of(folder: pathlib.Path) -> str:
    done = subprocess.run([sys.executable, str(REPORT), str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_report_prints_every_table_of_a_kept_run():
    run = ROOT / "benchmarks/h200-2026-12-04"
    text = report_of(run)
    for title in ["Machine", "Smoke test", "Predicted against measured", "Step time", "Host to device"]:
        assert f"#### {title}" in text, title
    measured = json.loads((run / "measure.json").read_text())
    assert all(f"| {row['label']} |" in text for row in measured), "a row per measured configuration"
    assert "NVIDIA H200" in text and "| resnet18 b32@224 | " in text


def test_the_report_refuses_a_missing_folder(tmp_path):
    done = subprocess.run([sys.executable, str(REPORT), str(tmp_path / "none")], capture_output=True, text=True)
    assert done.returncode == 2 and "gpu_check" in done.stderr


# The files a finished run leaves: the report's (h2d.json only where there is a device to copy to), the skips and the log.
REPORTED = [name for _, name, _ in gpu_report.SECTIONS]
WITHOUT_DEVICE = sorted({*REPORTED, "skipped.json", "log.txt"} - {"h2d.json"})


def gpu_check_sh(*args: str, dist: pathlib.Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """scripts/gpu_check.sh with this python, unpacking from `dist` (never the checkout's .gpu)."""
    env = dict(os.environ, PYTHON=sys.executable, GPU_DIST=str(dist))
    return subprocess.run(["bash", str(SHELL_SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_a_rehearsal_on_the_cpu_writes_every_file_the_report_reads(tmp_path):
    if not RELEASE_BINARY.is_file():
        pytest.skip(f"no release build of vramlab at {RELEASE_BINARY}: cargo build --release makes it")
    out = tmp_path / "out"
    done = gpu_check_sh("--device", "cpu", "--small", "--binary", str(RELEASE_BINARY), "--out", str(out), dist=tmp_path / "dist")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(path.name for path in out.iterdir()) == WITHOUT_DEVICE, done.stdout
    data = {name: json.loads((out / name).read_text()) for name in WITHOUT_DEVICE if name.endswith(".json")}
    assert data["ops.json"]["exit"] == 0 and "mismatch" not in data["ops.json"], data["ops.json"].get("stderr")
    rows = data["measure.json"]
    assert [row["label"] for row in rows] == [gpu_check.label(*config) for config in gpu_check.SMALL.measure]
    for row in rows:
        assert row["json"]["measured_peak"] > 0 and row["json"]["predicted_peak"] > 0, row
        assert "after_ops_mismatch" not in row
    assert [row["label"] for row in data["bench.json"]["results"]] == [gpu_check.label(*config) for config in gpu_check.SMALL.bench]
    assert data["bench.json"]["results"][0]["ours_s"], data["bench.json"]
    assert data["skipped.json"] == ["h2d: there is no device to copy to"]
    assert data["env.json"]["binary_sha256"] == hashlib.sha256(RELEASE_BINARY.read_bytes()).hexdigest()
    if not HAS_TORCH:
        assert data["env.json"]["torch"] is None and data["env.json"]["torch_absent"] == gpu_check.NO_TORCH
        assert all(row["torch"] == {"none": gpu_check.NO_TORCH} for row in rows)
        assert data["bench.json"]["results"][0]["torch"] == {"none": gpu_check.NO_TORCH}
    assert (out / "log.txt").read_text().splitlines()[-1].startswith("done in ")
    text = report_of(out)
    for title, name, _ in gpu_report.SECTIONS:
        assert (f"#### {title}" in text) == (name != "h2d.json"), title
    assert all(f"| {row['label']} |" in text for row in rows), text
    assert "check-ops mismatch" not in text and "did not finish" not in text, text


FAKE = '''#!{python}
"""A stand-in for vramlab: each command's JSON in the shape gpu_check.py reads."""
import json, pathlib, sys, time

args = sys.argv[1:]
command = " ".join(args[:2]) if args[0] == "bench" else args[0]
calls = pathlib.Path(__file__).with_name("calls.txt")
with calls.open("a") as log:
    log.write(command + "\\n")
if command == "check-ops":
    if {ops_exit} == 2:
        print("error: CUDA device 0: no device here", file=sys.stderr)
        sys.exit(2)
    checks = [dict(op="conv2d", case="a", shape="2x3x32x32", dtype="f32", pass_="forward", error=1e-6, tolerance=1e-4, ok=True, failure=None),
              dict(op="silu", case="b", shape="2x8x16x16", dtype="f16", pass_="grad_input", error={bad_error}, tolerance=5e-3,
                   ok={bad_error} <= 5e-3, failure=None)]
    checks = [{{("pass" if k == "pass_" else k): v for k, v in c.items()}} for c in checks]
    failed = sum(not c["ok"] for c in checks)
    print(json.dumps(dict(device="fake", reference="the fake's CPU", batch=2, res=32, error="max|a-b|/max|b|", tolerances=[],
                          checks=checks, passed=len(checks) - failed, failed=failed, seconds=0.1)))
    sys.exit(1 if failed else 0)
if command == "smoke":
    print(json.dumps(dict(device="fake", checks=[dict(name="fake check", passed=True, figure="all well", seconds=0.0)])))
elif command == "measure":
    if calls.read_text().split("\\n").count("measure") == {sleep_on_measure}:
        time.sleep(120)
    bills = dict(parameters=1 << 20, optimizer_state=1 << 20, activations=4 << 20, input_batch=1 << 16, context_and_workspace=8 << 20)
    print(json.dumps(dict(label="fake", predicted=bills, measured=bills, predicted_peak=14 << 20, measured_peak=15 << 20)))
elif command == "bench train":
    print(json.dumps(dict(step_seconds=[0.01], median_seconds=0.01, cudnn=None)))
else:
    print(f"error: the fake has no {{command}}", file=sys.stderr)
    sys.exit(2)
'''


def fake_vramlab(folder: pathlib.Path, ops_exit: int = 0, bad_error: float = 1e-6, sleep_on_measure: int = 0) -> pathlib.Path:
    """A fake binary in `folder`: check-ops failing a check (bad_error above f16's tolerance) or not
    running (ops_exit 2), and `measure` hanging on its `sleep_on_measure`th call."""
    binary = folder / "vramlab"
    binary.write_text(FAKE.format(python=sys.executable, ops_exit=ops_exit, bad_error=bad_error, sleep_on_measure=sleep_on_measure))
    binary.chmod(0o755)
    return binary


@pytest.mark.parametrize("ops_exit, bad_error, mismatch", [(1, 0.5, "1 of 2 checks failed"),
                                                           (2, 0.0, "check-ops did not finish (error: CUDA device 0: no device here)")],
                         ids=["a failing check", "check-ops not running"])
def test_a_check_ops_mismatch_is_recorded_and_every_later_part_runs_marked(tmp_path, ops_exit, bad_error, mismatch):
    out = tmp_path / "out"
    done = script("--device", "cpu", "--small", "--binary", str(fake_vramlab(tmp_path, ops_exit, bad_error)), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(path.name for path in out.iterdir()) == WITHOUT_DEVICE
    ops = json.loads((out / "ops.json").read_text())
    assert ops["exit"] == ops_exit and ops["mismatch"] == mismatch, ops
    assert "after_ops_mismatch" not in json.loads((out / "env.json").read_text()), "env runs before check-ops"
    assert json.loads((out / "smoke.json").read_text())["after_ops_mismatch"] is True
    rows = json.loads((out / "measure.json").read_text())
    assert len(rows) == len(gpu_check.SMALL.measure) and all(row["after_ops_mismatch"] is True and "json" in row for row in rows), rows
    bench = json.loads((out / "bench.json").read_text())["results"]
    assert len(bench) == len(gpu_check.SMALL.bench) and all(row["after_ops_mismatch"] is True and row["ours_s"] for row in bench), bench
    log = (out / "log.txt").read_text()
    for part in ["smoke", "measure", "bench"]:
        assert f"== {part} " in log, log
    assert log.count(f"these figures follow a check-ops mismatch: {mismatch}") == 4, log  # smoke, measure, bench and h2d
    text = report_of(out)
    assert text.count(f"These figures follow a check-ops mismatch: {mismatch}.") == 3, text  # smoke, measure, bench
    assert "| fake check" not in text and "- pass: fake check: all well" in text


def test_a_run_killed_mid_part_leaves_valid_json_with_every_row_done(tmp_path):
    out = tmp_path / "out"
    binary = fake_vramlab(tmp_path, sleep_on_measure=2)
    worker = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--binary", str(binary), "--out", str(out),
                               "--only", "measure", "bench"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        rows = []
        waited = time.monotonic() + 60
        while len(rows) < 2 and time.monotonic() < waited:  # the first row done, the second (the hanging one) begun
            time.sleep(0.1)
            if (out / "measure.json").exists():
                rows = json.loads((out / "measure.json").read_text())
        assert len(rows) == 2, "the second measure row never began"
    finally:
        os.killpg(worker.pid, signal.SIGKILL)  # the script and the fake it is waiting on
        worker.wait()
    rows = json.loads((out / "measure.json").read_text())
    assert rows[0]["json"]["measured_peak"] == 15 << 20, rows[0]
    assert rows[1]["label"] == gpu_check.label(*gpu_check.SMALL.measure[1]) and rows[1]["error"] == gpu_check.UNFINISHED, rows[1]
    assert json.loads((out / "skipped.json").read_text()) == []
    assert not list(out.glob(".*.partial")), "a temporary file is renamed over its JSON"
    text = report_of(out)
    assert "This run did not finish" in text and f"| {rows[0]['label']} |" in text and gpu_check.UNFINISHED in text, text


def test_a_skip_is_in_skipped_json_when_it_happens(tmp_path):
    run = gpu_check.Run(tmp_path, budget=60, no_torch=None)
    run.skip("measure resnet50 b32@224", "the part's time was spent")
    assert json.loads((tmp_path / "skipped.json").read_text()) == ["measure resnet50 b32@224: the part's time was spent"]
    run.skip("h2d", "there is no device to copy to")
    assert len(json.loads((tmp_path / "skipped.json").read_text())) == 2


def test_gpu_check_sh_unpacks_the_carried_binary_on_every_run(tmp_path):
    dist = tmp_path / "dist"
    dist.mkdir()
    builds = [fake_vramlab(tmp_path).read_bytes(), fake_vramlab(tmp_path).read_bytes() + b"# the next build\n"]
    for build in builds:
        (dist / "vramlab.xz").write_bytes(lzma.compress(build))
        out = tmp_path / f"out{builds.index(build)}"
        done = gpu_check_sh("--device", "cpu", "--only", "env", "--out", str(out), dist=dist, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        digest = hashlib.sha256(build).hexdigest()
        assert (dist / "vramlab").read_bytes() == build and os.access(dist / "vramlab", os.X_OK)
        assert f"{dist / 'vramlab'}: {len(build)} bytes, sha256 {digest}" in done.stdout, done.stdout
        env = json.loads((out / "env.json").read_text())
        assert env["binary"] == str(dist / "vramlab") and env["binary_sha256"] == digest, "$GPU_DIST/vramlab is the default binary"
        assert digest[:16] in report_of(out)
    assert sorted(path.name for path in dist.iterdir()) == ["vramlab", "vramlab.xz"]


def test_every_request_is_limited_by_the_time_left_in_the_run(tmp_path, monkeypatch):
    run = gpu_check.Run(tmp_path, budget=2, no_torch=None)
    far = time.monotonic() + 300
    assert run.limit(far, most=90) <= 2 and run.limit(time.monotonic() + 1.5, most=90) <= 1.5
    assert run.limit(time.monotonic() - 10) == 1, "a request at the edge still gets a second"
    hang = tmp_path / "hang"
    hang.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    hang.chmod(0o755)
    started = time.monotonic()
    result = gpu_check.vramlab(run, hang, ["measure"], far)
    assert result["error"].startswith("timed out after") and time.monotonic() - started < 10, result
    # PyTorch's worker is this script run again: here a script that never answers.
    monkeypatch.setattr(gpu_check, "__file__", str(hang))
    run = gpu_check.Run(tmp_path, budget=2, no_torch=None)
    worker = gpu_check.TorchWorker(run, "cpu")
    started = time.monotonic()
    answer = worker.ask({"ask": "env"}, far, most=90)
    worker.close()
    assert answer["error"].startswith("PyTorch took over") and time.monotonic() - started < 10, answer


def test_pytorchs_figures_land_beside_ours(tmp_path, monkeypatch):
    # PyTorch's worker is this script run again: here one that answers as PyTorch would, without PyTorch.
    worker = tmp_path / "worker"
    worker.write_text(f"""#!{sys.executable}
import json, sys
for line in sys.stdin:
    ask = json.loads(line)["ask"]
    answer = {{"peak": {{"torch_peak_bytes": 5 << 20, "torch_saved_bytes": 1 << 20}}, "times": {{"times": [0.004, 0.005, 0.006]}}}}[ask]
    print(json.dumps(answer), flush=True)
""")
    monkeypatch.setattr(gpu_check, "__file__", str(worker))
    run = gpu_check.Run(tmp_path, budget=60, no_torch=None)
    binary = fake_vramlab(tmp_path)
    gpu_check.part_measure(run, binary, "cpu", gpu_check.SMALL)
    gpu_check.part_bench(run, binary, "cpu", gpu_check.SMALL, steps=1, warmup=0, rounds=2)
    rows = json.loads((tmp_path / "measure.json").read_text())
    assert [row["torch"] for row in rows] == [{"torch_peak_bytes": 5 << 20, "torch_saved_bytes": 1 << 20}] * len(rows)
    (bench,) = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert bench["ours_s"] == [0.01, 0.01] and bench["torch_s"] == [0.005, 0.005] and bench["ratio"] == 2, bench
    assert "unfinished" not in bench
    text = report_of(tmp_path)
    assert "| 5.0 MiB | 1.0 MiB |" in text and f"| {bench['label']} | 10.0 ms | 5.0 ms | 2.0x |" in text, text


def test_a_card_run_is_recorded_for_the_library_and_a_rehearsal_is_not(tmp_path, monkeypatch):
    kept = tmp_path / "h200"
    shutil.copytree(ROOT / "benchmarks/h200-2026-12-04", kept)
    monkeypatch.setattr(gpu_report, "RECORD", tmp_path / "card-validation.json")
    said = gpu_report.record(kept)
    entry = json.loads((tmp_path / "card-validation.json").read_text())
    assert said.startswith("recorded"), said
    assert entry["card"] == "NVIDIA H200" and entry["configurations"] == 18
    assert entry["peak_error_percent"] == [22.3, 244.0] and entry["device_rules"] is None
    rehearsal = tmp_path / "rehearsal"
    shutil.copytree(kept, rehearsal)
    env = json.loads((rehearsal / "env.json").read_text())
    env["cuda_available"] = False
    (rehearsal / "env.json").write_text(json.dumps(env))
    (tmp_path / "card-validation.json").unlink()
    assert gpu_report.record(rehearsal) == "not recorded: the steps did not run on a card"
    assert not (tmp_path / "card-validation.json").exists()
