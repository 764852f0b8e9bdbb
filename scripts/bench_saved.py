"""What forward keeps for backward: vramlab against PyTorch, same models, batches and sizes.

vramlab: `vramlab measure --json`, "kept by forward" (the allocation counters:
in use after the last forward phase less in use once the batch was copied).
PyTorch: torchvision's model in training mode, fp32, CPU; every tensor autograd
saves goes through `torch.autograd.graph.saved_tensors_hooks`, and the unique
storages are summed (a saved tensor that is a view, or saved twice, counts once;
the parameters and the input batch, which forward does not add, are left out).

    VRAMLAB_BENCH_VENV=.venv-bench python3 scripts/bench_saved.py [MODEL:BATCH:RES ...]

Without arguments it measures ResNet-18 b32@64, ResNet-50 b8@224 and
EfficientNet-B0 b8@224; `resnet50:32:224` is the lesson's configuration.

The venv is created from scripts/bench-requirements.txt when it does not exist.
Prints a Markdown table for BENCHMARKS.md.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = [("resnet18", 32, 64), ("resnet50", 8, 224), ("efficientnet-b0", 8, 224)]
CLASSES = 1000
MIB = 1 << 20


def torch_kept(model: str, batch: int, res: int) -> int:
    import torch
    import torchvision

    torch.manual_seed(0)
    net = getattr(torchvision.models, model.replace("-", "_"))(num_classes=CLASSES).train()
    excluded = {p.untyped_storage().data_ptr() for p in net.parameters()}
    x = torch.randn(batch, 3, res, res)
    excluded.add(x.untyped_storage().data_ptr())
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(net(x), torch.zeros(batch, dtype=torch.long))
    loss.backward()
    return sum(storages.values())


def vramlab_kept(model: str, batch: int, res: int) -> int:
    binary = ROOT / "target/release/vramlab"
    if not binary.exists():
        subprocess.run(["cargo", "build", "--release", "--locked", "--workspace", "--bins"], cwd=ROOT, check=True)
    out = subprocess.run(
        [str(binary), "measure", "--model", model, "--batch", str(batch), "--res", str(res), "--classes", str(CLASSES), "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)["measured_kept_by_forward"]


def main() -> int:
    venv = pathlib.Path(os.environ.get("VRAMLAB_BENCH_VENV", ROOT / ".venv-bench"))
    python = venv / "bin" / "python"
    if os.environ.get("VRAMLAB_BENCH_INSIDE") != "1":
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(ROOT / "scripts/bench-requirements.txt")], check=True)
        env = dict(os.environ, VRAMLAB_BENCH_INSIDE="1")
        return subprocess.run([str(python), __file__, *sys.argv[1:]], env=env).returncode
    rows = ROWS
    if len(sys.argv) > 1:
        try:
            rows = [(model, int(batch), int(res)) for model, batch, res in (arg.split(":") for arg in sys.argv[1:])]
        except ValueError:
            print(f"usage: {sys.argv[0]} [MODEL:BATCH:RES ...], e.g. resnet50:32:224", file=sys.stderr)
            return 2
    import torch

    torch.set_num_threads(2)
    print(f"torch {torch.__version__}; vramlab {ROOT / 'target/release/vramlab'}; fp32, {CLASSES} classes")
    print()
    print("| model, batch @ resolution | vramlab kept by forward | PyTorch saved tensors | ratio |")
    print("|---|---:|---:|---:|")
    for model, batch, res in rows:
        ours, theirs = vramlab_kept(model, batch, res), torch_kept(model, batch, res)
        print(f"| {model} b{batch}@{res} | {ours / MIB:.1f} MiB | {theirs / MIB:.1f} MiB | {ours / theirs:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
