"""Request bodies in both RAG shapes -> system, documents, question; 400s name the field."""

import pytest

from holeblend_runtime.serve.requests import BadRequest, parse_chat, parse_completion

SEP = " # #"


def never_control(_: str) -> bool:
    return False


def completion(**body):
    return parse_completion({"model": "m", **body}, SEP, never_control)


def chat(**body):
    return parse_chat({"model": "m", **body}, SEP, never_control)


def test_lmcache_completion_prompt_splits_on_the_separator():
    request = completion(prompt="Be brief. # # Doc one. # # Doc two. # # Why?")
    assert request.system == "Be brief."
    assert request.documents == ("Doc one.", "Doc two.")
    assert request.question == "Why?"


def test_lmcache_chat_user_message_splits_after_the_system_message():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "D1 # # Q?"},
    ]
    request = chat(messages=messages)
    assert (request.system, request.documents, request.question) == ("Be brief.", ("D1",), "Q?")


def test_lmcache_chat_without_system_message_takes_the_first_piece_as_system():
    request = chat(messages=[{"role": "user", "content": "Sys # # D1 # # Q?"}])
    assert (request.system, request.documents, request.question) == ("Sys", ("D1",), "Q?")


def test_structured_documents_extension():
    request = chat(
        messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}],
        documents=["a", "b"],
    )
    assert (request.system, request.documents, request.question) == ("S", ("a", "b"), "Q?")
    request = completion(prompt="Q?", documents=["a"], system="S")
    assert (request.system, request.documents, request.question) == ("S", ("a",), "Q?")


def test_text_parts_of_a_message_are_joined_by_newlines_as_vllm_joins_them():
    """The same chat request must build the same prompt on CPU pods as on vLLM pods,
    whose server joins a message's text parts with newlines for a string template."""
    parts = [{"type": "text", "text": "Doc A."}, {"type": "text", "text": "What?"}]
    request = chat(messages=[{"role": "user", "content": parts}])
    assert request.question == "Doc A.\nWhat?"


def test_text_without_separator_is_a_question_without_documents():
    request = completion(prompt="Hello there")
    assert (request.system, request.documents, request.question) == ("", (), "Hello there")


def test_stream_options_and_max_tokens_are_read():
    request = completion(
        prompt="Q", stream=True, stream_options={"include_usage": True}, max_tokens=3
    )
    assert request.stream and request.include_usage and request.max_tokens == 3


@pytest.mark.parametrize("parse", [completion, chat])
def test_a_null_max_completion_tokens_leaves_max_tokens_in_force(parse):
    """JSON null means unset: a client that serialises every field sends
    `"max_completion_tokens": null` next to its `max_tokens`, which must still apply
    (else the answer is cut at the server's default)."""
    text = (
        {"prompt": "q"} if parse is completion else {"messages": [{"role": "user", "content": "q"}]}
    )
    assert parse(**text, max_tokens=256, max_completion_tokens=None).max_tokens == 256
    assert parse(**text, max_tokens=None, max_completion_tokens=7).max_tokens == 7
    assert parse(**text, max_tokens=256, max_completion_tokens=7).max_tokens == 7
    assert parse(**text, max_tokens=None, max_completion_tokens=None).max_tokens is None


def test_a_bad_max_completion_tokens_is_named_in_the_error():
    """The 400 names the field that was read."""
    with pytest.raises(BadRequest) as caught:
        completion(prompt="q", max_tokens=5, max_completion_tokens=0)
    assert caught.value.param == "max_completion_tokens"
    with pytest.raises(BadRequest) as caught:
        completion(prompt="q", max_tokens=0, max_completion_tokens=None)
    assert caught.value.param == "max_tokens"


def test_max_tokens_is_checked_when_max_completion_tokens_wins():
    """A `max_tokens` of the wrong type next to a valid `max_completion_tokens` was
    accepted unread."""
    with pytest.raises(BadRequest) as caught:
        completion(prompt="q", max_tokens="10", max_completion_tokens=5)
    assert caught.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_completion_tokens": 7}, "max_completion_tokens"),
        ({"max_tokens": 7}, "max_tokens"),
        ({"max_tokens": 9, "max_completion_tokens": 7}, "max_completion_tokens"),
        ({"max_tokens": 7, "max_completion_tokens": None}, "max_tokens"),
        ({}, "max_tokens"),
    ],
)
def test_the_request_names_the_field_its_max_tokens_came_from(body, field):
    """Errors about the token limit (over the context) name the field the client sent."""
    request = chat(messages=[{"role": "user", "content": "q"}], **body)
    assert request.max_tokens_field == field


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_a_zero_logprobs_field_asks_for_logprobs_and_is_refused(field):
    """`logprobs: 0` (completions) and `prompt_logprobs: 0` ask for the logprob of each
    chosen token (OpenAI's completions API, vLLM): they were accepted as the default and
    the answer came with `logprobs: null`."""
    with pytest.raises(BadRequest) as caught:
        completion(prompt="Q?", **{field: 0})
    assert caught.value.param == field


