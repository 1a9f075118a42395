"""Integer fields read JSON numbers as vLLM's server does: `1.0` is 1, `1.5` is a 400."""

import pytest

from holeblend_runtime.serve.requests import BadRequest, parse_chat, parse_completion

SEP = " # #"


def parse(kind: str, **fields):
    if kind == "completion":
        return parse_completion({"model": "m", "prompt": "Q?", **fields}, SEP, lambda _: False)
    body = {"model": "m", "messages": [{"role": "user", "content": "Q?"}], **fields}
    return parse_chat(body, SEP, lambda _: False)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize(
    "fields",
    [
        {"n": 1.0},
        {"seed": 1.0},
        {"seed": -7.0},
        {"top_k": 40.0},
        {"top_k": -1.0},
        {"top_logprobs": 0.0},
        {"min_tokens": 0.0},
        {"best_of": 1.0},
    ],
)
def test_an_integral_float_is_accepted_where_an_integer_is(kind, fields):
    """Some JSON encoders write every number as a float (`"n": 1.0`): vLLM's server reads
    it as the integer, and these requests were a 400 on CPU pods."""
    assert parse(kind, **fields).question == "Q?"


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_an_integral_float_max_tokens_is_read_as_the_integer(kind, field):
    request = parse(kind, **{field: 16.0})
    assert request.max_tokens == 16 and type(request.max_tokens) is int
    assert request.max_tokens_field == field


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 1.5),
        ("seed", 0.5),
        ("top_k", 1.5),
        ("max_tokens", 16.5),
        ("max_completion_tokens", 2.5),
        ("max_tokens", 0.0),
        ("top_logprobs", 0.5),
        ("n", float("inf")),
        ("max_tokens", float("nan")),
    ],
)
def test_a_fractional_or_non_finite_number_is_refused_naming_the_field(kind, field, value):
    with pytest.raises(BadRequest) as caught:
        parse(kind, **{field: value})
    assert caught.value.param == field


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", True),
        ("seed", True),
        ("top_k", False),
        ("max_tokens", True),
        ("max_completion_tokens", True),
        ("top_logprobs", False),
        ("best_of", True),
        ("n", "1"),
        ("seed", 2.0**63),
    ],
)
def test_a_boolean_string_or_out_of_range_value_is_still_refused(kind, field, value):
    with pytest.raises(BadRequest) as caught:
        parse(kind, **{field: value})
    assert caught.value.param == field


def test_a_zero_logprobs_as_a_float_still_asks_for_logprobs_and_is_refused():
    """`logprobs: 0` asks for the chosen tokens' logprobs; written `0.0` it asks the same."""
    with pytest.raises(BadRequest) as caught:
        parse("completion", logprobs=0.0)
    assert caught.value.param == "logprobs"
