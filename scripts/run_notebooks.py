"""Execute notebooks through the vramlab kernel with nbclient.

With --in-place the executed notebooks replace the originals (outputs kept);
otherwise they are written to --out. Exits non-zero if any cell fails.

`-p NAME VALUE` overrides a parameter as papermill does, with the same
translator (the package papermill_vramlab): the notebook's cell tagged
`parameters` declares each one as `let NAME: TYPE = VALUE;`, and a cell tagged
`injected-parameters` is inserted after it, binding NAME again with the same
type. VALUE is read as JSON (`12`, `0.5`, `true`, `null`, `[1, 2]`), or as a
string when it is not JSON. A NAME the parameters cell does not declare is an
error (papermill only warns). The notebooks run through nbclient rather than
papermill, which would write its own metadata into every committed cell.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from papermill_vramlab import ParameterError, inject

# The first cell that uses the library may build candle (minutes on 2 cores).
CELL_TIMEOUT_S = 1800


def parse_value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run(path: pathlib.Path, out: pathlib.Path, parameters: dict[str, object]) -> float:
    notebook = nbformat.read(path, as_version=4)
    if parameters:
        inject(notebook, parameters)
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
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    args = parser.parse_args()
    parameters = {name: parse_value(value) for name, value in args.parameter}
    failed = 0
    total = 0.0
    for path in args.notebooks:
        out = path if args.in_place else args.out / path.name
        try:
            seconds = run(path, out, parameters)
            total += seconds
            print(f"{path}: ran in {seconds:.1f} s -> {out}")
        except ParameterError as err:
            failed += 1
            print(f"{path}: {err}", file=sys.stderr)
        except CellExecutionError as err:
            failed += 1
            print(f"{path}: a cell failed (outputs so far saved to {out}):\n{err}", file=sys.stderr)
    ran = len(args.notebooks) - failed
    print(f"{ran} notebook{'' if ran == 1 else 's'} ran in {total / 60:.1f} minutes" + (f"; {failed} failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
