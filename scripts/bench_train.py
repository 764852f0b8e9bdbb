"""Training step time: vramlab (candle) against PyTorch on this machine, in one run.

Each configuration runs `vramlab bench train ... --json` and the same step in
PyTorch (torchvision's model, SGD momentum 0.9, cross-entropy, random images,
the same number of threads; for a ViT torchvision's `VisionTransformer` with
its sizes set to ours; for `unet` the U-Net of scripts/unet_twin.py, 2 classes
per pixel, random labels N x H x W and the mean cross-entropy over every
pixel), alternating the two several times so that both
see the same machine state. Prints a table and writes JSON with every sample.

    VRAMLAB_BENCH_VENV=.venv-bench python3 scripts/bench_train.py [--rounds 3] [--steps 5] [--threads 1 2]

Before each pair it waits for a quiet machine (one-minute load average under
the number of CPUs, and less than 10% of the CPUs busy over a second) and
records the load; while the pair runs it counts the CPU time that other
processes took. A configuration whose pairs did not all run quiet gets
no ratio: the table says "busy" and the JSON keeps the samples.

The venv is created from scripts/bench-requirements.txt when it does not exist.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = [
    {"model": "resnet18", "batch": 32, "res": 64},
    {"model": "resnet18", "batch": 8, "res": 224},
    {"model": "resnet50", "batch": 8, "res": 224},
    {"model": "efficientnet-b0", "batch": 8, "res": 224},
    {"model": "vit-tiny", "batch": 8, "res": 224},
    {"model": "vit-tiny", "batch": 32, "res": 64},
    {"model": "unet", "batch": 8, "res": 128},
    {"model": "unet", "batch": 16, "res": 64},
]
# Other processes may take this share of the CPUs' time during a pair before its ratio is refused.
OTHERS_BUSY_LIMIT = 0.10
TORCH_MODELS = {"resnet18": "resnet18", "resnet34": "resnet34", "resnet50": "resnet50", "efficientnet-b0": "efficientnet_b0",
                "vit-tiny": "vit-tiny", "vit-small": "vit-small", "unet": "unet"}
CLASSES = 10
# Models whose number of classes is not CLASSES, on both sides.
MODEL_CLASSES = {"unet": 2}
# (features, layers, heads, MLP) of the ViTs, patch 16.
VIT_SIZES = {"vit-tiny": (192, 12, 3, 768), "vit-small": (384, 12, 6, 1536)}

TORCH_STEP = r"""
import json, statistics, sys, time
import torch, torchvision
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
torch.manual_seed(0)
if cfg["torch_model"] == "unet":
    sys.path.insert(0, cfg["scripts"])
    from unet_twin import UNet
    model = UNet(classes=cfg["classes"])
elif cfg["vit"]:
    dim, depth, heads, mlp = cfg["vit"]
    model = torchvision.models.VisionTransformer(image_size=cfg["res"], patch_size=16, num_layers=depth, num_heads=heads,
                                                 hidden_dim=dim, mlp_dim=mlp, num_classes=cfg["classes"])
else:
    model = getattr(torchvision.models, cfg["torch_model"])(num_classes=cfg["classes"])
model.train()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(cfg["batch"], 3, cfg["res"], cfg["res"])
y = torch.randint(0, cfg["classes"], (cfg["batch"], cfg["res"], cfg["res"]) if cfg["torch_model"] == "unet" else (cfg["batch"],))
loss_fn = torch.nn.CrossEntropyLoss()
def step():
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
for _ in range(cfg["warmup"]):
    step()
times = []
for _ in range(cfg["steps"]):
    t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
