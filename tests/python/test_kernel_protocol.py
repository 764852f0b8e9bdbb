"""jupyter_kernel_test's protocol suite against the installed vramlab kernelspec."""
from __future__ import annotations

import unittest

import jupyter_kernel_test as jkt


class VramlabKernelTests(jkt.KernelTests):
    kernel_name = "vramlab"
    language_name = "rust"
    file_extension = ".rs"

    code_hello_world = 'println!("hello, world");'
    code_stderr = 'eprintln!("written to stderr");'

    completion_samples = [
        {"text": "std::mem::swa", "matches": {"swap(x, y)"}},
        {"text": "let numbers = vec![1, 2, 3];\nnumbers.len"},
    ]

    complete_code_samples = ["1 + 1", "let v = vec![1, 2];", "fn f() -> u8 { 1 }", "let s = \"{\";"]
    incomplete_code_samples = ["fn f() {", "let v = vec![1,", "let s = \"open", "/* comment"]
    invalid_code_samples = ["let x = (1, 2];", "fn f() { }}"]

    code_page_something = "%doc std::vec::Vec"

    code_generate_error = 'panic!("this cell fails on purpose")'

    code_execute_result = [
        {"code": "6 * 7", "result": "42"},
        {"code": "\"vram\".len()", "result": "4"},
        {"code": "vec![1u8, 2, 3]", "result": "[1, 2, 3]"},
    ]

    code_display_data = [
        {
            "code": 'vramlab::render::display(&vramlab::render::Bundle::plain("shown").with("text/html", "<b>shown</b>"));',
            "mime": "text/html",
        },
        {
            "code": 'vramlab::render::display(&vramlab::render::Table::new(["bill", "bytes"]).row(["input", "602112"]));',
            "mime": "text/plain",
        },
    ]

    code_history_pattern = "6 * ?"
    supported_history_operations = ("tail", "range", "search")

    code_inspect_sample = "std::vec::Vec"

    code_clear_output = "vramlab::render::clear_output(false);"

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        # The first cell builds (or, usually, loads) the library; give it time
        # here rather than inside a test that waits only 15 s for a reply.
        cls.kc.execute_interactive("let _ = vramlab::render::Bundle::plain(\"warm\");", timeout=1800)


class VramlabIopubWelcome(jkt.IopubWelcomeTests):
    kernel_name = "vramlab"
    support_iopub_welcome = True


if __name__ == "__main__":
    unittest.main()
