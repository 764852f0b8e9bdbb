"""vramlab's CUDA build on a GPU machine: the smoke test, the ledger against
the device pool, and step time and copy bandwidth against PyTorch, in one
time-boxed run that writes a handful of JSON files.

    bash scripts/gpu_check.sh [--out DIR] [--budget SECONDS] [--only PART ...]

Run by scripts/gpu_check.sh with the python that has PyTorch (on the device
machine, /opt/torch/.venv's). The binary comes from scripts/build_cuda.sh
(.gpu/vramlab); the CUDA libraries it links are found in that python's
site-packages/nvidia folders. The parts, in order, each with its own time
limit inside the overall budget (a part that would start past the budget is
skipped and the report says so):

  env      the GPU, the driver, torch, and the libraries the binary resolves
  ops      vramlab check-ops --device cuda: every op on the GPU against our CPU
           implementation; a mismatch stops the run here
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

`--device cpu --binary target/release/vramlab` rehearses the whole run on a
machine without a GPU (PyTorch on the CPU, no pool figures, no h2d).
"""
from __future__ import annotations

import argparse
import glob
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = ["env", "ops", "smoke", "measure", "bench", "h2d"]
# Seconds each part may take at most (it also stops at the overall budget).
PART_LIMITS = {"env": 30, "ops": 90, "smoke": 120, "measure": 240, "bench": 200, "h2d": 60}
STEP_LIMIT = 90

MEASURE_MATRIX = [
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
LARGE = [(model, 32, 224, amp) for model in ("resnet18", "resnet50", "efficientnet-b0") for amp in ([], ["--amp", "f16"])]
LARGE_PLAIN = [(model, batch, res, [*extra, "--layers", "plain"]) for model, batch, res, extra in LARGE]
TORCH_MODELS = {"resnet18": "resnet18", "resnet34": "resnet34", "resnet50": "resnet50", "efficientnet-b0": "efficientnet_b0"}
CLASSES = 10


class Run:
    """The overall clock, the log, and what was skipped and why."""

    def __init__(self, out: pathlib.Path, budget: float):
        self.out, self.budget, self.started = out, budget, time.monotonic()
        self.skipped: list[str] = []
        self.log = (out / "log.txt").open("w")

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        self.say(f"skipped {what}: {why}")

    def write(self, name: str, value) -> None:
        (self.out / name).write_text(json.dumps(value, indent=1))
        self.say(f"wrote {self.out / name}")


class TorchWorker:
    """PyTorch in a process of its own, asked one JSON line at a time. The
    driver never touches CUDA itself, and no PyTorch process is alive while
    `vramlab measure` reads the driver's in-use bytes (they count every
    process on the device)."""

    def __init__(self, device: str):
        self.process = subprocess.Popen([sys.executable, __file__, "--torch-worker", "--device", device],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, request: dict, limit: float) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], max(limit, 1))
        if not ready:
            self.close()
            return {"error": f"PyTorch took over {limit:.0f} s"}
        line = self.process.stdout.readline()
        return json.loads(line) if line else {"error": f"the PyTorch process ended (exit {self.process.wait()})"}

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


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


def vramlab(run: Run, binary: pathlib.Path, args: list[str], limit: float) -> dict:
    """One command's JSON, or what went wrong; never raises."""
    limit = min(limit, max(run.left(), 1))
    env = dict(os.environ, LD_LIBRARY_PATH=library_path())
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


def part_env(run: Run, binary: pathlib.Path, device: str) -> None:
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "binary": str(binary),
        "binary_bytes": binary.stat().st_size,
        "library_path": library_path(),
    }
    worker = TorchWorker(device)
    env |= worker.ask({"ask": "env"}, PART_LIMITS["env"])
    worker.close()
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv"],
                             capture_output=True, text=True)
        env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=library_path()))
    env["ldd"] = ldd.stdout.strip().splitlines()
    env["unresolved"] = [line.split()[0] for line in env["ldd"] if "not found" in line]
    run.write("env.json", env)
    run.say(f"  {env.get('gpu', 'no GPU')}, torch {env.get('torch')}, binary {env['binary_bytes'] >> 20} MiB")
    if env["unresolved"]:
        run.say(f"  the binary does not find: {', '.join(env['unresolved'])}")


