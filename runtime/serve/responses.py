"""OpenAI response bodies, SSE chunks and error bodies.

`usage.prompt_tokens_details.cached_tokens` is the number of prompt tokens whose cached KV
was reused (OpenAI's convention, which vLLM follows). `usage.holeblend` adds what the
blend did: `mode` (the engine mode: full, prefix, hole), `lookup_mode` (full-miss,
pure-hit, hole), `ratio`, `reused_tokens`, `hole_tokens`, `recomputed_tokens`, `ttft_s`.
"""

from __future__ import annotations

import json
import time
import uuid

from holeblend_runtime.serve.requests import RagRequest
from holeblend_runtime.serve.worker import PrefillDone


def usage(prefill: PrefillDone, num_completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prefill.num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": prefill.num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": prefill.num_reused_tokens},
        "holeblend": {
            "mode": prefill.mode,
            "lookup_mode": prefill.lookup_mode,
            "ratio": prefill.ratio,
            "reused_tokens": prefill.num_reused_tokens,
            "hole_tokens": prefill.num_hole_tokens,
            "recomputed_tokens": prefill.num_recomputed_tokens,
            "ttft_s": round(prefill.ttft_s, 6),
        },
    }


class ResponseWriter:
    """Bodies for one request: ids, object names and the choice shape of its endpoint."""

    def __init__(self, request: RagRequest, model: str) -> None:
        self.is_chat = request.kind == "chat"
        prefix = "chatcmpl" if self.is_chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def whole(self, text: str, finish_reason: str, usage_: dict) -> dict:
        choice = self._choice(text, finish_reason, whole=True)
        obj = "chat.completion" if self.is_chat else "text_completion"
        return self._envelope(obj, [choice]) | {"usage": usage_}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        choice = self._choice(text, finish_reason, whole=False, first=first)
        return self._envelope(self._chunk_object(), [choice])

    def usage_chunk(self, usage_: dict) -> dict:
        return self._envelope(self._chunk_object(), []) | {"usage": usage_}

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.is_chat else "text_completion"

    def _choice(self, text: str, finish_reason, whole: bool, first: bool = False) -> dict:
        if not self.is_chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if whole:
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "finish_reason": finish_reason}
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish_reason}

    def _envelope(self, obj: str, choices: list) -> dict:
        return {
            "id": self.id, "object": obj, "created": self.created, "model": self.model,
            "choices": choices,
        }  # fmt: skip


def error_body(message: str, param: str | None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class IncrementalText:
    """Token ids -> text deltas that never split a multi-byte character."""

    def __init__(self, decode) -> None:
        self._decode = decode
        self.token_ids: list[int] = []
        self._sent = 0

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        text = self._decode(self.token_ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self._sent = text[self._sent :], len(text)
        return delta

    @property
    def text(self) -> str:
        return self._decode(self.token_ids)

    def rest(self) -> str:
        text = self.text
        delta, self._sent = text[self._sent :], len(text)
        return delta