print(json.dumps({"step_seconds": times, "median_seconds": statistics.median(times), "torch": torch.__version__}))
"""


def bench_python() -> pathlib.Path:
    venv = pathlib.Path(os.environ.get("VRAMLAB_BENCH_VENV", ROOT / ".venv-bench"))
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(ROOT / "scripts/bench-requirements.txt")], check=True)
    return python


def vramlab_binary() -> pathlib.Path:
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    # The workspace's build, as set-up runs it: `-p vramlab` alone unifies features
    # differently and would compile candle and a hundred crates again.
    subprocess.run(["cargo", "build", "--release", "--locked", "--workspace", "--bins", "--features", "vramlab/mpi"], cwd=ROOT, check=True)
    return target / "release" / "vramlab"


def classes_of(cfg: dict) -> int:
    return MODEL_CLASSES.get(cfg["model"], CLASSES)


def ours(binary: pathlib.Path, cfg: dict, steps: int, warmup: int, threads: int) -> dict:
    args = [str(binary), "bench", "train", "--model", cfg["model"], "--batch", str(cfg["batch"]), "--res", str(cfg["res"]),
            "--classes", str(classes_of(cfg)), "--opt", "sgd-momentum", "--steps", str(steps), "--warmup", str(warmup), "--json"]
    args += cfg.get("extra", [])
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(args, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout)


def theirs(python: pathlib.Path, cfg: dict, steps: int, warmup: int, threads: int) -> dict:
    payload = {"torch_model": TORCH_MODELS[cfg["model"]], "vit": VIT_SIZES.get(cfg["model"]), "batch": cfg["batch"], "res": cfg["res"],
               "classes": classes_of(cfg), "scripts": str(ROOT / "scripts"), "steps": steps, "warmup": warmup, "threads": threads}
    out = subprocess.run([str(python), "-c", TORCH_STEP, json.dumps(payload)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(v) for v in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    total = sum(fields[:8])
    return total - idle, total


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def busy_share(seconds: float = 1.0) -> float:
    busy0, total0 = cpu_jiffies()
    time.sleep(seconds)
    busy1, total1 = cpu_jiffies()
    return (busy1 - busy0) / max(total1 - total0, 1)


def wait_for_quiet(settle: float) -> dict:
    """Waits up to `settle` seconds for a quiet machine; returns what it saw last."""
    deadline = time.monotonic() + settle
    cpus = os.cpu_count() or 1
    while True:
        share = busy_share()
        load1 = os.getloadavg()[0]
        quiet = load1 < cpus and share < OTHERS_BUSY_LIMIT
        if quiet or time.monotonic() >= deadline:
            return {"load_1min": round(load1, 2), "busy_share_1s": round(share, 3), "quiet": quiet}


class OthersMeter:
    """The share of the CPUs' time taken by processes other than this script's children."""

    def __enter__(self):
        self.jiffies, self.children = cpu_jiffies(), children_cpu_seconds()
        return self

    def __exit__(self, *_):
        busy, total = cpu_jiffies()
        ticks = os.sysconf("SC_CLK_TCK")
        busy_s = (busy - self.jiffies[0]) / ticks
        total_s = (total - self.jiffies[1]) / ticks
        others_s = max(busy_s - (children_cpu_seconds() - self.children), 0.0)
        self.share = others_s / max(total_s, 1e-9)


def write_report(out: pathlib.Path, **fields) -> None:
    """The run's JSON: when it ran, on what machine, and `fields`."""
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": cpu_model(), "cpus": os.cpu_count(), **fields}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written {out}")


def config_spec(spec: str) -> dict:
    """`MODEL:BATCH:RES`, such as `resnet18:32:64`."""
    try:
        model, batch, res = spec.split(":")
        return {"model": model, "batch": int(batch), "res": int(res)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r} is not MODEL:BATCH:RES (such as resnet18:32:64)") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of ours and PyTorch per configuration")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts, each a run of every configuration")
    parser.add_argument("--configs", nargs="+", type=config_spec, metavar="MODEL:BATCH:RES",
                        help="only these configurations (default: " + ", ".join(f"{c['model']}:{c['batch']}:{c['res']}" for c in CONFIGS) + ")")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds to wait for a quiet machine before a pair")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "target" / "bench_train.json")
    args = parser.parse_args()
    configs = args.configs or CONFIGS
    python, binary = bench_python(), vramlab_binary()
    results = []
    for threads in args.threads:
        for cfg in configs:
            our_medians, their_medians, pairs, torch_version = [], [], [], None
            for _ in range(args.rounds):
                before = wait_for_quiet(args.settle)
                with OthersMeter() as others:
                    our_medians.append(ours(binary, cfg, args.steps, args.warmup, threads)["median_seconds"])
                    t = theirs(python, cfg, args.steps, args.warmup, threads)
                their_medians.append(t["median_seconds"])
                torch_version = t["torch"]
                pairs.append(dict(before, others_share=round(others.share, 3)))
            quiet = all(p["quiet"] and p["others_share"] < OTHERS_BUSY_LIMIT for p in pairs)
            row = dict(cfg, threads=threads, ours_s=statistics.median(our_medians), torch_s=statistics.median(their_medians),
                       ours_all=our_medians, torch_all=their_medians, torch=torch_version, pairs=pairs, quiet=quiet)
            row["ratio"] = row["ours_s"] / row["torch_s"] if quiet else None
            results.append(row)
            verdict = f"ratio {row['ratio']:.2f}x" if quiet else "busy: no ratio (another process took CPU time)"
            loads = ", ".join(f"{p['load_1min']:.2f}" for p in pairs)
            print(f"{cfg['model']} b{cfg['batch']}@{cfg['res']}, {threads} thread(s): vramlab {row['ours_s']:.3f} s, "
                  f"PyTorch {torch_version} {row['torch_s']:.3f} s, {verdict} (load before each pair: {loads}; "
                  f"others' share during: {max(p['others_share'] for p in pairs):.1%} at most)", flush=True)
    write_report(args.out, threads=args.threads, rounds=args.rounds, steps=args.steps, warmup=args.warmup, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
