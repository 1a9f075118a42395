"""The CRD installs: its schema is structural as kube-apiserver checks it (ValidateStructural).

Under anyOf, allOf, oneOf and not a structural schema may only say what a value must satisfy,
never its type; the one exception is an x-kubernetes-int-or-string node's anyOf of exactly
`{type: integer}` and `{type: string}`, compared field by field, so a `minimum` inside it makes
the whole CRD refused ("anyOf[0].type: Forbidden: must be empty to be structural").
"""

import copy
from pathlib import Path

import yaml

from holeblend_operator.crd import build_crd
from tests.operator.crd_validation import api_server_errors, structural_errors

from .test_kube_rules import MINIMAL, model_problem

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "blenddeployments.blend.holeblend.io.yaml"


def _schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _quantity(any_of: list) -> dict:
    quantity = {"x-kubernetes-int-or-string": True, "anyOf": any_of}
    return {"type": "object", "properties": {"q": quantity}}


def test_the_generated_crd_is_structural():
    assert structural_errors(_schema(build_crd())) == []


def test_the_committed_crd_is_structural():
    assert structural_errors(_schema(yaml.safe_load(CRD_FILE.read_text()))) == []


def test_an_int_or_string_any_of_with_a_bound_in_it_is_not_structural():
    bounded = _quantity([{"type": "integer", "minimum": 0}, {"type": "string"}])
    assert structural_errors(bounded) == [
        "openAPIV3Schema.properties[q].anyOf[0].type: must be empty to be structural",
        "openAPIV3Schema.properties[q].anyOf[1].type: must be empty to be structural",
    ]
    assert structural_errors(_quantity([{"type": "integer"}, {"type": "string"}])) == []


def test_types_under_any_of_are_refused_outside_int_or_string():
    schema = {"type": "object", "properties": {"x": {"anyOf": [{"type": "string"}]}}}
    assert structural_errors(schema) == [
        "openAPIV3Schema.properties[x].anyOf[0].type: must be empty to be structural"
    ]


def test_negative_integer_quantities_are_still_refused_and_quoted_ones_accepted():
    for section in ("requests", "limits"):
        manifest = copy.deepcopy(MINIMAL)
        manifest["spec"]["engine"] = {"resources": {section: {"cpu": -1}}}
        assert any("-1 is less than the minimum of 0" in e for e in api_server_errors(manifest))
        assert model_problem(manifest) is not None
        manifest["spec"]["engine"] = {"resources": {section: {"cpu": 2}}}
        assert api_server_errors(manifest) == [] and model_problem(manifest) is None
    manifest = copy.deepcopy(MINIMAL)
    manifest["spec"]["engine"] = {"shmSize": -1}
    assert api_server_errors(manifest) and model_problem(manifest) is not None
