"""vramlab's CUDA build on a GPU machine: check-ops, the smoke test, the ledger
against the device pool, and step time and copy bandwidth against PyTorch, in
one time-boxed run that writes a handful of JSON files.

    bash scripts/gpu_check.sh [--out DIR] [--budget SECONDS] [--only PART ...] [--small]

Run by scripts/gpu_check.sh with the python that has PyTorch (on the device
machine, /opt/torch/.venv's). The binary comes from scripts/build_cuda.sh
($GPU_DIST/vramlab, .gpu/vramlab by default); the CUDA libraries it links are
found in that python's site-packages/nvidia folders. The parts, in order, each
with its own time limit inside the overall budget (a part that would start past
the budget is skipped, and skipped.json says so):

  env      the GPU, the driver, torch, the binary (its size and sha256, to tell
           which build ran) and the libraries it resolves
  ops      vramlab check-ops --device cuda, with TF32 off (NVIDIA_TF32_OVERRIDE=0):
           every op on the GPU against our CPU implementation (the same passes
           on the reference primitives are checked by the test command, so a
           mismatch here is cuDNN's arithmetic or a call the reference reads
           differently from cuDNN). A mismatch, or check-ops not running, does not stop
           the run: ops.json's "mismatch" says what went wrong, the log says so
           at every later part, and every result written after it (smoke.json,
           each row of measure.json and of bench.json's results, h2d.json)
           carries "after_ops_mismatch": true
  smoke    vramlab smoke --device cuda
  measure  vramlab measure --device cuda for the twelve configurations of the
           measure matrix (tests/tests/measure.rs) and ResNet-18, ResNet-50 and
           EfficientNet-B0 at batch 32, 224x224, f32 and f16, lean and plain;
           PyTorch's peak (max_memory_allocated) and what its forward saves for
           backward (unique storages) for the same step beside each
  bench    vramlab bench train --device cuda against the same step in PyTorch
           (torchvision's model, same batch, optimizer and precision),
           alternated, for the batch-32 224x224 configurations; each
           convolution's cuDNN algorithm and workspace, and whether any plan
           was made after the warm-up
  h2d      vramlab bench h2d, and PyTorch's pageable and pinned copies

A lease can end at any moment, so the run loses nothing it has done: each JSON
file is rewritten whole (a temporary file, then a rename) after every row, a
row is written as unfinished before it starts so that a killed run names what
was running, and every request, vramlab's or PyTorch's, is limited by both its
part's time and the time left in the run (Run.limit). log.txt ends with
"done in" only when the run finished.

--small gives every part tiny sizes (the whole run well under a minute on two
CPU cores). `--device cpu --small --binary target/release/vramlab` rehearses
the run on a machine without a GPU (the test command does, in
tests/python/test_gpu.py): PyTorch on the CPU where this python has it, and
where it has not, the reason in place of each PyTorch figure; no pool figures,
no h2d.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import pathlib
import platform
import select
import shutil
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = ["env", "ops", "smoke", "measure", "bench", "h2d"]
# Seconds each part may take at most (it also stops at the overall budget).
PART_LIMITS = {"env": 30, "ops": 90, "smoke": 120, "measure": 240, "bench": 200, "h2d": 60}
STEP_LIMIT = 90
TF32_OFF = {"NVIDIA_TF32_OVERRIDE": "0"}
# What a row says until its request answers: the run was stopped while it ran.
UNFINISHED = "unfinished: the run stopped while this ran"
NO_TORCH = "no PyTorch in this python (a rehearsal)"

Config = tuple[str, int, int, list[str]]  # model, batch, input side, further flags

MEASURE_MATRIX: list[Config] = [
    ("small-cnn", 32, 32, []),
    ("small-cnn", 32, 32, ["--amp", "f16", "--opt", "adam"]),
    ("resnet18", 16, 64, []),
    ("resnet18", 16, 64, ["--opt", "adam", "--ckpt", "stages"]),
    ("resnet18", 16, 64, ["--amp", "f16", "--opt", "adam"]),
    ("resnet18", 8, 64, ["--accum", "4"]),
    ("resnet18", 16, 64, ["--amp", "f16", "--opt", "adamw", "--ckpt", "layer1,layer2"]),
    ("resnet34", 8, 64, ["--opt", "adam"]),
    ("resnet50", 4, 64, []),
    ("resnet50", 4, 64, ["--amp", "f16", "--opt", "adam8bit", "--ckpt", "stages"]),
    ("efficientnet-b0", 8, 64, ["--opt", "adam"]),
    ("efficientnet-b0", 8, 64, ["--amp", "f16", "--ckpt", "stages"]),
]
LARGE: list[Config] = [(model, 32, 224, amp) for model in ("resnet18", "resnet50", "efficientnet-b0") for amp in ([], ["--amp", "f16"])]
LARGE_PLAIN: list[Config] = [(model, batch, res, [*extra, "--layers", "plain"]) for model, batch, res, extra in LARGE]
TORCH_MODELS = {"resnet18": "resnet18", "resnet34": "resnet34", "resnet50": "resnet50", "efficientnet-b0": "efficientnet_b0"}
CLASSES = 10


class Sizes(NamedTuple):
    """What each part runs: the GPU's matrices, or --small's tiny ones."""

    ops: list[str]  # check-ops' size flags
    measure: list[Config]
    bench: list[Config]
    steps: int  # bench's defaults for --steps, --warmup and --rounds
    warmup: int
    rounds: int
    h2d_mib: int
    h2d_repeats: int


FULL = Sizes(ops=[], measure=MEASURE_MATRIX + LARGE + LARGE_PLAIN, bench=LARGE, steps=5, warmup=2, rounds=2, h2d_mib=256, h2d_repeats=20)
# check-ops' smallest sizes; a step of each kind measured (f32 and mixed precision) and one bench
# configuration PyTorch has a counterpart for, each small enough for seconds on two CPU cores.
SMALL = Sizes(ops=["--batch", "2", "--res", "32"], measure=[("small-cnn", 4, 32, []), ("resnet18", 2, 32, ["--amp", "f16"])],
              bench=[("resnet18", 2, 32, [])], steps=1, warmup=0, rounds=1, h2d_mib=16, h2d_repeats=5)


class Run:
    """The overall clock, the log, what was skipped and why, and check-ops' mismatch once it has run."""

    def __init__(self, out: pathlib.Path, budget: float, no_torch: str | None):
        self.out, self.budget, self.started = out, budget, time.monotonic()
        self.no_torch = no_torch  # why this python has no PyTorch worker, or None
        self.mismatch: str | None = None  # what check-ops found wrong; every later result is marked
        self.skipped: list[str] = []
        self.written: set[str] = set()
        self.log = (out / "log.txt").open("w")

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def deadline(self, part: str) -> float:
        return time.monotonic() + PART_LIMITS[part]

    def spent(self, deadline: float) -> bool:
        """No time to start another row: the part's is over, or the run's nearly."""
        return time.monotonic() > deadline or self.left() < 5

    def limit(self, deadline: float, most: float = STEP_LIMIT) -> float:
        """The seconds one request may take: at most `most`, and within both its part's deadline
        and the time left in the run. At least a second, so that a request at the edge still
        ends with an answer or a timeout on record."""
        return max(min(most, deadline - time.monotonic(), self.left()), 1)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        self.say(f"skipped {what}: {why}")
        self.write("skipped.json", self.skipped)

    def mark(self, result: dict) -> dict:
        """`result`, marked as following a check-ops mismatch when one was found."""
        if self.mismatch is not None:
            result["after_ops_mismatch"] = True
        return result

    def write(self, name: str, value) -> None:
        """`name` whole or not at all: written beside it, then renamed over it, so that a run
        killed at any moment leaves valid JSON."""
        path = self.out / name
        temporary = path.with_name(f".{name}.partial")
        temporary.write_text(json.dumps(value, indent=1))
        os.replace(temporary, path)
        if name not in self.written:
            self.written.add(name)
            self.say(f"wrote {path}")


