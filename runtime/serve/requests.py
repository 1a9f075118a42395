"""OpenAI request bodies -> `RagRequest`; `BadRequest` naming the field otherwise.

Both endpoints give a system prompt, documents and a question, in one of two shapes:

- LMCache's CacheBlend shape: the separator inside the text. `/v1/completions`: `prompt` is
  `system SEP doc SEP ... SEP question`. `/v1/chat/completions`: the last user message is
  `doc SEP ... SEP question` after a system message, or `system SEP doc ... SEP question`
  without one. Text without a separator is a question with no documents.
- The structured extension: a top-level `documents` list of strings; the question is
  `prompt` (completions, with an optional `system` string) or the last user message (chat,
  with the system message as the system prompt).

The reference engine applies the model's chat template on both endpoints, decodes greedily
(`temperature`, `top_p` and the like are accepted and ignored) and supports one user turn.
Text may not contain the template's control tokens (`<|im_end|>` ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
    system: str
    documents: tuple[str, ...]
    question: str
    # None: the server's default.
    max_tokens: int | None
    stream: bool
    # Streaming only: send a last chunk with the usage (OpenAI's stream_options).
    include_usage: bool


def parse_completion(body: Any, separator: str, is_control_token: Callable[[str], bool]):
    body = _object(body)
    prompt = _prompt(body.get("prompt"))
    if "documents" in body:
        system = _string(body.get("system", ""), "system")
        documents, question = _documents(body["documents"]), prompt
    else:
        system, documents, question = _split(prompt, separator, "prompt", has_system=False)
    request = _request("completion", body, system, documents, question)
    return _checked(request, "prompt", separator, is_control_token)


def parse_chat(body: Any, separator: str, is_control_token: Callable[[str], bool]):
    body = _object(body)
    system, user = _messages(body.get("messages"))
    if "documents" in body:
        documents, question = _documents(body["documents"]), user
    else:
        split_system, documents, question = _split(
            user, separator, "messages", has_system=system is not None
        )
        system = split_system if system is None else system
    request = _request("chat", body, system or "", documents, question)
    return _checked(request, "messages", separator, is_control_token)


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest(None, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _request(kind: str, body: Mapping[str, Any], system, documents, question) -> RagRequest:
    stream = _bool(body.get("stream", False), "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise BadRequest("stream_options", "must be an object")
    if body.get("n", 1) != 1:
        raise BadRequest("n", "only n=1 is supported")
    return RagRequest(
        kind=kind,
        model=_string(body.get("model"), "model", required=True),
        system=system,
        documents=documents,
        question=question,
        max_tokens=_max_tokens(body),
        stream=stream,
        include_usage=_bool(options.get("include_usage", False), "stream_options.include_usage"),
    )


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(name, f"must be a positive integer, got {value!r}")
    return value


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise BadRequest("prompt", "must be a string (or a list of one string)")
    if not value.strip():
        raise BadRequest("prompt", "is empty")
    return value


def _messages(value: Any) -> tuple[str | None, str]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages", "must be a non-empty list of messages")
    system, user = None, None
    for i, message in enumerate(value):
        role, content = _message(message, i)
        if role == "system" and user is None and system is None:
            system = content
        elif role == "user" and user is None:
            user = content
        else:
            raise BadRequest(
                f"messages[{i}]",
                "the reference engine takes one optional system message and one user message",
            )
    if user is None or not user.strip():
        raise BadRequest("messages", "needs a non-empty user message")
    return system, user


def _message(message: Any, i: int) -> tuple[str, str]:
    if not isinstance(message, Mapping):
        raise BadRequest(f"messages[{i}]", "must be an object with role and content")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise BadRequest(f"messages[{i}].role", f"unknown role {role!r}")
    role = "system" if role == "developer" else role
    return role, _content(message.get("content"), f"messages[{i}].content")


def _content(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        return "".join(part["text"] for part in value)
    raise BadRequest(name, "must be a string or a list of text parts")


def _documents(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise BadRequest("documents", "must be a list of strings")
    for i, document in enumerate(value):
        if not isinstance(document, str) or not document.strip():
            raise BadRequest(f"documents[{i}]", "must be a non-empty string")
    return tuple(value)


def _split(text: str, separator: str, name: str, has_system: bool):
    """LMCache's shape: `[system SEP] doc SEP ... SEP question`."""
    pieces = [piece.strip() for piece in text.split(separator)]
    system = "" if has_system else pieces.pop(0) if len(pieces) > 1 else ""
    question = pieces.pop()
    for i, piece in enumerate(pieces):
        if not piece:
            raise BadRequest(name, f"document {i} between separators {separator!r} is empty")
    if not question:
        raise BadRequest(name, f"no question after the last separator {separator!r}")
    return system, tuple(pieces), question


def _checked(request: RagRequest, name: str, separator: str, is_control_token) -> RagRequest:
    texts = [("system", request.system), (name, request.question)]
    for field, text in texts:
        if separator in text:
            raise BadRequest(field, f"contains the separator {separator!r} outside the documents")
    texts += [(f"documents[{i}]", d) for i, d in enumerate(request.documents)]
    for field, text in texts:
        for match in CONTROL_TOKEN.finditer(text):
            if is_control_token(match.group()):
                raise BadRequest(field, f"contains the control token {match.group()!r}; remove it")
    return request


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
