"""Write executed notebooks as HTML pages that open in any browser, outputs included.

nbconvert's lab template draws each output as JupyterLab does: tables and reports
as their HTML, charts (SVG) as images, so a page reads like the notebook in Lab
without a Jupyter server or the kernel.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import nbformat
from nbconvert import HTMLExporter


def render(notebook: pathlib.Path, out_dir: pathlib.Path) -> pathlib.Path:
    """Writes `notebook` as `out_dir/<name>.html` and returns that path."""
    node = nbformat.read(notebook, as_version=4)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(node, resources={"metadata": {"name": notebook.stem}})
    out_dir.mkdir(parents=True, exist_ok=True)
    page = out_dir / f"{notebook.stem}.html"
    page.write_text(body, encoding="utf-8")
    return page


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("notebooks", nargs="+", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the folder the HTML pages go to")
    args = parser.parse_args()
    for notebook in args.notebooks:
        print(f"{notebook} -> {render(notebook, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
