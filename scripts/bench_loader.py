"""Data loader throughput: vramlab's loader against torchvision's DataLoader
with PIL, on the same files, in the same run.

Pipeline on both sides: decode, resize to RES x RES, random horizontal flip,
to tensor, normalise (ImageNet), batches of 32, one pass in file order, for
each worker count, on the synthetic leaf-disease set at its original sizes
and pre-resized to short side 512. The two loaders alternate so that the
machine's load falls on each alike. Also decode MB/s on one core for PIL,
and the one-minute load average sampled before each pair of passes.

Creates its own venv (torch, torchvision, pillow from
scripts/bench-requirements.txt) at $BENCH_VENV (default .venv-bench); point
BENCH_VENV at an existing one to reuse it. The vramlab binary is
$VRAMLAB_BIN, else $CARGO_TARGET_DIR/release/vramlab, else target/release/vramlab.

    python3 scripts/bench_loader.py --images 1000 --workers 0 1 2 --json bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def ensure_venv() -> None:
    venv = Path(os.environ.get("BENCH_VENV", REPO / ".venv-bench")).resolve()
    python = venv / "bin" / "python"
    if Path(sys.prefix).resolve() == venv:
        return
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(REPO / "scripts" / "bench-requirements.txt")], check=True)
    os.execv(str(python), [str(python), *sys.argv])


def vramlab_bin() -> str:
    if os.environ.get("VRAMLAB_BIN"):
        return os.environ["VRAMLAB_BIN"]
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return str(target / "release" / "vramlab")


def run_vramlab(*args: str) -> dict:
    out = subprocess.run([vramlab_bin(), *args, "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def torchvision_pass(root: Path, batch: int, res: int, workers: int) -> dict:
    import torch
    from torchvision import datasets, transforms

    transform = transforms.Compose([
        transforms.Resize((res, res)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
    ])
    dataset = datasets.ImageFolder(str(root), transform=transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=False, num_workers=workers)
    started = time.perf_counter()
    images = 0
    for x, _ in loader:
        images += x.shape[0]
    seconds = time.perf_counter() - started
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds}


def pil_decode_mb_per_s(root: Path, limit: int = 200) -> float:
    from PIL import Image

    files = sorted(p for p in root.rglob("*.jpg"))[:: max(1, len(list(root.rglob("*.jpg"))) // limit)][:limit]
    total_bytes, seconds = 0, 0.0
    for path in files:
        data = path.read_bytes()
        started = time.perf_counter()
        import io

        Image.open(io.BytesIO(data)).convert("RGB")
        seconds += time.perf_counter() - started
        total_bytes += len(data)
    return total_bytes / 1e6 / seconds


def summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "samples": len(values)}


def load_average() -> float | None:
    """The one-minute load average, or None where /proc/loadavg is missing."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ensure_venv()
    import torch
    import torchvision
    import PIL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--res", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=1, help="passes per configuration; the median counts")
    parser.add_argument("--data", type=Path, default=Path("/tmp/vramlab-bench-loader"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    # One thread for torch's own ops in the main process: each side gets the cores its workers ask for.
    torch.set_num_threads(1)
    original, resized = args.data / f"original-{args.images}-{args.seed}", args.data / f"resized-{args.images}-{args.seed}"
    if not (original / "manifest.csv").exists():
        run_vramlab("synth", "--out", str(original), "--images", str(args.images), "--seed", str(args.seed))
    if not (resized / "manifest.csv").exists():
        run_vramlab("preprocess", "--src", str(original), "--out", str(resized), "--short-side", "512")

    rows, loads = [], []
    for name, root in (("original", original), ("short side 512", resized)):
        for workers in args.workers:
            ours, theirs = [], []
            for _ in range(args.repeat):
                loads.append(load_average())
                ours.append(run_vramlab("bench", "loader", "--root", str(root), "--batch", str(args.batch), "--res", str(args.res), "--workers", str(workers)))
                theirs.append(torchvision_pass(root, args.batch, args.res, workers))
            best = lambda runs: statistics.median(r["images_per_s"] for r in runs)
            row = {
                "dataset": name,
                "workers": workers,
                "vramlab_images_per_s": best(ours),
                "torchvision_images_per_s": best(theirs),
                "vramlab_decode_mb_per_s_per_core": statistics.median(r["decode_mb_per_s_per_core"] for r in ours),
                "images": ours[0]["images"],
            }
            row["ratio"] = row["vramlab_images_per_s"] / row["torchvision_images_per_s"]
            rows.append(row)
            print(f"{name:>15} workers={workers}: vramlab {row['vramlab_images_per_s']:.1f} img/s, "
                  f"torchvision {row['torchvision_images_per_s']:.1f} img/s, x{row['ratio']:.2f}", file=sys.stderr)

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "torchvision": torchvision.__version__, "pillow": PIL.__version__},
        "images": args.images,
        "batch": args.batch,
        "res": args.res,
        "pil_decode_mb_per_s_per_core": {"original": pil_decode_mb_per_s(original), "short side 512": pil_decode_mb_per_s(resized)},
        "rows": rows,
        "load_average_1min": summary([l for l in loads if l is not None]),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
