"""Training step time: vramlab (candle) against PyTorch on this machine, in one run.

Each configuration runs `vramlab bench train ... --json` and the same step in
PyTorch (torchvision's model, SGD momentum 0.9, cross-entropy, random images,
the same number of threads), alternating the two several times so that both
see the same machine state. Prints a table and writes JSON with every sample.

    VRAMLAB_BENCH_VENV=.venv-bench python3 scripts/bench_train.py [--rounds 3] [--steps 5]

The venv is created from scripts/bench-requirements.txt when it does not exist.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = [
    {"model": "resnet18", "batch": 32, "res": 64},
    {"model": "resnet18", "batch": 8, "res": 224},
]
TORCH_MODELS = {"resnet18": "resnet18", "resnet34": "resnet34", "resnet50": "resnet50", "efficientnet-b0": "efficientnet_b0"}

TORCH_STEP = r"""
import json, statistics, sys, time
import torch, torchvision
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
torch.manual_seed(0)
model = getattr(torchvision.models, cfg["torch_model"])(num_classes=cfg["classes"])
model.train()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(cfg["batch"], 3, cfg["res"], cfg["res"])
y = torch.randint(0, cfg["classes"], (cfg["batch"],))
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
    subprocess.run(["cargo", "build", "--release", "--locked", "--workspace", "--bins"], cwd=ROOT, check=True)
    return target / "release" / "vramlab"


def ours(binary: pathlib.Path, cfg: dict, steps: int, warmup: int, threads: int) -> dict:
    args = [str(binary), "bench", "train", "--model", cfg["model"], "--batch", str(cfg["batch"]), "--res", str(cfg["res"]),
            "--opt", "sgd-momentum", "--steps", str(steps), "--warmup", str(warmup), "--json"]
    args += cfg.get("extra", [])
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(args, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout)


def theirs(python: pathlib.Path, cfg: dict, steps: int, warmup: int, threads: int) -> dict:
    payload = {"torch_model": TORCH_MODELS[cfg["model"]], "batch": cfg["batch"], "res": cfg["res"], "classes": 10,
               "steps": steps, "warmup": warmup, "threads": threads}
    out = subprocess.run([str(python), "-c", TORCH_STEP, json.dumps(payload)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of ours and PyTorch per configuration")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "target" / "bench_train.json")
    args = parser.parse_args()
    python, binary = bench_python(), vramlab_binary()
    results = []
    for cfg in CONFIGS:
        our_medians, their_medians, torch_version = [], [], None
        for _ in range(args.rounds):
            our_medians.append(ours(binary, cfg, args.steps, args.warmup, args.threads)["median_seconds"])
            t = theirs(python, cfg, args.steps, args.warmup, args.threads)
            their_medians.append(t["median_seconds"])
            torch_version = t["torch"]
        row = dict(cfg, ours_s=statistics.median(our_medians), torch_s=statistics.median(their_medians),
                   ours_all=our_medians, torch_all=their_medians, torch=torch_version)
        row["ratio"] = row["ours_s"] / row["torch_s"]
        results.append(row)
        print(f"{cfg['model']} b{cfg['batch']}@{cfg['res']}: vramlab {row['ours_s']:.3f} s, "
              f"PyTorch {torch_version} {row['torch_s']:.3f} s, ratio {row['ratio']:.2f}x", flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "threads": args.threads, "rounds": args.rounds, "steps": args.steps,
              "warmup": args.warmup, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
