"""OpenAI request bodies -> `RagRequest`; `BadRequest` naming the field otherwise.

Both endpoints give a system prompt, documents and a question, in one of two shapes:

- LMCache's CacheBlend shape: the separator inside the text. `/v1/completions`: `prompt` is
  `system SEP doc SEP ... SEP question`. `/v1/chat/completions`: the last user message is
  `[SEP] doc SEP ... SEP question` after a system message, or `system SEP doc ... SEP
  question` without one. Text without a separator is a question with no documents.
- The structured extension: a top-level `documents` list of strings; the question is
  `prompt` (completions, with an optional `system` string, none when whitespace only as
  in LMCache's shape; `system` alone is this shape with no documents) or the last user
  message (chat, with the system message as the system prompt). `documents: null` is as
  absent.

A chat without a system message (and, in LMCache's shape, without text before the first
separator) has no system prompt (None): the prompt gets the one the model's chat template
writes then, as vLLM renders it. A system message, even empty, is the system prompt.

The blend engine applies the model's chat template on both endpoints, decodes greedily
and supports one user turn. Text may not contain the template's control tokens
(`<|im_end|>` ...) or lone surrogates (text that is not Unicode).

Every top-level field is one of `FIELDS`: those the server implements, sampling fields
that are checked for type and range and then ignored (greedy decoding is what temperature
0 gives), and fields the blend engine does not implement, accepted only at their
default value (`logprobs: 5`, `echo: true`, `tools: [...]`, `frequency_penalty: 0.5`, ...
are a 400 naming the field). Any other field is a 400 naming it, as OpenAI's API does.
Integer fields also take an integral float (`1.0`: some JSON encoders write 1 so), as vLLM's
server does; `1.5` is a 400 naming the field. Types are otherwise JSON's own: `true` or `"1"`
for an integer is a 400, where vLLM's lax parsing reads 1.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

CONTROL_TOKEN = re.compile(r"<\|[^<>|\s]{1,64}\|>")


class BadRequest(ValueError):
    """A malformed request: answered with 400 and `param` naming the field."""

    def __init__(self, param: str | None, message: str, status: int = 400) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class RagRequest:
    """What the engine needs from one request."""

    # "completion" or "chat": the shape of the response.
    kind: str
    model: str
    # None: a chat without one (the chat template's default system prompt).
    system: str | None
    documents: tuple[str, ...]
    question: str
    # None: the server's default.
    max_tokens: int | None
    stream: bool
    # Streaming only: send a last chunk with the usage (OpenAI's stream_options).
    include_usage: bool
    # Stop sequences: the answer ends before the first one (not included in the text).
    stop: tuple[str, ...] = ()
    # Decode past the end-of-sequence token, to max_tokens (vLLM's extension).
    ignore_eos: bool = False
    # The field `max_tokens` came from, for the errors that name it.
    max_tokens_field: str = "max_tokens"
    # The fields the question and the system prompt came from (`messages[1].content`), for
    # the errors the prompt's build names them in.
    question_field: str = "prompt"
    system_field: str = "system"


def parse_completion(body: Any, separator: str, is_control_token: Callable[[str], bool]):
    body = _object(body)
    prompt = _prompt(body.get("prompt"))
    # `system` belongs to the structured shape: given without `documents`, it is the
    # system prompt of a question without documents (never silently dropped).
    if body.get("documents") is not None or body.get("system") is not None:
        system = _string(body.get("system"), "system")
        system = system if system.strip() else ""  # as LMCache's shape reads it
        documents, question = _documents(_or_default(body, "documents", [])), prompt
    else:
        system, documents, question = _split(prompt, separator, "prompt", has_system=False)
    request = _request("completion", body, system, documents, question)
    system_field = "system" if body.get("system") is not None else "prompt"
    return _checked(request, "prompt", separator, is_control_token, system_field)


def parse_chat(body: Any, separator: str, is_control_token: Callable[[str], bool]):
    body = _object(body)
    (system, system_field), (user, user_field) = _messages(body.get("messages"))
    if body.get("documents") is not None:  # null: the default, LMCache's shape
        documents, question = _documents(body["documents"]), user
    else:
        split_system, documents, question = _split(
            user, separator, user_field, has_system=system is not None
        )
        if system is None and split_system:  # the first piece of the user message
            system, system_field = split_system, user_field
    request = _request("chat", body, system, documents, question)
    return _checked(request, user_field, separator, is_control_token, system_field)


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest(None, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _request(kind: str, body: Mapping[str, Any], system, documents, question) -> RagRequest:
    _check_fields(body, kind)
    stream = _bool(_or_default(body, "stream", False), "stream")
    options = _or_default(body, "stream_options", {})
    if not isinstance(options, Mapping):
        raise BadRequest("stream_options", "must be an object")
    if options and not stream:  # as OpenAI's API and vLLM's server answer it
        raise BadRequest("stream_options", "may only be set with stream: true")
    _check_stream_options(options)
    n = _or_default(body, "n", 1)
    if _integral(n) != 1:
        raise BadRequest("n", f"only n=1 is supported, got {n!r}")
    max_tokens, max_tokens_field = _max_tokens(body)
    return RagRequest(
        kind=kind,
        model=_string(body.get("model"), "model", required=True),
        system=system,
        documents=documents,
        question=question,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=_bool(
            _or_default(options, "include_usage", False), "stream_options.include_usage"
        ),
        stop=_stop(body.get("stop")),
        ignore_eos=_bool(_or_default(body, "ignore_eos", False), "ignore_eos"),
        max_tokens_field=max_tokens_field,
    )


# At most this many stop sequences, each at most this many characters (OpenAI allows 4).
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256


def _stop(value: Any) -> tuple[str, ...]:
    """As vLLM's server reads it: `[]` (its default) and null are no stop sequences; an
    empty string, alone or in the list, is refused."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES:
        raise BadRequest(
            "stop", f"must be a string or a list of at most {MAX_STOP_SEQUENCES} strings"
        )
    for i, stop in enumerate(stops):
        name = "stop" if isinstance(value, str) else f"stop[{i}]"
        if not isinstance(stop, str) or not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise BadRequest(name, f"must be a string of 1 to {MAX_STOP_CHARS} characters")
        _unicode(stop, name)
    return tuple(stops)


