"""The papermill command with the vramlab kernel: -p values bound with the parameters cell's types."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import nbformat
import pytest

PAPERMILL = pathlib.Path(sys.executable).parent / "papermill"

PARAMETERS = """let batch: usize = 8; // examples per step
let lr: f64 = 0.1;
let name: &str = "a";
let tags: Vec<String> = vec![];
let limit: Option<u32> = None;"""

# Each line compiles only if its parameter has the declared type (evcxr would make
# an untyped `let batch = 16;` an i32, and `let lr = 1;` an integer).
USES = """let doubled: usize = vec![0u8; batch].len() * 2;
let halved: f64 = lr / 2.0;
let shown: String = format!("{name}|{}", tags.join(","));
let capped: u32 = limit.unwrap_or(0) + 1;
println!("doubled={doubled} halved={halved} name={shown} capped={capped}");"""


@pytest.fixture
def notebook(tmp_path: pathlib.Path) -> pathlib.Path:
    parameters = nbformat.v4.new_code_cell(PARAMETERS)
    parameters.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(
        cells=[parameters, nbformat.v4.new_code_cell(USES)],
        metadata={"kernelspec": {"name": "vramlab", "language": "rust", "display_name": "Rust (vramlab)"}},
    )
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    return path


def run_papermill(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PAPERMILL), *args], capture_output=True, text=True)


def printed(path: pathlib.Path) -> str:
    cell = nbformat.read(path, as_version=4).cells[-1]
    return "".join(o.text for o in cell.outputs if o.output_type == "stream")


def test_overrides_run_in_the_kernel_with_the_declared_types(notebook: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out.ipynb"
    overrides = ["-p", "batch", "16", "-p", "lr", "1", "-p", "name", 'x"y', "-y", "tags: [red, blue green]", "-p", "limit", "7"]
    ran = run_papermill(str(notebook), str(out), "-k", "vramlab", "--execution-timeout", "600", *overrides)
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert printed(out) == 'doubled=32 halved=0.5 name=x"y|red,blue green capped=8\n'


def test_without_overrides_the_notebook_runs_with_its_own_values(notebook: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out.ipynb"
    ran = run_papermill(str(notebook), str(out), "--execution-timeout", "600")
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert printed(out) == "doubled=16 halved=0.05 name=a| capped=1\n"


def test_help_notebook_lists_the_parameters_with_their_rust_types(notebook: pathlib.Path) -> None:
    ran = run_papermill(str(notebook), "--help-notebook")
    assert ran.returncode == 0, ran.stderr
    assert re.search(r"batch: usize \(default 8\) +examples per step", ran.stdout), ran.stdout
    listed = [line.strip() for line in ran.stdout.splitlines()]
    for line in ["lr: f64 (default 0.1)", 'name: &str (default "a")', "tags: Vec<String> (default vec![])", "limit: Option<u32> (default None)"]:
        assert line in listed, ran.stdout


def test_a_value_that_does_not_fit_fails_before_any_cell_runs(notebook: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out.ipynb"
    ran = run_papermill(str(notebook), str(out), "-p", "batch", "-1")
    assert ran.returncode != 0
    assert "cannot set `batch: usize` to -1: usize holds whole numbers from 0" in ran.stderr
    assert not out.exists()
