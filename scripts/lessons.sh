#!/usr/bin/env bash
# Sets everything up and runs the day-39 lessons: every notebook in
# notebooks/ is executed through the vramlab kernel and saved with its
# outputs, and written as an HTML page into rendered/. CPU and the bundled
# synthetic data by default.
source "$(dirname "$0")/setup.sh"

say "installing the kernelspec for this user (JupyterLab, VS Code)"
"$KERNEL_BIN" install --user

say "running the lessons"
.venv/bin/python scripts/run_notebooks.py --in-place notebooks/*.ipynb

say "writing the executed notebooks as HTML pages into rendered/"
.venv/bin/python scripts/render_notebooks.py --out rendered notebooks/*.ipynb