class TorchWorker:
    """PyTorch in a process of its own, asked one JSON line at a time. The
    driver never touches CUDA itself, and no PyTorch process is alive while
    `vramlab measure` reads the driver's in-use bytes (they count every
    process on the device). A worker that failed, timed out or died is
    started again by the next request."""

    def __init__(self, run: Run, device: str):
        self.run, self.device = run, device
        self.process: subprocess.Popen | None = None

    def ask(self, request: dict, deadline: float, most: float = STEP_LIMIT) -> dict:
        limit = self.run.limit(deadline, most)
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen([sys.executable, __file__, "--torch-worker", "--device", self.device],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError as error:
            self.close()
            return {"error": f"the PyTorch process took no request: {error}"}
        ready, _, _ = select.select([self.process.stdout], [], [], limit)
        if not ready:
            self.close()
            return {"error": f"PyTorch took over {limit:.0f} s"}
        line = self.process.stdout.readline()
        if not line:
            ended = self.process.wait()
            self.process = None
            return {"error": f"the PyTorch process ended (exit {ended})"}
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            answer = {"error": f"PyTorch answered {line[:300]!r}"}
        if "error" in answer:  # a failed step may leave the process's CUDA state broken: the next request starts afresh
            self.close()
        return answer

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None


class NoTorch:
    """TorchWorker's stand-in where this python has no PyTorch (a rehearsal on
    the CPU): every figure PyTorch would give is the reason there is none."""

    def __init__(self, why: str):
        self.why = why

    def ask(self, request: dict, deadline: float, most: float = STEP_LIMIT) -> dict:
        return {"none": self.why}

    def close(self) -> None:
        pass


def torch_worker(run: Run, device: str) -> TorchWorker | NoTorch:
    return NoTorch(run.no_torch) if run.no_torch else TorchWorker(run, device)


# Where a container's NVIDIA driver (libcuda.so.1) is mounted when it is not in the loader's cache.
DRIVER_FOLDERS = ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib"]


def library_path() -> str:
    """The lib folders of this python's NVIDIA wheels, where the binary finds CUDA 13's libraries,
    and the driver's folder."""
    folders = [folder for folder in DRIVER_FOLDERS if os.path.isdir(folder)]
    try:
        import nvidia  # the namespace package the CUDA wheels install into

        for base in nvidia.__path__:
            folders += sorted(glob.glob(os.path.join(base, "*", "lib")))
    except ImportError:
        pass
    return ":".join(folders + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p])


