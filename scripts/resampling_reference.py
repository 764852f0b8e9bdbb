"""PyTorch's gradients of 2D max and average pooling and of nearest
upsampling, for `lib/tests/resampling.rs` to hold candle's (patched)
backward to.

Each case pools a 2 x 3 x H x W input whose values come in few levels, so
that many windows hold their maximum more than once (half of them are
zeros, as after a ReLU): max pooling's gradient then goes to one element of
each window, the first in the window's row-major order, which is the index
PyTorch records. The gradient arriving at the output is a multiple of 1/8, so
every sum is exact and the test compares values exactly. A case with
`padding` is pooled by PyTorch with that padding (implicit -inf for max
pooling) and by candle after `pad_with_same` by as much, which gives the same
maxima and the same first maximum. Nearest upsampling (PyTorch's
`interpolate(mode="nearest")`, candle's `upsample_nearest2d`) resizes by
factors that are not integers, down as well as up (DINOv2 fits its 37 x 37
position embeddings to a 224-pixel input's 16 x 16 patches), and by an integer
one. Written to `lib/tests/fixtures/resampling.json`.

    python3 scripts/resampling_reference.py

Runs in the PyTorch venv of the benchmarks ($VRAMLAB_BENCH_VENV, default
.venv-bench, created from scripts/bench-requirements.txt when missing).
"""
from __future__ import annotations

import json
import pathlib

from torchvision_reference import in_bench_venv

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "lib" / "tests" / "fixtures" / "resampling.json"

# (name, H, W, kernel, stride, padding, modes)
CASES = [
    ("resnet stem: 3x3 stride 2, padding 1", 12, 10, (3, 3), (2, 2), (1, 1), ["max"]),
    ("3x3 stride 2", 9, 11, (3, 3), (2, 2), (0, 0), ["max", "avg"]),
    ("2x2 stride 2, sizes that divide", 8, 8, (2, 2), (2, 2), (0, 0), ["max", "avg"]),
    ("2x2 stride 2, odd sizes (the last row and column read by no window)", 9, 7, (2, 2), (2, 2), (0, 0), ["max", "avg"]),
    ("3x3 stride 1", 7, 8, (3, 3), (1, 1), (0, 0), ["max", "avg"]),
    ("2x2 stride 3 (gaps between windows)", 11, 10, (2, 2), (3, 3), (0, 0), ["max", "avg"]),
    ("3x2 window, stride 2x1", 9, 8, (3, 2), (2, 1), (0, 0), ["max", "avg"]),
    ("1x1 window, stride 2", 7, 6, (1, 1), (2, 2), (0, 0), ["max", "avg"]),
]
# (name, H, W, target H, target W)
UPSAMPLING = [
    ("37x37 to 16x16 (DINOv2's position embeddings at 224 pixels)", 37, 37, 16, 16),
    ("5x7 to 8x10", 5, 7, 8, 10),
    ("4x4 to 8x8 (an integer factor)", 4, 4, 8, 8),
    ("4x6 to 8x18 (integer factors that differ)", 4, 6, 8, 18),
]
BATCH, CHANNELS = 2, 3


def levels(count: int) -> list[float]:
    """Values in {0, 0.5, 1, 1.5, 2}, half of them 0 (as after a ReLU): few
    levels from a multiplicative hash, so that windows tie."""
    values = []
    for i in range(count):
        h = (i * 2654435761 + 12345) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x045D9F3B) & 0xFFFFFFFF
        h ^= h >> 16
        values.append(max(0, (h >> 29) - 3) * 0.5)
    return values


def arriving(count: int) -> list[float]:
    """The gradient at the output: multiples of 1/8, so that sums are exact."""
    return [((i * 31 + 5) % 17 - 8) / 8 for i in range(count)]


def case(name, h, w, kernel, stride, padding, mode) -> dict:
    import torch

    x = torch.tensor(levels(BATCH * CHANNELS * h * w), dtype=torch.float64).reshape(BATCH, CHANNELS, h, w)
    x.requires_grad_(True)
    if mode == "max":
        y = torch.nn.functional.max_pool2d(x, kernel, stride, padding)
    else:
        y = torch.nn.functional.avg_pool2d(x, kernel, stride, padding)
    grad = torch.tensor(arriving(y.numel()), dtype=torch.float64).reshape(y.shape)
    y.backward(grad)
    return {
        "name": name,
        "mode": mode,
        "input_shape": [BATCH, CHANNELS, h, w],
        "kernel": list(kernel),
        "stride": list(stride),
        "padding": list(padding),
        "input": x.detach().reshape(-1).tolist(),
        "output_shape": list(y.shape),
        "output": y.detach().reshape(-1).tolist(),
        "grad_output": grad.reshape(-1).tolist(),
        "grad_input": x.grad.reshape(-1).tolist(),
    }


def upsampling(name, h, w, target_h, target_w) -> dict:
    import torch

    x = torch.tensor(levels(BATCH * CHANNELS * h * w), dtype=torch.float64).reshape(BATCH, CHANNELS, h, w)
    x.requires_grad_(True)
    y = torch.nn.functional.interpolate(x, size=(target_h, target_w), mode="nearest")
    grad = torch.tensor(arriving(y.numel()), dtype=torch.float64).reshape(y.shape)
    y.backward(grad)
    return {
        "name": name,
        "input_shape": [BATCH, CHANNELS, h, w],
        "target": [target_h, target_w],
        "input": x.detach().reshape(-1).tolist(),
        "output": y.detach().reshape(-1).tolist(),
        "grad_output": grad.reshape(-1).tolist(),
        "grad_input": x.grad.reshape(-1).tolist(),
    }


def main() -> None:
    in_bench_venv()
    import torch

    cases = [case(*spec[:6], mode) for spec in CASES for mode in spec[6]]
    upsampled = [upsampling(*spec) for spec in UPSAMPLING]
    OUT.write_text(json.dumps({"torch": torch.__version__, "cases": cases, "upsampling": upsampled}) + "\n")
    print(f"{OUT.relative_to(ROOT)}: {len(cases)} pooling cases, {len(upsampled)} upsampling cases")


if __name__ == "__main__":
    main()
