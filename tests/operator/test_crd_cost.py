"""The CRD installs: every CEL rule is within the API server's estimated cost budgets.

When a CRD is created or updated, kube-apiserver estimates each rule's worst-case cost from
the schema's bounds (maxLength, maxItems, maxProperties) and refuses the whole CRD when one
rule is over 10,000,000 or all rules together are over 100,000,000 ("estimated rule cost
exceeds budget"). tests/operator/crd_validation.py emulates the estimate of Kubernetes 1.30,
the oldest version the chart supports.
"""

from pathlib import Path

import yaml

from holeblend_operator.crd import build_crd
from tests.operator.crd_validation import (
    MAX_REQUEST_SIZE,
    STATIC_ESTIMATED_COST_LIMIT,
    cost_errors,
    rule_cost,
    rule_costs,
)

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "blenddeployments.blend.holeblend.io.yaml"
QUANTITY = {"x-kubernetes-int-or-string": True, "maxLength": 64}


def _schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _quantities(max_properties: int) -> dict:
    return {"type": "object", "maxProperties": max_properties, "additionalProperties": QUANTITY}


def test_every_rule_of_the_generated_crd_is_within_the_cost_budgets():
    assert cost_errors(_schema(build_crd())) == []


def test_every_rule_of_the_committed_crd_is_within_the_cost_budgets():
    assert cost_errors(_schema(yaml.safe_load(CRD_FILE.read_text()))) == []


def test_an_int_or_string_value_costs_the_whole_request_whatever_its_max_length():
    # Kubernetes 1.30 to 1.33 size x-kubernetes-int-or-string as the request, not maxLength.
    bounded = rule_cost("quantity(string(self)).isInteger()", QUANTITY)
    unbounded = rule_cost(
        "quantity(string(self)).isInteger()", {"x-kubernetes-int-or-string": True}
    )
    assert bounded == unbounded > 2 * (MAX_REQUEST_SIZE // 10)


def test_a_string_is_sized_by_its_max_length():
    short = {"type": "string", "maxLength": 10}
    assert rule_cost("self.startsWith('a') && self.matches('^a+$')", short) < 100
    unbounded = {"type": "string"}
    assert rule_cost("self.matches('^a+$')", unbounded) > MAX_REQUEST_SIZE // 10


def test_a_rule_over_a_list_without_max_items_is_refused():
    names = {"type": "string", "maxLength": 64}
    rule = {"rule": "self.all(x, x.matches('^[a-z]+$'))", "message": "lowercase"}
    unbounded = {"type": "array", "items": names, "x-kubernetes-validations": [rule]}
    assert cost_errors(unbounded) and "exceeds budget" in cost_errors(unbounded)[0]
    assert cost_errors({**unbounded, "maxItems": 64}) == []


def test_a_rule_under_a_list_counts_once_per_item_toward_the_budgets():
    rule = {"rule": "quantity(string(self)).isInteger()", "message": "whole"}
    item = {**QUANTITY, "x-kubernetes-validations": [rule]}
    alone = rule_cost(rule["rule"], item)
    listed = {"type": "array", "maxItems": 16, "items": item}
    assert [cost for _, _, cost in rule_costs(listed)] == [16 * alone]
    assert cost_errors(listed) and "exceeds budget" in cost_errors(listed)[0]


def test_the_resource_rules_fit_only_because_resource_lists_are_bounded():
    # Comparing each request with its limit reads two quantities per key: at 16 keys this
    # rule alone is twice its budget.
    rule = (
        "!has(self.requests) || !has(self.limits) || self.requests.all(k, !(k in self.limits) || "
        "quantity(string(self.requests[k])).compareTo(quantity(string(self.limits[k]))) <= 0)"
    )

    def resources(max_properties: int) -> dict:
        sections = {name: _quantities(max_properties) for name in ("requests", "limits")}
        return {"type": "object", "properties": sections}

    engine = _schema(build_crd())["properties"]["spec"]["properties"]["engine"]
    bound = engine["properties"]["resources"]["properties"]["requests"]["maxProperties"]
    assert rule_cost(rule, resources(bound)) <= STATIC_ESTIMATED_COST_LIMIT
    assert rule_cost(rule, resources(16)) > 2 * STATIC_ESTIMATED_COST_LIMIT
