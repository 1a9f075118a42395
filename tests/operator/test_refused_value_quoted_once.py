"""A refused value is quoted once in the message: where the validator's own message quotes
it, no "(got ...)" repeats it; where pydantic's message does not, "(got ...)" shows it."""

import copy
from pathlib import Path

import pydantic
import pytest
import yaml

from holeblend_operator.api import QUOTED_INPUT_MAX_LENGTH, BlendDeployment, format_validation_error

EXAMPLE = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "examples" / "cpu.yaml").read_text()
)
LONG = "x" * (3 * QUOTED_INPUT_MAX_LENGTH)


def refusal(path: str, value) -> str:
    body = copy.deepcopy(EXAMPLE)
    *parents, key = path.split(".")
    node = body
    for part in parents:
        node = node.setdefault(part, {})
    node[key] = value
    with pytest.raises(pydantic.ValidationError) as caught:
        BlendDeployment.model_validate(body)
    return format_validation_error(caught.value)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("metadata.name", "Bad_Name"),
        ("spec.blend.selection", "k-deviation"),
        ("spec.blend.kv.sharedUrl", "http://kv:6379"),
        ("spec.accelerator.networkInterface", "it's"),
        ("spec.engine.podLabels.team", 'say "hi"'),
        ("spec.blend.separator", LONG),
    ],
)
def test_a_value_the_validator_quotes_is_not_quoted_again(path, value):
    message = refusal(path, value)
    quoted = (
        repr(value)
        if len(value) <= QUOTED_INPUT_MAX_LENGTH
        else repr(value[:QUOTED_INPUT_MAX_LENGTH])
    )
    assert message.count(quoted) == 1, message
    assert "(got " not in message


@pytest.mark.parametrize(
    ("path", "value"), [("spec.replicas", "three"), ("spec.model.dtype", "float64")]
)
def test_a_value_the_message_leaves_out_is_shown_once(path, value):
    message = refusal(path, value)
    assert message.endswith(f"(got {value!r})")
    assert message.count(repr(value)) == 1
