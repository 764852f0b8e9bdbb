"""Parameters injected the papermill way: typed `let` bindings after the `parameters` cell."""
from __future__ import annotations

import importlib.util
import pathlib

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts/run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_notebooks)

PARAMETERS = """// The full run; the test command runs fewer photos.
let photos: usize = 1200;
let epochs: usize = 12;
let learning_rate: f64 = 0.002;
let augment: bool = false;
let data_dir: Option<&str> = None;
let folds: Vec<u64> = vec![0, 1];
let label: String = "full".to_string();
"""


def notebook() -> nbformat.NotebookNode:
    cells = [nbformat.v4.new_markdown_cell("# title"), nbformat.v4.new_code_cell(PARAMETERS), nbformat.v4.new_code_cell("photos")]
    cells[1].metadata["tags"] = ["parameters"]
    return nbformat.v4.new_notebook(cells=cells)


def test_each_override_is_bound_again_with_its_declared_type_right_after_the_parameters_cell() -> None:
    nb = notebook()
    run_notebooks.inject(
        nb,
        {
            "photos": 240,
            "learning_rate": 1,
            "augment": True,
            "data_dir": "/data/PlantVillage \"color\"",
            "folds": [3],
            "label": "quick",
        },
    )
    injected = nb.cells[2]
    assert injected.metadata["tags"] == ["injected-parameters"]
    assert injected.source.splitlines()[1:] == [
        "let photos: usize = 240;",
        "let learning_rate: f64 = 1.0;",
        "let augment: bool = true;",
        'let data_dir: Option<&str> = Some("/data/PlantVillage \\"color\\"");',
        "let folds: Vec<u64> = vec![3];",
        'let label: String = "quick".to_string();',
    ]
    assert nb.cells[3].source == "photos"
    nbformat.validate(nb)


def test_none_sets_an_option_back_to_none() -> None:
    nb = notebook()
    run_notebooks.inject(nb, {"data_dir": None})
    assert nb.cells[2].source.splitlines()[1] == "let data_dir: Option<&str> = None;"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"photoz": 1}, "no parameter `photoz`: the parameters cell declares photos, epochs"),
        ({"photos": -1}, "-1 given for a parameter of type usize"),
        ({"photos": 2.5}, "2.5 given for a parameter of type usize"),
        ({"augment": 1}, "1 given for a bool parameter"),
        ({"epochs": None}, "null given for a parameter of type usize"),
        ({"folds": 3}, "write a JSON list"),
    ],
)
def test_a_wrong_override_names_the_parameter_and_what_is_wrong(parameters: dict, message: str) -> None:
    with pytest.raises(run_notebooks.ParameterError, match=message.replace("(", r"\(")):
        run_notebooks.inject(notebook(), parameters)


def test_a_notebook_without_a_parameters_cell_says_so() -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    with pytest.raises(run_notebooks.ParameterError, match="no cell tagged `parameters`"):
        run_notebooks.inject(nb, {"photos": 1})


def test_values_on_the_command_line_are_json_or_else_strings() -> None:
    assert run_notebooks.parse_value("12") == 12
    assert run_notebooks.parse_value("null") is None
    assert run_notebooks.parse_value("[1, 2]") == [1, 2]
    assert run_notebooks.parse_value("/data/leaves") == "/data/leaves"