def part_ops(run: Run, binary: pathlib.Path, device: str) -> bool:
    """check-ops on the device; False (the run stops) on a mismatch or when it did not run."""
    result = vramlab(run, binary, ["check-ops", "--device", device, "--json"], PART_LIMITS["ops"])
    run.write("ops.json", result)
    report = result.get("json", {})
    failed = [c for c in report.get("checks", []) if not c.get("ok")]
    for check in failed[:20]:
        run.say(f"  MISMATCH {json.dumps(check)}")
    run.say(f"  check-ops: exit {result.get('exit')}, {report.get('passed', '?')} passed, {report.get('failed', '?')} failed")
    if result.get("exit") != 0:
        run.say(f"  {result.get('error') or result.get('stderr', '')[-500:]}")
        return False
    return True


def part_smoke(run: Run, binary: pathlib.Path, device: str) -> None:
    result = vramlab(run, binary, ["smoke", "--device", device, "--json"], PART_LIMITS["smoke"])
    run.write("smoke.json", result)
    for check in result.get("json", {}).get("checks", []):
        run.say(f"  {'pass' if check['passed'] else 'FAIL'}  {check['name']}: {check['figure']}")
    if "error" in result or result.get("exit") not in (0, 1):
        run.say(f"  smoke did not run: {result.get('error') or result.get('stderr', '')[-500:]}")


def part_measure(run: Run, binary: pathlib.Path, device: str) -> None:
    deadline = time.monotonic() + PART_LIMITS["measure"]
    rows = []
    for model, batch, res, extra in MEASURE_MATRIX + LARGE + LARGE_PLAIN:
        label = " ".join([model, f"b{batch}@{res}", *extra])
        if time.monotonic() > deadline or run.left() < 5:
            run.skip(f"measure {label}", "the part's time was spent")
            continue
        row = {"label": label, "config": [model, batch, res, extra],
               **vramlab(run, binary, ["measure", *step_flags(model, batch, res, extra, device), "--json"],
                         min(STEP_LIMIT, deadline - time.monotonic()))}
        comparison = row.get("json", {})
        if "measured_peak" in comparison:
            error = (comparison["measured_peak"] - comparison["predicted_peak"]) / comparison["predicted_peak"] * 100
            run.say(f"  {label}: predicted {comparison['predicted_peak'] / 2**20:.1f} MiB, "
                    f"measured {comparison['measured_peak'] / 2**20:.1f} MiB ({error:+.1f}%)")
        else:
            run.say(f"  {label}: {row.get('error') or row.get('stderr', '')[-300:]}")
        rows.append(row)
    worker = TorchWorker(device)
    for row in rows:
        if time.monotonic() > deadline or run.left() < 5:
            run.skip(f"PyTorch's peak for {row['label']}", "the part's time was spent")
            continue
        model, batch, res, extra = row["config"]
        row["torch"] = worker.ask({"ask": "peak", "model": model, "batch": batch, "res": res, "extra": extra},
                                  min(STEP_LIMIT, deadline - time.monotonic()))
        if "torch_peak_bytes" in row["torch"]:
            ours = row.get("json", {})
            run.say(f"  {row['label']}: PyTorch's peak {row['torch']['torch_peak_bytes'] / 2**20:.1f} MiB "
                    f"(ours {ours.get('measured_peak', 0) / 2**20:.1f}), saved for backward "
                    f"{row['torch'].get('torch_saved_bytes', 0) / 2**20:.1f} MiB")
    worker.close()
    run.write("measure.json", rows)


def part_bench(run: Run, binary: pathlib.Path, device: str, steps: int, warmup: int, rounds: int) -> None:
    deadline = time.monotonic() + PART_LIMITS["bench"]
    worker = TorchWorker(device)
    rows = []
    for model, batch, res, extra in LARGE:
        label = " ".join([model, f"b{batch}@{res}", *extra])
        if time.monotonic() > deadline or run.left() < 5:
            run.skip(f"bench {label}", "the part's time was spent")
            continue
        row = {"label": label, "ours_s": [], "torch_s": [], "failures": []}
        for _ in range(rounds):
            result = vramlab(run, binary, ["bench", "train", *step_flags(model, batch, res, extra, device),
                                           "--steps", str(steps), "--warmup", str(warmup), "--json"],
                             min(STEP_LIMIT, deadline - time.monotonic()))
            if "json" not in result:
                row["failures"].append(result.get("error") or result.get("stderr", "")[-300:])
                break
            row["ours_s"].append(result["json"]["median_seconds"])
            row["cudnn"] = result["json"].get("cudnn")
            theirs = worker.ask({"ask": "times", "model": model, "batch": batch, "res": res, "extra": extra,
                                 "steps": steps, "warmup": warmup}, min(STEP_LIMIT, deadline - time.monotonic()))
            if "times" not in theirs:
                row["torch"] = theirs
                if "error" in theirs:
                    worker.close()
                    worker = TorchWorker(device)
                break
            row["torch_s"].append(statistics.median(theirs["times"]))
        if row["ours_s"] and row["torch_s"]:
            ours, torch_s = statistics.median(row["ours_s"]), statistics.median(row["torch_s"])
            row["ratio"] = ours / torch_s
            run.say(f"  {label}: vramlab {ours * 1000:.1f} ms, PyTorch {torch_s * 1000:.1f} ms, ratio {row['ratio']:.2f}x")
            if row.get("cudnn"):
                plans = row["cudnn"]
                off_first = [a for a in plans["algorithms"] if a["rank"] > 0]
                run.say(f"  {label}: {len(plans['algorithms'])} cuDNN plans, {plans['made_while_timed']} made while timed, "
                        f"largest workspace {max((a['workspace_bytes'] for a in plans['algorithms']), default=0) / 2**20:.1f} MiB, "
                        f"{len(off_first)} not the heuristics' first choice")
        else:
            run.say(f"  {label}: vramlab {row['ours_s'] or row['failures']}, PyTorch {row['torch_s'] or row.get('torch')}")
        rows.append(row)
    worker.close()
    run.write("bench.json", {"steps": steps, "warmup": warmup, "rounds": rounds, "results": rows})


