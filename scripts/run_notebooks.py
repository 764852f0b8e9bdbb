"""Execute notebooks through the vramlab kernel with nbclient.

With --in-place the executed notebooks replace the originals (outputs kept);
otherwise they are written to --out. Exits non-zero if any cell fails.

`-p NAME VALUE` overrides a parameter, papermill's way: the notebook's cell
tagged `parameters` declares each one as `let NAME: TYPE = VALUE;`, and a
cell tagged `injected-parameters` is inserted after it, binding NAME again
with the same type. VALUE is read as JSON (`12`, `0.5`, `true`, `null`,
`[1, 2]`), or as a string when it is not JSON.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

# The first cell that uses the library may build candle (minutes on 2 cores).
CELL_TIMEOUT_S = 1800


DECLARATION = re.compile(r"^\s*let\s+(?:mut\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*:\s*(.+?)\s*=", re.MULTILINE)


class ParameterError(ValueError):
    pass


def declared_parameters(notebook: nbformat.NotebookNode) -> tuple[int, dict[str, str]]:
    """The index of the `parameters` cell and the type of each `let` it declares."""
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
            return index, {name: ty for name, ty in DECLARATION.findall(cell.source)}
    raise ParameterError("the notebook has no cell tagged `parameters` to override")


def rust_literal(value: object, ty: str) -> str:
    """`value` as a Rust expression of type `ty`."""
    ty = ty.replace(" ", "")
    option = re.fullmatch(r"Option<(.+)>", ty)
    if option:
        return "None" if value is None else f"Some({rust_literal(value, option.group(1))})"
    if value is None:
        raise ParameterError(f"null given for a parameter of type {ty}, which is not an Option")
    vector = re.fullmatch(r"Vec<(.+)>", ty)
    if vector:
        if not isinstance(value, list):
            raise ParameterError(f"{value!r} given for a parameter of type {ty}; write a JSON list")
        return "vec![" + ", ".join(rust_literal(v, vector.group(1)) for v in value) + "]"
    if ty == "bool":
        if not isinstance(value, bool):
            raise ParameterError(f"{value!r} given for a bool parameter; write true or false")
        return "true" if value else "false"
    if re.fullmatch(r"[ui](8|16|32|64|128|size)", ty):
        if isinstance(value, bool) or not isinstance(value, int) or (ty.startswith("u") and value < 0):
            raise ParameterError(f"{value!r} given for a parameter of type {ty}")
        return str(value)
    if ty in ("f32", "f64"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParameterError(f"{value!r} given for a parameter of type {ty}")
        return repr(float(value))
    if ty in ("&str", "&'staticstr", "String"):
        if not isinstance(value, str):
            raise ParameterError(f"{value!r} given for a parameter of type {ty}")
        literal = json.dumps(value, ensure_ascii=False)
        return f"{literal}.to_string()" if ty == "String" else literal
    raise ParameterError(f"parameters of type {ty} cannot be set from outside (use a number, bool, string, Vec or Option of them)")


def inject(notebook: nbformat.NotebookNode, parameters: dict[str, object]) -> None:
    """Inserts the `injected-parameters` cell after the `parameters` cell."""
    index, declared = declared_parameters(notebook)
    lines = []
    for name, value in parameters.items():
        if name not in declared:
            raise ParameterError(f"no parameter `{name}`: the parameters cell declares {', '.join(declared) or 'none'}")
        lines.append(f"let {name}: {declared[name]} = {rust_literal(value, declared[name])};")
    cell = nbformat.v4.new_code_cell("// Injected parameters\n" + "\n".join(lines))
    cell.metadata["tags"] = ["injected-parameters"]
    notebook.cells.insert(index + 1, cell)


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
    for path in args.notebooks:
        out = path if args.in_place else args.out / path.name
        try:
            seconds = run(path, out, parameters)
            print(f"{path}: ran in {seconds:.1f} s -> {out}")
        except ParameterError as err:
            failed += 1
            print(f"{path}: {err}", file=sys.stderr)
        except CellExecutionError as err:
            failed += 1
            print(f"{path}: a cell failed (outputs so far saved to {out}):\n{err}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
