"""Parameters injected the papermill way: typed `let` bindings after the `parameters` cell,
by papermill_vramlab, through papermill itself and through scripts/run_notebooks.py."""
from __future__ import annotations

import importlib.util
import math
import pathlib
import shutil
import subprocess
import sys

import nbformat
import papermill
import pytest
from papermill.exceptions import PapermillException
from papermill.iorw import load_notebook_node
from papermill.models import Parameter
from papermill.parameterize import parameterize_notebook
from papermill.translators import papermill_translators

from papermill_vramlab import ParameterError, RustTranslator, bindings, declarations, inject

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts/run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_notebooks)

PARAMETERS = """// The full run; the test command runs fewer photos.
let photos: usize = 1200;
let epochs: usize = 12;
let learning_rate: f64 = 0.002; // Adam's step
let augment: bool = false;
let data_dir: Option<&str> = None;
let folds: Vec<u64> = vec![0, 1];
let label: String = "full".to_string();
"""


def notebook(parameters: str = PARAMETERS) -> nbformat.NotebookNode:
    cells = [nbformat.v4.new_markdown_cell("# title"), nbformat.v4.new_code_cell(parameters), nbformat.v4.new_code_cell("photos")]
    cells[1].metadata["tags"] = ["parameters"]
    return nbformat.v4.new_notebook(
        cells=cells,
        metadata={"kernelspec": {"name": "vramlab", "language": "rust", "display_name": "Rust (vramlab)"}},
    )


def test_each_override_is_bound_again_with_its_declared_type_right_after_the_parameters_cell() -> None:
    nb = notebook()
    inject(
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
    inject(nb, {"data_dir": None})
    assert nb.cells[2].source.splitlines()[1] == "let data_dir: Option<&str> = None;"


def test_injecting_again_replaces_the_injected_cell() -> None:
    nb = notebook()
    inject(nb, {"photos": 1})
    inject(nb, {"photos": 2})
    assert [c.source.splitlines()[-1] for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])] == [
        "let photos: usize = 2;"
    ]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"photoz": 1}, "no parameter `photoz`: the parameters cell declares photos, epochs"),
        ({"photos": -1}, "cannot set `photos: usize` to -1: usize holds whole numbers from 0 to 18446744073709551615"),
        ({"photos": 2.5}, "cannot set `photos: usize` to 2.5: usize holds whole numbers"),
        ({"photos": 2.0}, "cannot set `photos: usize` to 2.0: usize holds whole numbers"),
        ({"photos": "12"}, "cannot set `photos: usize` to '12'"),
        ({"photos": 2**64}, "cannot set `photos: usize` to 18446744073709551616"),
        ({"augment": 1}, "cannot set `augment: bool` to 1: a bool takes True or False"),
        ({"augment": "true"}, "cannot set `augment: bool` to 'true'"),
        ({"epochs": None}, "cannot set `epochs: usize` to None: only an Option can be None"),
        ({"folds": 3}, "cannot set `folds: Vec<u64>` to 3: a Vec<u64> takes a list"),
        ({"folds": [1, -1]}, r"cannot set `folds: Vec<u64>` to [1, -1]: element 1 (-1): u64 holds whole numbers"),
        ({"learning_rate": "fast"}, "cannot set `learning_rate: f64` to 'fast': an f64 takes a number"),
        ({"learning_rate": True}, "cannot set `learning_rate: f64` to True"),
        ({"label": 7}, "cannot set `label: String` to 7: a String takes a string (papermill's -r passes a value as a string)"),
        ({"data_dir": 7}, "cannot set `data_dir: Option<&str>` to 7: a &str takes a string"),
        ({"label": {"a": 1}}, "cannot set `label: String` to {'a': 1}"),
        ({"photos": {"a": 1}}, "cannot set `photos: usize` to {'a': 1}"),
        ({"label": "\ud800"}, "cannot set `label: String` to '\\\\ud800': it holds a lone surrogate"),
    ],
)
def test_a_wrong_override_names_the_parameter_its_type_and_the_value(parameters: dict, message: str) -> None:
    with pytest.raises(ParameterError, match=escape(message)):
        inject(notebook(), parameters)


def escape(message: str) -> str:
    return "".join("\\" + c if c in "()[]{}.*+?^$|" else c for c in message)


def test_a_parameter_error_is_a_papermill_exception() -> None:
    assert issubclass(ParameterError, PapermillException)


def test_a_notebook_without_a_parameters_cell_says_so() -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    with pytest.raises(ParameterError, match="no cell tagged `parameters`"):
        inject(nb, {"photos": 1})


def test_values_on_the_command_line_are_json_or_else_strings() -> None:
    assert run_notebooks.parse_value("12") == 12
    assert run_notebooks.parse_value("null") is None
    assert run_notebooks.parse_value("[1, 2]") == [1, 2]
    assert run_notebooks.parse_value("/data/leaves") == "/data/leaves"