def vramlab(run: Run, binary: pathlib.Path, args: list[str], deadline: float, most: float = STEP_LIMIT,
            extra_env: dict | None = None) -> dict:
    """One command's JSON, or what went wrong; never raises."""
    limit = run.limit(deadline, most)
    env = dict(os.environ, LD_LIBRARY_PATH=library_path(), **(extra_env or {}))
    started = time.monotonic()
    try:
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return {"args": args, "error": f"timed out after {limit:.0f} s"}
    except OSError as error:
        return {"args": args, "error": str(error)}
    seconds = time.monotonic() - started
    result = {"args": args, "exit": done.returncode, "seconds": round(seconds, 2), "stderr": done.stderr[-4000:]}
    try:
        result["json"] = json.loads(done.stdout)
    except json.JSONDecodeError:
        result["stdout"] = done.stdout[-4000:]
    return result


def output(args: list[str], limit: float, env: dict | None = None) -> str:
    """A helper command's output (stdout, else stderr), or why there is none; never raises."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return f"{args[0]} timed out after {limit:.0f} s"
    except OSError as error:
        return f"{args[0]}: {error}"
    return done.stdout.strip() or done.stderr.strip()


def sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def step_flags(model: str, batch: int, res: int, extra: list[str], device: str) -> list[str]:
    return ["--model", model, "--batch", str(batch), "--res", str(res), "--classes", str(CLASSES), "--device", device, *extra]


def flag(extra: list[str], name: str, default: str) -> str:
    return extra[extra.index(name) + 1] if name in extra else default


def torch_step(model: str, batch: int, res: int, extra: list[str], device: str):
    """PyTorch's step for the same configuration, or the reason there is none."""
    import torch
    import torchvision

    if model not in TORCH_MODELS:
        return None, f"{model} has no torchvision counterpart"
    if "--ckpt" in extra:
        return None, "checkpointing is placed differently in PyTorch"
    optimizers = {
        "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    }
    opt_name = flag(extra, "--opt", "sgd-momentum")
    if opt_name not in optimizers:
        return None, f"PyTorch has no {opt_name}"
    f16 = flag(extra, "--amp", "") == "f16"
    accum = int(flag(extra, "--accum", "1"))
    dev = torch.device(device)
    torch.manual_seed(0)
    net = getattr(torchvision.models, TORCH_MODELS[model])(num_classes=CLASSES).to(dev).train()
    opt = optimizers[opt_name](net.parameters())
    scaler = torch.amp.GradScaler(device, enabled=f16)
    x = torch.randn(batch, 3, res, res, device=dev)
    y = torch.randint(0, CLASSES, (batch,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        for _ in range(accum):
            with torch.autocast(device_type=dev.type, dtype=torch.float16, enabled=f16):
                loss = loss_fn(net(x), y) / accum
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if dev.type == "cuda":
            torch.cuda.synchronize()

    return step, None


def torch_saved(model: str, batch: int, res: int, extra: list[str], device: str) -> dict:
    """What the forward of PyTorch's step saves for backward: unique storages, counted once, the
    parameters and the batch left out."""
    import torch
    import torchvision

    if model not in TORCH_MODELS:
        return {}
    f16 = flag(extra, "--amp", "") == "f16"
    dev = torch.device(device)
    net = getattr(torchvision.models, TORCH_MODELS[model])(num_classes=CLASSES).to(dev).train()
    x = torch.randn(batch, 3, res, res, device=dev)
    # The parameters and the batch exist before forward: not what it keeps (as scripts/bench_saved.py).
    excluded = {p.untyped_storage().data_ptr() for p in net.parameters()} | {x.untyped_storage().data_ptr()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device_type=dev.type, dtype=torch.float16, enabled=f16):
            out = net(x)
    saved = sum(storages.values())
    del out, net, x
    return {"torch_saved_bytes": saved}


def torch_peak(step, device: str) -> dict:
    """PyTorch's allocated and reserved bytes around one step after two warm-ups."""
    import torch

    step()
    step()
    if device != "cuda":
        return {}
    torch.cuda.reset_peak_memory_stats()
    step()
    return {"torch_peak_bytes": torch.cuda.max_memory_allocated(), "torch_reserved_bytes": torch.cuda.max_memory_reserved()}


def torch_times(step, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def torch_env(device: str) -> dict:
    import torch

    env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "gpu_total_bytes": props.total_memory, "compute_capability": f"{props.major}.{props.minor}"}
    return env


def torch_h2d(mib: int, repeats: int) -> dict:
    import torch

    host = torch.empty(mib << 20, dtype=torch.uint8)
    pinned = host.pin_memory()
    target = torch.empty_like(host, device="cuda")

    def bandwidth(source) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            started = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return source.numel() / statistics.median(times) / 1e6

    return {"pageable_mb_per_s": bandwidth(host), "pinned_mb_per_s": bandwidth(pinned)}


def serve(device: str) -> int:
    """The worker's side of TorchWorker: one JSON answer per JSON request."""
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["ask"] == "env":
                answer = torch_env(device)
            elif request["ask"] == "h2d":
                answer = torch_h2d(request["mib"], request["repeats"])
            else:
                step, why = torch_step(request["model"], request["batch"], request["res"], request["extra"], device)
                if step is None:
                    answer = {"none": why}
                elif request["ask"] == "peak":
                    answer = torch_peak(step, device)
                    del step
                    release_torch()
                    step = None
                    answer |= torch_saved(request["model"], request["batch"], request["res"], request["extra"], device)
                else:
                    answer = {"times": torch_times(step, request["steps"], request["warmup"])}
                del step
                release_torch()
        except Exception as error:  # a failing PyTorch step is a finding, not the end of the run
            answer = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(answer), flush=True)
    return 0


def release_torch() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def label(model: str, batch: int, res: int, extra: list[str]) -> str:
    return " ".join([model, f"b{batch}@{res}", *extra])


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def part_env(run: Run, binary: pathlib.Path, device: str) -> None:
    deadline = run.deadline("env")
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "binary": str(binary),
        "binary_bytes": binary.stat().st_size,
        "binary_sha256": sha256(binary),
        "library_path": library_path(),
    }
    worker = torch_worker(run, device)
    answer = worker.ask({"ask": "env"}, deadline, PART_LIMITS["env"])
    worker.close()
    if "none" in answer:
        env |= {"torch": None, "torch_absent": answer["none"]}
    elif "error" in answer:
        env |= {"torch": None, "torch_error": answer["error"]}
    else:
        env |= answer
    if shutil.which("nvidia-smi"):
        env["nvidia_smi"] = output(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv"],
                                   run.limit(deadline))
    ldd = output(["ldd", str(binary)], run.limit(deadline), env=dict(os.environ, LD_LIBRARY_PATH=library_path()))
    env["ldd"] = ldd.splitlines()
    env["unresolved"] = [line.split()[0] for line in env["ldd"] if "not found" in line]
    run.write("env.json", env)
    torch = env["torch"] or f"absent: {env.get('torch_absent') or env.get('torch_error')}"
    run.say(f"  {env.get('gpu', 'no GPU')}; torch {torch}; binary {env['binary_bytes'] >> 20} MiB, sha256 {env['binary_sha256']}")
    if env["unresolved"]:
        run.say(f"  the binary does not find: {', '.join(env['unresolved'])}")


def part_ops(run: Run, binary: pathlib.Path, device: str, sizes: Sizes) -> None:
    """check-ops on the device. A mismatch, or check-ops not running, goes into ops.json's
    "mismatch" and run.mismatch (which marks every later result); the run goes on, since what
    the later parts measure is a finding either way."""
    args = ["check-ops", "--device", device, *sizes.ops, "--json"]
    run.write("ops.json", {"args": args, "error": UNFINISHED})
    # f32 convolutions on TF32 tensor cores would be compared at a tolerance loosened for them;
    # with TF32 off, check-ops holds cuDNN's f32 to the CPU's own tolerance.
    result = vramlab(run, binary, args, run.deadline("ops"), PART_LIMITS["ops"], extra_env=TF32_OFF)
    report = result.get("json", {})
    failed = [c for c in report.get("checks", []) if not c.get("ok")]
    for check in failed[:20]:
        run.say(f"  MISMATCH {json.dumps(check)}")
    run.say(f"  check-ops: exit {result.get('exit')}, {report.get('passed', '?')} passed, {report.get('failed', '?')} failed")
    if result.get("exit") != 0:
        if failed:
            result["mismatch"] = f"{len(failed)} of {len(report['checks'])} checks failed"
        else:
            why = result.get("error") or last_line(result.get("stderr", "")) or f"exit {result.get('exit')}"
            result["mismatch"] = f"check-ops did not finish ({why})"
            run.say(f"  {result.get('error') or result.get('stderr', '')[-500:]}")
        run.mismatch = result["mismatch"]
        run.say(f"  check-ops mismatch: {run.mismatch}; the run goes on, and every later result is marked after_ops_mismatch")
    run.write("ops.json", result)


def part_smoke(run: Run, binary: pathlib.Path, device: str) -> None:
    args = ["smoke", "--device", device, "--json"]
    run.write("smoke.json", run.mark({"args": args, "error": UNFINISHED}))
    result = run.mark(vramlab(run, binary, args, run.deadline("smoke"), PART_LIMITS["smoke"]))
    run.write("smoke.json", result)
    for check in result.get("json", {}).get("checks", []):
        run.say(f"  {'pass' if check['passed'] else 'FAIL'}  {check['name']}: {check['figure']}")
    if "error" in result or result.get("exit") not in (0, 1):
        run.say(f"  smoke did not run: {result.get('error') or result.get('stderr', '')[-500:]}")


def part_measure(run: Run, binary: pathlib.Path, device: str, sizes: Sizes) -> None:
    deadline = run.deadline("measure")
    rows = []
    for model, batch, res, extra in sizes.measure:
        name = label(model, batch, res, extra)
        if run.spent(deadline):
            run.skip(f"measure {name}", "the part's time was spent")
            continue
        args = ["measure", *step_flags(model, batch, res, extra, device), "--json"]
        rows.append(run.mark({"label": name, "config": [model, batch, res, extra], "args": args, "error": UNFINISHED}))
        run.write("measure.json", rows)
        rows[-1] = run.mark({"label": name, "config": [model, batch, res, extra], **vramlab(run, binary, args, deadline)})
        run.write("measure.json", rows)
        comparison = rows[-1].get("json", {})
        if "measured_peak" in comparison:
            error = (comparison["measured_peak"] - comparison["predicted_peak"]) / comparison["predicted_peak"] * 100
            run.say(f"  {name}: predicted {comparison['predicted_peak'] / 2**20:.1f} MiB, "
                    f"measured {comparison['measured_peak'] / 2**20:.1f} MiB ({error:+.1f}%)")
        else:
            run.say(f"  {name}: {rows[-1].get('error') or rows[-1].get('stderr', '')[-300:]}")
    worker = torch_worker(run, device)
    for row in rows:
        if run.spent(deadline):
            run.skip(f"PyTorch's peak for {row['label']}", "the part's time was spent")
            continue
        model, batch, res, extra = row["config"]
        row["torch"] = {"error": UNFINISHED}
        run.write("measure.json", rows)
        row["torch"] = worker.ask({"ask": "peak", "model": model, "batch": batch, "res": res, "extra": extra}, deadline)
        run.write("measure.json", rows)
        if "torch_peak_bytes" in row["torch"]:
            ours = row.get("json", {})
            run.say(f"  {row['label']}: PyTorch's peak {row['torch']['torch_peak_bytes'] / 2**20:.1f} MiB "
                    f"(ours {ours.get('measured_peak', 0) / 2**20:.1f}), saved for backward "
                    f"{row['torch'].get('torch_saved_bytes', 0) / 2**20:.1f} MiB")
    worker.close()


def part_bench(run: Run, binary: pathlib.Path, device: str, sizes: Sizes, steps: int, warmup: int, rounds: int) -> None:
    deadline = run.deadline("bench")
    worker = torch_worker(run, device)
    bench = {"steps": steps, "warmup": warmup, "rounds": rounds, "results": []}
    for model, batch, res, extra in sizes.bench:
        name = label(model, batch, res, extra)
        if run.spent(deadline):
            run.skip(f"bench {name}", "the part's time was spent")
            continue
        row = run.mark({"label": name, "ours_s": [], "torch_s": [], "failures": [], "unfinished": UNFINISHED})
        bench["results"].append(row)
        run.write("bench.json", bench)
        for _ in range(rounds):
            result = vramlab(run, binary, ["bench", "train", *step_flags(model, batch, res, extra, device),
                                           "--steps", str(steps), "--warmup", str(warmup), "--json"], deadline)
            if "median_seconds" not in result.get("json", {}):
                row["failures"].append(result.get("error") or result.get("stderr", "")[-300:])
                break
            row["ours_s"].append(result["json"]["median_seconds"])
            row["cudnn"] = result["json"].get("cudnn")
            run.write("bench.json", bench)
            # Once PyTorch has no figure for this configuration (or failed), our rounds go on alone.
            if "torch" not in row:
                theirs = worker.ask({"ask": "times", "model": model, "batch": batch, "res": res, "extra": extra,
                                     "steps": steps, "warmup": warmup}, deadline)
                if "times" in theirs:
                    row["torch_s"].append(statistics.median(theirs["times"]))
                else:
                    row["torch"] = theirs
                run.write("bench.json", bench)
        del row["unfinished"]
        if row["ours_s"] and row["torch_s"]:
            ours, torch_s = statistics.median(row["ours_s"]), statistics.median(row["torch_s"])
            row["ratio"] = ours / torch_s
            run.say(f"  {name}: vramlab {ours * 1000:.1f} ms, PyTorch {torch_s * 1000:.1f} ms, ratio {row['ratio']:.2f}x")
            if row.get("cudnn"):
                plans = row["cudnn"]
                off_first = [a for a in plans["algorithms"] if a["rank"] > 0]
                run.say(f"  {name}: {len(plans['algorithms'])} cuDNN plans, {plans['made_while_timed']} made while timed, "
                        f"largest workspace {max((a['workspace_bytes'] for a in plans['algorithms']), default=0) / 2**20:.1f} MiB, "
                        f"{len(off_first)} not the heuristics' first choice")
        else:
            ours = f"{statistics.median(row['ours_s']) * 1000:.1f} ms" if row["ours_s"] else row["failures"]
            run.say(f"  {name}: vramlab {ours}, PyTorch {row['torch_s'] or row.get('torch')}")
        run.write("bench.json", bench)
    worker.close()


def part_h2d(run: Run, binary: pathlib.Path, device: str, sizes: Sizes) -> None:
    if device != "cuda":
        run.skip("h2d", "there is no device to copy to")
        return
    deadline = run.deadline("h2d")
    args = ["bench", "h2d", "--mib", str(sizes.h2d_mib), "--repeats", str(sizes.h2d_repeats), "--json"]
    result = run.mark({"mib": sizes.h2d_mib, "vramlab": {"args": args, "error": UNFINISHED}, "torch": {"error": UNFINISHED}})
    run.write("h2d.json", result)
    result["vramlab"] = vramlab(run, binary, args, deadline, PART_LIMITS["h2d"])
    run.write("h2d.json", result)
    worker = torch_worker(run, device)
    result["torch"] = worker.ask({"ask": "h2d", "mib": sizes.h2d_mib, "repeats": sizes.h2d_repeats}, deadline, PART_LIMITS["h2d"])
    worker.close()
    run.write("h2d.json", result)
    ours, theirs = result["vramlab"].get("json", {}), result["torch"]
    run.say(f"  vramlab pageable {ours.get('pageable_mb_per_s', 0):.0f}, pinned {ours.get('pinned_mb_per_s', 0):.0f} MB/s; "
            f"PyTorch pageable {theirs.get('pageable_mb_per_s', 0):.0f}, pinned {theirs.get('pinned_mb_per_s', 0):.0f} MB/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", ROOT / "target" / "gpu-check")))
    parser.add_argument("--binary", type=pathlib.Path, default=pathlib.Path(os.environ.get("GPU_DIST", ROOT / ".gpu")) / "vramlab")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--budget", type=float, default=480, help="seconds for everything; parts past it are skipped")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=PARTS, help="run these parts alone")
    parser.add_argument("--small", action="store_true", help="tiny sizes in every part: a rehearsal, or a quick look")
    parser.add_argument("--steps", type=int, help=f"timed steps per bench run ({FULL.steps}; {SMALL.steps} with --small)")
    parser.add_argument("--warmup", type=int, help=f"untimed steps before them ({FULL.warmup}; {SMALL.warmup} with --small)")
    parser.add_argument("--rounds", type=int,
                        help=f"alternations of vramlab and PyTorch per bench configuration ({FULL.rounds}; {SMALL.rounds} with --small)")
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_worker:
        return serve(args.device)
    sizes = SMALL if args.small else FULL
    steps = sizes.steps if args.steps is None else args.steps
    warmup = sizes.warmup if args.warmup is None else args.warmup
    rounds = sizes.rounds if args.rounds is None else args.rounds
    if args.budget <= 0 or steps <= 0 or rounds <= 0 or warmup < 0:
        parser.error("--budget, --steps and --rounds must be positive and --warmup not negative")
    if not args.binary.is_file():
        parser.error(f"no vramlab binary at {args.binary}: build it with scripts/build_cuda.sh (or name one with --binary)")
    no_torch = None
    if subprocess.run([sys.executable, "-c", "import torch, torchvision"], capture_output=True).returncode != 0:
        if args.device == "cuda":
            parser.error(f"{sys.executable} has no PyTorch and torchvision: run this with the python that has them")
        no_torch = NO_TORCH
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.budget, no_torch)
    run.say(f"gpu_check: device {args.device}, binary {args.binary}, budget {args.budget:.0f} s, out {args.out}"
            f"{', small sizes' if args.small else ''}{f'; {no_torch}' if no_torch else ''}")
    run.write("skipped.json", run.skipped)
    for part in PARTS:
        if part not in args.only:
            continue
        if run.left() < 5:
            run.skip(part, f"the {args.budget:.0f} s budget was spent")
            continue
        run.say(f"== {part} ({run.left():.0f} s left)")
        if run.mismatch is not None:
            run.say(f"   these figures follow a check-ops mismatch: {run.mismatch}")
        started = time.monotonic()
        if part == "env":
            part_env(run, args.binary, args.device)
        elif part == "ops":
            part_ops(run, args.binary, args.device, sizes)
        elif part == "smoke":
            part_smoke(run, args.binary, args.device)
        elif part == "measure":
            part_measure(run, args.binary, args.device, sizes)
        elif part == "bench":
            part_bench(run, args.binary, args.device, sizes, steps, warmup, rounds)
        elif part == "h2d":
            part_h2d(run, args.binary, args.device, sizes)
        run.say(f"   {part} took {time.monotonic() - started:.0f} s")
    skipped = "nothing" if not run.skipped else f"{len(run.skipped)} (each is in skipped.json)"
    after = f"; the figures after ops follow a check-ops mismatch: {run.mismatch}" if run.mismatch else ""
    run.say(f"done in {time.monotonic() - run.started:.0f} s; skipped: {skipped}{after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
