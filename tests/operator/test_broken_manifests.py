"""Broken manifests are rejected, with the field path and the fix, by every layer.

Each file in broken/ starts with `# expect:` (the message `render` and the operator give,
from the pydantic models) and `# server:` (what the API server says: the generated schema
validated with jsonschema, then the CRD's CEL rules evaluated by a CEL interpreter).
"""

import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
import yaml

from holeblend_operator.api import BlendDeployment, format_validation_error
from tests.operator.crd_validation import api_server_errors

BROKEN = sorted((Path(__file__).parent / "broken").glob("*.yaml"))
ACCEPTED_BY_SERVER = "accepted"
# The installed console script: `python -m` from the repository root would put the
# `operator/` folder in front of Python's own `operator` module.
OPERATOR_CLI = str(Path(sys.executable).parent / "holeblend-operator")


def _expectations(path: Path) -> tuple[str, str]:
    lines = path.read_text().splitlines()
    return lines[0].removeprefix("# expect: "), lines[1].removeprefix("# server: ")


def test_there_are_at_least_fifteen_broken_manifests():
    assert len(BROKEN) >= 15


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_models_reject_with_field_and_fix(path):
    expected, _ = _expectations(path)
    with pytest.raises(pydantic.ValidationError) as caught:
        BlendDeployment.model_validate(yaml.safe_load(path.read_text()))
    assert expected in format_validation_error(caught.value)


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_api_server_schema_and_cel_reject(path):
    _, expected = _expectations(path)
    errors = api_server_errors(yaml.safe_load(path.read_text()))
    if expected.startswith(ACCEPTED_BY_SERVER):
        assert errors == []
    else:
        assert any(expected in error for error in errors), errors


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_render_exits_1_with_one_line(path):
    expected, _ = _expectations(path)
    result = subprocess.run(
        [OPERATOR_CLI, "render", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in message
    assert expected in message