def test_declarations_read_each_typed_let_with_its_default_and_trailing_comment() -> None:
    found = declarations(
        PARAMETERS
        + """let (batch, res) = (128usize, 64usize);
let model = vramlab::models::ModelName::Resnet18; // untyped
let mut sizes: [u8; 2] = [1; 2];
let motto: &'static str = "a; b // not a comment"; // the motto
let multi: Vec<&str> = vec![
    "x", // first
    "y",
];
let items: Box<dyn Iterator<Item = u8>> = Box::new(0..3);
let fun: fn(u8) -> u8 = |x| x;
let chars: (char, char) = ('"', '\\'');
/* let hidden: u8 = 1; /* nested */ still hidden: u8 = 2; */
let r: &str = r#"raw "quoted"; text"#;
println!("{photos}");
"""
    )
    assert [(d.name, d.type, d.default, d.help) for d in found] == [
        ("photos", "usize", "1200", ""),
        ("epochs", "usize", "12", ""),
        ("learning_rate", "f64", "0.002", "Adam's step"),
        ("augment", "bool", "false", ""),
        ("data_dir", "Option<&str>", "None", ""),
        ("folds", "Vec<u64>", "vec![0, 1]", ""),
        ("label", "String", '"full".to_string()', ""),
        ("model", None, "vramlab::models::ModelName::Resnet18", "untyped"),
        ("sizes", "[u8; 2]", "[1; 2]", ""),
        ("motto", "&'static str", '"a; b // not a comment"', "the motto"),
        ("multi", "Vec<&str>", 'vec![ "x", "y", ]', ""),
        ("items", "Box<dyn Iterator<Item = u8>>", "Box::new(0..3)", ""),
        ("fun", "fn(u8) -> u8", "|x| x", ""),
        ("chars", "(char, char)", "('\"', '\\'')", ""),
        ("r", "&str", 'r#"raw "quoted"; text"#', ""),
    ]


@pytest.mark.parametrize(
    ("value", "ty", "rust"),
    [
        (1.0, "f64", "1.0"),
        (3, "f32", "3.0"),
        (1e-5, "f64", "1e-05"),
        (-2.5e300, "f64", "-2.5e+300"),
        (math.nan, "f64", "f64::NAN"),
        (math.inf, "f32", "f32::INFINITY"),
        (-math.inf, "f64", "f64::NEG_INFINITY"),
        (-(2**63), "i64", "-9223372036854775808"),
        (255, "u8", "255"),
        (None, "Option<u32>", "None"),
        (4, "Option<u32>", "Some(4)"),
        ([[1], []], "Vec<Vec<i32>>", "vec![vec![1], vec![]]"),
        ([None, 1.5], "Vec<Option<f64>>", "vec![None, Some(1.5)]"),
        ('say "hi"\\ \n\t\r\0 é 🌿 \x07 \u2028', "&str", '"say \\"hi\\"\\\\ \\n\\t\\r\\0 é 🌿 \\u{7} \\u{2028}"'),
        ("x", "String", '"x".to_string()'),
        ("x", "& 'static  str", '"x"'),
        ("x", "Option<String>", 'Some("x".to_string())'),
    ],
)
def test_values_become_rust_literals_of_the_declared_type(value: object, ty: str, rust: str) -> None:
    assert bindings({"p": value}, {"p": ty}, "c").splitlines()[1] == f"let p: {ty} = {rust};"


@pytest.mark.parametrize(
    ("value", "binding"),
    [
        (16, "let p: i64 = 16;"),
        (0.5, "let p: f64 = 0.5;"),
        (2.0, "let p: f64 = 2.0;"),
        (True, "let p: bool = true;"),
        ("a\nb", 'let p: String = "a\\nb".to_string();'),
        ([1, 2], "let p: Vec<i64> = vec![1, 2];"),
        ([1, 2.5], "let p: Vec<f64> = vec![1.0, 2.5];"),
        ([["a"], ["b"]], 'let p: Vec<Vec<String>> = vec![vec!["a".to_string()], vec!["b".to_string()]];'),
    ],
)
def test_a_parameter_without_a_declared_type_gets_one_from_its_value(value: object, binding: str) -> None:
    assert bindings({"p": value}, {}, "c").splitlines()[1] == binding


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "cannot set `p` (the parameters cell does not declare its type) to None: None does not say which Option"),
        ([], "an empty list does not say its Vec's element type"),
        ([1, "a"], "a Vec's elements share one type, and these would be String, i64"),
        ([1, True], "these would be bool, i64"),
        ({"a": 1}, "a dict has no Rust form here"),
        (2**63, "i64 holds whole numbers"),
    ],
)
def test_a_value_without_a_declared_type_and_no_rust_type_of_its_own_is_refused(value: object, message: str) -> None:
    with pytest.raises(ParameterError, match=escape(message)):
        bindings({"p": value}, {}, "c")


def test_a_name_that_is_not_a_rust_identifier_is_refused() -> None:
    with pytest.raises(ParameterError, match="must be a Rust identifier"):
        bindings({"two words": 1}, {}, "c")


