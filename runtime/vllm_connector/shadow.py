"""Quality proxies on vLLM pods: shadow full prefill through the pod's own API server.

holeblend-serve scores its proxies in-process (`holeblend_runtime.quality.shadow`). In a vLLM pod
the model belongs to vLLM's workers, and a second thread running it beside vLLM's forward
is not safe, so the scheduler-side connector asks vLLM itself, over HTTP, as any client
would, and vLLM schedules the work with the rest:

1. `request_finished` offers each finished request that blended a reused document.
   One decoded greedily (`is_greedy`: temperature 0 or top_k 1) is scored on its own
   answer. A sampled one (vLLM samples at temperature 1, or generation_config's, when a
   client leaves temperature out: most clients) departs from full prefill's argmax with
   no blending at all, so it is scored on a **replay** instead: the shadow first sends its
   prompt again, greedy and blended like any user request (`kv_transfer_params.holeblend`
   `shadow` and `replay`: the scheduler class yields it to user requests as any shadow,
   the connector plans and blends it but counts it in no user figure), at most
   `REPLAY_MAX_TOKENS` answer tokens; the connector returns, in the answer's
   `kv_transfer_params.holeblend.replay`, the replay's own answer, where it ended, the
   ratio it blended at and its inline statistic, and steps 2-3 score that answer (a
   replay that found nothing to blend, the documents evicted meanwhile, is counted as
   `replay_not_blended`, not scored). `offer` samples it (blend.json's `shadowSampleRate`) and admits it
   when the one shadow slot is free and the token budget allows (`shadowBudget` x the
   user requests' prompt tokens, which the connector counts as it plans them;
   `ShadowBudget`); otherwise it is dropped at once, never queued. Load does not stop
   sampling.
2. A worker thread sends the prompt plus the blended answer to `engineUrl/v1/completions`
   (blend.json; `$HOLEBLEND_ENGINE_URL` when unset, deprecated) with `prompt_logprobs: 1`,
   `max_tokens: 1` and `kv_transfer_params.holeblend.shadow: true` (the connector then
   plans a full miss, stores nothing and counts nothing): full prefill teacher-forced on
   the blended answer. The rank of each answer token gives **top-1 agreement**
   (`holeblend_top1_agreement`); the one token it generates is full prefill's pick after
   the answer, which, when the blended answer ended with EOS or one of the request's
   stop token ids (`end_token_ids`), is scored too: any of them ends the answer.
   An answer that reached one of the request's stop strings (`stop`) is scored as its
   client got it, as holeblend-serve scores one: vLLM's API server checks stop strings
   itself and aborts the request in the engine, which may have decoded more tokens by
   then, so its tokens count up to the one whose text reached the stop string. That ends
   it as EOS does for full prefill's own answer (step 3 runs on past it), but no end
   position is scored: a stop string is text, not a token full prefill could pick.
3. Where full prefill first disagrees, a second request continues greedily from its own
   pick to its own end (EOS, a stop string; the blended length when that was the
   request's limit, else `RUN_ON_TOKENS` more within it): full prefill's answer, and
   **answer-token F1** of the two (`holeblend_f1_proxy`), both texts as the client gets
   them (cut at the first stop string), as holeblend-serve scores it.
4. Every shadow request carries vLLM's `priority` at `SHADOW_PRIORITY`, the largest value
   the API takes: under `--scheduling-policy priority` vLLM serves smaller values first,
   so a waiting shadow is scheduled after every waiting user request, and it is the
   first preempted when KV blocks run short. Priority does not stop a *running* shadow's
   chunked prefill from taking whole steps: the operator's scheduler class
   (`scheduler.py`, `--scheduler-cls`) makes it sit out every step a user request waits
   or prefills in and prefill one small chunk per step beside decoding ones. A server on the default FCFS policy may refuse a
   priority other than 0 (vLLM's API documents that): the shadow then logs a warning
   once and sends priority 0 from then on.
5. A shadow the idle floor admitted is paid for by idle time, not by the budget: its
   requests also carry `kv_transfer_params.holeblend.idle: true`, and the scheduler class
   runs them only in steps no user request is in (not beside decoding ones). Such a
   shadow waits at most `IDLE_PATIENCE_S` for an answer; past that (vLLM aborts the
   request its client left) the budget takes it over when the account allows (sent
   again unmarked, charged) or it is given up (`expired`), so it cannot hold the slot
   through sustained load.

Both proxies are observed by the ratio the request ran with, as in holeblend-serve.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from holeblend_runtime import local_http
from holeblend_runtime.quality.scores import answer_f1, answer_words
from holeblend_runtime.quality.shadow import (
    IDLE_PATIENCE_S,
    ShadowExpired,
    ShadowSampler,
    ShadowScore,
    ShadowSkipped,
    answer_budget,
    end_targets,
    question_words,
    through_stop,
)

log = logging.getLogger(__name__)

# Deprecated: the pod's own API server, e.g. http://127.0.0.1:8000, from engine.env; read
# only when blend.json has no `engineUrl` (which the operator renders).
ENGINE_URL_ENV = "HOLEBLEND_ENGINE_URL"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own: set when the server requires a key
# Our key in a request's (and an answer's) kv_transfer_params.
TRANSFER_PARAMS_KEY = "holeblend"
# kv_transfer_params["holeblend"]["shadow"]: a shadow request, when it holds SHADOW_MARK.
SHADOW_KEY = "shadow"
# A shadow's mark: a random token of this process (the shadow that sends it, and the
# connector and scheduler that read it, all live in vLLM's engine-core process). Any
# client can put anything in kv_transfer_params: a constant mark would let it pass its own
# requests off as shadows or replays, counted in no user figure and charged to no budget.
SHADOW_MARK = secrets.token_hex(16)
IDLE_KEY = "idle"  # kv_transfer_params["holeblend"]["idle"]: the idle floor's shadow
# kv_transfer_params["holeblend"]["replay"]: a shadow's blended, greedy replay of a sampled
# request (blended and answered as a user request, counted as none); the connector answers
# with the replay's figures under the same key.
REPLAY_KEY = "replay"
# Most answer tokens a replay decodes (and full prefill's answer then has).
REPLAY_MAX_TOKENS = 64
# vLLM's priority scheduler serves smaller values first (ties by arrival) and preempts
# the largest: the largest value its API accepts (int64) is served last.
SHADOW_PRIORITY = (1 << 63) - 1
# vLLM's _SAMPLING_EPS: a request whose temperature is below it is decoded greedily.
GREEDY_TEMPERATURE = 1e-5
_warned_env = False


def is_shadow_request(kv_transfer_params: Any, key: str, *, idle: bool = False) -> bool:
    """Whether a request's transfer params mark it a shadow (`idle`: one the idle floor
    admitted)."""
    params = kv_transfer_params.get(key) if isinstance(kv_transfer_params, dict) else None
    mark = params.get(SHADOW_KEY) if isinstance(params, dict) else None
    if not (isinstance(mark, str) and secrets.compare_digest(mark, SHADOW_MARK)):
        return False  # a user request, whatever its client put there
    return params.get(IDLE_KEY) is True if idle else True


def is_replay_request(kv_transfer_params: Any, key: str) -> bool:
    """Whether a shadow request is a replay (planned and blended as a user request)."""
    if not is_shadow_request(kv_transfer_params, key):
        return False
    return kv_transfer_params[key].get(REPLAY_KEY) is True


def engine_url(configured: str | None) -> str | None:
    """The API server shadows go to: blend.json's `engineUrl`, else the deprecated
    `$HOLEBLEND_ENGINE_URL` (logged once)."""
    global _warned_env
    if configured:
        return configured
    url = os.environ.get(ENGINE_URL_ENV)
    if url and not _warned_env:
        _warned_env = True
        log.warning(
            "%s is deprecated: blend.json's engineUrl names the pod's API server (the "
            "operator renders it when spec.tuning.qualityProxies is on); remove %s from "
            "engine.env",
            ENGINE_URL_ENV,
            ENGINE_URL_ENV,
        )
    return url or None


def is_greedy(params: Any) -> bool:
    """Whether vLLM picked each answer token as the model's argmax, as far as the request's
    sampling params tell: temperature 0 (or top_k 1), and no constraint on the picks
    (structured output, logit bias, allowed token ids, bad words, min_tokens). Sampled
    answers differ from full prefill's argmax even with no blending, so the proxies
    score only greedy ones. Penalties are not checked: a pod's generation_config may set
    one for every request, and then the shadow's own requests get it too."""
    if params is None:
        return False
    temperature = getattr(params, "temperature", None)
    argmax = isinstance(temperature, int | float) and temperature < GREEDY_TEMPERATURE
    if not (argmax or getattr(params, "top_k", None) == 1):
        return False
    constraints = ("structured_outputs", "logit_bias", "allowed_token_ids", "bad_words")
    if any(getattr(params, name, None) for name in constraints):
        return False
    return not getattr(params, "min_tokens", 0)


