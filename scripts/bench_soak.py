"""A long session: many small cells, half of them defining a new variable.

For each kernelspec given, starts one kernel and runs CELLS cells in turn:
`let v{i} = {i};` (Python: `v{i} = {i}`) and then an expression that reads
it. After every hundred cells it records the median round trip of those
hundred and the resident memory (VmRSS) of the kernel and of each process
below it (the cell process, for vramlab). Prints JSON.

    .venv/bin/python scripts/bench_soak.py vramlab python3 --cells 1000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from jupyter_client.manager import KernelManager

CELLS = {
    "vramlab": ("let v{i} = {i}u64;", "v{i} + 1"),
    "python3": ("v{i} = {i}", "v{i} + 1"),
}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def soak(name: str, cells: int) -> dict:
    define, use = CELLS.get(name, CELLS["python3"])
    manager = KernelManager(kernel_name=name)
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=120)
    pid = manager.provisioner.process.pid
    rows = []
    try:
        client.execute_interactive("1", timeout=600, output_hook=lambda msg: None)
        times: list[float] = []
        for n in range(cells):
            i = n // 2
            code = (define if n % 2 == 0 else use).format(i=i)
            started = time.perf_counter()
            reply = client.execute_interactive(code, timeout=600, output_hook=lambda msg: None)
            times.append(time.perf_counter() - started)
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"cell {n} ({code!r}) failed: {reply['content'].get('evalue')}")
            if (n + 1) % 100 == 0:
                below = {p: rss_kib(p) for p in descendants(pid)}
                rows.append({
                    "cells": n + 1,
                    "median_round_trip_s": statistics.median(times[-100:]),
                    "kernel_rss_mib": rss_kib(pid) / 1024,
                    "below_rss_mib": sum(below.values()) / 1024,
                    "loadavg_1min": os.getloadavg()[0],
                })
                print(json.dumps({"kernel": name, **rows[-1]}), flush=True)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    first, last = rows[0], rows[-1]
    return {
        "kernel": name,
        "per_hundred": rows,
        "round_trip_last_over_first": last["median_round_trip_s"] / first["median_round_trip_s"],
        "rss_growth_mib": (last["kernel_rss_mib"] + last["below_rss_mib"]) - (first["kernel_rss_mib"] + first["below_rss_mib"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernels", nargs="+")
    parser.add_argument("--cells", type=int, default=1000)
    args = parser.parse_args()
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True).stdout.strip(),
        "cores": os.cpu_count(),
        "results": [soak(name, args.cells) for name in args.kernels],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