def test_fields_that_ask_for_no_logprobs_are_accepted():
    request = completion(prompt="Q?", logprobs=False, top_logprobs=0, prompt_logprobs=None)
    assert request.question == "Q?"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": 3}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "q", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "q", "max_tokens": "10"}, "max_tokens"),
        ({"prompt": "q", "max_tokens": True}, "max_tokens"),
        ({"prompt": "q", "stream": "yes"}, "stream"),
        ({"prompt": "q", "documents": "a"}, "documents"),
        ({"prompt": "q", "documents": ["a", ""]}, "documents[1]"),
        ({"prompt": "q", "documents": ["a"], "system": "x # # y"}, "system"),
        ({"prompt": "S # # # # Q"}, "prompt"),
        ({"prompt": "q", "n": 2}, "n"),
    ],
)
def test_bad_completion_bodies_name_the_field(body, param):
    with pytest.raises(BadRequest) as caught:
        completion(**body)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "user", "content": ""}], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "messages[1]"),
    ],
)
def test_bad_messages_name_the_field(messages, param):
    with pytest.raises(BadRequest) as caught:
        chat(messages=messages)
    assert caught.value.param == param


def test_control_tokens_are_refused_naming_the_field():
    with pytest.raises(BadRequest) as caught:
        parse_completion(
            {"model": "m", "prompt": "S # # doc <|im_end|> # # Q"}, SEP, lambda t: t == "<|im_end|>"
        )
    assert caught.value.param == "documents[0]" and "<|im_end|>" in str(caught.value)


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(BadRequest, match="JSON object"):
        parse_completion([1, 2], SEP, never_control)


def test_missing_model_is_refused():
    with pytest.raises(BadRequest) as caught:
        parse_completion({"prompt": "q"}, SEP, never_control)
    assert caught.value.param == "model"


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, ()), ("END", ("END",)), (["a", "bc"], ("a", "bc"))],
)
def test_stop_is_a_string_or_a_list_of_strings(stop, expected):
    assert completion(prompt="Q?", stop=stop).stop == expected


@pytest.mark.parametrize("parse", [completion, chat])
def test_an_empty_stop_list_is_no_stop_sequences_as_in_vllm(parse):
    """`stop: []` is vLLM's default for the field, and clients that send every field send
    it: it was a 400, so a request vLLM pods answer was refused on CPU pods."""
    text = (
        {"prompt": "q"} if parse is completion else {"messages": [{"role": "user", "content": "q"}]}
    )
    assert parse(**text, stop=[]).stop == ()


@pytest.mark.parametrize(
    ("stop", "param"), [("", "stop"), ([""], "stop[0]"), (["a", ""], "stop[1]")]
)
def test_an_empty_stop_string_is_refused_as_vllm_refuses_it(stop, param):
    with pytest.raises(BadRequest) as caught:
        completion(prompt="Q?", stop=stop)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stop": 5}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["ok", 3]}, "stop[1]"),
        ({"stop": "x" * 257}, "stop"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"echo": True}, "echo"),
        ({"logprobs": 1}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"user": 7}, "user"),
        ({"promt": "typo"}, "promt"),
        ({"messages": []}, "messages"),  # a chat field on the completions endpoint
        ({"stream_options": []}, "stream_options"),  # falsy, yet not an object
        ({"stream_options": False}, "stream_options"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"system": 5}, "system"),  # checked without documents too
        ({"documents": 0}, "documents"),
    ],
)
def test_fields_are_checked_by_type_range_and_support(body, param):
    with pytest.raises(BadRequest) as error:
        completion(prompt="Q?", **body)
    assert error.value.param == param


def test_null_means_the_default_for_every_optional_field():
    nulls = dict.fromkeys(("stream", "n", "stop", "temperature", "logprobs", "tools", "seed"))
    request = completion(prompt="Q?", **nulls)
    assert request.stream is False and request.stop == ()


def test_null_documents_mean_the_default_shape_on_both_endpoints():
    """`documents: null` (a client that sends every optional field) is LMCache's shape, as
    if absent: it was a 400 "documents: must be a list of strings"."""
    request = completion(prompt="Be brief. # # Doc one. # # Why?", documents=None, system=None)
    assert (request.system, request.documents, request.question) == (
        "Be brief.",
        ("Doc one.",),
        "Why?",
    )
    request = chat(messages=[{"role": "user", "content": "S # # D1 # # Q?"}], documents=None)
    assert (request.system, request.documents, request.question) == ("S", ("D1",), "Q?")


def test_a_completion_system_without_documents_is_the_system_prompt():
    """`system` without `documents` was silently dropped (the prompt was read in
    LMCache's shape): the answer came without the system prompt the client sent."""
    request = completion(prompt="Why?", system="Answer as a pirate.")
    assert (request.system, request.documents, request.question) == (
        "Answer as a pirate.",
        (),
        "Why?",
    )


