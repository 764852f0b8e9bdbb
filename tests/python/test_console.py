"""jupyter console on the vramlab kernel, typed into as in a terminal: a cell and a magic."""
from __future__ import annotations

import pathlib
import re
import sys

import pexpect

KERNEL = "vramlab"
JUPYTER = pathlib.Path(sys.executable).parent / "jupyter"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PROMPT = re.compile(r"In \[(\d+)\]: ")

CELL = 'println!("typed into the console"); 6 * 7'
MAGIC = "%oomcheck resnet18 --batch 384 --res 224 --gpu rtx4060-laptop"


def test_a_cell_and_a_magic_in_jupyter_console() -> None:
    console = pexpect.spawn(
        str(JUPYTER),
        ["console", "--kernel", KERNEL, "--simple-prompt", "--no-confirm-exit"],
        encoding="utf-8",
        timeout=120,
        dimensions=(50, 200),
    )
    try:
        console.expect(PROMPT)

        console.sendline(CELL)
        console.expect(PROMPT)
        shown = ANSI.sub("", console.before)
        assert "typed into the console" in shown, shown
        assert re.search(r"Out\[\d+\]: 42", shown), shown

        console.sendline(MAGIC)
        console.expect(PROMPT)
        shown = ANSI.sub("", console.before)
        assert re.search(r"Out\[\d+\]:", shown) and "DOES NOT FIT" in shown and "RTX 4060 Laptop" in shown, shown

        console.sendeof()
        console.expect(pexpect.EOF)
    finally:
        console.close(force=True)
    assert console.exitstatus == 0, ANSI.sub("", console.before or "")