def end_token_ids(params: Any, eos_token_id: int | None) -> frozenset[int]:
    """The tokens that end a request's answer: the tokenizer's EOS, the request's own EOS
    and its stop token ids. vLLM adds generation_config's other EOS ids (e.g. Gemma's
    `<end_of_turn>`) to the stop token ids, stops at any of them and keeps that token in
    the output."""
    ends = {eos_token_id, getattr(params, "eos_token_id", None)}
    ends.update(getattr(params, "stop_token_ids", None) or ())
    return frozenset(token for token in ends if isinstance(token, int))


def template_closing(tokenizer: Any, decode: Callable[[Sequence[int]], str]) -> str:
    """What the tokenizer's chat template writes after a user's message (the end of its
    turn, the assistant's header), as `decode` gives it: the end of a chat request's
    question segment (`VllmShadow.closing`). "" when the tokenizer has no chat template,
    or its template refuses a lone user message."""
    marker = "holeblend-question-end"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
        )
    except Exception as error:  # no template, or one that wants more than a user turn
        log.info("the question's words may include the chat template's closing: %s", error)
        return ""
    if not isinstance(text, str) or marker not in text:
        return ""
    closing = text[text.rindex(marker) + len(marker) :]
    return decode(tokenizer.encode(closing, add_special_tokens=False))


