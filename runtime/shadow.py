"""Quality proxies from shadow full prefill: how much blending changed the answers.

For a sampled share of requests (spec.tuning.shadowSampleRate) the engine also runs full
prefill of the same prompt, in the background, and scores the blended request against it:

1. `offer` samples the request, and drops it at once (never queues it) when requests are
   waiting or the shadow slots are taken: serving never waits for a shadow.
2. A worker thread at low CPU priority (nice 10) runs full prefill in chunks of
   `chunk_tokens`; before every layer of a chunk and between decode steps it pauses while
   the engine is busy, so a request waits at most one layer's work for the CPU, and gives
   the sample up (`preempted`) if it stays paused longer than `max_pause_s`. Pausing inside
   the model rather than between small chunks keeps the chunks large: a 512-token prompt
   prefilled 32 tokens at a time took twice as long on two CPU cores as in one pass.
3. Teacher-forced on the blended answer, full prefill's next-token argmax at each answer
   position gives **top-1 agreement** (`holeblend_top1_agreement`): the share of positions
   where full prefill would have picked the token the blended request picked. Where they
   first disagree, full prefill continues greedily by itself (the KV before that point is
   shared), which gives its own answer; **answer-token F1** of the two answers
   (`holeblend_f1_proxy`, SQuAD-style words, words copied from the question skipped) is
   the second proxy. Both answers get the same token budget: the blended answer's length.
4. Both are observed in histograms labelled by the ratio the request ran with, so a ratio
   change starts a fresh series and the tuner reads only samples of the ratio in force.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence

import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from holeblend_runtime.bench.quality import answer_f1, answer_words
from holeblend_runtime.segments import SegmentedPrompt

LOG = logging.getLogger(__name__)
PROXY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)
# Nice value of the worker thread (Linux: per thread). Low, but not the lowest: pausing
# while the engine serves is what keeps serving first; on a machine shared with other
# busy processes, nice 19 starved the shadow of any CPU at all.
SHADOW_NICE = 10


@dataclasses.dataclass(frozen=True)
class ShadowRequest:
    """A served request to score: what the blended engine saw and answered."""

    prompt: SegmentedPrompt
    answer_ids: tuple[int, ...]  # the blended answer (greedy; EOS not included)
    ratio: float  # the recompute ratio the request ran with


@dataclasses.dataclass(frozen=True)
class ShadowScore:
    f1: float  # answer-token F1, blended vs full prefill
    top1: float  # share of answer positions where full prefill's argmax = the blended token
    ratio: float
    seconds: float  # wall time of the shadow work, pauses included


class Preempted(Exception):
    """The engine stayed busy too long: the sample is given up."""


class ShadowMetrics:
    """The proxies as Prometheus histograms (by ratio) and what happened to each offer."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY):
        self.f1 = Histogram(
            "holeblend_f1_proxy",
            "Answer-token F1 of blended vs shadow full-prefill answers, by ratio in force.",
            ["ratio"],
            buckets=PROXY_BUCKETS,
            registry=registry,
        )
        self.top1 = Histogram(
            "holeblend_top1_agreement",
            "Share of answer positions where full prefill's top-1 token equals the blended "
            "one, by ratio in force.",
            ["ratio"],
            buckets=PROXY_BUCKETS,
            registry=registry,
        )
        self.offers = Counter(
            "holeblend_shadow_requests",
            "Requests offered for shadow scoring, by outcome (scored, not_sampled, "
            "dropped_busy, dropped_full, preempted, failed).",
            ["outcome"],
            registry=registry,
        )

    def observe(self, score: ShadowScore) -> None:
        label = ratio_label(score.ratio)
        self.f1.labels(ratio=label).observe(score.f1)
        self.top1.labels(ratio=label).observe(score.top1)


def ratio_label(ratio: float) -> str:
    """The `ratio` label value: the ratio as the tuner writes it (rounded to 4 places)."""
    return repr(round(float(ratio), 4))


