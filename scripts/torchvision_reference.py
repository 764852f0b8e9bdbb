"""torchvision's logits and gradients on weights both sides can build, for
`lib/tests/torchvision.rs` to hold our networks to.

For each model (ResNet-18, ResNet-50, EfficientNet-B0, and ViT-Tiny/16 as
torchvision's `VisionTransformer` at 192 features, 12 layers of 3 heads and
an MLP of 768; and `unet`, the U-Net of `scripts/unet_twin.py`, 2 classes per
pixel) torchvision's network
gets a deterministic state dict: every entry filled from its name by an
integer hash (exact in numpy and in Rust, no libm), scaled by what the entry
is (a convolution's or linear layer's weight by sqrt(3 / fan_in), batch-norm's
weight near 1, its running variance in [1, 1.5]). The input batch is filled the
same way. Recorded, in `lib/tests/fixtures/torchvision/MODEL.json`:
- every state-dict entry's name, shape and sum (the test checks that it built
  the same weights);
- the logits in evaluation mode (running statistics), then, in training mode,
  the logits, the mean cross-entropy against fixed labels, and every
  parameter's gradient: its norm and 32 values at an even stride.
Stochastic depth and dropout are set to 0 (our networks have neither), so the
training step is deterministic.

The U-Net's logits are N x 2 x H x W and its labels N x H x W, given by a rule
(`labels_rule` in the JSON; `labels` holds them too, flat in (n, i, j) order,
the order of the logits permuted to N x H x W x classes and flattened to rows).
Its loss is the mean cross-entropy over every pixel. All its logits would make
a file of megabytes, so each sample's row holds every `logits_stride`-th of its
classes x H x W logits (the stride is odd, so every column and row of the map
is sampled), and `eval_logits_norms` / `train_logits_norms` hold each sample's
norm over all of them.

    python3 scripts/torchvision_reference.py [MODEL ...]

writes every model's file, or only those named (resnet18, resnet50,
efficientnet_b0, vit_tiny, unet).

Runs in the PyTorch venv of the benchmarks ($VRAMLAB_BENCH_VENV, default
.venv-bench, created from scripts/bench-requirements.txt when missing).
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "lib" / "tests" / "fixtures" / "torchvision"
MODELS = [("resnet18", 4, 64), ("resnet50", 4, 64), ("efficientnet_b0", 4, 64), ("vit_tiny", 4, 64), ("unet", 4, 64)]
CLASSES = {"unet": 2}
DEFAULT_CLASSES = 1000
SAMPLES = 32
LABELS_RULE = "labels[n, i, j] = (n + i // 4 + j // 4) % 2"
# Odd, so that it is coprime to the map's power-of-two width and its samples reach every column.
LOGITS_STRIDE = 13
WEIGHT_SCALE = (
    "a weight of 2 or more dimensions: u * sqrt(3 / fan_in), fan_in = shape[1] * prod(shape[2:]), as PyTorch's "
    "_calculate_fan_in_and_fan_out computes it; for a ConvTranspose2d weight (in x out x k x k) that is out * k * k"
)


def in_bench_venv() -> None:
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401
        return
    except ImportError:
        pass
    venv = pathlib.Path(os.environ.get("VRAMLAB_BENCH_VENV", ROOT / ".venv-bench"))
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(ROOT / "scripts/bench-requirements.txt")], check=True)
    os.execv(str(python), [str(python), os.path.abspath(sys.argv[0]), *sys.argv[1:]])


def fnv1a(name: str) -> int:
    h = 0x811C9DC5
    for byte in name.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def pattern(name: str, count: int):
    """`count` values in [-1, 1) from `name`, as `lib/tests/torchvision.rs` computes them."""
    import numpy as np

    mask = np.uint64(0xFFFFFFFF)
    h = (np.arange(count, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(fnv1a(name))) & mask
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x045D9F3B)) & mask
    h ^= h >> np.uint64(16)
    return h.astype(np.float64) / 4294967296.0 * 2.0 - 1.0


def entry(name: str, shape: tuple[int, ...]):
    import numpy as np

    count = int(np.prod(shape, dtype=np.int64))
    u = pattern(name, count)
    if name.endswith("num_batches_tracked"):
        return np.zeros(shape, dtype=np.int64)
    if name.endswith("running_var"):
        values = 1.0 + 0.25 * (u + 1.0)
    elif name.endswith("running_mean"):
        values = 0.1 * u
    elif len(shape) >= 2:
        values = u * np.sqrt(3.0 / fan_in(shape))
    elif name.endswith("weight"):
        values = 1.0 + 0.2 * u
    else:
        values = 0.1 * u
    return values.astype(np.float32).reshape(shape)


def fan_in(shape: tuple[int, ...]) -> int:
    """A weight's fan-in as PyTorch's `_calculate_fan_in_and_fan_out` computes
    it, `shape[1]` times the kernel's size, and as `lib/tests/torchvision.rs`
    does (the product of `shape[1..]`). A ConvTranspose2d weight is laid out
    in x out x k x k, so its fan-in is out * k * k: PyTorch's reading of that
    layout, not the number of inputs that reach one output."""
    import numpy as np

    return int(np.prod(shape[1:], dtype=np.int64))


def classes_of(model: str) -> int:
    return CLASSES.get(model, DEFAULT_CLASSES)


def pixel_labels(batch: int, res: int):
    """The U-Net's labels, N x H x W, by LABELS_RULE: 4 x 4 tiles of both
    classes in a checkerboard, shifted by one tile from each sample to the next."""
    import torch

    n = torch.arange(batch).view(batch, 1, 1)
    i = torch.arange(res).view(1, res, 1)
    j = torch.arange(res).view(1, 1, res)
    return (n + i // 4 + j // 4) % 2


def short(values):
    """f32 values at the 9 significant digits that keep them exactly."""
    if isinstance(values, list):
        return [short(v) for v in values]
    return float(f"{values:.9g}")


def run(model: str, batch: int, res: int, dtype):
    """torchvision's `model` on the filled state dict, in `dtype`: the
    evaluation logits, then the training logits, loss and gradients."""
    import torch
    import torchvision

    classes = classes_of(model)
    if model == "vit_tiny":
        net = torchvision.models.VisionTransformer(
            image_size=res, patch_size=16, num_layers=12, num_heads=3, hidden_dim=192, mlp_dim=768, num_classes=classes
        )
    elif model == "unet":
        from unet_twin import UNet

        net = UNet(classes=classes)
    else:
        net = getattr(torchvision.models, model)(num_classes=classes)
    for module in net.modules():
        if isinstance(module, (torch.nn.Dropout, torchvision.ops.StochasticDepth)):
            module.p = 0.0
    filled = {name: torch.from_numpy(entry(name, tuple(t.shape))) for name, t in net.state_dict().items()}
    net.load_state_dict(filled)
    net = net.to(dtype)
    x = torch.from_numpy(pattern("input", batch * 3 * res * res).astype("float32").reshape(batch, 3, res, res)).to(dtype)
    if model == "unet":
        labels = pixel_labels(batch, res)
    else:
        labels = torch.tensor([(i * 37) % classes for i in range(batch)])
    net.eval()
    with torch.no_grad():
        eval_logits = net(x).double()
    net.train()
    logits = net(x)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    grads = {name: p.grad.detach().reshape(-1).double() for name, p in net.named_parameters()}
    return filled, labels, eval_logits, logits.detach().double(), loss.item(), grads


def gradient_errors(found: dict, exact: dict) -> dict:
    """Each gradient's error as `lib/tests/torchvision.rs` measures it: the
    largest difference, and the difference of the norms, over the larger of
    the exact norm and a floor (a thousandth of the model's largest norm; some
    gradients are exactly zero, a batch-norm's bias before a convolution and
    another batch-norm, and only rounding noise remains of them)."""
    floor = 1e-3 * max(g.norm().item() for g in exact.values())
    errors = {}
    for name, g in exact.items():
        scale = max(g.norm().item(), floor)
        errors[name] = max((found[name] - g).abs().max().item(), abs(found[name].norm().item() - g.norm().item())) / scale
    return errors


def reference(model: str, batch: int, res: int) -> dict:
    """The exact answer (float64 throughout, on the same float32 weights and
    input) and how far torchvision's own float32 step is from it."""
    import torch
    import torchvision

    torch.set_num_threads(2)
    filled, labels, eval_logits, logits, loss, grads = run(model, batch, res, torch.float64)
    _, _, eval32, logits32, _, grads32 = run(model, batch, res, torch.float32)
    relative = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    torch_errors = gradient_errors(grads32, grads)
    floor = 1e-3 * max(g.norm().item() for g in grads.values())
    record = {
        "model": model,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "batch": batch,
        "res": res,
        "classes": classes_of(model),
        "labels": labels.reshape(-1).tolist(),
        "state_dict": [
            {"name": name, "shape": list(t.shape), "sum": t.double().sum().item()} for name, t in filled.items()
        ],
        "eval_logits": short(eval_logits.tolist()),
        "train_logits": short(logits.tolist()),
        "loss": loss,
        "gradient_floor": short(floor),
        "torch_f32": {
            "logits_error": short(max(relative(eval32, eval_logits), relative(logits32, logits))),
            "worst_gradient_error": short(max(torch_errors.values())),
            "worst_gradient": max(torch_errors, key=torch_errors.get),
        },
        "grads": [
            {
                "name": name,
                "norm": short(g.norm().item()),
                "stride": max(1, g.numel() // SAMPLES),
                "samples": short(g[:: max(1, g.numel() // SAMPLES)][:SAMPLES].tolist()),
            }
            for name, g in grads.items()
        ],
    }
    if model == "unet":
        rows = lambda t: t.reshape(batch, -1)  # noqa: E731
        record.update(
            labels_rule=LABELS_RULE,
            labels_shape=list(labels.shape),
            weight_scale=WEIGHT_SCALE,
            logits_shape=list(logits.shape),
            logits_stride=LOGITS_STRIDE,
            eval_logits=short(rows(eval_logits)[:, ::LOGITS_STRIDE].tolist()),
            train_logits=short(rows(logits)[:, ::LOGITS_STRIDE].tolist()),
            eval_logits_norms=short(rows(eval_logits).norm(dim=1).tolist()),
            train_logits_norms=short(rows(logits).norm(dim=1).tolist()),
        )
    return record


def main() -> None:
    in_bench_venv()
    OUT.mkdir(parents=True, exist_ok=True)
    known = [model for model, _, _ in MODELS]
    unknown = [name for name in sys.argv[1:] if name not in known]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(known)}")
    for model, batch, res in MODELS:
        if sys.argv[1:] and model not in sys.argv[1:]:
            continue
        record = reference(model, batch, res)
        path = OUT / f"{model}.json"
        path.write_text(json.dumps(record, separators=(",", ":")) + "\n")
        f32 = record["torch_f32"]
        print(
            f"{path.relative_to(ROOT)}: {model} b{batch}@{res}, loss {record['loss']:.6f}; torch float32 against float64: "
            f"logits {f32['logits_error']:.1e}, worst gradient {f32['worst_gradient_error']:.1e} ({f32['worst_gradient']})"
        )


if __name__ == "__main__":
    main()