# --- the fields a body may carry ----------------------------------------------------------


def _number(low: float, high: float, *, low_open: bool = False):
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be a number, got {value!r}"
        if not (low < value if low_open else low <= value) or not value <= high:
            bracket = "(" if low_open else "["
            return f"must be in {bracket}{low}, {high}], got {value!r}"
        return None

    return check


def _integral(value: Any) -> int | None:
    """The integer a JSON number stands for (`16` or `16.0`); None for anything else,
    `1.5` and booleans included."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if type(value) is int else None


def _integer(low: int, high: int):
    def check(value: Any) -> str | None:
        number = _integral(value)
        if number is None or not low <= number <= high:
            return f"must be an integer in [{low}, {high}], got {value!r}"
        return None

    return check


def _of_type(kind: type, name: str):
    def check(value: Any) -> str | None:
        return None if isinstance(value, kind) else f"must be {name}, got {value!r}"

    return check


def _neutral(check: Callable[[Any], str | None], neutral: int):
    """A penalty the blend engine does not apply: accepted only at its neutral value.
    Greedy decoding with a penalty picks other tokens than without it (OpenAI's API and
    vLLM apply penalties at temperature 0 too), so ignoring one changes the answer."""

    def checked(value: Any) -> str | None:
        if problem := check(value):
            return problem
        if value != neutral:
            return f"is not supported by the blend engine; leave it out or send {neutral}"
        return None

    return checked


def _only(*defaults: Any):
    """An unimplemented field: accepted only at one of its default values."""

    def is_default(value: Any, default: Any) -> bool:
        if type(default) is int:  # `top_logprobs: 0.0` too, not `false`
            return _integral(value) == default
        return type(value) is type(default) and value == default

    def check(value: Any) -> str | None:
        if any(is_default(value, d) for d in defaults):
            return None
        shown = " or ".join(json.dumps(d) for d in defaults)
        return f"is not supported by the blend engine; leave it out or send {shown}"

    return check


_INT64 = (-(1 << 63), (1 << 63) - 1)
# Sampling fields: checked, then ignored (decoding is greedy, and greedy's token is within
# every top_p, top_k and min_p cut).
SAMPLING = {
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "top_k": _integer(-1, 1 << 31),
    "min_p": _number(0, 1),
    "seed": _integer(*_INT64),
}
# Bookkeeping fields: checked, then ignored.
BOOKKEEPING = {
    "user": _of_type(str, "a string"),
    "metadata": _of_type(dict, "an object"),
    "store": _of_type(bool, "true or false"),
    "service_tier": _of_type(str, "a string"),
    "prompt_cache_key": _of_type(str, "a string"),
    "safety_identifier": _of_type(str, "a string"),
}
# Not implemented by the blend engine: refused unless at their default. `logprobs: 0` and
# `prompt_logprobs: 0` are not defaults: they ask for the chosen tokens' own logprobs
# (OpenAI's completions, vLLM).
UNSUPPORTED = {
    "frequency_penalty": _neutral(_number(-2, 2), 0),
    "presence_penalty": _neutral(_number(-2, 2), 0),
    "repetition_penalty": _neutral(_number(0, 2, low_open=True), 1),
    "logprobs": _only(False),
    "top_logprobs": _only(0),
    "prompt_logprobs": _only(None),
    "echo": _only(False),
    "best_of": _only(1),
    "suffix": _only(""),
    "logit_bias": _only({}),
    "tools": _only([]),
    "tool_choice": _only("none"),
    "parallel_tool_calls": _only(True, False),
    "functions": _only([]),
    "function_call": _only("none"),
    "response_format": _only({"type": "text"}),
    "min_tokens": _only(0),
    "stop_token_ids": _only([]),
    "include_stop_str_in_output": _only(False),
    "skip_special_tokens": _only(True),
    "modalities": _only(["text"]),
    "audio": _only(None),
    "prediction": _only(None),
    "reasoning_effort": _only(None),
    "web_search_options": _only(None),
}
# Implemented, and parsed where they are used.
IMPLEMENTED = {
    "completion": ("model", "prompt", "system", "documents"),
    "chat": ("model", "messages", "documents"),
}
COMMON = (
    "max_tokens", "max_completion_tokens", "stream", "stream_options", "n", "stop", "ignore_eos",
)  # fmt: skip


def known_fields(kind: str) -> tuple[str, ...]:
    return (*IMPLEMENTED[kind], *COMMON, *SAMPLING, *BOOKKEEPING, *UNSUPPORTED)


def _check_fields(body: Mapping[str, Any], kind: str) -> None:
    known = known_fields(kind)
    for name, value in body.items():
        if name not in known:
            raise BadRequest(
                str(name)[:64], f"unknown field; this endpoint takes {', '.join(known)}"
            )
        check = SAMPLING.get(name) or BOOKKEEPING.get(name) or UNSUPPORTED.get(name)
        if check is not None and value is not None and (problem := check(value)):
            raise BadRequest(name, problem)


# `stream_options` keys besides `include_usage` (read where it is used): OpenAI's
# `include_obfuscation` only pads chunks with random characters against side channels
# (ignored); vLLM's `continuous_usage_stats` (the usage in every chunk) is not implemented.
STREAM_OPTIONS = {
    "include_obfuscation": _of_type(bool, "true or false"),
    "continuous_usage_stats": _only(False),
}


def _check_stream_options(options: Mapping[str, Any]) -> None:
    """As the top-level fields: a misspelt `include_usage` is a 400, not an answer
    without the usage."""
    for name, value in options.items():
        param = f"stream_options.{str(name)[:64]}"
        if name != "include_usage" and name not in STREAM_OPTIONS:
            known = ", ".join(("include_usage", *STREAM_OPTIONS))
            raise BadRequest(param, f"unknown field; stream_options takes {known}")
        check = STREAM_OPTIONS.get(name)
        if check is not None and value is not None and (problem := check(value)):
            raise BadRequest(param, problem)


def _or_default(body: Mapping[str, Any], name: str, default: Any) -> Any:
    """The field's value; its default when absent or null (JSON null means unset)."""
    value = body.get(name)
    return default if value is None else value