class ShadowSampler(abc.ABC):
    """Samples offered requests and scores them on one background thread (step 1 of the
    module doc); subclasses say how a request is scored (`score`)."""

    def __init__(
        self,
        sample_rate: float,
        *,
        is_busy: Callable[[], bool] = lambda: False,
        is_backlogged: Callable[[], bool] | None = None,
        metrics: ShadowMetrics | None = None,
        slots: int = 1,
        max_pause_s: float = 30.0,
        rng: random.Random | None = None,
    ):
        if not 0 <= sample_rate <= 1:
            raise ValueError(f"sample_rate: must be within [0, 1], got {sample_rate}")
        if slots < 1:
            raise ValueError(f"slots: must be >= 1, got {slots}")
        self.sample_rate = sample_rate
        self.is_busy = is_busy  # a request is running or waiting: the worker pauses
        # Requests are waiting (default: is_busy): an offer is dropped. A server that offers
        # from its compute thread, while its own request still counts, passes this apart.
        self.is_backlogged = is_backlogged or is_busy
        self.metrics = metrics
        self.max_pause_s = max_pause_s
        self._rng = rng or random.Random()
        self.slots = slots
        self._jobs: queue.Queue[object | None] = queue.Queue()
        self._lock = threading.Lock()
        self._num_in_flight = 0
        self._idle = threading.Event()
        self._idle.set()
        self.scores: list[ShadowScore] = []  # kept for benchmarks and tests (bounded below)
        self.outcomes: collections.Counter[str] = collections.Counter()  # offers by outcome
        self._thread = threading.Thread(target=self._work, name="shadow-prefill", daemon=True)
        self._thread.start()

    @abc.abstractmethod
    def score(self, request) -> ShadowScore:
        """Both proxies of one sampled request (on the worker thread)."""

    def offer(self, request) -> str:
        """Take the request for scoring or drop it; returns the outcome (never blocks)."""
        if self._rng.random() >= self.sample_rate:
            return self._count("not_sampled")
        if self.is_backlogged():
            return self._count("dropped_busy")
        with self._lock:
            if self._num_in_flight >= self.slots:  # queued or running
                return self._count("dropped_full")
            self._num_in_flight += 1
            self._idle.clear()
        self._jobs.put(request)
        return "queued"

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until no shadow work is queued or running (tests, benchmarks)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _work(self) -> None:
        _lower_own_priority()
        while (request := self._jobs.get()) is not None:
            try:
                score = self.score(request)
                self.scores = [*self.scores[-999:], score]
                if self.metrics is not None:
                    self.metrics.observe(score)
                self._count("scored")
            except Preempted:
                self._count("preempted")
            except Exception:  # a shadow must never take the engine down
                LOG.exception("shadow scoring failed")
                self._count("failed")
            finally:
                with self._lock:
                    self._num_in_flight -= 1
                    if self._num_in_flight == 0:
                        self._idle.set()

    def _yield_to_serving(self) -> None:
        """Pause while the engine serves; give up after max_pause_s."""
        paused_at = time.monotonic()
        while self.is_busy():
            if time.monotonic() - paused_at > self.max_pause_s:
                raise Preempted
            time.sleep(0.005)

    def _count(self, outcome: str) -> str:
        self.outcomes[outcome] += 1
        if self.metrics is not None:
            self.metrics.offers.labels(outcome=outcome).inc()
        return outcome


