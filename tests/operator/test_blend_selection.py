"""spec.blend.selection (a strategy or a budget mix) and spec.blend.filterLayers (gradual
filtering): refused alike by the models and the emulated API server where the CRD can say
it, rendered into blend.json, and restart keys (a change rolls the pods)."""

import json
import re

import pydantic
import pytest

from holeblend_contract.blend_settings import Selection, parse_selection
from holeblend_operator.api import (
    SELECTION_MAX_LENGTH,
    SELECTION_PATTERN,
    BlendDeployment,
    format_validation_error,
)
from holeblend_operator.render import config_hash, render_children
from tests.operator.crd_validation import api_server_errors
from tests.operator.test_render import MINIMAL, find


def manifest(**blend) -> dict:
    return {**MINIMAL, "spec": {**MINIMAL["spec"], "blend": blend}}


def model_problem(spec: dict) -> str | None:
    try:
        BlendDeployment.model_validate(spec)
    except pydantic.ValidationError as error:
        return format_validation_error(error)
    return None


def settings(**blend) -> dict:
    bd = BlendDeployment.model_validate(manifest(**blend))
    return json.loads(
        find(render_children(bd), "ConfigMap", "runtime-config")["data"]["blend.json"]
    )


VALID = [
    *(s.value for s in Selection),
    "sinks:0.25+kDeviation",
    "kDeviation+sinks:0.25",
    "sinks:.25+query:0.25+kDeviation",
    "sinks:0.5+kDeviation:0.5",
    "random:1",
    "random:1.0",
    "sinks:0.05+query:0.1+vDeviation:0.1+kvDeviation:0.1+random:0.05+kDeviation",
]


@pytest.mark.parametrize("selection", VALID)
def test_strategies_and_mixes_pass_both_and_reach_blend_json(selection):
    assert model_problem(manifest(selection=selection)) is None
    assert api_server_errors(manifest(selection=selection)) == []
    assert settings(selection=selection)["selection"] == selection


GARBAGE = [
    "",
    "kdeviation",
    "kDeviation ",
    "sinks:0.25 + kDeviation",
    "sinks:+kDeviation",
    "sinks:0+kDeviation",
    "sinks:1.5+kDeviation",
    "sinks:-0.5+kDeviation",
    "sinks:1e-1+kDeviation",
    "sinks++kDeviation",
    "+kDeviation",
    "kDeviation+",
    "random; rm -rf /",
    "+".join(["sinks:0.1"] * 7),
    "kDeviation:0.1" * 20,
]


@pytest.mark.parametrize("selection", GARBAGE)
def test_garbage_is_refused_by_both(selection):
    problem = model_problem(manifest(selection=selection))
    assert problem is not None and problem.startswith("spec.blend.selection"), problem
    errors = api_server_errors(manifest(selection=selection))
    assert any(e.startswith("spec.blend.selection") for e in errors), errors


def test_the_models_message_names_the_strategies_and_the_mix_grammar():
    problem = model_problem(manifest(selection="kDev"))
    assert "kDeviation, vDeviation, kvDeviation, sinks, query, random" in problem
    assert "'sinks:0.25+kDeviation'" in problem


@pytest.mark.parametrize(
    ("selection", "says"),
    [
        ("sinks:0.5+kDeviation:0.75", "must not exceed 1"),
        ("sinks:0.5+kDeviation:0.25", "make them sum to 1 or leave one out"),
        ("sinks+kDeviation", "only one strategy may leave out its share"),
        ("sinks:0.25+sinks", "appears twice"),
    ],
)
def test_what_the_grammar_cannot_say_is_the_parsers_message(selection, says):
    """The pattern admits these (shares and repeats are beyond a regular expression); the
    operator refuses them with parse_selection's message (InvalidSpec, pods left running)."""
    assert api_server_errors(manifest(selection=selection)) == []
    problem = model_problem(manifest(selection=selection))
    assert problem.startswith("spec.blend.selection") and says in problem, problem


def test_the_pattern_admits_exactly_what_the_grammar_writes():
    pattern = re.compile(f"^{SELECTION_PATTERN}$")
    for text in VALID:
        assert pattern.fullmatch(text) and len(text) <= SELECTION_MAX_LENGTH
        parse_selection(text)
    for text in GARBAGE:
        assert not (pattern.fullmatch(text) and len(text) <= SELECTION_MAX_LENGTH), text


def test_a_stored_spec_with_the_old_enum_values_still_reads():
    for old in ("kDeviation", "random"):
        assert settings(selection=old)["selection"] == old
    assert settings()["selection"] == "kvDeviation"  # the default


# --- filterLayers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("blend", "layers"),
    [
        ({}, []),
        ({"filterLayers": [8]}, [8]),
        ({"checkLayer": 2, "filterLayers": [3, 8, 16, 255]}, [3, 8, 16, 255]),
    ],
)
def test_filter_layers_pass_both_and_reach_blend_json(blend, layers):
    assert model_problem(manifest(**blend)) is None
    assert api_server_errors(manifest(**blend)) == []
    assert settings(**blend)["filterLayers"] == layers


ORDER = "blend.filterLayers must be strictly increasing and above blend.checkLayer"


@pytest.mark.parametrize(
    "blend",
    [
        {"filterLayers": [16, 8]},
        {"filterLayers": [8, 8]},
        {"checkLayer": 8, "filterLayers": [8]},
        {"checkLayer": 10, "filterLayers": [4, 12]},
        {"filterLayers": [2, 3, 5, 4]},
    ],
)
def test_unordered_filter_layers_are_refused_by_both_with_the_same_message(blend):
    problem = model_problem(manifest(**blend))
    assert problem is not None and ORDER in problem and "lower checkLayer" in problem, problem
    errors = api_server_errors(manifest(**blend))
    assert any(e.startswith(".spec.blend") and ORDER in e for e in errors), errors


@pytest.mark.parametrize(
    ("layers", "server_says"),
    [
        ([1], "less than the minimum of 2"),
        ([256], "greater than the maximum of 255"),
        ([2, 3, 4, 5, 6], "is too long"),
        (["8"], "is not of type 'integer'"),
    ],
)
def test_filter_layers_out_of_range_are_refused_by_both(layers, server_says):
    assert model_problem(manifest(filterLayers=layers)).startswith("spec.blend.filterLayers")
    errors = api_server_errors(manifest(filterLayers=layers))
    assert any(e.startswith("spec.blend.filterLayers") and server_says in e for e in errors), errors


# --- restart keys ----------------------------------------------------------------------------


def test_changing_selection_or_filter_layers_rolls_the_pods():
    def hash_of(**blend):
        return config_hash(BlendDeployment.model_validate(manifest(**blend)))

    base = hash_of()
    assert hash_of(selection="sinks:0.25+kDeviation") != base
    assert hash_of(filterLayers=[8]) != base
    assert hash_of(filterLayers=[8]) != hash_of(filterLayers=[8, 16])
    assert hash_of(selection="kvDeviation", filterLayers=[]) == base
