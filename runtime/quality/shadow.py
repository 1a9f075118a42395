"""Quality proxies from shadow full prefill: how much blending changed the answers.

For a sampled share of requests (blend.json `shadowSampleRate`), within a token budget
(`shadowBudget`), the engine also runs full prefill of the same prompt in the background
and scores the blended request against it:

1. `offer` samples the request and admits it when the shadow slot is free and the budget
   allows (`ShadowBudget`: the shadows' prefill tokens stay within `shadowBudget` x the
   user requests' prompt tokens, plus a small burst); otherwise it is dropped at once,
   never queued. Load does not stop sampling: a saturated engine is scored too. A request
   offered while no other user request is in flight passes the idle floor instead when
   the budget refuses (or the sample rate skips) it: up to `shadowIdleSamples` shadows per
   `shadowIdleSeconds` (the tuner's minSamples per interval), so a lightly loaded engine,
   which earns little budget, still gives the tuner its readings.
2. A worker thread at low CPU priority (nice 10) runs full prefill in chunks of
   `chunk_tokens` and passes a `ShadowGate` before every layer of a chunk and every
   decode step. While the engine is idle it runs freely; while the engine serves, the
   engine grants it units (a layer, a decode step) between its own steps, at most a
   `time_share` of the time, and waits for them: what the engine's last stretch earned of
   the share, at most `SHADOW_CATCH_UP_S` (plus the unit that crosses it), so a user step
   waits for at most that much shadow work, and the shadow still progresses under
   sustained load. The share is the budget's (`serving_time_share`), larger while the
   inline proxy is blind (holeblend-serve: no estimate for the requests it serves, so the
   shadow is the tuner's only signal). Every
   shadow waits for idle time first: its units run only while the engine is idle (a unit
   running when a request arrives is finished first), so under paced load, which leaves
   the engine idle between requests, shadows take none of the serving time. Only when
   the engine serves for longer than `IDLE_PATIENCE_S` at one stretch (or a shadow that
   did so ended moments ago) does a budget
   shadow take its time share; a shadow the idle floor admitted is then taken over by
   the budget if the account allows (charged then; it goes on as the budget's shadows
   do), else it gives its slot up (`expired`). So the floor costs a user request at most
   one unit, and what a shadow costs beyond that is the budget's, at saturation only.
   Pausing inside the model rather than between small chunks keeps the chunks large: a
   512-token prompt prefilled 32 tokens at a time took twice as long on two CPU cores.
3. Teacher-forced on the blended answer, full prefill's next-token argmax at each answer
   position gives **top-1 agreement** (`holeblend_top1_agreement`): the share of positions
   where full prefill would have picked the token the blended request picked. When the
   blended answer ended with the end-of-sequence token, the position after its last token
   is scored too (would full prefill have stopped there?). Where they first disagree,
   full prefill continues greedily by itself (the KV before that point is shared) to its
   own end: EOS, or the blended answer's length when that was the request's token limit,
   else `RUN_ON_TOKENS` past the blended length (within the limit). **Answer-token F1**
   of the two answers (`holeblend_f1_proxy`, SQuAD-style words, words copied from the
   question skipped: the question as written, not the chat template's closing that ends
   its segment) is the second proxy. So an answer that stops early, or runs on where
   full prefill would have stopped, loses on both. With the request's stop sequences,
   both answers are scored as the client gets them, ending before the first one their
   text reaches: the blended answer's tokens count up to the one that reached it (tokens
   decoded after it, before the engine saw it, are dropped), its stop sequence is its end
   as EOS would be, and full prefill's own answer runs to where its text reaches one (or
   its EOS, or its budget as after EOS).
4. Both are observed in histograms labelled by the ratio the request ran with, so a ratio
   change starts a fresh series and the tuner reads only samples of the ratio in force.
   A scored request that carries its blend's inline statistic also calibrates the inline
   proxy (quality/inline_proxy.py).
"""

from __future__ import annotations

import abc
import bisect
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from holeblend_runtime.blend.prompt import ChatMLTemplate
from holeblend_runtime.blend.segments import SegmentedPrompt
from holeblend_runtime.model.threads import serial_thread
from holeblend_runtime.quality.scores import answer_f1, answer_words

if TYPE_CHECKING:
    from holeblend_runtime.quality.inline_proxy import InlineProxy