class ShadowScorer(ShadowSampler):
    """Scores sampled requests against full prefill of the engine's own model (steps 2-4)."""

    def __init__(
        self,
        model,
        tokenizer,
        sample_rate: float,
        *,
        chunk_tokens: int = 256,
        cache_prompt: bool = False,
        **options,
    ):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: must be >= 1, got {chunk_tokens}")
        self.model, self.tokenizer = model, tokenizer
        self.chunk_tokens = chunk_tokens
        # Keep the last prompt's full-prefill KV, so that several answers to one prompt (an
        # offline sweep over ratios) cost one full prefill. Off in the engine: its prompts
        # rarely repeat back to back, and the copy would hold memory between samples.
        self.cache_prompt = cache_prompt
        self._cached_prompt: (
            tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor] | None
        ) = None
        super().__init__(sample_rate, **options)

    @torch.inference_mode()
    def score(self, request: ShadowRequest) -> ShadowScore:
        """Full prefill of the prompt and both proxies (steps 2-3 of the module doc)."""
        started = time.monotonic()
        answer = list(request.answer_ids)
        prompt_ids = list(request.prompt.token_ids)
        k, v = self.model.new_kv(len(prompt_ids) + max(len(answer), 1))
        last = self._prefill_prompt(prompt_ids, k, v)
        hidden = self._forward_chunks(answer[:-1], len(prompt_ids), k, v)
        rows = self.model.logits(torch.cat([last, *hidden]))
        full_top1 = rows.argmax(dim=-1).tolist()  # full prefill's pick at each answer position
        if not answer:
            eos = self.model.config.eos_token_id
            top1 = float(full_top1[0] == eos)
            return ShadowScore(top1, top1, request.ratio, time.monotonic() - started)
        agree = [a == b for a, b in zip(full_top1, answer, strict=True)]
        full_answer = self._full_answer(answer, full_top1, agree, len(prompt_ids), k, v)
        question = answer_words(self.tokenizer.decode(request.prompt.question.token_ids))
        f1 = answer_f1(
            answer_words(self.tokenizer.decode(full_answer)),
            answer_words(self.tokenizer.decode(answer)),
            question,
        )
        top1 = sum(agree) / len(agree)
        return ShadowScore(f1, top1, request.ratio, time.monotonic() - started)

    def _prefill_prompt(self, prompt_ids: list[int], k, v) -> torch.Tensor:
        """Full prefill of the prompt into k, v; the last prompt token's hidden state [1, d]."""
        n, key = len(prompt_ids), tuple(prompt_ids)
        if self._cached_prompt is not None and self._cached_prompt[0] == key:
            _, cached_k, cached_v, last = self._cached_prompt
            k[:, :, :n], v[:, :, :n] = cached_k, cached_v
            return last
        last = self._forward_chunks(prompt_ids, 0, k, v)[-1][-1:]
        if self.cache_prompt:
            self._cached_prompt = (key, k[:, :, :n].clone(), v[:, :, :n].clone(), last)
        return last

    def _forward_chunks(self, token_ids: Sequence[int], start: int, k, v) -> list[torch.Tensor]:
        """Hidden states of `token_ids` at positions start.., chunk by chunk, pausing
        before every layer while the engine serves."""
        hidden = []
        for offset in range(0, len(token_ids), self.chunk_tokens):
            chunk = torch.tensor(token_ids[offset : offset + self.chunk_tokens], dtype=torch.int64)
            hidden.append(
                self.model.forward(
                    chunk.to(self.model.device),
                    k,
                    v,
                    start + offset,
                    before_layer=lambda _layer: self._yield_to_serving(),
                )
            )
        return hidden

    def _full_answer(self, answer, full_top1, agree, num_prompt, k, v) -> list[int]:
        """Full prefill's own greedy answer within the blended answer's token budget."""
        eos = self.model.config.eos_token_id
        first_diff = agree.index(False) if False in agree else len(agree)
        full = list(answer[:first_diff])
        if first_diff == len(answer):
            return full
        token, position = full_top1[first_diff], num_prompt + first_diff
        while token != eos and len(full) < len(answer):
            full.append(token)
            if len(full) == len(answer) or position >= k.shape[2]:
                break
            self._yield_to_serving()
            h = self.model.forward(torch.tensor([token], device=self.model.device), k, v, position)
            token, position = int(self.model.logits(h)[0].argmax()), position + 1
        return full


def _lower_own_priority() -> None:
    # Linux applies setpriority to one thread when given its id; elsewhere this is a no-op.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SHADOW_NICE)
