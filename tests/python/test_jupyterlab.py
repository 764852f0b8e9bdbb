"""JupyterLab in headless Chromium: a notebook on the vramlab kernel, run from Lab's menu and
checked in the page, as a person sees it: streams, results, a table, a chart, a progress bar,
errors drawn as errors, the library's notice not drawn as one, and an interrupt."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator

import nbformat
import pytest

KERNEL = "vramlab"
DISPLAY_NAME = "Rust (vramlab)"
NOTEBOOK = "browser.ipynb"
STDOUT = "application/vnd.jupyter.stdout"
# Lab draws error outputs and stderr streams alike, with this mime type.
STDERR = "application/vnd.jupyter.stderr"

CELLS = [
    'println!("printed from a cell");',
    "6 * 7",
    'vramlab::render::Table::new(["bill", "bytes"]).row(["input", "602112"]).title("a table in the browser")',
    'vramlab::render::Chart::new("a chart in the browser")\n'
    '    .series(vramlab::render::Series::line("line", vec![(0.0, 1.0), (1.0, 3.0), (2.0, 2.0)]))',
    'let mut bar = vramlab::render::Progress::new("a bar in the browser", 5);\n'
    "for _ in 0..5 {\n"
    "    bar.inc(1);\n"
    "    std::thread::sleep(std::time::Duration::from_millis(40));\n"
    "}\n"
    "bar.finish();",
    'panic!("this cell fails on purpose");',
    'println!("spinning until interrupted");\nloop {}',
    'println!("alive after the interrupt");',
]
STREAM, RESULT, TABLE, CHART, PROGRESS, PANIC, LOOP, AFTER_INTERRUPT = range(len(CELLS))
FIRST_LIBRARY_CELL = TABLE

# Run All stops at the panic (stop_on_error); the cells after it are run one by one.
RUN_ALL_S = 1800  # the first cell that uses the library may build it (minutes on 2 cores)
LAB_LOAD_S = 60
KERNEL_START_S = 120
CELL_S = 60

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # Without these Chromium keeps opening connections a closed network refuses.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"checkForUpdates": False, "fetchNews": "false"},
}


def chromium() -> str:
    found = shutil.which("chromium")
    if found:
        return found
    reason = "Chromium not found (scripts/test.sh installs Debian's `chromium` package)"
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(reason)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_notebook(path: pathlib.Path) -> None:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    notebook.metadata["kernelspec"] = {"name": KERNEL, "display_name": DISPLAY_NAME, "language": "rust"}
    nbformat.write(notebook, path)


def write_lab_settings(settings_dir: pathlib.Path) -> None:
    for plugin, values in LAB_SETTINGS.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@contextlib.contextmanager
def jupyterlab(workdir: pathlib.Path) -> Iterator[tuple[str, str, pathlib.Path]]:
    """A JupyterLab server on a free port serving `workdir/notebooks`: its URL, token and log."""
    notebooks = workdir / "notebooks"
    notebooks.mkdir()
    write_notebook(notebooks / NOTEBOOK)
    write_lab_settings(workdir / "lab-settings")
    port, token = free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(workdir / "config"),
        JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(workdir / "lab-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(workdir / "lab-workspaces"),
    )
    log_path = workdir / "jupyterlab.log"
    command = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser",
        "--allow-root",
        "--LabApp.extension_manager=readonly",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={notebooks}",
    ]  # fmt: skip
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(server, url, token, log_path)
        yield url, token, log_path
    finally:
        with contextlib.suppress(OSError):
            request = urllib.request.Request(f"{url}/api/shutdown", method="POST", headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(request, timeout=10)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def wait_for_server(server: subprocess.Popen, url: str, token: str, log_path: pathlib.Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"JupyterLab exited with {server.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(OSError):
            request = urllib.request.Request(f"{url}/api/status", headers={"Authorization": f"token {token}"})
            if urllib.request.urlopen(request, timeout=2).status == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"JupyterLab did not answer on {url} within 60 s:\n{log_path.read_text()}")


def test_a_notebook_runs_in_jupyterlab_as_a_person_sees_it(tmp_path: pathlib.Path) -> None:
    executable = chromium()
    from playwright.sync_api import expect, sync_playwright

    with jupyterlab(tmp_path) as (url, token, log_path), sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1600},
        )
        page = context.new_page()
        page.set_default_timeout(CELL_S * 1000)
        notebook = page.locator(".jp-NotebookPanel .jp-Notebook")
        cells = notebook.locator(".jp-Cell")

        def cell(index: int):
            return cells.nth(index)

        def outputs(index: int, mime: str):
            return cell(index).locator(f'.jp-Cell-outputArea [data-mime-type="{mime}"]')

        def run_one(index: int) -> None:
            cell(index).locator(".jp-InputPrompt").click()
            page.keyboard.press("Control+Enter")

        def check_stream() -> None:
            expect(outputs(STREAM, STDOUT)).to_have_text("printed from a cell")

        def check_result() -> None:
            expect(cell(RESULT).locator('.jp-OutputArea-executeResult [data-mime-type="text/plain"]')).to_have_text("42")

        def check_table() -> None:
            shown = outputs(TABLE, "text/html").filter(has=page.locator("table"))
            expect(shown).to_contain_text("a table in the browser")
            expect(shown.locator("th")).to_have_text(["bill", "bytes"])
            expect(shown.locator("td")).to_have_text(["input", "602112"])

        def check_chart() -> None:
            image = outputs(CHART, "image/svg+xml").locator("img")
            expect(image).to_be_visible()
            width = image.evaluate("img => img.decode().then(() => img.naturalWidth)")
            assert width > 0, "the chart's SVG did not decode to an image"

        def check_progress() -> None:
            bar = cell(PROGRESS).locator(".jp-Cell-outputArea progress")
            expect(bar).to_have_count(1)  # updated in place, not drawn once per step
            expect(bar).to_have_attribute("value", "5")
            expect(bar).to_have_attribute("max", "5")
            expect(outputs(PROGRESS, "text/html").filter(has=page.locator("progress"))).to_contain_text("5/5 (100%)")

        def check_error() -> None:
            expect(outputs(PANIC, STDERR)).to_contain_text("this cell fails on purpose")

        def check_library_notice_is_not_an_error() -> None:
            area = cell(FIRST_LIBRARY_CELL).locator(".jp-Cell-outputArea")
            expect(area).to_contain_text("vramlab ready")
            on_stderr = outputs(FIRST_LIBRARY_CELL, STDERR)
            assert on_stderr.count() == 0, f"drawn as an error (stderr): {on_stderr.all_inner_texts()}"

        def check_interrupt() -> None:
            run_one(LOOP)
            expect(outputs(LOOP, STDOUT)).to_have_text("spinning until interrupted", timeout=CELL_S * 1000)
            page.locator('.jp-NotebookPanel-toolbar [data-command="notebook:interrupt-kernel"]').click()
            expect(outputs(LOOP, STDERR)).to_contain_text("Interrupted", timeout=CELL_S * 1000)
            run_one(AFTER_INTERRUPT)
            expect(outputs(AFTER_INTERRUPT, STDOUT)).to_have_text("alive after the interrupt", timeout=CELL_S * 1000)

        checks: list[tuple[str, int, Callable[[], None]]] = [
            ("a println! is a stdout stream", STREAM, check_stream),
            ("the last expression is the result", RESULT, check_result),
            ("a Table is an HTML table", TABLE, check_table),
            ("a Chart is an SVG image", CHART, check_chart),
            ("a Progress bar ends at 100%", PROGRESS, check_progress),
            ("a panic is drawn as an error", PANIC, check_error),
            ("the library's notice is not drawn as an error", FIRST_LIBRARY_CELL, check_library_notice_is_not_an_error),
            ("an interrupt stops loop {} and the kernel lives on", LOOP, check_interrupt),
        ]
        failures = []
        try:
            page.goto(f"{url}/lab/tree/{NOTEBOOK}?reset&token={token}")
            expect(cells).to_have_count(len(CELLS), timeout=LAB_LOAD_S * 1000)
            # The status bar, not the toolbar's indicator, which reads idle before the kernel is
            # connected: a Run All sent then runs nothing.
            kernel_status = page.locator('.jp-StatusBar-TextItem[title^="Change kernel"]')
            expect(kernel_status).to_have_text(f"{DISPLAY_NAME} | Idle", timeout=KERNEL_START_S * 1000)
            page.locator(".lm-MenuBar-item", has_text="Run").click()
            page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
            prompts = notebook.locator(".jp-InputArea-prompt")
            expect(prompts.first).to_have_text(re.compile(r"\[(\*|\d+)\]"), timeout=CELL_S * 1000)
            expect(prompts.nth(PANIC)).to_have_text(re.compile(r"\[\d+\]"), timeout=RUN_ALL_S * 1000)
            for name, index, check in checks:
                try:
                    check()
                except AssertionError as err:
                    shot = tmp_path / f"failed-{len(failures)}.png"
                    cell(index).scroll_into_view_if_needed()
                    page.screenshot(path=shot)
                    failures.append(f"{name}: {err}\n  screenshot: {shot}")
        except Exception as err:
            shot = tmp_path / "failed.png"
            page.screenshot(path=shot)
            err.add_note(f"screenshot: {shot}\nJupyterLab's log: {log_path}")
            raise
        finally:
            context.close()
        assert not failures, "\n".join(failures) + f"\nJupyterLab's log: {log_path}"
