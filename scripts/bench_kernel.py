"""Kernel latency benchmarks, vramlab against peer kernels in the same run.

For each kernelspec given: start to kernel_info_reply; the first cell sent at
once after the start (`1 + 1`, and in another kernel one that defines a
variable), and `1 + 1` sent 3 s after the start; warm `1 + 1` round trip (p50 of
20); where the kernel has them, magic round trips; and restart-then-first-candle-
cell, for a cell that shows a value and for one that also defines a variable;
then warm `1 + 1` on all kernels in turn (interleaved, so that the machine's
load falls on each alike). Records the one-minute load average before each
kernel's part. Prints JSON.

    .venv/bin/python scripts/bench_kernel.py vramlab evcxr
    .venv/bin/python scripts/bench_kernel.py --only-magics vramlab python3
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

from jupyter_client.manager import KernelManager

CANDLE_CELL = {
    # Everything compiled before the restart: the library is in the kernel's build cache.
    "vramlab": (
        "use vramlab::candle::{DType, Device, Tensor};\n"
        "Tensor::ones((64, 64), DType::F32, &Device::Cpu).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()"
    ),
    # evcxr_jupyter's build directory is temporary: after a restart it rebuilds candle.
    "evcxr": (
        ':dep candle-core = "=0.11.1"\n'
        "use candle_core::{DType, Device, Tensor};\n"
        "Tensor::ones((64, 64), DType::F32, &Device::Cpu).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()"
    ),
}
# The same cell keeping the tensor: the kernel must infer its type (rust-analyzer, in both).
CANDLE_LET_CELL = {
    name: cell.replace("Tensor::ones(", "let kept = Tensor::ones(").replace(
        ".unwrap().sum_all()", ".unwrap();\nkept.sum_all()"
    )
    for name, cell in CANDLE_CELL.items()
}
MAGIC_CELLS = {
    "vramlab": {
        "lsmagic": "%lsmagic",
        "oomcheck": "%oomcheck resnet50 --batch 32 --res 224 --gpu rtx4060-laptop",
        # Read from the cell process's shared counters; nothing is compiled.
        "mem": "%mem",
    }
}


def execute(client, code: str, timeout: float = 1800) -> float:
    started = time.perf_counter()
    reply = client.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
    elapsed = time.perf_counter() - started
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"{code!r} failed: {reply['content'].get('evalue')}")
    return elapsed


def start(name: str) -> tuple[KernelManager, object, float]:
    manager = KernelManager(kernel_name=name)
    started = time.perf_counter()
    # evcxr_jupyter writes its start-up lines on stdout, which is this script's JSON.
    manager.start_kernel(stdout=subprocess.DEVNULL)
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=120)
    return manager, client, time.perf_counter() - started


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


def bench_magics(name: str, repeats: int) -> dict:
    """Warm `1 + 1` and the kernel's magics, on one started kernel."""
    result: dict = {"kernel": name}
    manager, client, _ = start(name)
    try:
        execute(client, "1 + 1")
        for label, cell in [("1_plus_1", "1 + 1"), *MAGIC_CELLS.get(name, {}).items()]:
            samples = [execute(client, cell) for _ in range(repeats)]
            result[f"{label}_round_trip_s"] = {"p50": p50(samples), "min": min(samples), "max": max(samples)}
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return result


def first_cell(name: str, code: str, after_s: float = 0.0) -> float:
    manager, client, _ = start(name)
    try:
        time.sleep(after_s)
        return execute(client, code)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def restart_then(manager, client, code: str) -> tuple[object, float]:
    client.stop_channels()
    started = time.perf_counter()
    manager.restart_kernel(now=True)
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=120)
    execute(client, code)
    return client, time.perf_counter() - started


def bench(name: str, starts: int, repeats: int) -> dict:
    result: dict = {"kernel": name, "load_average_1min_before": os.getloadavg()[0]}
    start_times = []
    for _ in range(starts):
        manager, client, seconds = start(name)
        start_times.append(seconds)
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    result["start_to_kernel_info_s"] = {"p50": p50(start_times), "samples": start_times}

    result["first_let_cell_s"] = first_cell(name, "let x = 1;")
    result["first_cell_3s_after_start_s"] = first_cell(name, "1 + 1", after_s=3.0)
    manager, client, _ = start(name)
    try:
        result["first_cell_s"] = execute(client, "1 + 1")
        samples = [execute(client, "1 + 1") for _ in range(repeats)]
        result["warm_1_plus_1_s"] = {"p50": p50(samples), "min": min(samples), "max": max(samples)}
        for magic, cell in MAGIC_CELLS.get(name, {}).items():
            samples = [execute(client, cell) for _ in range(repeats)]
            result[f"{magic}_round_trip_s"] = {"p50": p50(samples), "min": min(samples), "max": max(samples)}
        if name in CANDLE_CELL:
            result["candle_cell_before_restart_s"] = execute(client, CANDLE_CELL[name])
            client, result["restart_to_first_candle_cell_s"] = restart_then(manager, client, CANDLE_CELL[name])
            client, result["restart_to_first_candle_let_cell_s"] = restart_then(manager, client, CANDLE_LET_CELL[name])
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return result


def interleaved_warm(names: list[str], repeats: int) -> dict:
    """`1 + 1` on each kernel in turn, so that load on the machine hits all alike."""
    kernels = {name: start(name) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    try:
        for _, client, _ in kernels.values():
            execute(client, "1 + 1")
            execute(client, "1 + 1")
        for _ in range(repeats):
            for name, (_, client, _) in kernels.items():
                samples[name].append(execute(client, "1 + 1"))
    finally:
        for manager, client, _ in kernels.values():
            client.stop_channels()
            manager.shutdown_kernel(now=True)
    return {name: {"p50": p50(s), "min": min(s), "max": max(s), "repeats": len(s)} for name, s in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernels", nargs="+")
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only-interleaved", action="store_true", help="only the interleaved warm `1 + 1` comparison")
    parser.add_argument("--only-magics", action="store_true", help="only warm `1 + 1` and magic round trips, one kernel at a time")
    args = parser.parse_args()
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": {
            "cpu": subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True).stdout.strip(),
            "cores": subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
            "python": platform.python_version(),
        },
        "results": [],
    }
    if args.only_magics:
        report["results"] = [bench_magics(name, args.repeats) for name in args.kernels]
        print(json.dumps(report, indent=2))
        return 0
    if not args.only_interleaved:
        for name in args.kernels:
            print(f"benchmarking {name}...", file=sys.stderr)
            report["results"].append(bench(name, args.starts, args.repeats))
    if len(args.kernels) > 1:
        print("interleaved warm 1 + 1...", file=sys.stderr)
        report["interleaved_warm_1_plus_1_s"] = interleaved_warm(args.kernels, args.repeats)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
