"""The README's capture example runs and prints exactly the output shown under it."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_capture_readme_example_output_is_real() -> None:
    text = README.read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", text, re.S).group(1)
    torch.manual_seed(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    assert out.getvalue() == shown
