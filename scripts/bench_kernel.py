"""Kernel latency benchmarks, vramlab against peer kernels in the same run.

For each kernelspec given: start to kernel_info_reply; the first cell sent at
once after the start (`1 + 1`, and in another kernel one that defines a
variable), and `1 + 1` sent 3 s after the start; warm `1 + 1` round trip (p50 of
20); where the kernel has them, magic round trips; and restart-then-first-candle-
cell, for a cell that shows a value and for one that also defines a variable;
then warm `1 + 1` on all kernels in turn (interleaved, so that the machine's
load falls on each alike). Records the one-minute load average before each
kernel's part. Prints JSON.

The warm cell (`--only-warm`, and part of the full run): `1 + 1` (p50 of 20) in
a new kernel, and in a kernel where the library has been used (for vramlab
`use vramlab::units::human;` then `let x = human(1024);`, as a notebook's first
cells do), then, in that kernel, a cell naming a kept variable (`x`) and one
calling the library (`human(5)`). Each kernel waits 10 s after its first cell,
so that rust-analyzer's first load (about 4 s on 2 cores) does not fall on the
samples.
With `:timing` on, where the kernel prints evcxr's phases, a breakdown of the
same warm `1 + 1`: each phase's p50, evcxr's whole evaluation, and the rest of
the round trip (the kernel's own steps and the messages), each the p50 of the
per-cell values.

    .venv/bin/python scripts/bench_kernel.py vramlab evcxr
    .venv/bin/python scripts/bench_kernel.py --only-magics vramlab python3
    .venv/bin/python scripts/bench_kernel.py --only-warm vramlab
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
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
# Cells that use the library, run before the warm cells "after the library was used". evcxr_jupyter
# has no library of its own: candle by `:dep` (its first build takes minutes).
LIBRARY_CELLS = {
    "vramlab": ["use vramlab::units::human;", "let x = human(1024);"],
    "evcxr": [':dep candle-core = "=0.11.1"', "use candle_core::Device;", 'let x = format!("{:?}", Device::Cpu);'],
}
# In the kernel where the library was used: a cell naming the kept variable, and one calling the library.
NAMING_CELLS = {
    "vramlab": {"names_a_variable": "x.len()", "calls_the_library": "human(5)"},
    "evcxr": {"names_a_variable": "x.len()", "calls_the_library": "Device::Cpu.is_cpu()"},
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
    return execute_collecting(client, code, timeout)[0]


def execute_collecting(client, code: str, timeout: float = 1800) -> tuple[float, str]:
    """The round trip, request to execute_reply, and what the cell printed on stdout."""
    printed: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream" and msg["content"].get("name") == "stdout":
            printed.append(msg["content"]["text"])

    started = time.perf_counter()
    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    elapsed = time.perf_counter() - started
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"{code!r} failed: {reply['content'].get('evalue')}")
    return elapsed, "".join(printed)


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


def summary(samples: list[float]) -> dict:
    return {"p50": p50(samples), "min": min(samples), "max": max(samples), "repeats": len(samples)}


TOOK = re.compile(r"Took (\d+) ms: (.*)")
PHASE = re.compile(r"(.+) (\d+) ms$")


def phases_of(printed: str) -> dict[str, float] | None:
    """evcxr's `:timing` line, `Took 91 ms: Code generation 0 ms, Final compile (rustc) 90 ms, ...`,
    in seconds (a phase met twice, summed); None when the cell printed none."""
    match = TOOK.search(printed)
    if not match:
        return None
    phases = {"evcxr_total": int(match.group(1)) / 1e3}
    for part in match.group(2).strip().split(", "):
        if found := PHASE.match(part.strip()):
            phases[found.group(1)] = phases.get(found.group(1), 0.0) + int(found.group(2)) / 1e3
    return phases


def warm_breakdown(client, repeats: int) -> dict | None:
    """Warm `1 + 1` with `:timing` on: the round trip and evcxr's phases, cell by cell."""
    execute(client, ":timing")
    execute(client, "1 + 1")
    cells = []
    for _ in range(repeats):
        round_trip, printed = execute_collecting(client, "1 + 1")
        phases = phases_of(printed)
        if phases is None:
            execute(client, ":timing")
            return None
        phases["outside_evcxr"] = round_trip - phases["evcxr_total"]
        phases["round_trip"] = round_trip
        cells.append(phases)
    execute(client, ":timing")
    names = sorted({name for cell in cells for name in cell}, key=lambda n: (n in ("round_trip", "evcxr_total"), n))
    return {name: p50([cell.get(name, 0.0) for cell in cells]) for name in names} | {"repeats": len(cells)}


# rust-analyzer loads on a thread of its own after the start (about 4 s on 2 cores).
WARM_AFTER_S = 10


def by_kernel(table: dict, name: str):
    """The entry for a kernelspec named like `vramlab` or `vramlab-dev`."""
    return next((value for key, value in table.items() if name == key or name.startswith(key + "-")), None)


def bench_warm(name: str, repeats: int) -> dict:
    """Warm `1 + 1` in a new kernel and after the library was used, and where its time goes."""
    result: dict = {"kernel": name, "load_average_1min_before": os.getloadavg()[0]}
    manager, client, _ = start(name)
    try:
        execute(client, "1 + 1")
        time.sleep(WARM_AFTER_S)
        result["new_kernel_1_plus_1_s"] = summary([execute(client, "1 + 1") for _ in range(repeats)])
        result["new_kernel_breakdown_s"] = warm_breakdown(client, repeats)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    library_cells = by_kernel(LIBRARY_CELLS, name)
    if library_cells is None:
        return result
    result["load_average_1min_before_library"] = os.getloadavg()[0]
    manager, client, _ = start(name)
    try:
        execute(client, "1 + 1")
        time.sleep(WARM_AFTER_S)
        result["library_cells_s"] = {cell: execute(client, cell) for cell in library_cells}
        execute(client, "1 + 1")
        result["after_library_1_plus_1_s"] = summary([execute(client, "1 + 1") for _ in range(repeats)])
        result["after_library_breakdown_s"] = warm_breakdown(client, repeats)
        for label, cell in (by_kernel(NAMING_CELLS, name) or {}).items():
            execute(client, cell)
            result[f"after_library_{label}_s"] = {"cell": cell} | summary([execute(client, cell) for _ in range(repeats)])
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    result["load_average_1min_after"] = os.getloadavg()[0]
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
    result["warm_cell"] = bench_warm(name, repeats)
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
    parser.add_argument("--only-warm", action="store_true", help="only the warm cell: new kernel, after the library, and its breakdown")
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
    if args.only_warm:
        for name in args.kernels:
            print(f"warm cell on {name}...", file=sys.stderr)
            report["results"].append(bench_warm(name, args.repeats))
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
