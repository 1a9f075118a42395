"""The README's runtime example runs and prints what the README says it prints."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_readme_runtime_example_prints_what_the_readme_claims():
    text = README.read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    claimed = re.search(r"prints `([^`]+)`", text).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    first_line, answer = out.getvalue().splitlines()[:2]
    assert first_line == claimed
    assert "Lyon" in answer
