"""The compute thread: one request at a time through the reference engine.

The model runs on a single thread (torch itself uses `torch_threads` for each operation),
fed by a bounded queue:

1. `submit` admits a job while fewer than `queue_size` wait, else raises `QueueFull` (the
   route answers 429 with Retry-After: when the running job is expected to end, see
   `SlotEstimate`).
2. The thread takes jobs in arrival order. A job cancelled (its client went away) or past
   its deadline before it starts is dropped without compute.
3. It looks the segments up (timed), prefills in the configured mode at the live ratio,
   then decodes greedily, one token at a time, checking cancellation, a reached stop
   sequence and the deadline after each token.
4. Events go back to the job's asyncio queue on the server's loop: `Started`,
   `PrefillDone`, token ids, then one `Finished` (or an exception).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from holeblend_contract.blend_settings import BlendMode
from holeblend_runtime.engine import Mode, Prefill, ReferenceEngine
from holeblend_runtime.segments import SegmentedPrompt
from holeblend_runtime.serve.live_config import LiveConfig
from holeblend_runtime.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)

ENGINE_MODES = {BlendMode.HOLE: Mode.HOLE, BlendMode.PREFIX: Mode.PREFIX, BlendMode.OFF: Mode.FULL}


class QueueFull(Exception):
    """No room in the queue; `retry_after_s` estimates when there will be."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"queue full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class SlotEstimate:
    """When the full queue frees a place: when the compute thread takes its next job, i.e.
    when the running job ends. Expected from the durations of the recently finished jobs
    (their mean, the last `window` jobs) minus what the running one has already taken."""

    def __init__(self, window: int = 8, initial_s: float = 1.0) -> None:
        self._durations: deque[float] = deque([initial_s], maxlen=window)
        self._running_since: float | None = None

    def started(self, now: float) -> None:
        self._running_since = now

    def finished(self, now: float) -> None:
        if self._running_since is not None:
            self._durations.append(now - self._running_since)
        self._running_since = None

    def retry_after_s(self, now: float) -> int:
        """Whole seconds (at least 1, as Retry-After takes) until a place is expected."""
        expected = sum(self._durations) / len(self._durations)
        elapsed = 0.0 if self._running_since is None else now - self._running_since
        return max(1, math.ceil(expected - elapsed))


@dataclass(frozen=True)
class PrefillDone:
    """What a response reports about the prefill (the usage extension)."""

    mode: str
    lookup_mode: str
    ratio: float
    num_prompt_tokens: int
    num_reused_tokens: int
    num_hole_tokens: int
    num_recomputed_tokens: int
    # Reused tokens the blend recomputed (part of both reused and recomputed tokens).
    num_recomputed_cached_tokens: int
    ttft_s: float

    @classmethod
    def of(cls, prefill: Prefill, ttft_s: float) -> PrefillDone:
        lookup = prefill.lookup.mode if prefill.lookup is not None else "full-miss"
        return cls(
            str(prefill.mode), str(lookup), prefill.ratio, prefill.num_prompt_tokens,
            prefill.num_reused_tokens, prefill.num_hole_tokens, prefill.num_recomputed_tokens,
            int(prefill.selected_positions.shape[0]), ttft_s,
        )  # fmt: skip


@dataclass(frozen=True)
class Finished:
    # "stop" (EOS or a stop sequence), "length" (max_tokens), "timeout" or "cancelled".
    reason: str


@dataclass(eq=False)
class Job:
    prompt: SegmentedPrompt
    max_tokens: int
    arrived: float
    deadline: float
    loop: asyncio.AbstractEventLoop
    # Decode past the end-of-sequence token (the request's ignore_eos).
    ignore_eos: bool = False
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Set when the answer reached a stop sequence: decoding ends, the answer stands.
    stopped: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: object) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def stop_reason(self) -> str | None:
        if self.stopped.is_set():
            return "stop"
        if self.cancelled.is_set():
            return "cancelled"
        if time.perf_counter() > self.deadline:
            return "timeout"
        return None


class EngineWorker:
    """The queue and the one thread that runs the engine."""

    def __init__(
        self, engine: ReferenceEngine, live: LiveConfig, metrics: ServeMetrics, queue_size: int
    ) -> None:
        self.engine, self.live, self.metrics = engine, live, metrics
        self.queue_size = queue_size
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._num_waiting = 0
        self._num_running = 0
        self._slot = SlotEstimate()
        self._thread = threading.Thread(target=self._run, name="holeblend-engine", daemon=True)
        # Called after each answered request that blended cached KV (the shadow quality
        # proxies; see `is_blended`).
        self.on_answered: Callable[[SegmentedPrompt, tuple[int, ...], float], None] | None = None

    @property
    def num_pending(self) -> int:
        """Waiting plus running jobs."""
        with self._lock:
            return self._num_waiting + self._num_running

    @property
    def mode(self) -> Mode:
        return ENGINE_MODES[self.live.current.mode]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._num_waiting >= self.queue_size:
                raise QueueFull(self._slot.retry_after_s(time.perf_counter()))
            self._num_waiting += 1
            self.metrics.queue_depth.set(self._num_waiting)
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._num_waiting -= 1
                self._num_running += 1
                self.metrics.queue_depth.set(self._num_waiting)
                self._slot.started(time.perf_counter())
            try:
                self._serve(job)
            except Exception as error:  # reported to the request; the thread serves on
                log.exception("request failed")
                job.emit(error)
            finally:
                self._finish()

    def _finish(self) -> None:
        with self._lock:
            self._num_running -= 1
            self._slot.finished(time.perf_counter())

    def _serve(self, job: Job) -> None:
        if (reason := job.stop_reason()) is not None:
            job.emit(Finished(reason))
            return
        self.metrics.queue_wait.observe(time.perf_counter() - job.arrived)
        self._time_lookup(job.prompt)
        prefill = self.engine.prefill(job.prompt, self.mode, self.live.recompute_ratio)
        self.metrics.observe_prefill(prefill)
        job.emit(PrefillDone.of(prefill, time.perf_counter() - job.arrived))
        answer: list[int] = []
        job.emit(Finished(reason := self._decode(job, prefill, answer)))
        if self.on_answered is not None and is_blended(prefill) and reason != "cancelled":
            self.on_answered(job.prompt, tuple(answer), prefill.ratio)

    def _decode(self, job: Job, prefill: Prefill, answer: list[int]) -> str:
        limit = min(job.max_tokens, self.engine.config.context_length - prefill.num_prompt_tokens)
        for token in self.engine.generate_stream(prefill, limit, job.ignore_eos):
            if (reason := job.stop_reason()) is not None:
                return reason
            job.emit(token)
            answer.append(token)
            self.metrics.completion_tokens.labels(str(prefill.mode)).inc()
        return "length" if len(answer) == job.max_tokens else "stop"

    def _time_lookup(self, prompt: SegmentedPrompt) -> None:
        """Keys and store look-ups, as the prefill does them (the store is in-process)."""
        if self.mode is Mode.FULL:
            return
        started = time.perf_counter()
        keys = [key for key in self.engine.segment_keys(prompt) if key is not None]
        self.engine.store.contains_many(keys)  # one lookup-server call for the local misses
        self.metrics.lookup.observe(time.perf_counter() - started)


def is_blended(prefill: Prefill) -> bool:
    """Whether the request reused KV beyond an exact cached prefix: only then can its answer
    differ from full prefill's, so only then does a shadow sample measure the ratio (a full
    miss or an exact prefix hit would score 1.0 at any ratio and dilute the proxies)."""
    return prefill.num_reused_tokens > prefill.num_exact_prefix_tokens