LOG = logging.getLogger(__name__)
PROXY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)
# Nice value of the worker thread (Linux: per thread). Low, but not the lowest: the gate
# is what keeps serving first; on a machine shared with other busy processes, nice 19
# starved the shadow of any CPU at all.
SHADOW_NICE = 10
# How far past the blended answer's length full prefill's own answer may run when the
# blended answer stopped at EOS (within the request's token limit): an answer that
# stopped early then loses F1 for the words it left out.
RUN_ON_TOKENS = 16
# Shadow prefill tokens the budget may run ahead of its share of the user tokens.
BURST_TOKENS = 2048
# Most of the engine's time the shadow takes while the engine serves (`ShadowGate`).
SHADOW_TIME_SHARE = 0.1
# While the inline proxy is blind (`serving_time_share`), the shadow's time share: this
# many times its budget, at most BLIND_TIME_SHARE (about what the token budget lets a
# full prefill take, at several times a blend's cost per token). A pod that starts at
# saturation otherwise needs some 8 intervals to gather the pairs that calibrate it.
BLIND_TIME_SHARE_FACTOR = 4.0
BLIND_TIME_SHARE = 0.2
# Most shadow time the engine grants between two of its steps (`ShadowGate`). Between
# steps the shadow catches up what the engine's last stretch earned of the time share
# (time_share / (1 - time_share) of it: ~5 % of a step at the default budget): one unit
# per step left most of the share unused at saturation, where holeblend-serve's steps are
# mostly prefills of about a second and a unit (a layer) takes 10-20 ms (measured: 1.6 %
# of the time at a 5 % share). This caps the catch-up after a long step.
SHADOW_CATCH_UP_S = 0.05
# How long a shadow the idle floor admitted waits, at one stretch, for the engine to be
# idle again before it gives its slot up (`ShadowGate.idle_only`): several service times
# of a lightly loaded pod, well inside a tuning interval.
IDLE_PATIENCE_S = 10.0


class ShadowExpired(Exception):
    """An idle-only shadow waited longer than its patience for the engine to be idle."""


def serving_time_share(budget: float, *, blind: bool = False) -> float:
    """The share of the engine's time the shadow may take while the engine serves: its
    budget (`shadowBudget`), at most SHADOW_TIME_SHARE. The budget counts prompt tokens,
    and a shadow's full prefill costs several times a blend per token, so the tokens alone
    would let it take several times its share of a saturated engine's time (measured:
    requests/s 12 % lower at a 5 % budget with a 10 % time share).

    `blind`: the inline proxy gives no estimate for the requests being served (too few
    calibration pairs, or statistics outside the ones its pairs span), so the tuner has
    no signal at saturation but the shadow's: then up to BLIND_TIME_SHARE_FACTOR times
    that, at most BLIND_TIME_SHARE, which the token budget still bounds."""
    if not 0 < budget <= 1:
        raise ValueError(f"shadowBudget: must be within (0, 1] for a shadow to run, got {budget}")
    if blind:
        return min(BLIND_TIME_SHARE, BLIND_TIME_SHARE_FACTOR * budget)
    return min(SHADOW_TIME_SHARE, budget)


def serving_catch_up_s(*, blind: bool) -> float:
    """Most shadow time the engine grants between two of its steps (`ShadowGate`): while
    the inline proxy is blind, `SHADOW_CATCH_UP_S`, so the shadow takes the share its
    long steps earn; once it estimates, 0 (one unit per step), as the inline proxy then
    gives the tuner its samples and every unit granted is latency a user pays (measured:
    the catch-up cost TTFT p99 1.06-1.26x and ITL p99 1.15-1.21x at saturation at a 5 %
    share, one unit per step 1.09x / 1.10x)."""
    return SHADOW_CATCH_UP_S if blind else 0.0


@dataclasses.dataclass(frozen=True)
class ShadowRequest:
    """A served request to score: what the blended engine saw and answered."""

    prompt: SegmentedPrompt
    answer_ids: tuple[int, ...]  # the blended answer (greedy; EOS not included)
    ratio: float  # the recompute ratio the request ran with
    # The answer ended with the end-of-sequence token (False: at the token limit, a stop
    # sequence, or unknown); then full prefill is also asked whether it would stop there.
    stopped_at_eos: bool = False
    # The request's token limit (None: unknown); bounds full prefill's own answer.
    max_tokens: int | None = None
    # The blend's inline statistic (quality/inline_proxy.py); None: not taken.
    inline_statistic: float | None = None
    # The request's stop sequences: each answer ends before the first one its text reaches.
    stop: tuple[str, ...] = ()

    @property
    def num_shadow_tokens(self) -> int:
        """Tokens the teacher-forced full prefill computes (prompt, answer, end check)."""
        return len(self.prompt.token_ids) + len(self.answer_ids) + 1


