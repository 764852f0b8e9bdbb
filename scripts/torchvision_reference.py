"""torchvision's logits and gradients on weights both sides can build, for
`lib/tests/torchvision.rs` to hold our networks to.

For each model (ResNet-18, ResNet-50, EfficientNet-B0, and ViT-Tiny/16 as
torchvision's `VisionTransformer` at 192 features, 12 layers of 3 heads and
an MLP of 768) torchvision's network
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

    python3 scripts/torchvision_reference.py

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
MODELS = [("resnet18", 4, 64), ("resnet50", 4, 64), ("efficientnet_b0", 4, 64), ("vit_tiny", 4, 64)]
CLASSES = 1000
SAMPLES = 32


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
    os.execv(str(python), [str(python), __file__, *sys.argv[1:]])


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
        fan_in = int(np.prod(shape[1:], dtype=np.int64))
        values = u * np.sqrt(3.0 / fan_in)
    elif name.endswith("weight"):
        values = 1.0 + 0.2 * u
    else:
        values = 0.1 * u
    return values.astype(np.float32).reshape(shape)


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

    if model == "vit_tiny":
        net = torchvision.models.VisionTransformer(
            image_size=res, patch_size=16, num_layers=12, num_heads=3, hidden_dim=192, mlp_dim=768, num_classes=CLASSES
        )
    else:
        net = getattr(torchvision.models, model)(num_classes=CLASSES)
    for module in net.modules():
        if isinstance(module, (torch.nn.Dropout, torchvision.ops.StochasticDepth)):
            module.p = 0.0
    filled = {name: torch.from_numpy(entry(name, tuple(t.shape))) for name, t in net.state_dict().items()}
    net.load_state_dict(filled)
    net = net.to(dtype)
    x = torch.from_numpy(pattern("input", batch * 3 * res * res).astype("float32").reshape(batch, 3, res, res)).to(dtype)
    labels = torch.tensor([(i * 37) % CLASSES for i in range(batch)])
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
    return {
        "model": model,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "batch": batch,
        "res": res,
        "classes": CLASSES,
        "labels": labels.tolist(),
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


def main() -> None:
    in_bench_venv()
    OUT.mkdir(parents=True, exist_ok=True)
    for model, batch, res in MODELS:
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