@pytest.mark.parametrize("documents", [None, ["Doc one."]])
def test_a_whitespace_completion_system_is_no_system_prompt_as_in_lmcache_shape(documents):
    """`system: "  "` was kept as the system prompt, while the same text before the first
    separator of LMCache's shape is none: the two shapes of one request built different
    prompts (an empty system turn against one holding the spaces)."""
    structured = completion(prompt="Why?", system="  ", documents=documents)
    in_text = completion(prompt="  # # Doc one. # # Why?" if documents else "Why?")
    assert structured.system == in_text.system == ""


def test_a_lone_surrogate_is_refused_naming_the_field():
    with pytest.raises(BadRequest) as error:
        completion(prompt="Q?", documents=["fine", "bad \udc80"])
    assert error.value.param == "documents[1]"


@pytest.mark.parametrize(
    ("field", "value"),
    [("frequency_penalty", 0.5), ("presence_penalty", -1), ("repetition_penalty", 1.2)],
)
@pytest.mark.parametrize("parse", [completion, chat])
def test_a_penalty_is_refused_as_greedy_decoding_would_not_apply_it(parse, field, value):
    """A penalty changes even a greedy answer (OpenAI's API and vLLM apply it at
    temperature 0): it was accepted and ignored, and the answer was the one without it."""
    text = (
        {"prompt": "q"} if parse is completion else {"messages": [{"role": "user", "content": "q"}]}
    )
    with pytest.raises(BadRequest) as caught:
        parse(**text, **{field: value})
    assert caught.value.param == field


def test_neutral_penalties_are_accepted():
    """What clients send by default: LangChain's `frequency_penalty: 0`, `vllm bench serve`'s
    `repetition_penalty: 1.0`."""
    request = completion(
        prompt="Q?", frequency_penalty=0, presence_penalty=0.0, repetition_penalty=1.0
    )
    assert request.question == "Q?"


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"include_usgae": True}, "stream_options.include_usgae"),
        (
            {"include_usage": True, "continuous_usage_stats": True},
            "stream_options.continuous_usage_stats",
        ),
        ({"include_obfuscation": "no"}, "stream_options.include_obfuscation"),
    ],
)
def test_stream_options_keys_are_checked_as_the_top_level_fields(options, param):
    """A misspelt `include_usage` was accepted and the stream came without its usage;
    vLLM's `continuous_usage_stats: true` (the usage in every chunk) was ignored."""
    with pytest.raises(BadRequest) as caught:
        completion(prompt="Q?", stream=True, stream_options=options)
    assert caught.value.param == param


def test_known_stream_options_are_accepted():
    options = {"include_usage": True, "include_obfuscation": False, "continuous_usage_stats": False}
    assert completion(prompt="Q?", stream=True, stream_options=options).include_usage


def test_a_later_turn_is_refused_for_its_place_not_its_content():
    """An assistant message with tool calls (`content: null`, valid in OpenAI's API) was
    refused as "messages[1].content: must be a string or a list of text parts": the
    client was told to fix a field that was right, not that the engine takes one turn."""
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
    ]
    with pytest.raises(BadRequest, match="one optional system message and one user") as caught:
        chat(messages=messages)
    assert caught.value.param == "messages[1]"


def im_end(text: str) -> bool:
    return text == "<|im_end|>"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (
            [
                {"role": "system", "content": "Be <|im_end|> brief."},
                {"role": "user", "content": "Q?"},
            ],
            "messages[0].content",
        ),
        (
            [{"role": "developer", "content": "S # # x"}, {"role": "user", "content": "D # # Q?"}],
            "messages[0].content",
        ),
        ([{"role": "user", "content": "Sys <|im_end|> # # D # # Q?"}], "messages[0].content"),
        (
            [{"role": "system", "content": "S"}, {"role": "user", "content": "Why <|im_end|>?"}],
            "messages[1].content",
        ),
        (
            [{"role": "system", "content": "S"}, {"role": "user", "content": "D # # # # Q"}],
            "messages[1].content",
        ),
    ],
)
def test_a_chat_text_error_names_the_message_it_came_from(messages, param):
    """Errors about a chat's system prompt named `system`, a field the chat endpoint does
    not take (sent, it is an unknown field), and those about its question `messages`: the
    error names the content field of the message the text came from."""
    with pytest.raises(BadRequest) as caught:
        parse_chat({"model": "m", "messages": messages}, SEP, im_end)
    assert caught.value.param == param


def test_a_completion_prompts_system_piece_is_named_prompt():
    """In LMCache's shape the system prompt is the prompt's first piece: the client sent no
    `system` field."""
    with pytest.raises(BadRequest) as caught:
        parse_completion({"model": "m", "prompt": "S <|im_end|> # # D # # Q"}, SEP, im_end)
    assert caught.value.param == "prompt"
    with pytest.raises(BadRequest) as caught:
        parse_completion({"model": "m", "prompt": "Q", "system": "S <|im_end|>"}, SEP, im_end)
    assert caught.value.param == "system"
