"""Quality proxies on vLLM pods: shadow full prefill through the pod's own API server.

holeblend-serve scores its proxies in-process (`holeblend_runtime.shadow`). In a vLLM pod
the model belongs to vLLM's workers, and a second thread running it beside vLLM's forward
is not safe, so the scheduler-side connector asks vLLM itself, over HTTP, as any client
would, and vLLM batches the work with the rest:

1. `request_finished` offers each finished request that blended a reused document. `offer`
   samples it (blend.json's `shadowSampleRate`) and drops it at once (never queues it)
   when other requests are in flight or the one shadow slot is taken.
2. A worker thread sends the prompt plus the blended answer to
   `$HOLEBLEND_ENGINE_URL/v1/completions` with `prompt_logprobs: 1` and
   `kv_transfer_params.holeblend.shadow: true` (the connector then plans a full miss,
   stores nothing and counts nothing): full prefill teacher-forced on the blended answer.
   The rank of each answer token gives **top-1 agreement** (`holeblend_top1_agreement`).
3. Where full prefill first disagrees, a second request continues greedily from its own
   pick, within the blended answer's token budget: full prefill's answer, and
   **answer-token F1** of the two (`holeblend_f1_proxy`), as holeblend-serve scores it.
4. Before each request the worker waits while user requests are in flight and gives the
   sample up (`preempted`) after `max_pause_s`; once sent, a shadow request is a short
   prefill (plus a few decode steps) that vLLM batches with whatever arrives. Sampling,
   dropping, the slot and the outcomes are `holeblend_runtime.shadow.ShadowSampler`'s, as
   in holeblend-serve.

Both proxies are observed by the ratio the request ran with, as in holeblend-serve.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from holeblend_runtime.bench.quality import answer_f1, answer_words
from holeblend_runtime.shadow import ShadowSampler, ShadowScore

# The pod's own API server, e.g. http://127.0.0.1:8000; set in engine.env, it turns the
# shadow on (off by default: a sent shadow delays requests that arrive meanwhile).
ENGINE_URL_ENV = "HOLEBLEND_ENGINE_URL"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own: set when the server requires a key
SHADOW_KEY = "shadow"  # kv_transfer_params["holeblend"]["shadow"]: a shadow request


def is_shadow_request(kv_transfer_params: Any, key: str) -> bool:
    params = kv_transfer_params.get(key) if isinstance(kv_transfer_params, dict) else None
    return isinstance(params, dict) and params.get(SHADOW_KEY) is True


@dataclasses.dataclass(frozen=True)
class VllmShadowRequest:
    """A finished request to score: its prompt, its answer and the ratio it ran with."""

    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # EOS not included
    question: str  # the question's text: its words are not counted by the F1
    ratio: float


class ShadowFailed(Exception):
    """The API server's answer was not usable."""


def teacher_forced_top1(
    prompt_logprobs: Sequence[Any], num_prompt: int, answer: Sequence[int]
) -> list[int]:
    """Full prefill's top-1 token at each answer position, from vLLM's `prompt_logprobs`
    (per prompt position: {token id: {logprob, rank, ...}}, the actual token and the top-1)
    of a request whose prompt was the prompt followed by the answer."""
    if len(prompt_logprobs) != num_prompt + len(answer):
        raise ShadowFailed(
            f"prompt_logprobs: {len(prompt_logprobs)} positions, expected "
            f"{num_prompt + len(answer)}"
        )
    picks = []
    for position, token in enumerate(answer, start=num_prompt):
        entry = prompt_logprobs[position]
        if not isinstance(entry, dict) or not entry:
            raise ShadowFailed(f"prompt_logprobs[{position}]: {entry!r}")
        ranks = {int(tid): info.get("rank") for tid, info in entry.items()}
        best = [tid for tid, rank in ranks.items() if rank == 1]
        picks.append(token if ranks.get(token) == 1 else best[0] if best else -1)
    return picks


def first_disagreement(answer: Sequence[int], picks: Sequence[int]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(answer, picks, strict=True)) if a != b), len(answer)
    )


class VllmShadow(ShadowSampler):
    """Samples finished requests and scores them through the API server, on one thread."""

    def __init__(
        self,
        url: str,
        model: str,
        sample_rate: float,
        decode: Callable[[Sequence[int]], str],
        *,
        eos_token_id: int | None = None,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        **options,
    ):
        if not 0 <= sample_rate <= 1:
            raise ValueError(f"shadowSampleRate: must be within [0, 1], got {sample_rate}")
        self.url = url.rstrip("/") + "/v1/completions"
        self.model, self.decode, self.eos_token_id = model, decode, eos_token_id
        self.api_key, self.timeout_s = api_key, timeout_s
        super().__init__(sample_rate, **options)

    @classmethod
    def from_env(cls, model: str, sample_rate: float, decode, **options) -> VllmShadow | None:
        """The shadow of a pod whose env names its API server (the opt-in); None without
        one (the default, or an offline `LLM`) or at sample rate 0."""
        url = os.environ.get(ENGINE_URL_ENV)
        if not url or sample_rate <= 0:
            return None
        return cls(url, model, sample_rate, decode, api_key=os.environ.get(API_KEY_ENV), **options)

    def score(self, request: VllmShadowRequest) -> ShadowScore:
        """Both proxies from one or two requests to the API server (steps 2-3 above)."""
        started = time.monotonic()
        prompt, answer = list(request.prompt_ids), list(request.answer_ids)
        forced = self._complete(prompt + answer, max_tokens=1, prompt_logprobs=1)
        picks = teacher_forced_top1(forced.get("prompt_logprobs") or [], len(prompt), answer)
        agree = first_disagreement(answer, picks)
        full = answer[:agree]
        if agree < len(answer) and picks[agree] != self.eos_token_id:
            full.append(picks[agree])
            budget = len(answer) - len(full)
            if budget > 0:
                more = self._complete(prompt + full, max_tokens=budget)
                full += [t for t in more.get("token_ids") or [] if t != self.eos_token_id]
        top1 = sum(a == b for a, b in zip(answer, picks, strict=True)) / max(len(answer), 1)
        f1 = answer_f1(
            answer_words(self.decode(full)),
            answer_words(self.decode(answer)),
            answer_words(request.question),
        )
        return ShadowScore(f1, top1, request.ratio, time.monotonic() - started)

    def _complete(self, prompt: list[int], max_tokens: int, **extra: Any) -> dict:
        """One greedy completion of token ids, marked as a shadow request; its choice."""
        self._yield_to_serving()  # Preempted after max_pause_s
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "kv_transfer_params": {"holeblend": {SHADOW_KEY: True}},
            **extra,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        call = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(call, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise ShadowFailed(f"{self.url}: HTTP {exc.code}: {exc.read()[:200]!r}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ShadowFailed(f"{self.url}: {exc}") from exc
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise ShadowFailed(f"{self.url}: no choices in {str(answer)[:200]}")
        return choices[0]