def part_h2d(run: Run, binary: pathlib.Path, device: str) -> None:
    if device != "cuda":
        run.skip("h2d", "there is no device to copy to")
        return
    result = {"vramlab": vramlab(run, binary, ["bench", "h2d", "--mib", "256", "--repeats", "20", "--json"], PART_LIMITS["h2d"])}
    worker = TorchWorker(device)
    result["torch"] = worker.ask({"ask": "h2d", "mib": 256, "repeats": 20}, PART_LIMITS["h2d"])
    worker.close()
    run.write("h2d.json", result)
    ours, theirs = result["vramlab"].get("json", {}), result["torch"]
    run.say(f"  vramlab pageable {ours.get('pageable_mb_per_s', 0):.0f}, pinned {ours.get('pinned_mb_per_s', 0):.0f} MB/s; "
            f"PyTorch pageable {theirs.get('pageable_mb_per_s', 0):.0f}, pinned {theirs.get('pinned_mb_per_s', 0):.0f} MB/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", ROOT / "target" / "gpu-check")))
    parser.add_argument("--binary", type=pathlib.Path, default=ROOT / ".gpu" / "vramlab")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--budget", type=float, default=480, help="seconds for everything; parts past it are skipped")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=PARTS, help="run these parts alone")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per bench run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of vramlab and PyTorch per bench configuration")
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_worker:
        return serve(args.device)
    if args.budget <= 0 or args.steps <= 0 or args.rounds <= 0 or args.warmup < 0:
        parser.error("--budget, --steps and --rounds must be positive and --warmup not negative")
    if not args.binary.is_file():
        parser.error(f"no vramlab binary at {args.binary}: build it with scripts/build_cuda.sh (or name one with --binary)")
    if subprocess.run([sys.executable, "-c", "import torch, torchvision"], capture_output=True).returncode != 0:
        parser.error(f"{sys.executable} has no PyTorch and torchvision: run this with the python that has them")
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.budget)
    run.say(f"gpu_check: device {args.device}, binary {args.binary}, budget {args.budget:.0f} s, out {args.out}")
    for part in PARTS:
        if part not in args.only:
            continue
        if run.left() < 5:
            run.skip(part, f"the {args.budget:.0f} s budget was spent")
            continue
        run.say(f"== {part} ({run.left():.0f} s left)")
        started = time.monotonic()
        if part == "env":
            part_env(run, args.binary, args.device)
        elif part == "ops":
            if not part_ops(run, args.binary, args.device):
                for rest in PARTS[PARTS.index("ops") + 1:]:
                    if rest in args.only:
                        run.skip(rest, "check-ops found a mismatch or did not run")
                break
        elif part == "smoke":
            part_smoke(run, args.binary, args.device)
        elif part == "measure":
            part_measure(run, args.binary, args.device)
        elif part == "bench":
            part_bench(run, args.binary, args.device, args.steps, args.warmup, args.rounds)
        elif part == "h2d":
            part_h2d(run, args.binary, args.device)
        run.say(f"   {part} took {time.monotonic() - started:.0f} s")
    skipped = "nothing" if not run.skipped else f"{len(run.skipped)} (each is in skipped.json)"
    run.say(f"done in {time.monotonic() - run.started:.0f} s; skipped: {skipped}")
    (args.out / "skipped.json").write_text(json.dumps(run.skipped, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
