"""Every example manifest passes the API server's checks and the models."""

from pathlib import Path

import pytest
import yaml

from holeblend_operator.api import BlendDeployment
from tests.operator.crd_validation import api_server_errors

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_the_documented_examples_exist():
    names = {path.stem for path in EXAMPLES}
    assert {"minimal", "cpu", "nvidia"} <= names
    assert any(name.startswith("ascend") for name in names)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_passes_schema_and_cel(path):
    assert api_server_errors(yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_passes_the_models(path):
    bd = BlendDeployment.model_validate(yaml.safe_load(path.read_text()))
    assert bd.metadata.name
