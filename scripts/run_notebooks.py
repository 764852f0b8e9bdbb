"""Execute notebooks through the vramlab kernel with nbclient.

With --in-place the executed notebooks replace the originals (outputs kept);
otherwise they are written to --out. Exits non-zero if any cell fails.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

# The first cell that uses the library may build candle (minutes on 2 cores).
CELL_TIMEOUT_S = 1800


def run(path: pathlib.Path, out: pathlib.Path) -> float:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name="vramlab",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},
    )
    started = time.monotonic()
    try:
        client.execute()
    finally:
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, out)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("notebooks", nargs="+", type=pathlib.Path)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--in-place", action="store_true")
    where.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    failed = 0
    for path in args.notebooks:
        out = path if args.in_place else args.out / path.name
        try:
            seconds = run(path, out)
            print(f"{path}: ran in {seconds:.1f} s -> {out}")
        except CellExecutionError as err:
            failed += 1
            print(f"{path}: a cell failed (outputs so far saved to {out}):\n{err}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
