"""OpenAI response bodies, SSE chunks and error bodies.

`usage.prompt_tokens_details.cached_tokens` is the number of prompt tokens whose cached KV
was loaded instead of computed from scratch (OpenAI's convention, which vLLM follows):
`holeblend.reused_tokens`. A blend then recomputes a share of them (the recompute ratio), so
`recomputed_tokens` (hole tokens, the recomputed share and the question) include
`recomputed_cached_tokens` of the `cached_tokens`; `prompt_tokens - cached_tokens` were not
cached. `usage.holeblend` adds what the
blend did: `mode` (the engine mode: full, prefix, hole), `lookup_mode` (full-miss,
pure-hit, hole), `ratio`, `reused_tokens`, `hole_tokens`, `recomputed_tokens`, `ttft_s`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence

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
            "recomputed_cached_tokens": prefill.num_recomputed_cached_tokens,
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
        # The first chunk has the content even empty, as OpenAI's and vLLM's have: a client
        # that builds the message from the deltas gets "" for an empty answer, not null.
        if first:
            delta = {"role": "assistant", "content": text}
        else:
            delta = {"content": text} if text else {}
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
    """Token ids -> text deltas that never split a multi-byte character, cut at the first
    stop sequence (OpenAI's `stop`: the answer ends before it, and it is not sent).

    While the text ends with the start of a stop sequence, that tail is held back: sent
    once the text moves past it, dropped when the stop sequence completes.

    Each token costs the same however long the answer (it runs on the server's event loop
    once per token): as vLLM's incremental detokenizer, it decodes only a window of recent
    tokens, `token_ids[prefix:]`, of which `token_ids[prefix:read]` is context whose text
    was already taken, and takes the text past that context. While the window's text ends
    with U+FFFD (a character whose bytes have not all arrived) nothing is taken and the
    window grows. Stop sequences are searched in the new text and the longest stop
    sequence's length - 1 characters before it (an earlier match would have ended the
    answer before). The deltas are those of decoding the whole answer after every token.
    """

    def __init__(self, decode, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._overlap = max(0, max(map(len, self._stop), default=0) - 1)
        self.token_ids: list[int] = []
        self._prefix = self._read = 0  # the decoding window (see the class doc)
        self._pieces: list[str] = []  # the text taken so far, joined when needed
        self._length = 0  # its length
        # Its last `_overlap` characters: all those not sent yet and the overlap to search.
        self._tail = ""
        self._sent = 0
        # The final text once a stop sequence was seen (later tokens are ignored).
        self._final: str | None = None

    @property
    def stopped(self) -> bool:
        return self._final is not None

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        new = self._new_text()
        if not new:
            return ""
        window = self._tail + new
        start = self._length - len(self._tail)  # where `window` begins in the text
        self._pieces.append(new)
        self._length += len(new)
        cut = self._first_stop(window)
        if cut is not None:
            end = start + cut
            self._final = "".join(self._pieces)[:end]
        else:
            end = self._length - self._held_back(window)
            self._tail = window[max(0, len(window) - self._overlap) :]
        if end <= self._sent:
            return ""
        delta, self._sent = window[self._sent - start : end - start], end
        return delta

    def _new_text(self) -> str:
        """The text the last token completed ("" while a character is incomplete)."""
        ids = self.token_ids
        context = self._decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        text = self._decode(ids[self._prefix :])
        if text.endswith("\ufffd"):
            return ""
        if not text.startswith(context):  # a decoder whose window text is not that
            text, context = self._decode(ids), "".join(self._pieces)  # the whole answer
        self._prefix, self._read = self._read, len(ids)
        return text[len(context) :]

    def _first_stop(self, text: str) -> int | None:
        found = [i for stop in self._stop if (i := text.find(stop)) >= 0]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop sequence."""
        return max(
            (
                k
                for stop in self._stop
                for k in range(len(stop) - 1, 0, -1)
                if text.endswith(stop[:k])
            ),
            default=0,
        )

    @property
    def text(self) -> str:
        return self._final if self._final is not None else self._decode(self.token_ids)

    def end(self) -> None:
        """The answer has ended: cut it at a stop sequence in the text never taken. A token
        may end with the first bytes of the next character (SmolLM2's " \\xe6"): while the
        text ends with it nothing is taken or searched, so an answer that ends there would
        otherwise keep a stop sequence that token completed."""
        if self.stopped:
            return
        text = self._decode(self.token_ids)
        start = self._length - len(self._tail)
        cut = self._first_stop(text[start:])
        if cut is not None:
            self._final = text[: start + cut]

    def rest(self) -> str:
        """The text not sent yet, once the answer has ended (`end`)."""
        self.end()
        text = self.text
        delta, self._sent = text[self._sent :], len(text)
        return delta
