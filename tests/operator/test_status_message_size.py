"""Condition messages fit the status schema, however long the input they quote.

The API server refuses a whole status patch when one condition message is longer than the
schema's maxLength: the InvalidSpec a person should read would then never show, and every
retry would be refused again. The fake API server here refuses what the CRD's status schema
refuses (tests/operator/crd_validation.py), as the real one answers 422.
"""

import asyncio
import copy
import pathlib
import re

import pydantic
import pytest
import yaml

from holeblend_operator import kube
from holeblend_operator.api import BlendDeployment, format_validation_error
from holeblend_operator.crd import open_api_schema
from holeblend_operator.handlers import FIRST_CREATE
from holeblend_operator.reconcile import InvalidSpec, reconcile
from holeblend_operator.status import Observed, Problem, build_status, invalid_spec_status
from tests.operator.crd_validation import api_server_errors, object_errors

ROOT = pathlib.Path(__file__).parents[2]
STATUS_SCHEMA = open_api_schema()["properties"]["status"]
MESSAGE_MAX_LENGTH = STATUS_SCHEMA["properties"]["conditions"]["items"]["properties"]["message"][
    "maxLength"
]
LONG = 40_000


class StatusSchemaServer:
    """Keeps the owner's status, refusing a status patch the CRD's schema refuses."""

    def __init__(self):
        self.status: dict = {}

    async def patch_status(self, namespace, name, status):
        errors = object_errors({**self.status, **copy.deepcopy(status)}, STATUS_SCHEMA)
        if errors:
            raise kube.Invalid(f"PATCH BlendDeployment: {errors[0][:300]}")
        self.status |= copy.deepcopy(status)
        return {}


def stored_manifest(**blend) -> dict:
    """A manifest as stored before the CRD bounded its fields: the models refuse it."""
    body = yaml.safe_load((ROOT / "examples" / "cpu.yaml").read_text())
    body["metadata"].update(uid="u-1", generation=2, namespace="default")
    body["spec"]["blend"].update(blend)
    return body


def degraded_message(status: dict) -> str:
    return next(c["message"] for c in status["conditions"] if c["type"] == "Degraded")


def test_a_long_refused_value_is_quoted_by_its_start_and_its_length():
    value = "x" * LONG
    with pytest.raises(pydantic.ValidationError) as caught:
        BlendDeployment.model_validate(stored_manifest(separator=value))
    message = format_validation_error(caught.value)
    assert message.startswith("spec.blend.separator: ")
    assert f"{value[:100]!r}... ({LONG} characters)" in message
    assert value[:101] not in message
    assert len(message) < 1000


def test_an_invalid_spec_with_a_long_value_shows_in_the_status_the_api_server_accepts():
    """A 40,000-character separator stored before the CRD's bound: the reconcile reports
    InvalidSpec (not a refused status patch, retried at every backoff), and the status
    names the field."""
    body = stored_manifest(separator="x" * LONG)
    assert api_server_errors(body)  # the CRD refuses it now: it can only come from before
    server = StatusSchemaServer()

    with pytest.raises(InvalidSpec):
        asyncio.run(reconcile(server, body, FIRST_CREATE, "t1"))

    assert server.status["phase"] == "Degraded"
    assert degraded_message(server.status).startswith("spec.blend.separator: ")


def test_an_over_long_condition_message_is_cut_to_the_schema_bound_at_a_character():
    """Two-byte characters: a cut by bytes would split one, a cut by characters does not."""
    message = "spec.engine.env: é" + "é" * (2 * MESSAGE_MAX_LENGTH)
    status = invalid_spec_status(3, message, [], "t")
    written = degraded_message(status)

    assert object_errors(status, STATUS_SCHEMA) == []
    assert len(written) == MESSAGE_MAX_LENGTH
    assert written.startswith("spec.engine.env: éé")
    cut = re.search(r"\(cut: (\d+) characters in all\)$", written)
    assert cut and int(cut[1]) > len(message)  # the whole text, the fix it names included
    written.encode("utf-8")  # no lone half of a character


def test_a_problem_with_a_long_message_still_gives_a_status_the_schema_accepts():
    body = stored_manifest()
    bd = BlendDeployment.model_validate(body)
    problem = Problem("ChildRejected", "the API server said: " + "y" * LONG)

    status = build_status(bd, Observed(None, None, [], problem), [], "t")

    assert object_errors(status, STATUS_SCHEMA) == []
    assert degraded_message(status).startswith("the API server said: yyy")