def stop_strings(params: Any) -> tuple[str, ...]:
    """A request's stop strings (vLLM's `SamplingParams.stop`: a list, a string or None)."""
    stop = getattr(params, "stop", None)
    if isinstance(stop, str):
        return (stop,)
    return tuple(s for s in stop or () if isinstance(s, str))


def stop_cut(text: str, stop: Sequence[str], include: bool = False) -> int | None:
    """Where vLLM cuts an answer's text at its stop strings: at the start of the one that
    completes first (ties in the request's order), or at its end when the answer keeps
    it (`include`: `include_stop_str_in_output`); None when the text reaches none."""
    found = [(start + len(s), start) for s in stop if (start := text.find(s)) >= 0]
    if not found:
        return None
    end, start = min(found, key=lambda cut: cut[0])
    return end if include else start


@dataclasses.dataclass(frozen=True)
class VllmShadowRequest:
    """A finished request to score: its prompt, its answer and the ratio it ran with."""

    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # the end token (EOS or a stop token id) not included
    # The question segment's text (the chat template's closing, `VllmShadow.closing`, at
    # its end): the question's words are not counted by the F1.
    question: str
    ratio: float
    # The answer ended with EOS or a stop token id (False: the token limit, a stop
    # string, which `stop` tells, or unknown).
    stopped_at_eos: bool = False
    max_tokens: int | None = None  # the request's token limit; None: unknown
    inline_statistic: float | None = None  # the blend's (quality/inline_proxy.py)
    # Tokens besides the tokenizer's EOS that end an answer (`end_token_ids`): full
    # prefill picking any of them where an answer ends agrees with its end.
    stop_token_ids: tuple[int, ...] = ()
    # A sampled request: its answer is not scored; a greedy replay of its prompt is (no
    # answer_ids; max_tokens is the replay's limit).
    replay: bool = False
    # The request's stop strings: an answer ends where its text first reaches one (the
    # answer's tokens may go past it: `stop_cut`).
    stop: tuple[str, ...] = ()
    # The answer's text keeps the stop string it reached (`include_stop_str_in_output`).
    include_stop: bool = False

    @property
    def num_shadow_tokens(self) -> int:
        """Tokens of the teacher-forced request (prompt, answer, one generated); for a
        replay, also the replay's own: its recomputed share of the prompt and its answer
        (at most max_tokens, which then stands for the answer too)."""
        if not self.replay:
            return len(self.prompt_ids) + len(self.answer_ids) + 1
        answer = self.max_tokens or REPLAY_MAX_TOKENS
        recomputed = math.ceil(self.ratio * len(self.prompt_ids))
        return recomputed + answer + len(self.prompt_ids) + answer + 1


