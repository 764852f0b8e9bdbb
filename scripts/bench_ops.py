"""Convolution and pooling ops: vramlab against candle and PyTorch, in one run.

Runs `cargo bench -p vramlab --bench ops` (ours and candle's builtin ops), then
the same cases in PyTorch with the same number of threads, and prints JSON with
the ratios ours / torch and ours / candle. Times are medians after a warm-up.

PyTorch comes from a venv built from scripts/bench-requirements.txt at
$VRAMLAB_BENCH_VENV (default .venv-bench), created on first use:

    python3 scripts/bench_ops.py [--repeats N] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import venv

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (name, batch, channels, out_channels, size, kernel, stride, padding, groups): as in lib/benches/ops.rs
CONVS = [
    ("conv3x3_64_64_32x32_b32", 32, 64, 64, 32, 3, 1, 1, 1),
    ("conv7x7s2_3_64_224x224_b8", 8, 3, 64, 224, 7, 2, 3, 1),
    ("conv3x3_256_256_4x4_b32", 32, 256, 256, 4, 3, 1, 1, 1),
    ("conv3x3_512_512_2x2_b32", 32, 512, 512, 2, 3, 1, 1, 1),
    ("dwconv3x3_96_56x56_b8", 8, 96, 96, 56, 3, 1, 1, 96),
    ("conv3x3_64_64_56x56_b8", 8, 64, 64, 56, 3, 1, 1, 1),
    ("conv3x3_128_128_28x28_b8", 8, 128, 128, 28, 3, 1, 1, 1),
    ("conv3x3_256_256_14x14_b8", 8, 256, 256, 14, 3, 1, 1, 1),
    ("conv3x3_512_512_7x7_b8", 8, 512, 512, 7, 3, 1, 1, 1),
    ("conv3x3_64_64_16x16_b32", 32, 64, 64, 16, 3, 1, 1, 1),
    ("conv3x3_128_128_8x8_b32", 32, 128, 128, 8, 3, 1, 1, 1),
    ("conv3x3_16_16_64x64_b16", 16, 16, 16, 64, 3, 1, 1, 1),
    ("conv3x3_32_32_32x32_b16", 16, 32, 32, 32, 3, 1, 1, 1),
    ("conv3x3_64_64_16x16_b16", 16, 64, 64, 16, 3, 1, 1, 1),
    ("conv3x3_128_128_8x8_b16", 16, 128, 128, 8, 3, 1, 1, 1),
]

TORCH_SIDE = r"""
import json, statistics, sys, time
import torch
threads, repeats, convs = json.loads(sys.argv[1])
torch.set_num_threads(threads)

def timed(f):
    f()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        f()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)

def fwd_and_bwd(x, w, op):
    def forward():
        with torch.no_grad():
            op(x, w)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    def train():
        xg.grad = None
        wg.grad = None
        op(xg, wg).sum().backward()
    return {"fwd_s": timed(forward), "fwd_bwd_s": timed(train)}

report = {}
for name, n, c, o, size, k, s, p, g in convs:
    x = torch.randn(n, c, size, size)
    w = torch.randn(o, c // g, k, k)
    conv = lambda x, w: torch.nn.functional.conv2d(x, w, stride=s, padding=p, groups=g)
    report[name + "_f32"] = fwd_and_bwd(x, w, conv)
x = torch.randn(32, 64, 32, 32)
def pool_train():
    xg.grad = None
    torch.nn.functional.max_pool2d(xg, 3, 2, 1).sum().backward()
xg = x.clone().requires_grad_()
def pool_forward():
    with torch.no_grad():
        torch.nn.functional.max_pool2d(x, 3, 2, 1)
report["maxpool3x3s2_64_32x32_b32_f32"] = {"fwd_s": timed(pool_forward), "fwd_bwd_s": timed(pool_train)}
report["torch_version"] = torch.__version__
report["threads"] = torch.get_num_threads()
print(json.dumps(report))
"""


def bench_python() -> pathlib.Path:
    env_dir = pathlib.Path(os.environ.get("VRAMLAB_BENCH_VENV", ROOT / ".venv-bench"))
    python = env_dir / "bin" / "python"
    if not python.exists():
        venv.create(env_dir, with_pip=True)
        requirements = ROOT / "scripts" / "bench-requirements.txt"
        subprocess.run([python, "-m", "pip", "install", "-q", "-r", requirements], check=True)
    return python


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    ours = subprocess.run(
        ["cargo", "bench", "-q", "-p", "vramlab", "--bench", "ops", "--", "--repeats", str(args.repeats)],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    )
    rust = json.loads(ours.stdout)
    torch_out = subprocess.run(
        [bench_python(), "-c", TORCH_SIDE, json.dumps([args.threads, args.repeats, CONVS])],
        env=env, check=True, capture_output=True, text=True,
    )
    torch = json.loads(torch_out.stdout)

    rows = {}
    for case, peers in rust.items():
        if not isinstance(peers, dict):
            continue
        row = {"ours": peers["ours"], "candle": peers["candle"], "torch": torch.get(case)}
        for phase in ("fwd_s", "fwd_bwd_s"):
            mine = peers["ours"].get(phase)
            row[f"{phase[:-2]}_ours_over_candle"] = ratio(mine, peers["candle"].get(phase))
            row[f"{phase[:-2]}_ours_over_torch"] = ratio(mine, (torch.get(case) or {}).get(phase))
        rows[case] = row
    print(json.dumps({
        "threads": {"ours": rust["threads"], "torch": torch["threads"]},
        "repeats": args.repeats,
        "torch_version": torch["torch_version"],
        "python": sys.version.split()[0],
        "cases": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
