"""What forward keeps for backward, and the step's peak: vramlab's lean and
plain layers against PyTorch, same models, batches and sizes, in one run.

vramlab: `vramlab measure --layers lean|plain --json` (SGD with momentum):
"kept by forward" is in use after the last forward phase less in use once the
batch was copied, the peak is the highest in use during the measured step
(after two warm-up steps), both from the allocation counters, exact; what the
process held before the model existed is left out.

PyTorch: torchvision's model in training mode, fp32, CPU. Kept: every tensor
autograd saves goes through `torch.autograd.graph.saved_tensors_hooks`, and the
unique storages are summed (a saved tensor that is a view, or saved twice,
counts once; the parameters and the input batch, images and labels, which
forward does not add, are left out: the cross-entropy saves its labels, a few
bytes for a classifier but as many int64 as pixels for the U-Net). Peak: in a process of its own with `MALLOC_MMAP_THRESHOLD_`
fixed at 64 KiB (every tensor of 64 KiB or more is its own mapping, returned to
the system when freed, so RSS follows what is in use), the resident set after
`import torch` and a first operation is the baseline; the model, SGD with
momentum and two warm-up steps follow, the high-water mark is reset
(`/proc/self/clear_refs`), and the peak is VmHWM during one more step less the
baseline. RSS counts pages, so it includes what the allocator and oneDNN hold
besides tensors: an upper bound on PyTorch's in-use peak.

    VRAMLAB_BENCH_VENV=.venv-bench python3 scripts/bench_saved.py [MODEL:BATCH:RES ...]

Without arguments it measures ResNet-18 b32@64, ResNet-50 b8@224,
EfficientNet-B0 b8@224 and ViT-Tiny/16 b8@224; `resnet50:32:224` is the
lesson's configuration. A ViT (`vit-tiny`, `vit-small`) is torchvision's
`VisionTransformer` with its sizes set to ours (patch 16; 192 features, 12
layers of 3 heads and an MLP of 768, or 384, 6 heads and 1536). `unet` is the
U-Net of scripts/unet_twin.py, 2 classes per pixel (labels N x H x W, random
with a fixed seed, and the mean cross-entropy over every pixel), such as
`unet:8:128`. Linux only (the peak reads /proc).

The venv is created from scripts/bench-requirements.txt when it does not exist.
Prints a Markdown table for BENCHMARKS.md. With `--record`, each row is also
written into benchmarks/pytorch-saved.json (a row of the same model, batch and
resolution replaced), which the library compiles in, so that notebooks set
vramlab's measurements beside PyTorch's from this record rather than from
figures copied into their text.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = [("resnet18", 32, 64), ("resnet50", 8, 224), ("efficientnet-b0", 8, 224), ("vit-tiny", 8, 224)]
CLASSES = 1000
# Models whose number of classes is not CLASSES, on both sides.
MODEL_CLASSES = {"unet": 2}
MIB = 1 << 20

# torchvision's network for one of our model names, at `res` pixels, and its
# labels: run here and in the peak's own process, which finds unet_twin.py by SCRIPTS.
TORCH_MODEL = f"SCRIPTS = {str(ROOT / 'scripts')!r}\n" + """
def torch_model(model, res, classes):
    import torchvision
    if model == "unet":
        import sys
        if SCRIPTS not in sys.path:
            sys.path.insert(0, SCRIPTS)
        from unet_twin import UNet
        return UNet(classes=classes)
    vit = {"vit-tiny": (192, 12, 3, 768), "vit-small": (384, 12, 6, 1536)}
    if model in vit:
        dim, depth, heads, mlp = vit[model]
        return torchvision.models.VisionTransformer(
            image_size=res, patch_size=16, num_layers=depth, num_heads=heads, hidden_dim=dim, mlp_dim=mlp, num_classes=classes
        )
    return getattr(torchvision.models, model.replace("-", "_"))(num_classes=classes)

def torch_labels(model, batch, res, classes):
    import torch
    if model == "unet":
        # A generator of its own: the global one's draws (the images) stay those of the other models.
        return torch.randint(0, classes, (batch, res, res), generator=torch.Generator().manual_seed(0))
    return torch.zeros(batch, dtype=torch.long)
"""
exec(TORCH_MODEL)


def classes_of(model: str) -> int:
    return MODEL_CLASSES.get(model, CLASSES)


def torch_kept(model: str, batch: int, res: int) -> int:
    import torch

    torch.manual_seed(0)
    net = torch_model(model, res, classes_of(model)).train()  # noqa: F821 (defined by exec above)
    excluded = {p.untyped_storage().data_ptr() for p in net.parameters()}
    x = torch.randn(batch, 3, res, res)
    y = torch_labels(model, batch, res, classes_of(model))  # noqa: F821 (defined by exec above)
    excluded |= {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    return sum(storages.values())


TORCH_PEAK = TORCH_MODEL + """
import sys, torch

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status")