@dataclasses.dataclass(frozen=True)
class ShadowScore:
    f1: float  # answer-token F1, blended vs full prefill
    top1: float  # share of answer positions where full prefill's argmax = the blended token
    ratio: float
    seconds: float  # wall time of the shadow work, pauses included
    # The inline statistic of the blend scored, when it is not the offered request's own
    # (a vLLM pod's replay of a sampled request); None: the offered request's.
    inline_statistic: float | None = None


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
            "over_budget, dropped_full, expired, failed; vLLM pods: replay_not_blended, "
            "a sampled request's greedy replay that found nothing to blend).",
            ["outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "holeblend_shadow_tokens",
            "Prefill tokens spent by the shadow requests shadowBudget admitted (within "
            "shadowBudget x user prompt tokens).",
            registry=registry,
        )
        self.idle_requests = Counter(
            "holeblend_shadow_idle_requests",
            "Shadow requests admitted beyond shadowBudget by the idle floor: offered while "
            "no user request was in flight, up to shadowIdleSamples per shadowIdleSeconds.",
            registry=registry,
        )
        self.idle_tokens = Counter(
            "holeblend_shadow_idle_tokens",
            "Prefill tokens spent by the shadow requests the idle floor admitted.",
            registry=registry,
        )
        self.taken_over = Counter(
            "holeblend_shadow_taken_over_requests",
            "Idle-floor shadows that met sustained load and went on as shadowBudget's "
            "(charged to it: their tokens count in holeblend_shadow_tokens_total too).",
            registry=registry,
        )
        self.units = Counter(
            "holeblend_shadow_units",
            "Units of shadow work (a layer of a prefill chunk, a decode step) run, by "
            "whether the engine was idle when the unit started or serving (granted or "
            "paced: user requests waited for it).",
            ["engine_state"],
            registry=registry,
        )
        self.unit_seconds = Counter(
            "holeblend_shadow_unit_seconds",
            "Seconds of shadow work units, by the engine's state when each started (idle "
            "or serving): the serving ones are the time user requests waited for shadows.",
            ["engine_state"],
            registry=registry,
        )

    def observe_unit(self, seconds: float, serving: bool) -> None:
        """One unit of shadow work ended (`ShadowGate`'s `on_unit`)."""
        state = "serving" if serving else "idle"
        self.units.labels(engine_state=state).inc()
        self.unit_seconds.labels(engine_state=state).inc(max(0.0, seconds))

    def observe(self, score: ShadowScore) -> None:
        label = ratio_label(score.ratio)
        self.f1.labels(ratio=label).observe(score.f1)
        self.top1.labels(ratio=label).observe(score.top1)


def ratio_label(ratio: float) -> str:
    """The `ratio` label value: the ratio as the tuner writes it (rounded to 4 places)."""
    return repr(round(float(ratio), 4))


