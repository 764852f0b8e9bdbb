"""The markdown tables of a scripts/gpu_check.sh run, for BENCHMARKS.md.

    python3 scripts/gpu_report.py DIR            # DIR: the run's output folder ($OUT there)
    python3 scripts/gpu_report.py DIR --record   # also writes benchmarks/card-validation.json

Reads the files of SECTIONS (whichever the run wrote), skipped.json and
log.txt, and prints the machine, check-ops' largest error per op and dtype
against its tolerance, the smoke test's checks, predicted against measured
peaks and bills beside PyTorch's peak and saved tensors, step times against
PyTorch's with cuDNN's plans, and copy bandwidth. A section whose figures
follow a check-ops mismatch says so under its title; a run that did not
finish (no "done in" line in log.txt) is said to be cut short; where PyTorch
gave no figure (a rehearsal without it), the reason stands in its place.

With --record, the run's predicted-against-measured peaks become the library's
validation record (benchmarks/card-validation.json, compiled in by
lib/src/ledger/validation.rs): the card, the date, the binary, the fingerprint
of the rules its ledger followed and the range of its peak errors. Every card
verdict says the figures are predictions until a record of the same rules has
all its peaks within 5%. A run whose measure section did not finish, or
followed a check-ops mismatch, is not recorded.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys

BILLS = ["parameters", "optimizer_state", "activations", "input_batch", "context_and_workspace"]


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def load(folder: pathlib.Path, name: str):
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def env_lines(env: dict) -> list[str]:
    smi = env.get("nvidia_smi", "").splitlines()
    if env.get("torch"):
        torch = f"torch {env['torch']} (CUDA {env.get('torch_cuda')})"
    else:
        torch = f"torch absent: {env.get('torch_absent') or env.get('torch_error')}"
    build = f"; vramlab binary sha256 {env['binary_sha256'][:16]}" if "binary_sha256" in env else ""
    return [f"- {env.get('date')}: {smi[-1] if smi else env.get('gpu', 'no GPU')}; {torch}; {env.get('cpus')} CPUs; {env.get('machine')}{build}"]


def ops_lines(ops: dict) -> list[str]:
    report = ops.get("json")
    if not report:
        return [f"- check-ops did not run: {ops.get('error') or ops.get('stderr', '')[-300:]}"]
    worst: dict[tuple[str, str], dict] = {}
    for check in report["checks"]:
        key = (check["op"], check["dtype"])
        if key not in worst or (check.get("error") or 0) > (worst[key].get("error") or 0) or not check["ok"]:
            worst[key] = check
    lines = [f"{report['passed']} passed, {report['failed']} failed, against {report['reference']} ({report['seconds']:.1f} s).", "",
             "| op | dtype | largest error | tolerance | all ok |", "|---|---|---:|---:|---|"]
    for (op, dtype), check in sorted(worst.items()):
        ok = all(c["ok"] for c in report["checks"] if (c["op"], c["dtype"]) == (op, dtype))
        error = f"{check['error']:.1e}" if check.get("error") is not None else check.get("failure", "")
        lines.append(f"| {op} | {dtype} | {error} | {check['tolerance']:.0e} | {'yes' if ok else 'NO'} |")
    return lines


def smoke_lines(smoke: dict) -> list[str]:
    checks = smoke.get("json", {}).get("checks", [])
    if not checks:
        return [f"- smoke did not run: {smoke.get('error') or smoke.get('stderr', '')[-300:]}"]
    return [f"- {'pass' if c['passed'] else 'FAIL'}: {c['name']}: {c['figure']}" for c in checks]


def measure_lines(rows: list) -> list[str]:
    lines = ["| configuration | predicted peak | measured peak | error | activations pred / meas | context and workspace pred / meas "
             "| PyTorch peak | PyTorch saves |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        c = row.get("json")
        if not c or "measured_peak" not in c:
            lines.append(f"| {row['label']} | | | {row.get('error') or 'failed'} | | | | |")
            continue
        error = (c["measured_peak"] - c["predicted_peak"]) / c["predicted_peak"] * 100
        torch = row.get("torch", {})
        theirs = mib(torch["torch_peak_bytes"]) if "torch_peak_bytes" in torch else torch.get("none", torch.get("error", ""))
        saved = mib(torch["torch_saved_bytes"]) if "torch_saved_bytes" in torch else ""
        bill = lambda name: f"{mib(c['predicted'][name])} / {mib(c['measured'][name])}"
        lines.append(f"| {row['label']} | {mib(c['predicted_peak'])} | {mib(c['measured_peak'])} | {error:+.1f}% "
                     f"| {bill('activations')} | {bill('context_and_workspace')} | {theirs} | {saved} |")
    return lines


def median_ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1000:.1f} ms"


def bench_lines(bench: dict) -> list[str]:
    lines = [f"{bench['rounds']} alternations of {bench['steps']} timed steps after {bench['warmup']} warm-up; medians.", "",
             "| configuration | vramlab | PyTorch | ratio |", "|---|---:|---:|---:|"]
    for row in bench["results"]:
        if "ratio" in row:
            lines.append(f"| {row['label']} | {median_ms(row['ours_s'])} | {median_ms(row['torch_s'])} | {row['ratio']:.1f}x |")
        else:
            torch = row.get("torch", {})
            ours = median_ms(row["ours_s"]) if row["ours_s"] else "; ".join(row["failures"]) or row.get("unfinished", "")
            theirs = median_ms(row["torch_s"]) if row["torch_s"] else torch.get("none") or torch.get("error") or row.get("unfinished", "")
            lines.append(f"| {row['label']} | {ours} | {theirs} | |")
    plans = [(row["label"], row["cudnn"]) for row in bench["results"] if row.get("cudnn")]
    if plans:
        lines += ["", "| configuration | cuDNN plans | made while timed | not the heuristics' first | largest workspace |",
                  "|---|---:|---:|---:|---:|"]
        for label, p in plans:
            algorithms = p["algorithms"]
            largest = max((a["workspace_bytes"] for a in algorithms), default=0)
            lines.append(f"| {label} | {len(algorithms)} | {p['made_while_timed']} | {sum(a['rank'] > 0 for a in algorithms)} | {mib(largest)} |")
    return lines


def h2d_lines(h2d: dict) -> list[str]:
    ours, theirs = h2d["vramlab"].get("json", {}), h2d["torch"]
    rate = lambda d, k: f"{d[k] / 1000:.1f} GB/s" if k in d else "n/a"
    return [f"| copy of {h2d.get('mib', 256)} MiB | vramlab | PyTorch |", "|---|---:|---:|",
            f"| pageable | {rate(ours, 'pageable_mb_per_s')} | {rate(theirs, 'pageable_mb_per_s')} |",
            f"| pinned | {rate(ours, 'pinned_mb_per_s')} | {rate(theirs, 'pinned_mb_per_s')} |",
            f"| pageable through a pinned staging buffer | {rate(ours, 'staged_mb_per_s')} | |"]


def after_mismatch(data) -> bool:
    """Whether a section's figures follow a check-ops mismatch: the file's result is marked,
    or any of its rows (measure.json's, bench.json's results)."""
    results = data if isinstance(data, list) else [data, *data.get("results", [])]
    return any(isinstance(result, dict) and result.get("after_ops_mismatch") for result in results)


def finished(folder: pathlib.Path) -> bool:
    """Whether the run got to its end: gpu_check.py's last line, "done in ...", is in log.txt
    (a run without a log is taken as finished)."""
    log = folder / "log.txt"
    return not log.exists() or any(line.startswith("done in ") for line in log.read_text().splitlines())


# Each section's title, the file it reads, and how it is printed, in gpu_check.py's order.
SECTIONS = [("Machine", "env.json", env_lines), ("Ops against the CPU", "ops.json", ops_lines), ("Smoke test", "smoke.json", smoke_lines),
            ("Predicted against measured", "measure.json", measure_lines), ("Step time", "bench.json", bench_lines),
            ("Host to device", "h2d.json", h2d_lines)]


RECORD = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "card-validation.json"


def record(folder: pathlib.Path) -> str:
    """Writes RECORD from the run in `folder`; returns what it did, in a sentence."""
    rows = load(folder, "measure.json") or []
    compared = [row["json"] for row in rows if row.get("json") and "measured_peak" in row["json"]]
    if not compared or not finished(folder) or after_mismatch(rows):
        return f"not recorded: the run measured {len(compared)} steps, finished: {finished(folder)}, after a mismatch: {after_mismatch(rows)}"
    if len(compared) < len(rows):
        return f"not recorded: {len(rows) - len(compared)} of {len(rows)} configurations gave no comparison"
    env = load(folder, "env.json") or {}
    if not env.get("cuda_available") or any("cuda" not in c.get("measured_with", "").lower() for c in compared):
        return "not recorded: the steps did not run on a card"
    rules = {c.get("device_rules") for c in compared}
    if len(rules) != 1:
        return f"not recorded: the steps name {len(rules)} different rule fingerprints"
    errors = [(c["measured_peak"] - c["predicted_peak"]) / c["predicted_peak"] * 100 for c in compared]
    sha = env.get("binary_sha256", "")
    entry = {
        "about": "The last GPU run that measured the ledger's predicted steps on a card, written by `scripts/gpu_report.py DIR "
                 "--record` and compiled into the library (lib/src/ledger/validation.rs).",
        "device_rules": rules.pop(),
        "card": env.get("gpu", "an unnamed card"),
        "date": str(env.get("date", ""))[:10],
        "build": f"binary sha256 {sha[:16]}" if sha else "an unnamed build",
        "configurations": len(compared),
        "peak_error_percent": [round(min(errors), 1), round(max(errors), 1)],
        "source": str(folder),
    }
    RECORD.write_text(json.dumps(entry, indent=1) + "\n")
    return f"recorded in {RECORD.name}: {len(compared)} steps, peaks {min(errors):+.1f}% to {max(errors):+.1f}% of the ledger's"


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--record"]
    if len(args) != 1 or not pathlib.Path(args[0]).is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    folder = pathlib.Path(args[0])
    if not finished(folder):
        print("This run did not finish (log.txt has no \"done in\" line): the figures are those written before it stopped.\n")
    mismatch = (load(folder, "ops.json") or {}).get("mismatch", "see ops.json")
    for title, name, render in SECTIONS:
        data = load(folder, name)
        if data is not None:
            print(f"#### {title}\n")
            if name != "ops.json" and after_mismatch(data):
                print(f"These figures follow a check-ops mismatch: {mismatch}.\n")
            print("\n".join(render(data)) + "\n")
    skipped = load(folder, "skipped.json") or []
    print(f"Skipped: {'; '.join(skipped) if skipped else 'nothing'}.")
    if "--record" in sys.argv[1:]:
        print(f"\nValidation record: {record(folder)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