model, batch, res, classes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(2)
torch.manual_seed(0)
(torch.ones(64, 64) @ torch.ones(64, 64)).sum().item()
baseline = status("VmRSS")
net = torch_model(model, res, classes).train()
optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(batch, 3, res, res), torch_labels(model, batch, res, classes)

def step():
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()

step()
step()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
step()
print(status("VmHWM") - baseline)
"""


def torch_peak(model: str, batch: int, res: int) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, "-c", TORCH_PEAK, model, str(batch), str(res), str(classes_of(model))], env=env, check=True, capture_output=True, text=True
    ).stdout
    return int(out.split()[-1])


def vramlab_measure(model: str, batch: int, res: int, layers: str) -> dict:
    binary = ROOT / "target/release/vramlab"
    if not binary.exists():
        subprocess.run(["cargo", "build", "--release", "--locked", "--workspace", "--bins", "--features", "vramlab/mpi"], cwd=ROOT, check=True)
    args = ["measure", "--model", model, "--batch", str(batch), "--res", str(res), "--classes", str(classes_of(model)), "--layers", layers, "--json"]
    out = subprocess.run([str(binary), *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> int:
    venv = pathlib.Path(os.environ.get("VRAMLAB_BENCH_VENV", ROOT / ".venv-bench"))
    python = venv / "bin" / "python"
    if os.environ.get("VRAMLAB_BENCH_INSIDE") != "1":
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(ROOT / "scripts/bench-requirements.txt")], check=True)
        env = dict(os.environ, VRAMLAB_BENCH_INSIDE="1")
        return subprocess.run([str(python), __file__, *sys.argv[1:]], env=env).returncode
    record = "--record" in sys.argv[1:]
    given = [arg for arg in sys.argv[1:] if arg != "--record"]
    rows = ROWS
    if given:
        try:
            rows = [(model, int(batch), int(res)) for model, batch, res in (arg.split(":") for arg in given)]
        except ValueError:
            print(f"usage: {sys.argv[0]} [--record] [MODEL:BATCH:RES ...], e.g. resnet50:32:224", file=sys.stderr)
            return 2
    import torch

    torch.set_num_threads(2)
    classes = ", ".join(f"{model} {n}" for model, n in MODEL_CLASSES.items() if model in {row[0] for row in rows})
    classes = f"{CLASSES} classes" + (f" ({classes})" if classes else "")
    print(f"torch {torch.__version__}; vramlab {ROOT / 'target/release/vramlab'}; fp32, {classes}, SGD with momentum")
    print()
    print("| model, batch @ resolution | kept: lean | plain | PyTorch | lean / PyTorch | peak: lean | plain | PyTorch (RSS) | lean / PyTorch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    measured = []
    for model, batch, res in rows:
        lean, plain = (vramlab_measure(model, batch, res, layers) for layers in ("lean", "plain"))
        kept, peak = torch_kept(model, batch, res), torch_peak(model, batch, res)
        measured.append({
            "model": model, "batch": batch, "res": res, "classes": classes_of(model),
            "kept_by_forward": {"lean": lean["measured_kept_by_forward"], "plain": plain["measured_kept_by_forward"], "pytorch": kept},
            "peak": {"lean": lean["measured_peak"], "plain": plain["measured_peak"], "pytorch_rss": peak},
        })
        print(
            f"| {model} b{batch}@{res} | {lean['measured_kept_by_forward'] / MIB:.1f} MiB | {plain['measured_kept_by_forward'] / MIB:.1f} MiB"
            f" | {kept / MIB:.1f} MiB | {lean['measured_kept_by_forward'] / kept:.2f}x"
            f" | {lean['measured_peak'] / MIB:.1f} MiB | {plain['measured_peak'] / MIB:.1f} MiB | {peak / MIB:.1f} MiB"
            f" | {lean['measured_peak'] / peak:.2f}x |"
        )
    if record:
        write_record(measured, torch.__version__)
    return 0


RECORD = ROOT / "benchmarks" / "pytorch-saved.json"


def write_record(measured: list[dict], torch_version: str) -> None:
    """Adds the rows to the record, each replacing one of the same model, batch and resolution."""
    import datetime
    import platform

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = next((line.split(":", 1)[1].strip() for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.machine())
    rows = json.loads(RECORD.read_text())["rows"] if RECORD.exists() else []
    for row in measured:
        row.update(date=when, torch=torch_version, threads=2, cpu=cpu, optimizer="SGD with momentum", dtype="f32")
        rows = [r for r in rows if (r["model"], r["batch"], r["res"]) != (row["model"], row["batch"], row["res"])] + [row]
    rows.sort(key=lambda r: (r["model"], r["batch"], r["res"]))
    RECORD.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"\nrecorded {len(measured)} row{'' if len(measured) == 1 else 's'} in {RECORD.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