def _max_tokens(body: Mapping[str, Any]) -> tuple[int | None, str]:
    """`max_completion_tokens`, else `max_tokens` (either null counts as unset; both are
    checked), and the field it came from."""
    found: tuple[int | None, str] = (None, "max_tokens")
    for name in ("max_tokens", "max_completion_tokens"):
        if (value := body.get(name)) is None:
            continue
        number = _integral(value)
        if number is None or number < 1:
            raise BadRequest(name, f"must be a positive integer, got {value!r}")
        found = (number, name)
    return found


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise BadRequest("prompt", "must be a string (or a list of one string)")
    if not value.strip():
        raise BadRequest("prompt", "is empty")
    return value


def _messages(value: Any) -> tuple[tuple[str | None, str], tuple[str, str]]:
    """The system message's text (None without one) and the user message's, each with the
    field it came from (`messages[1].content`), which errors about the text name."""
    if not isinstance(value, list) or not value:
        raise BadRequest("messages", "must be a non-empty list of messages")
    system, user = (None, "system"), None
    for i, message in enumerate(value):
        # The role first: a message refused for its place is not judged by its content
        # (an assistant's tool call has `content: null`).
        role, field = _role(message, i), f"messages[{i}].content"
        if role == "system" and user is None and system[0] is None:
            system = (_content(message.get("content"), field), field)
        elif role == "user" and user is None:
            user = (_content(message.get("content"), field), field)
        else:
            raise BadRequest(
                f"messages[{i}]",
                "the blend engine takes one optional system message and one user message",
            )
    if user is None or not user[0].strip():
        raise BadRequest("messages", "needs a non-empty user message")
    return system, user


