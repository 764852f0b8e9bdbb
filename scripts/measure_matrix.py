"""Predicted against measured memory for a matrix of training configurations.

Runs `vramlab measure ... --json` (real training steps on the CPU, every
allocation counted) for each configuration and prints a Markdown table of the
predicted and measured peaks and bills, with the differences in percent.

    python3 scripts/measure_matrix.py [--out target/measure_matrix.json]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# model, batch, resolution, extra flags: models x batch x f32/f16 x checkpointing x optimizer.
MATRIX = [
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
BILLS = ["parameters", "optimizer_state", "activations", "input_batch", "context_and_workspace"]


def binary() -> pathlib.Path:
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / "vramlab"


def measure(model: str, batch: int, res: int, extra: list[str]) -> dict:
    args = [str(binary()), "measure", "--model", model, "--batch", str(batch), "--res", str(res), "--json", *extra]
    return json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)


def pct(predicted: int, measured: int) -> float:
    return (measured - predicted) / predicted * 100 if predicted else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "target" / "measure_matrix.json")
    args = parser.parse_args()
    rows = []
    print("| configuration | peak predicted | peak measured | peak | " + " | ".join(BILLS) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(BILLS))
    for model, batch, res, extra in MATRIX:
        result = measure(model, batch, res, extra)
        label = f"{model} b{batch}@{res} {' '.join(extra) or 'f32 sgd-momentum'}"
        cells = []
        for bill in BILLS:
            p, m = result["predicted"][bill], result["measured"][bill]
            cells.append(f"{p / 2**20:.1f} / {m / 2**20:.1f} MiB ({pct(p, m):+.1f}%)" if p else f"0 / {m / 2**20:.1f} MiB")
        peak = pct(result["predicted_peak"], result["measured_peak"])
        print(f"| {label} | {result['predicted_peak'] / 2**20:.1f} MiB | {result['measured_peak'] / 2**20:.1f} MiB | "
              f"{peak:+.1f}% | " + " | ".join(cells) + " |", flush=True)
        rows.append({"config": label, **result})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
