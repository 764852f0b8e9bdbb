"""CPU work of one training step, vramlab against PyTorch, on one thread each.

Wall-clock ratios on a shared machine depend on how each side's threads wait
(PyTorch's OpenMP threads spin). This measures the CPU seconds one step costs
with a single thread on each side, which other load disturbs far less:
ours as the CPU time of `vramlab bench train` run with 6 timed steps minus
the same with 2, divided by 4 (start-up and warm-up cancel out); PyTorch's as
the median process CPU time of steps 3 to 6 (torchvision's model, SGD
momentum 0.9, cross-entropy). Prints JSON.

    VRAMLAB_BENCH_VENV=.venv-bench python3 scripts/bench_step_cpu.py
"""
from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_ops import ROOT, bench_python  # noqa: E402

CONFIGS = [("resnet18", 32, 64), ("resnet18", 8, 224)]

TORCH_STEP = r"""
import json, resource, statistics, sys
import torch, torchvision
model_name, batch, res = json.loads(sys.argv[1])
torch.set_num_threads(1)
torch.manual_seed(0)
model = getattr(torchvision.models, model_name)(num_classes=10)
model.train()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(batch, 3, res, res), torch.randint(0, 10, (batch,))
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
costs = []
for i in range(6):
    start = cpu()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if i >= 2:
        costs.append(cpu() - start)
print(json.dumps({"cpu_s": statistics.median(costs), "torch": torch.__version__}))
"""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ours_cpu_per_step(binary: pathlib.Path, model: str, batch: int, res: int) -> float:
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    spent = {}
    for steps in (2, 6):
        before = children_cpu()
        subprocess.run(
            [binary, "bench", "train", "--model", model, "--batch", str(batch), "--res", str(res),
             "--opt", "sgd-momentum", "--steps", str(steps), "--warmup", "1", "--json"],
            check=True, capture_output=True, env=env,
        )
        spent[steps] = children_cpu() - before
    return (spent[6] - spent[2]) / 4


def main() -> None:
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    # The workspace's build, as set-up runs it: `-p vramlab` alone unifies features
    # differently and would compile candle and a hundred crates again.
    subprocess.run(["cargo", "build", "-q", "--release", "--locked", "--workspace", "--bins"], cwd=ROOT, check=True)
    python = bench_python()
    rows = []
    for model, batch, res in CONFIGS:
        ours = ours_cpu_per_step(target / "release" / "vramlab", model, batch, res)
        out = subprocess.run([python, "-c", TORCH_STEP, json.dumps([model, batch, res])],
                             check=True, capture_output=True, text=True)
        torch = json.loads(out.stdout)
        rows.append({"model": model, "batch": batch, "res": res, "ours_cpu_s": round(ours, 3),
                     "torch_cpu_s": round(torch["cpu_s"], 3), "ratio": round(ours / torch["cpu_s"], 3),
                     "torch": torch["torch"]})
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
