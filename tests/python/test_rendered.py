"""The HTML pages the lessons command writes keep the notebooks' charts and tables."""
from __future__ import annotations

import base64
import importlib.util
import pathlib
import re

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("render_notebooks", ROOT / "scripts/render_notebooks.py")
render_notebooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render_notebooks)

QUICKSTART = ROOT / "notebooks/00-quickstart.ipynb"
EMBEDDED_SVG = re.compile(r'src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)"')


def outputs_of(notebook: pathlib.Path, mime: str) -> list[str]:
    cells = nbformat.read(notebook, as_version=4).cells
    return [o.data[mime] for c in cells if c.cell_type == "code" for o in c.outputs if mime in o.get("data", {})]


def test_charts_and_tables_survive_the_html_rendering(tmp_path: pathlib.Path) -> None:
    page = render_notebooks.render(QUICKSTART, tmp_path)
    assert page == tmp_path / "00-quickstart.html"
    html = page.read_text(encoding="utf-8")

    charts = outputs_of(QUICKSTART, "image/svg+xml")
    assert charts, f"{QUICKSTART.name} has no chart in its committed outputs to check"
    embedded = [base64.b64decode(data).decode("utf-8") for data in EMBEDDED_SVG.findall(html)]
    for chart in charts:
        assert chart.startswith("<svg") and chart in embedded, "a chart of the notebook is not in the page as its SVG image"

    rich = outputs_of(QUICKSTART, "text/html")
    tables = sum(h.count("<table") for h in rich)
    inline_svgs = sum(h.count("<svg") for h in rich)
    assert tables and inline_svgs, f"{QUICKSTART.name}'s HTML outputs have no table and chart (a %oomcheck report) to check"
    assert html.count("<table") >= tables, "tables of the notebook's HTML outputs are missing from the page"
    assert html.count("<svg") >= inline_svgs, "charts inside the notebook's HTML outputs are missing from the page"
    first_title = re.search(r"<p><b>(.+?)</b></p><table>", "".join(rich))
    assert first_title and first_title.group(1) in html