class ShadowBudget:
    """The running account of shadow prefill tokens against user prompt tokens, and the
    idle floor.

    The account starts with `burst_tokens` of credit (a started engine gets its first
    samples soon) and each user prompt token earns `share` tokens more, banked up to
    `burst_tokens`; a shadow is admitted while the balance is not negative and is charged
    its tokens (the balance may go below zero by one shadow, repaid by later user
    tokens). Over any stretch the shadows the budget admits spend at most `share` x the
    user tokens + `burst_tokens` + one shadow. Share 0: no shadow.

    The idle floor: a shadow offered while no user request is in flight (`idle`) and
    refused by the account is admitted anyway while fewer than `idle_samples` shadows (of
    either kind) were admitted in the last `idle_seconds`. Such a shadow costs no user
    latency when it starts, and yields to the requests that arrive while it runs (the
    engine's gate or vLLM's scheduler class); its tokens are counted apart
    (`idle_tokens`) and never charged to the account, so the budget under load stays what
    it was. Thread-safe."""

    def __init__(
        self,
        share: float,
        burst_tokens: int = BURST_TOKENS,
        *,
        idle_samples: int = 0,
        idle_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= share <= 1:
            raise ValueError(f"shadowBudget: must be within [0, 1], got {share}")
        if burst_tokens < 0:
            raise ValueError(f"burst_tokens: must be >= 0, got {burst_tokens}")
        self.share, self.burst_tokens, self._clock = share, burst_tokens, clock
        self._lock = threading.Lock()
        self.set_floor(idle_samples, idle_seconds)
        self._balance = float(burst_tokens)
        self._admitted: collections.deque[float] = collections.deque()  # admission times
        self.user_tokens = 0
        self.shadow_tokens = 0  # admitted by the account
        self.idle_tokens = 0  # admitted by the idle floor
        self.num_idle = 0  # shadows the idle floor admitted

    @property
    def balance(self) -> float:
        with self._lock:
            return self._balance

    def add_user_tokens(self, num_tokens: int) -> None:
        """User prompt tokens the engine prefilled (reused or computed)."""
        if num_tokens <= 0:
            return
        with self._lock:
            self.user_tokens += num_tokens
            self._balance = min(self.burst_tokens, self._balance + self.share * num_tokens)

    def set_floor(self, idle_samples: int, idle_seconds: float) -> None:
        """The idle floor in force (blend.json's live keys); admissions already made count
        in the new window."""
        if idle_samples < 0:
            raise ValueError(f"shadowIdleSamples: must be >= 0, got {idle_samples}")
        if not idle_seconds > 0:
            raise ValueError(f"shadowIdleSeconds: must be > 0, got {idle_seconds}")
        with self._lock:
            self.idle_samples, self.idle_seconds = idle_samples, idle_seconds

    def floor_open(self) -> bool:
        """Whether the idle floor would admit a shadow now (fewer than `idle_samples`
        admitted in the last `idle_seconds`)."""
        with self._lock:
            return self._floor_open(self._clock())

    def try_spend(self, num_tokens: int) -> bool:
        """Admit a shadow of `num_tokens` (and charge it) if the account allows."""
        return self.admit(num_tokens) == "budget"

    def admit(self, num_tokens: int, *, idle: bool = False, sampled: bool = True) -> str | None:
        """Admit a shadow of `num_tokens`: "budget" when the account allows (charged),
        else "idle" when `idle` and the floor is open (counted apart), else None.
        `sampled`: the sample rate took the request; a request it passed over that the
        floor offers is the floor's alone, never charged to the account."""
        with self._lock:
            now = self._clock()
            # The window forgets what is older than `idle_seconds` on every admission, not
            # only when an idle offer reads it: a pod that never idles would otherwise
            # remember every shadow it ever admitted.
            self._forget(now)
            if sampled and self._spend(num_tokens):
                self._admitted.append(now)
                return "budget"
            if self.share > 0 and idle and self._floor_open(now):
                self.idle_tokens += num_tokens
                self.num_idle += 1
                self._admitted.append(now)
                return "idle"
            return None

    def take_over(self, num_tokens: int) -> bool:
        """An idle-floor shadow caught by sustained load goes on as one of the account's
        when the account allows now (as `admit` would): charged its tokens, which move
        from `idle_tokens` to `shadow_tokens`."""
        with self._lock:
            if not self._spend(num_tokens):
                return False
            self.idle_tokens -= num_tokens
            return True

    def _spend(self, num_tokens: int) -> bool:
        """Under the lock: charge the account when it allows (a share and a balance that
        is not negative)."""
        if not (self.share > 0 and self._balance >= 0):
            return False
        self._balance -= num_tokens
        self.shadow_tokens += num_tokens
        return True

    def charge(self, num_tokens: int, *, idle: bool = False) -> None:
        """Tokens an admitted shadow spent beyond its estimate (a continuation); `idle`:
        the shadow was the idle floor's."""
        with self._lock:
            if idle:
                self.idle_tokens += num_tokens
                return
            self._balance -= num_tokens
            self.shadow_tokens += num_tokens

    def _floor_open(self, now: float) -> bool:
        self._forget(now)
        return len(self._admitted) < self.idle_samples

    def _forget(self, now: float) -> None:
        """Under the lock: drop the admissions that left the floor's window."""
        while self._admitted and self._admitted[0] <= now - self.idle_seconds:
            self._admitted.popleft()


class ShadowGate:
    """Serving first, yet progress under load: the shadow's work in units (a layer of a
    prefill chunk, a decode step), each entered through the gate.

    - Engine idle: a unit runs at once.
    - The time share is an account of shadow time (`_credit`, seconds): it grows by
      time_share / (1 - time_share) of every second no unit runs, up to
      `max_catch_up_s`, and each unit's duration is taken from it (a unit owes at most
      its own duration: idle units do not pile up a debt); a unit may start while the
      engine serves only when the account is not negative. So after a unit of
      d seconds none starts for d x (1/time_share - 1), and over time the units take at
      most `time_share` of the time, however long the engine's steps are.
    - Engine serving, `cooperative` (the engine calls `between_steps` between its own
      steps): the engine grants the waiting shadow units while the account allows, and
      waits for them, until `max_catch_up_s` of shadow time has run in that call (what a
      long engine step, a prefill, earned; at 0, one unit per call at most); a unit
      already running when a request arrives is finished first. Either way a user step
      waits for at most `max_catch_up_s` plus one unit of shadow work, and the engine
      never computes beside the shadow.
    - Engine serving, not cooperative (nothing calls `between_steps`): the shadow runs
      units beside the engine at the same pacing.
    - `idle_only` (set per shadow, `begin`; every shadow of `ShadowSampler`): no unit
      while the engine serves, granted or paced; a unit running when a request arrives
      is still finished first. After a wait longer than `idle_patience_s` at one stretch,
      or once `idle_patience_s` have passed since `begin` while its units so far took
      less than `time_share` of that time (an engine that is idle only in brief gaps
      between requests, one unit per gap, never waits a whole stretch), the shadow goes on
      as any shadow when `on_patience` says so (a budget shadow; a
      floor shadow the budget took over), else `ShadowExpired` is raised in the shadow's
      thread, so a floor shadow caught by sustained load gives its slot up instead of
      holding it. A shadow that begins within `idle_patience_s` of the end of one that
      went on so starts with its patience spent: the load most likely goes on, and
      waiting it out again would cost every shadow at saturation `idle_patience_s`.
    - `set_time_share`: the share and the slice can change as the engine serves
      (holeblend-serve raises the share and grants the slice only while the inline proxy
      is blind, `serving_time_share`, `serving_catch_up_s`; else one unit per step).
    """

    def __init__(
        self,
        is_busy: Callable[[], bool],
        *,
        time_share: float = SHADOW_TIME_SHARE,
        cooperative: bool = False,
        max_unit_wait_s: float = 10.0,
        idle_patience_s: float = IDLE_PATIENCE_S,
        max_catch_up_s: float = SHADOW_CATCH_UP_S,
        clock: Callable[[], float] = time.monotonic,
        on_unit: Callable[[float, bool], None] | None = None,
    ) -> None:
        """`on_unit(seconds, serving)`: called as each unit ends (under the gate's lock:
        keep it short), `serving` when the engine was serving as it started."""
        if not 0 < time_share <= 1:
            raise ValueError(f"time_share: must be within (0, 1], got {time_share}")
        if not idle_patience_s > 0:
            raise ValueError(f"idle_patience_s: must be > 0, got {idle_patience_s}")
        if not max_catch_up_s >= 0:
            raise ValueError(f"max_catch_up_s: must be >= 0, got {max_catch_up_s}")
        self.max_catch_up_s = max_catch_up_s
        self.is_busy, self.time_share, self.cooperative = is_busy, time_share, cooperative
        self.max_unit_wait_s, self._clock = max_unit_wait_s, clock
        self.idle_patience_s = idle_patience_s
        self.on_unit = on_unit
        self._unit_serving = False  # the running unit started while the engine served
        # The running shadow's start (`begin`) and the seconds its units took since.
        self._began_at, self._units_s = clock(), 0.0
        self.idle_only = False  # the running shadow's units only while the engine is idle
        self._on_patience: Callable[[], bool] | None = None
        # When the last shadow that went on past its patience ended (sustained load then),
        # and whether the running one starts with its patience spent because of it.
        self._left_going_on_at: float | None = None
        self._went_on = self._patience_spent = False
        self._cond = threading.Condition()
        self._running_since: float | None = None  # a unit runs
        self._waiting = False  # the shadow waits for a grant
        self._granted = False
        # Shadow time the share allows now (seconds; negative: owed), as of `_credit_at`.
        self._credit, self._credit_at = 0.0, clock()
        self.num_units = 0
        self.num_granted = 0  # units run while the engine served

    def begin(self, *, idle_only: bool, on_patience: Callable[[], bool] | None = None) -> None:
        """Shadow thread, before a shadow's first unit: whether it runs only while the
        engine is idle, and what decides, once its patience ran out, whether it goes on as
        any shadow (True) or is given up."""
        with self._cond:
            self.idle_only, self._on_patience = idle_only, on_patience
            self._began_at, self._units_s = self._clock(), 0.0
            # The shadow before went on past its patience and ended moments ago: the load
            # that spent its patience most likely goes on, and waiting out the patience
            # again would idle the shadow for idle_patience_s per shadow at saturation.
            left = self._left_going_on_at
            self._patience_spent = (
                idle_only and left is not None and self._began_at - left <= self.idle_patience_s
            )
            self._went_on = False

    def set_time_share(self, time_share: float, max_catch_up_s: float | None = None) -> None:
        """Any thread: the share (and, if given, the catch-up slice) in force from now on
        (`serving_time_share`, `serving_catch_up_s`)."""
        if not 0 < time_share <= 1:
            raise ValueError(f"time_share: must be within (0, 1], got {time_share}")
        if max_catch_up_s is not None and not max_catch_up_s >= 0:
            raise ValueError(f"max_catch_up_s: must be >= 0, got {max_catch_up_s}")
        with self._cond:
            self._refill()  # the time so far earns at the old share
            self.time_share = time_share
            if max_catch_up_s is not None:
                self.max_catch_up_s = max_catch_up_s
                self._credit = min(self._credit, max_catch_up_s)

    def enter(self) -> None:
        """Shadow thread, before a unit: ends the previous unit; returns when this one
        may run (`ShadowExpired`: an idle-only shadow waited past its patience)."""
        with self._cond:
            self._end_unit()
            granted = False
            waiting_since = self._clock()
            while self.is_busy():
                if self.idle_only:
                    if self._out_of_patience(waiting_since):
                        if self._on_patience is None or not self._on_patience():
                            self._waiting = self._granted = False
                            raise ShadowExpired(
                                "sustained load: idle time gave it less than its time "
                                f"share for over {self.idle_patience_s:g} s"
                            )
                        self.idle_only = False  # taken over: paced as any shadow
                        self._went_on = True
                elif self._granted:
                    self._granted, granted = False, True
                    break
                elif not self.cooperative and self._allowed():
                    granted = True
                    break
                self._waiting = True
                self._cond.wait(0.005)
            # Whatever let this unit run, a grant given meanwhile is used by it.
            self._waiting = self._granted = False
            self._refill()
            self._running_since = self._clock()
            self._unit_serving = granted or self.is_busy()
            self.num_units += 1
            self.num_granted += granted

    def _out_of_patience(self, waiting_since: float) -> bool:
        """An idle-only shadow waited `idle_patience_s` at one stretch, or has been going
        that long while idle time gave it less than its time share."""
        if self._patience_spent:
            return True
        now = self._clock()
        if now - waiting_since > self.idle_patience_s:
            return True
        going = now - self._began_at
        return going > self.idle_patience_s and self._units_s < self.time_share * going

    def leave(self) -> None:
        """Shadow thread: the shadow's work is over (scored, failed, expired)."""
        with self._cond:
            self._end_unit()
            self._left_going_on_at = self._clock() if self._went_on else None
            self._granted = self.idle_only = self._went_on = self._patience_spent = False
            self._on_patience = None

    def between_steps(self) -> None:
        """Engine thread, before each step while it serves: finish a running unit, then
        grant the waiting shadow units while the time share allows, until
        `max_catch_up_s` of this call has passed (one unit at least), and wait for each."""
        with self._cond:
            started, granted = self._clock(), False
            while True:
                if (self._running_since is not None or self._granted) and not (
                    self._cond.wait_for(
                        lambda: not self._granted and self._running_since is None,
                        self.max_unit_wait_s,
                    )
                ):
                    return  # a unit that overran its wait: the engine goes on
                if granted and self._clock() - started >= self.max_catch_up_s:
                    return
                # A granted unit ends where the shadow enters its next one, so a shadow
                # in the middle of a chunk is waiting again by now.
                if not (self._waiting and not self.idle_only and self._allowed()):
                    return
                self._granted = granted = True
                self._cond.notify_all()

    def _allowed(self) -> bool:
        """The account is not negative (the lock held; no unit running)."""
        self._refill()
        return self._credit >= 0

    def _refill(self) -> None:
        now = self._clock()
        if self._running_since is None:
            if self.time_share >= 1:
                self._credit = max(self._credit, 0.0)
            else:
                rate = self.time_share / (1 - self.time_share)
                gained = (now - self._credit_at) * rate
                self._credit = min(self.max_catch_up_s, self._credit + gained)
        self._credit_at = now

    def _end_unit(self) -> None:
        if self._running_since is None:
            return
        now = self._clock()
        duration = now - self._running_since
        # A unit owes at most its own duration: units run while the engine was idle took
        # none of its serving time, and a long run of them must not bar the next serving
        # stretch (a paced unit starts with the account at 0 or more anyway).
        self._credit, self._credit_at = max(self._credit, 0.0) - duration, now
        self._units_s += duration
        if self.on_unit is not None:
            try:
                self.on_unit(duration, self._unit_serving)
            except Exception:  # a metric never stops the shadow or the engine
                LOG.exception("on_unit hook failed")
        self._running_since = None
        self._cond.notify_all()


class ShadowSkipped(Exception):
    """A sampled request that turned out to have nothing to score; counted under the
    outcome it names (e.g. `replay_not_blended`), neither scored nor failed."""

    def __init__(self, outcome: str):
        super().__init__(outcome)
        self.outcome = outcome


class ShadowSampler(abc.ABC):
    """Samples offered requests and scores them on one background thread (step 1 of the
    module doc); subclasses say how a request is scored (`score`)."""

    def __init__(
        self,
        sample_rate: float,
        *,
        is_busy: Callable[[], bool] = lambda: False,
        gate: ShadowGate | None = None,
        budget: ShadowBudget | None = None,
        inline: InlineProxy | None = None,
        metrics: ShadowMetrics | None = None,
        slots: int = 1,
        rng: random.Random | None = None,
    ):
        if not 0 <= sample_rate <= 1:
            raise ValueError(f"sample_rate: must be within [0, 1], got {sample_rate}")
        if slots < 1:
            raise ValueError(f"slots: must be >= 1, got {slots}")
        self.sample_rate = sample_rate
        # Units of shadow work pass the gate (default: pacing against `is_busy` alone).
        self.gate = gate or ShadowGate(is_busy)
        self.budget = budget  # None: no token budget (offline use)
        self.inline = inline  # calibrated by each scored request's inline statistic
        self.metrics = metrics
        self._rng = rng or random.Random()
        self.slots = slots
        self._jobs: queue.Queue[object | None] = queue.Queue()
        self._lock = threading.Lock()
        self._num_in_flight = 0
        self._idle = threading.Event()
        self._idle.set()
        self._running_idle = False  # the running shadow is the idle floor's (worker thread)
        # Worker thread, the running shadow's: whether the budget takes it over when its
        # patience ran out (`_take_over`); subclasses that wait elsewhere call it too.
        self._patience_out: Callable[[], bool] = lambda: False
        self.scores: list[ShadowScore] = []  # kept for benchmarks and tests (bounded below)
        self.outcomes: collections.Counter[str] = collections.Counter()  # offers by outcome
        self._outcomes_lock = threading.Lock()  # counted by the serving and worker threads
        # Serially: a second OpenMP team in the process would slow every forward of the
        # engine's thread for as long as this thread lives (model/threads.py).
        self._thread = serial_thread(self._work, "shadow-prefill")

    @abc.abstractmethod
    def score(self, request) -> ShadowScore:
        """Both proxies of one sampled request (on the worker thread)."""

    def offer(self, request, *, idle: bool = False) -> str:
        """Take the request for scoring or drop it; returns the outcome (never blocks).
        `idle`: no other user request is in flight (the idle floor may admit it)."""
        floor = idle and self.budget is not None and self.budget.floor_open()
        sampled = self._rng.random() < self.sample_rate
        if not sampled and not floor:
            return self._count("not_sampled")
        with self._lock:
            if self._num_in_flight >= self.slots:  # queued or running
                return self._count("dropped_full")
            kind = "budget"
            if self.budget is not None:
                kind = self.budget.admit(request.num_shadow_tokens, idle=idle, sampled=sampled)
                if kind is None:
                    return self._count("over_budget")
            self._num_in_flight += 1
            self._idle.clear()
        if self.metrics is not None and kind == "idle":
            self.metrics.idle_requests.inc()
            self.metrics.idle_tokens.inc(request.num_shadow_tokens)
        elif self.metrics is not None and self.budget is not None:
            self.metrics.tokens.inc(request.num_shadow_tokens)
        self._jobs.put((request, kind == "idle"))
        return "queued"

    def charge(self, num_tokens: int) -> None:
        """Tokens a running shadow spends beyond its admission estimate (worker thread)."""
        if self.budget is not None and num_tokens > 0:
            self.budget.charge(num_tokens, idle=self._running_idle)
            if self.metrics is not None:
                counter = self.metrics.idle_tokens if self._running_idle else self.metrics.tokens
                counter.inc(num_tokens)

    def _take_over(self, request) -> bool:
        """Worker thread: the running idle-floor shadow met sustained load; whether the
        budget takes it over (then charged, and counted in the budget's tokens too)."""
        tokens = request.num_shadow_tokens
        if self.budget is None or not self.budget.take_over(tokens):
            return False
        self._running_idle = False
        if self.metrics is not None:
            self.metrics.tokens.inc(tokens)
            self.metrics.taken_over.inc()
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until no shadow work is queued or running (tests, benchmarks)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _work(self) -> None:
        _lower_own_priority()
        while (job := self._jobs.get()) is not None:
            request, self._running_idle = job
            try:
                # Idle time first for every shadow; past its patience a budget shadow
                # goes on paced, a floor one only if the budget takes it over.
                self._patience_out = (
                    functools.partial(self._take_over, request) if self._running_idle else _goes_on
                )
                self.gate.begin(idle_only=True, on_patience=self._patience_out)
                score = self.score(request)
                self.scores = [*self.scores[-999:], score]
                if self.metrics is not None:
                    self.metrics.observe(score)
                if self.inline is not None:
                    statistic = score.inline_statistic
                    if statistic is None:
                        statistic = getattr(request, "inline_statistic", None)
                    self.inline.add_pair(statistic, score)
                self._count("scored")
            except ShadowSkipped as skipped:
                self._count(skipped.outcome)
            except ShadowExpired as expired:
                LOG.info("idle-floor shadow given up: %s", expired)
                self._count("expired")
            except Exception:  # a shadow must never take the engine down
                LOG.exception("shadow scoring failed")
                self._count("failed")
            finally:
                self.gate.leave()
                with self._lock:
                    self._num_in_flight -= 1
                    if self._num_in_flight == 0:
                        self._idle.set()
                self._running_idle = False

    def _yield_to_serving(self) -> None:
        """Before a unit of shadow work: pass the gate."""
        self.gate.enter()

    def _count(self, outcome: str) -> str:
        with self._outcomes_lock:
            self.outcomes[outcome] += 1
        if self.metrics is not None:
            self.metrics.offers.labels(outcome=outcome).inc()
        return outcome


def _goes_on() -> bool:
    # A budget shadow's patience ran out: it takes its time share (already charged).
    return True


def answer_budget(num_answer: int, stopped_at_eos: bool, max_tokens: int | None) -> int:
    """Tokens full prefill's own answer may have: the blended length when that was the
    limit (or the end is unknown), else (`stopped_at_eos`: the blended answer ended by
    itself, at EOS or a stop sequence) `RUN_ON_TOKENS` more, within `max_tokens`."""
    if not stopped_at_eos:
        return num_answer
    budget = num_answer + RUN_ON_TOKENS
    return budget if max_tokens is None else max(num_answer, min(budget, max_tokens))


def end_targets(answer: Sequence[int], stopped_at_eos: bool, eos: int) -> list[int]:
    """The tokens full prefill is teacher-forced to agree with: the answer, plus EOS after
    it when the blended answer ended there (an empty answer always did)."""
    return [*answer, eos] if stopped_at_eos or not answer else list(answer)


def through_stop(
    answer: list[int], reaches: Callable[[Sequence[int]], bool]
) -> tuple[list[int], bool]:
    """The answer's tokens up to the one whose text reached a stop sequence (`reaches`: a
    prefix's text holds one), and whether one did. Reaching one is monotone in the
    answer's length (its text only grows), so the shortest such prefix is bisected."""
    if not reaches(answer):
        return answer, False
    end = bisect.bisect_left(range(len(answer) + 1), True, key=lambda n: reaches(answer[:n]))
    return answer[:end], True


def before_stop(text: str, stop: Sequence[str]) -> str | None:
    """`text` up to the first stop sequence in it (OpenAI's `stop`: the answer ends before
    it); None when it holds none."""
    found = [i for sequence in stop if (i := text.find(sequence)) >= 0]
    return text[: min(found)] if found else None


def question_words(question: str, closing: str) -> list[str]:
    """The words the F1 skips in both answers (`answer_f1`): those of the question segment's
    text (`question`) without the chat template's closing that ends it (`closing`, decoded
    as the segment is: ChatML's "<|im_end|>\n<|im_start|>assistant\n" decodes to
    "\nassistant\n"). The closing's words ("assistant") are the template's: taken for the
    question's, they would be dropped from both answers, where holeblend-bench skips only
    the question's own. A segment that does not end with it (a prompt sent without the
    template) is kept whole."""
    return answer_words(question.removesuffix(closing))


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
        # The end of every question segment, as `score` decodes it: the engine's prompts
        # are ChatML (blend/prompt.py).
        self.closing = tokenizer.decode(tokenizer.encode(ChatMLTemplate().closing()))
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
        eos = self.model.config.eos_token_id
        answer, at_stop = self._through_stop(list(request.answer_ids), request.stop)
        at_eos = request.stopped_at_eos and not at_stop
        prompt_ids = list(request.prompt.token_ids)
        targets = end_targets(answer, at_eos, eos)
        room = self.model.config.context_length - len(prompt_ids)
        budget = min(answer_budget(len(answer), at_eos or at_stop, request.max_tokens), room)
        k, v = self.model.new_kv(len(prompt_ids) + max(len(targets), budget) + 1)
        last = self._prefill_prompt(prompt_ids, k, v)
        # Teacher-forced: the rows after the prompt and after each answer token but the
        # last target's input (the last answer token when the end is checked).
        hidden = self._forward_chunks(targets[:-1], len(prompt_ids), k, v)
        rows = self.model.logits(torch.cat([last, *hidden]))
        picks = rows.argmax(dim=-1).tolist()  # full prefill's pick at each target position
        agree = [a == b for a, b in zip(picks, targets, strict=True)]
        full_answer = self._full_answer(
            targets, picks, agree, budget, len(prompt_ids), k, v, request.stop
        )
        question = question_words(
            self.tokenizer.decode(request.prompt.question.token_ids), self.closing
        )
        f1 = answer_f1(
            answer_words(self._text(full_answer, request.stop)),
            answer_words(self._text(answer, request.stop)),
            question,
        )
        top1 = sum(agree) / len(agree)
        return ShadowScore(f1, top1, request.ratio, time.monotonic() - started)

    def _through_stop(self, answer: list[int], stop: Sequence[str]) -> tuple[list[int], bool]:
        return through_stop(answer, lambda ids: self._reaches_stop(ids, stop))

    def _reaches_stop(self, token_ids: Sequence[int], stop: Sequence[str]) -> bool:
        return bool(stop) and before_stop(self.tokenizer.decode(token_ids), stop) is not None

    def _text(self, token_ids: Sequence[int], stop: Sequence[str]) -> str:
        """The answer's text as the client got it: cut before its first stop sequence."""
        text = self.tokenizer.decode(token_ids)
        cut = before_stop(text, stop)
        return text if cut is None else cut

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
        """Hidden states of `token_ids` at positions start.., chunk by chunk, passing the
        gate before every layer."""
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

    def _full_answer(self, targets, picks, agree, budget, num_prompt, k, v, stop) -> list[int]:
        """Full prefill's own greedy answer: the targets up to the first disagreement, then
        its own picks to EOS, a stop sequence or `budget` tokens."""
        eos = self.model.config.eos_token_id
        first_diff = agree.index(False) if False in agree else len(agree)
        full = [t for t in targets[:first_diff] if t != eos]
        if first_diff == len(agree):
            return full
        token, position = picks[first_diff], num_prompt + first_diff
        while token != eos and len(full) < budget:
            full.append(token)
            if len(full) == budget or position + 1 >= k.shape[2]:
                break
            if self._reaches_stop(full, stop):
                break
            self._yield_to_serving()
            self.charge(1)
            h = self.model.forward(torch.tensor([token], device=self.model.device), k, v, position)
            token, position = int(self.model.logits(h)[0].argmax()), position + 1
        return full


def _lower_own_priority() -> None:
    # Linux applies setpriority to one thread when given its id; elsewhere this is a no-op.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SHADOW_NICE)