def _role(message: Any, i: int) -> str:
    if not isinstance(message, Mapping):
        raise BadRequest(f"messages[{i}]", "must be an object with role and content")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise BadRequest(f"messages[{i}].role", f"unknown role {role!r}")
    return "system" if role == "developer" else role


def _content(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        # Joined by newlines, as vLLM's server renders text parts for a string template:
        # the same request builds the same prompt on the deployment's vLLM pods.
        return "\n".join(part["text"] for part in value)
    raise BadRequest(name, "must be a string or a list of text parts")


def _documents(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise BadRequest("documents", "must be a list of strings")
    for i, document in enumerate(value):
        if not isinstance(document, str) or not document.strip():
            raise BadRequest(f"documents[{i}]", "must be a non-empty string")
    return tuple(value)


def _split(text: str, separator: str, name: str, has_system: bool):
    """LMCache's shape: `[system SEP] doc SEP ... SEP question`. After a system message the
    text may open with the separator (`SEP doc ... SEP question`): what the chat template
    writes for it is the prompt holeblend-serve builds, so vLLM's split finds its segments.
    The system prompt is kept as written, as the structured shape's `system` (and a system
    message) is, so both shapes build the same prompt; text of whitespace only is none."""
    written = text.split(separator)
    pieces = [piece.strip() for piece in written]
    system = ""
    if len(pieces) > 1 and (not has_system or not pieces[0]):
        system = written[0] if pieces.pop(0) else ""
    question = pieces.pop()
    for i, piece in enumerate(pieces):
        if not piece:
            raise BadRequest(name, f"document {i} between separators {separator!r} is empty")
    if not question:
        raise BadRequest(name, f"no question after the last separator {separator!r}")
    return system, tuple(pieces), question


def _checked(
    request: RagRequest, name: str, separator: str, is_control_token, system_name: str
) -> RagRequest:
    """Refuse text the prompt cannot hold, naming the field it came from: `name` the
    question's, `system_name` the system prompt's."""
    texts = [(system_name, request.system or ""), (name, request.question)]
    for field, text in texts:
        if separator in text:
            raise BadRequest(field, f"contains the separator {separator!r} outside the documents")
    texts += [(f"documents[{i}]", d) for i, d in enumerate(request.documents)]
    for field, text in texts:
        _unicode(text, field)
        for match in CONTROL_TOKEN.finditer(text):
            if is_control_token(match.group()):
                raise BadRequest(field, f"contains the control token {match.group()!r}; remove it")
    return replace(request, question_field=name, system_field=system_name)


def _unicode(text: str, name: str) -> None:
    """Refuse lone surrogates: JSON can carry them (`"\\ud800"`), UTF-8 cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise BadRequest(
            name, f"contains a lone surrogate at character {error.start}; send valid Unicode"
        ) from None


def _string(value: Any, name: str, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise BadRequest(name, "must be a non-empty string" if required else "must be a string")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(name, f"must be true or false, got {value!r}")
    return value