@pytest.mark.skipif(shutil.which("rustc") is None, reason="needs rustc")
def test_rustc_reads_the_literals_back_as_the_same_values(tmp_path: pathlib.Path) -> None:
    text = 'quote " backslash \\ newline \n tab \t return \r nul \0 bell \x07 é 🌿 \u2028 {}'
    floats = [1.0, 1e-05, 2.5e300, -0.0, 0.1]
    code = bindings({"text": text, "floats": floats, "low": -(2**63), "nan": math.nan}, {"low": "i64", "nan": "f64"}, "c")
    program = tmp_path / "main.rs"
    program.write_text(
        f"""fn main() {{
{code}
    print!("{{}}", text);
    for f in &floats {{ print!("\\u{{1}}{{:?}}", f); }}
    print!("\\u{{1}}{{}}\\u{{1}}{{}}", low, nan.is_nan());
}}
""",
        encoding="utf-8",
    )
    subprocess.run(["rustc", "--edition", "2021", "-o", str(tmp_path / "main"), str(program)], check=True, capture_output=True)
    printed = subprocess.run([str(tmp_path / "main")], check=True, capture_output=True).stdout.decode("utf-8").split("\x01")
    assert printed[0] == text
    assert [float(f) for f in printed[1:-2]] == floats
    assert printed[-2:] == [str(-(2**63)), "true"]


def test_inspect_lists_each_parameter_with_its_rust_type_default_and_help() -> None:
    cell = notebook().cells[1]
    assert RustTranslator.inspect(cell)[2] == Parameter("learning_rate", "f64", "0.002", "Adam's step")
    assert RustTranslator.inspect(nbformat.v4.new_code_cell("let model = 3;")) == [Parameter("model", "None", "3", "")]


def test_papermill_finds_the_translator_for_the_kernel_and_the_language() -> None:
    assert papermill_translators.find_translator("vramlab", "python") is RustTranslator
    assert papermill_translators.find_translator("evcxr", "rust") is RustTranslator


def test_papermill_binds_each_value_with_the_type_the_parameters_cell_declares(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "in.ipynb"
    nbformat.write(notebook(), source)
    executed = papermill.execute_notebook(
        str(source),
        str(tmp_path / "out.ipynb"),
        parameters={"photos": 240, "learning_rate": 1, "folds": [2], "label": 'x"y', "extra": 0.5},
        prepare_only=True,
    )
    injected = executed.cells[2]
    assert injected.metadata["tags"] == ["injected-parameters"]
    assert injected.source.splitlines() == [
        "// Parameters",
        "let photos: usize = 240;",
        "let learning_rate: f64 = 1.0;",
        "let folds: Vec<u64> = vec![2];",
        'let label: String = "x\\"y".to_string();',
        "let extra: f64 = 0.5;",
    ]


def test_papermill_refuses_a_value_that_does_not_fit_before_anything_runs(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "in.ipynb"
    nbformat.write(notebook(), source)
    with pytest.raises(ParameterError, match=escape("cannot set `photos: usize` to -1")):
        papermill.execute_notebook(str(source), str(tmp_path / "out.ipynb"), parameters={"photos": -1}, prepare_only=True)
    assert not (tmp_path / "out.ipynb").exists()


def test_parameterize_notebook_alone_infers_the_types_from_the_values(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setattr(RustTranslator, "declared_types", {})
    nbformat.write(notebook(), tmp_path / "in.ipynb")
    nb = parameterize_notebook(load_notebook_node(str(tmp_path / "in.ipynb")), {"photos": 240, "rate": 0.5})
    assert nb.cells[2].source.splitlines()[1:] == ["let photos: i64 = 240;", "let rate: f64 = 0.5;"]


def test_the_declared_types_serve_one_codify_only() -> None:
    RustTranslator.inspect(notebook().cells[1])
    assert RustTranslator.codify({"photos": 2}).splitlines()[1] == "let photos: usize = 2;"
    assert RustTranslator.codify({"photos": 2}).splitlines()[1] == "let photos: i64 = 2;"


@pytest.mark.parametrize("first", ["import papermill", "import papermill_vramlab.translator", "import papermill_vramlab.rust"])
def test_the_translator_is_registered_whichever_module_a_program_imports_first(first: str) -> None:
    check = f"{first}; from papermill.translators import papermill_translators as t; print(t.find_translator('vramlab', None).__name__)"
    assert subprocess.run([sys.executable, "-c", check], check=True, capture_output=True, text=True).stdout == "RustTranslator\n"


def test_the_papermill_command_injects_typed_bindings(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "in.ipynb"
    nbformat.write(notebook(), source)
    papermill_cli = pathlib.Path(sys.executable).parent / "papermill"
    subprocess.run(
        [str(papermill_cli), str(source), str(tmp_path / "out.ipynb"), "--prepare-only", "-p", "photos", "16", "-p", "learning_rate", "nan", "-r", "label", "12"],
        check=True,
        capture_output=True,
    )
    injected = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[2]
    assert injected.source.splitlines()[1:] == [
        "let photos: usize = 16;",
        "let learning_rate: f64 = f64::NAN;",
        'let label: String = "12".to_string();',
    ]
