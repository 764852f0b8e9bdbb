"""The committed notebooks run through the kernel, with papermill, without an error."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import nbformat
import papermill
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
# The first cell that uses the library may build it for the cells (minutes on 2 cores).
CELL_TIMEOUT_S = 1800
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# The lessons command runs each notebook with the values of its `parameters` cell;
# the tests run the same notebooks with these, so that they stay inside CI's time.
QUICK = {
    "03-three-levers.ipynb": {
        "checkpoint_rounds": 1,
        "checkpoint_res": 64,
        "checkpoint_batch": 2,
    },
    "03b-beyond-resnet.ipynb": {
        "unet_photos": 96,
        "unet_res": 64,
        "unet_epochs": 1,
    },
    "05-leaf-disease-project.ipynb": {
        "photos": 240,
        "bench_photos": 24,
        "step_batch": 2,
        "step_res": 64,
        "r50_batch": 1,
        "epochs": 2,
        "cv_photos": 120,
        "cv_epochs": 1,
        "memory_every": 5,
    },
    "06-your-own-model.ipynb": {
        "card": "700MiB",
        "res": 64,
        "batch": 128,
    },
}


def test_kernelspec_is_listed() -> None:
    listed = subprocess.run(
        [str(BIN / "jupyter"), "kernelspec", "list", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    specs = json.loads(listed.stdout)["kernelspecs"]
    assert "vramlab" in specs
    spec = specs["vramlab"]["spec"]
    assert spec["display_name"] == "Rust (vramlab)"
    assert spec["language"] == "rust"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_without_error(notebook: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = tmp_path / notebook.name
    # papermill's -p reads a number, True, False or None, and anything else as a string.
    overrides = [arg for name, value in QUICK.get(notebook.name, {}).items() for arg in ("-p", name, str(value))]
    command = [str(BIN / "papermill"), str(notebook), str(out), "-k", "vramlab", "--cwd", str(notebook.parent)]
    command += ["--execution-timeout", str(CELL_TIMEOUT_S), "--no-progress-bar", *overrides]
    ran = subprocess.run(command, capture_output=True, text=True)
    assert out.exists(), ran.stderr[-4000:]
    executed = nbformat.read(out, as_version=4)
    code = [c for c in executed.cells if c.cell_type == "code"]
    expected = [c for c in code if "raises-exception" in c.metadata.get("tags", [])]
    errors = [o for c in code if c not in expected for o in c.outputs if o.output_type == "error"]
    assert not errors, "\n\n".join(f"{e['ename']}: {e['evalue']}" for e in errors)
    unfinished = [c.source for c in code if c.metadata.papermill.get("status") != "completed"]
    assert not unfinished, f"{notebook.name}: papermill stopped before these cells:\n{unfinished}\n{ran.stderr[-4000:]}"
    # A cell tagged raises-exception (nbclient's convention) shows a failure on
    # purpose: it must really fail, or the prose around it is wrong.
    for cell in expected:
        assert any(o.output_type == "error" for o in cell.outputs), f"{notebook.name}: a raises-exception cell did not fail:\n{cell.source}"
    # papermill runs on past a raises-exception cell, but exits 1 for any error output.
    assert ran.returncode == (1 if expected else 0), ran.stderr[-4000:]


def test_quick_values_name_parameters_the_notebooks_declare() -> None:
    for name, values in QUICK.items():
        declared = papermill.inspect_notebook(str(ROOT / "notebooks" / name))
        assert set(values) <= set(declared), f"{name}: {sorted(set(values) - set(declared))} not in its parameters cell"


def test_committed_notebooks_keep_their_outputs() -> None:
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert code and any(c.outputs for c in code), f"{path.name}: run scripts/lessons.sh and commit the outputs"
