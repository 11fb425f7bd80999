"""docs/memory.md: its estimate and plan snippets run as written and print what the page shows."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


@pytest.mark.slow
def test_the_memory_page_runs_and_prints_what_it_shows() -> None:
    text = PAGE.read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)
    shown = re.findall(r"```text\n(.*?)```", text, re.S)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code[0] + code[1], str(PAGE), "exec"), {})  # the third snippet needs the job's GPUs
    printed = out.getvalue()
    assert printed == shown[0] + shown[1], "docs/memory.md shows other numbers than its code prints"
