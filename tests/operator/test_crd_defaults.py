"""The CRD installs: every default passes what kube-apiserver checks when a CRD is created.

kube-apiserver (`ValidateDefaults`) validates each `default` against its own node's schema
and runs that node's CEL rules on the default as written, without filling in nested
defaults first. A rule such as `self.type == 'cpu' || ...` on an object defaulting to `{}`
fails with "no such key" and the whole CRD is refused.
"""

from pathlib import Path

import yaml

from holeblend_operator.crd import build_crd
from tests.operator.crd_validation import cel_errors, default_errors, schema_errors

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "blenddeployments.blend.holeblend.io.yaml"


def _schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _object_with_rule(default: dict) -> dict:
    return {
        "type": "object",
        "default": default,
        "properties": {
            "type": {"type": "string", "default": "ascend"},
            "count": {"type": "integer", "default": 1},
        },
        "x-kubernetes-validations": [
            {"rule": "self.type == 'cpu' || self.count >= 1", "message": "count >= 1"}
        ],
    }


def test_every_default_of_the_generated_crd_passes_default_validation():
    assert default_errors(_schema(build_crd())) == []


def test_every_default_of_the_committed_crd_passes_default_validation():
    assert default_errors(_schema(yaml.safe_load(CRD_FILE.read_text()))) == []


def test_a_rule_reading_a_field_absent_from_an_empty_default_is_refused():
    errors = default_errors({"type": "object", "properties": {"a": _object_with_rule({})}})
    assert len(errors) == 1 and "cannot be evaluated" in errors[0], errors
    assert errors[0].startswith("openAPIV3Schema.properties[a].default")


def test_a_complete_default_passes_the_same_rule():
    schema = {
        "type": "object",
        "properties": {"a": _object_with_rule({"type": "ascend", "count": 1})},
    }
    assert default_errors(schema) == []


def test_a_default_that_breaks_its_own_rule_is_refused():
    schema = {
        "type": "object",
        "properties": {"a": _object_with_rule({"type": "ascend", "count": 0})},
    }
    assert default_errors(schema) == ["openAPIV3Schema.properties[a].default: count >= 1"]


def test_a_default_with_unknown_fields_is_refused():
    schema = _object_with_rule({"type": "cpu", "count": 0, "colour": "red"})
    assert "must not have unknown fields" in default_errors(schema)[0]


def test_a_default_of_the_wrong_type_is_refused():
    schema = {"type": "integer", "default": "three"}
    assert "'three' is not of type 'integer'" in default_errors(schema)[0]


def test_integers_in_number_fields_are_doubles_in_cel():
    schema = {
        "type": "object",
        "properties": {"low": {"type": "number"}, "high": {"type": "number"}},
        "x-kubernetes-validations": [{"rule": "self.low <= self.high", "message": "low > high"}],
    }
    assert cel_errors(schema, {"low": 0, "high": 0.5}) == []
    assert cel_errors(schema, {"low": 1, "high": 0.5}) == ["<root>: low > high"]


def test_nullable_nulls_are_neither_schema_nor_cel_errors():
    schema = {
        "type": "object",
        "properties": {
            "url": {
                "type": "string",
                "nullable": True,
                "x-kubernetes-validations": [{"rule": "self.size() > 3", "message": "short"}],
            }
        },
    }
    assert schema_errors(schema, {"url": None}) == []
    assert cel_errors(schema, {"url": None}) == []
    assert cel_errors(schema, {"url": "ab"}) == [".url: short"]