def replay_request(
    prompt_ids: Sequence[int],
    question: str,
    ratio: float,
    max_tokens: int | None,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    include_stop: bool = False,
) -> VllmShadowRequest:
    """The shadow request of a sampled request: a greedy replay of its prompt, at most
    `REPLAY_MAX_TOKENS` (or the request's own limit, if smaller) answer tokens, scored up
    to where its text reaches one of the request's stop strings."""
    limit = REPLAY_MAX_TOKENS if max_tokens is None else max(1, min(max_tokens, REPLAY_MAX_TOKENS))
    return VllmShadowRequest(
        tuple(prompt_ids), (), question, ratio, max_tokens=limit,
        stop_token_ids=tuple(stop_token_ids), replay=True, stop=tuple(stop),
        include_stop=include_stop,
    )  # fmt: skip


def replay_figures(
    answer_ids: Sequence[int], stopped_at_eos: bool, ratio: float, inline_statistic: float | None
) -> dict[str, Any]:
    """What the connector returns for a replay that blended (JSON, in the answer's
    kv_transfer_params): read back by `VllmShadow._replay`."""
    return {
        "answer_ids": [int(t) for t in answer_ids],
        "stopped_at_eos": bool(stopped_at_eos),
        "ratio": float(ratio),
        "inline_statistic": None if inline_statistic is None else float(inline_statistic),
    }


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
        priority: int = SHADOW_PRIORITY,
        closing: str = "",
        **options,
    ):
        if not 0 <= sample_rate <= 1:
            raise ValueError(f"shadowSampleRate: must be within [0, 1], got {sample_rate}")
        self.url = url.rstrip("/") + "/v1/completions"
        self.model, self.decode, self.eos_token_id = model, decode, eos_token_id
        self.api_key, self.timeout_s = api_key, timeout_s
        self.priority = priority
        # What the chat template writes after the user's message, as `decode` gives it
        # (`quality.shadow.question_words`); "": none known.
        self.closing = closing
        super().__init__(sample_rate, **options)

    @classmethod
    def create(
        cls, url: str | None, model: str, sample_rate: float, decode, **options
    ) -> VllmShadow | None:
        """The shadow of a pod whose API server is known (`engine_url`); None without one
        (an offline `LLM`) or at sample rate 0."""
        if not url or sample_rate <= 0:
            return None
        return cls(url, model, sample_rate, decode, api_key=os.environ.get(API_KEY_ENV), **options)

    @classmethod
    def from_env(cls, model: str, sample_rate: float, decode, **options) -> VllmShadow | None:
        """`create` with the deprecated `$HOLEBLEND_ENGINE_URL` alone."""
        return cls.create(engine_url(None), model, sample_rate, decode, **options)

    def score(self, request: VllmShadowRequest) -> ShadowScore:
        """Both proxies from one or two requests to the API server (steps 2-3 above), after
        the replay of a sampled request (step 1)."""
        started = time.monotonic()
        if request.replay:
            request = self._replay(request)
        prompt = list(request.prompt_ids)
        answer, at_stop = self._through_stop(list(request.answer_ids), request)
        at_eos = request.stopped_at_eos and not at_stop
        eos = self.eos_token_id if self.eos_token_id is not None else -1
        ends = {eos, *request.stop_token_ids}
        forced = _first_choice(self._complete(prompt + answer, max_tokens=1, prompt_logprobs=1))
        picks = teacher_forced_top1(forced.get("prompt_logprobs") or [], len(prompt), answer)
        generated = forced.get("token_ids") or []
        if not generated:
            raise ShadowFailed(f"{self.url}: no token generated after the answer")
        targets = end_targets(answer, at_eos, eos)
        picks = [*picks, int(generated[0])][: len(targets)]
        if len(picks) > len(answer) and picks[-1] in ends:
            picks[-1] = eos  # full prefill ends the answer there too, with any end token
        agree = first_disagreement(targets, picks)
        full = [t for t in targets[:agree] if t not in ends]
        budget = answer_budget(len(answer), at_eos or at_stop, request.max_tokens)
        if agree < len(targets) and picks[agree] not in ends and len(full) < budget:
            full.append(picks[agree])
            full += self._continued(prompt, full, budget - len(full), ends, request)
        top1 = sum(a == b for a, b in zip(targets, picks, strict=True)) / len(targets)
        f1 = answer_f1(
            answer_words(self._text(full, request)),
            answer_words(self._text(answer, request)),
            question_words(request.question, self.closing),
        )
        return ShadowScore(
            f1, top1, request.ratio, time.monotonic() - started, request.inline_statistic
        )

    def _continued(
        self,
        prompt: list[int],
        full: list[int],
        more_tokens: int,
        ends: set[int],
        request: VllmShadowRequest,
    ) -> list[int]:
        """Full prefill's own answer past `full`: at most `more_tokens`, up to its first end
        token, or the token whose text reaches a stop string (vLLM stops there itself)."""
        if more_tokens <= 0 or self._reaches_stop(full, request):
            return []
        self.charge(len(prompt) + len(full) + more_tokens)
        stop = {"stop": list(request.stop)} if request.stop else {}
        more = _first_choice(self._complete(prompt + full, max_tokens=more_tokens, **stop))
        tokens = []
        for token in more.get("token_ids") or []:
            if token in ends:
                break
            tokens.append(token)
        return tokens

    def _through_stop(
        self, answer: list[int], request: VllmShadowRequest
    ) -> tuple[list[int], bool]:
        return through_stop(answer, lambda ids: self._reaches_stop(ids, request))

    def _reaches_stop(self, token_ids: Sequence[int], request: VllmShadowRequest) -> bool:
        return bool(request.stop) and stop_cut(self.decode(token_ids), request.stop) is not None

    def _text(self, token_ids: Sequence[int], request: VllmShadowRequest) -> str:
        """The answer's text as the client got it: cut at its first stop string."""
        text = self.decode(token_ids)
        cut = stop_cut(text, request.stop, request.include_stop)
        return text if cut is None else text[:cut]

    def _replay(self, request: VllmShadowRequest) -> VllmShadowRequest:
        """The greedy, blended answer to a sampled request's prompt, as the request to
        score (its ratio and inline statistic the replay's own); ShadowSkipped when the
        replay blended nothing. The replay is sent without the request's stop strings:
        vLLM's API server ends a request at one by aborting it in the engine, and the
        connector's figures of an aborted request never reach the answer; `score` cuts
        the replay's answer where its text reaches one instead."""
        answer = self._complete(
            list(request.prompt_ids), max_tokens=request.max_tokens or REPLAY_MAX_TOKENS,
            replay=True,
        )  # fmt: skip
        params = answer.get("kv_transfer_params") or {}
        figures = params.get(TRANSFER_PARAMS_KEY) if isinstance(params, dict) else None
        replayed = figures.get(REPLAY_KEY) if isinstance(figures, dict) else None
        if replayed is None:
            raise ShadowSkipped("replay_not_blended")
        try:
            return dataclasses.replace(
                request,
                answer_ids=tuple(int(t) for t in replayed["answer_ids"]),
                stopped_at_eos=bool(replayed["stopped_at_eos"]),
                ratio=float(replayed["ratio"]),
                inline_statistic=_optional_float(replayed["inline_statistic"]),
                replay=False,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ShadowFailed(f"{self.url}: replay figures {str(replayed)[:200]}") from exc

    def _complete(
        self, prompt: list[int], max_tokens: int, *, replay: bool = False, **extra: Any
    ) -> dict:
        """One greedy completion of token ids, marked as a shadow request at the lowest
        priority; the whole answer. A server that refuses the priority gets 0 from then on."""
        try:
            try:
                return self._post(prompt, max_tokens, extra, replay)
            except ShadowExpired:
                if not self._patience_out():  # the budget did not take it over
                    raise
                return self._post(prompt, max_tokens, extra, replay)  # again, as the budget's
        except _PriorityRefused as refused:
            log.warning(
                "the API server refused shadow priority %d (%s): run vLLM with "
                "--scheduling-policy priority, so that shadows yield to user requests; "
                "sending them at priority 0 until then",
                self.priority,
                refused,
            )
            self.priority = 0
            return self._post(prompt, max_tokens, extra, replay)

    def _post(
        self, prompt: list[int], max_tokens: int, extra: dict[str, Any], replay: bool = False
    ) -> dict:
        """The answer (its first choice checked to be there)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "kv_transfer_params": {TRANSFER_PARAMS_KEY: {SHADOW_KEY: SHADOW_MARK}},
            **extra,
        }
        idle = self._running_idle
        if idle:  # the idle floor's: only in steps no user request is in, and bounded
            body["kv_transfer_params"][TRANSFER_PARAMS_KEY][IDLE_KEY] = True
        if replay:
            body["kv_transfer_params"][TRANSFER_PARAMS_KEY][REPLAY_KEY] = True
        if self.priority:
            body["priority"] = self.priority
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        call = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        timeout_s = min(self.timeout_s, IDLE_PATIENCE_S) if idle else self.timeout_s
        try:
            with local_http.LOCAL.open(call, timeout=timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500]
            if self.priority and exc.code in (400, 422) and b"priority" in detail.lower():
                raise _PriorityRefused(detail.decode("utf-8", "replace")[:200]) from exc
            raise ShadowFailed(f"{self.url}: HTTP {exc.code}: {detail[:200]!r}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            # A read that times out raises TimeoutError; a connect that does (a server too
            # busy to accept), a URLError holding it.
            if idle and isinstance(getattr(exc, "reason", exc), TimeoutError):
                raise ShadowExpired(f"{self.url}: no answer within {timeout_s:g} s") from exc
            raise ShadowFailed(f"{self.url}: {exc}") from exc
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise ShadowFailed(f"{self.url}: no choices in {str(answer)[:200]}")
        return answer


def _first_choice(answer: dict) -> dict:
    return answer["choices"][0]  # `_post` checked it is there


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


class _PriorityRefused(Exception):
    """The API server refused a priority other than 0 (not the priority policy)."""
