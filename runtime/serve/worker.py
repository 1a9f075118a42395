"""The compute thread: the requests in flight decode together, one batched step at a time.

The model runs on a single thread (torch itself uses `torch_threads` for each operation),
fed by a bounded queue, and schedules as vLLM's default scheduler does (prefill first,
continuous batching of the decode steps):

1. `submit` admits a job while fewer than `queue_size` wait, else raises `QueueFull` (the
   route answers 429 with Retry-After: when a running job is expected to end, see
   `SlotEstimate`). A waiting job that is cancelled (`cancel`: its client went away or
   got its timeout) gives its place back and leaves the queue at once; so does one whose
   `cancelled` event was set directly, by the next `submit` or `num_pending` at the latest.
2. Whenever a job waits and fewer than `max_batch` jobs are decoding, the thread takes the
   next one in arrival order before any decode step, at most `max_batch` between two steps
   (jobs that end at their prefill would otherwise starve the batch). With a byte budget
   for the decode pool (`decode_pool_bytes`), the next job joins a batch only when the
   pool, grown for it and for every answer in it to its limit, stays within the budget;
   else it stays first in line (no job passes it) until rows are freed, and when the
   batch is empty it runs, alone, whatever it needs. A job cancelled or
   past its deadline before it starts is dropped without compute (and is no job duration
   for the Retry-After estimate). Otherwise it looks the segments up (timed), prefills in
   the configured mode at the live ratio, takes its first token from the prefill's logits
   and joins the batch (keeping only the prefill's figures: its KV now lives in the decode
   pool's row).
3. Otherwise the thread runs one decode step for every job in the batch: one forward pass
   for all their last tokens (`BlendEngine.decode_step`; the weights are read once
   for the batch, not once per job). After each token it checks, per job, the
   end-of-sequence token, cancellation, a reached stop sequence and the deadline, and
   drops the jobs that ended. A failed step fails the jobs in it; the thread serves on.
4. Events go back to the job's asyncio queue on the server's loop: `PrefillDone`, token
   ids, then one `Finished` (or an exception). A job whose loop is gone (closed: nobody
   waits for it) fails at its next event; the event that reports its end is then only
   logged, and the thread serves on.
5. The quality proxies hook in at three points (app.py wires them): `on_prefilled` sees
   every completed prefill (the shadow budget counts its tokens, the inline proxy reads
   its blend's statistic), `on_answered` every answered request that blended
   (`Answered`, offered to the shadow), and `between_steps` runs before every prefill and
   decode step (the shadow gate: a user step waits for at most a catch-up slice of
   shadow work, `SHADOW_CATCH_UP_S`, plus the unit that crosses it).

Should something escape the thread (no handler catches it), every job waiting or running
gets `ComputeThreadEnded` at once, as does one submitted from then on: nothing would answer
it, and it would wait out its deadline.

`max_batch` 1 serves one request at a time: prefill, then its whole answer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from holeblend_contract.blend_settings import BlendMode
from holeblend_runtime.blend.segments import SegmentedPrompt
from holeblend_runtime.engine import BlendEngine, Mode, Prefill
from holeblend_runtime.model.batch_decode import DecodeSequence
from holeblend_runtime.model.threads import compute_threads
from holeblend_runtime.serve.live_config import LiveConfig
from holeblend_runtime.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)

ENGINE_MODES = {BlendMode.HOLE: Mode.HOLE, BlendMode.PREFIX: Mode.PREFIX, BlendMode.OFF: Mode.FULL}


class QueueFull(Exception):
    """No room in the queue; `retry_after_s` estimates when there will be."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"queue full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ComputeThreadEnded(RuntimeError):
    """Something escaped the compute thread, which ended: no job is served any more."""

    def __init__(self) -> None:
        super().__init__("the compute thread ended; this server answers no more requests")


class SlotEstimate:
    """When the full queue frees a place: when the compute thread takes its next job, i.e.
    (the batch being full) when the running job that started first ends. Expected from
    the durations of the recently finished jobs (their mean, the last `window` jobs) minus
    what that job has already taken, never later than a running job's deadline (it ends
    there). Once that job has run past the mean, the mean says nothing more: the estimate
    is then when some running job ends at the latest (`ends_by`: its tokens left at the
    recent step time, or its deadline). With answers of mixed lengths the job running
    longest often is past it, and 1 s would send every refused client back each second
    until a place frees.

    Jobs are told apart by `key` (any hashable; the default None is one job at a time)."""

    def __init__(self, window: int = 8, initial_s: float = 1.0) -> None:
        self._durations: deque[float] = deque([initial_s], maxlen=window)
        # key -> start time, in start order.
        self._running: dict[Hashable, float] = {}
        # key -> the running job's deadline.
        self._deadlines: dict[Hashable, float] = {}
        # key -> when the running job ends at the latest.
        self._latest_ends: dict[Hashable, float] = {}

    def started(self, now: float, key: Hashable = None, deadline: float = math.inf) -> None:
        self._running.pop(key, None)
        self._running[key] = now
        self._deadlines[key] = self._latest_ends[key] = deadline

    def ends_by(self, when: float, key: Hashable = None) -> None:
        """The running job `key` ends by `when` (or its deadline) at the latest."""
        if key in self._running:
            self._latest_ends[key] = min(when, self._deadlines[key])

    def finished(self, now: float, key: Hashable = None) -> None:
        self._deadlines.pop(key, None)
        self._latest_ends.pop(key, None)
        if (since := self._running.pop(key, None)) is not None:
            self._durations.append(now - since)

    def retry_after_s(self, now: float) -> int:
        """Whole seconds (at least 1, as Retry-After takes) until a place is expected."""
        expected = sum(self._durations) / len(self._durations)
        first = next(iter(self._running.values()), None)
        rest = expected - (0.0 if first is None else now - first)
        if rest > 0:
            estimate = min(rest, min(self._deadlines.values(), default=math.inf) - now)
        else:
            estimate = min(self._latest_ends.values(), default=math.inf) - now
        return max(1, math.ceil(estimate)) if math.isfinite(estimate) else 1


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
        reuse = prefill.reuse.mode if prefill.reuse is not None else "full-miss"
        return cls(
            str(prefill.mode), str(reuse), prefill.ratio, prefill.num_prompt_tokens,
            prefill.num_reused_tokens, prefill.num_hole_tokens, prefill.num_recomputed_tokens,
            int(prefill.selected_positions.shape[0]), ttft_s,
        )  # fmt: skip


# The ends whose answers the shadow scores: an answer cut by its deadline ("timeout",
# often empty when the deadline passed during its prefill) or cancelled is not the blend's
# answer, and full prefill's would be scored against its cut (an empty one: F1 1.0).
_SCORED_REASONS = ("stop", "length")


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
    # The request's stop sequences (the route watches for them; `Answered` carries them).
    stop: tuple[str, ...] = ()

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


@dataclass(eq=False)
class _Running:
    """A job in the batch: what it needs of its prefill, its decode state and its answer so
    far. The `Prefill` itself is not kept: its KV was copied into the decode pool's row,
    and holding it would keep a second copy of the prompt's KV for the whole answer."""

    job: Job
    mode: Mode
    ratio: float
    blended: bool  # `is_blended` of the prefill
    sequence: DecodeSequence
    # The answer's token limit (max_tokens within the context).
    limit: int
    answer: list[int] = field(default_factory=list)
    # What `on_prefilled` returned (the blend's inline statistic), passed on in `Answered`.
    inline_statistic: float | None = None


@dataclass(frozen=True)
class Answered:
    """An answered request that blended cached KV (what the shadow scores)."""

    prompt: SegmentedPrompt
    answer: tuple[int, ...]  # EOS not included
    ratio: float
    stopped_at_eos: bool  # the answer ended with the end-of-sequence token
    max_tokens: int  # its token limit
    inline_statistic: float | None
    # The request's stop sequences: its text ended before the first it reached (the answer
    # may hold tokens decoded after that, before the route's `stopped` reached the thread).
    stop: tuple[str, ...]


class EngineWorker:
    """The queue and the one thread that runs the engine, `max_batch` jobs at a time."""

    def __init__(
        self,
        engine: BlendEngine,
        live: LiveConfig,
        metrics: ServeMetrics,
        queue_size: int,
        max_batch: int = 8,
        torch_threads: int | None = None,
        decode_pool_bytes: int | None = None,
    ) -> None:
        """`torch_threads`: the engine thread's torch threads (None: the count of the
        thread that builds the worker, i.e. the one the engine was loaded with).
        `decode_pool_bytes`: the decode pool's byte budget (None: none), which decides
        when the next job joins the batch (step 2 of the module doc)."""
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        if decode_pool_bytes is not None and decode_pool_bytes < 1:
            raise ValueError(f"decode_pool_bytes: must be >= 1, got {decode_pool_bytes}")
        self.engine, self.live, self.metrics = engine, live, metrics
        self.queue_size, self.max_batch = queue_size, max_batch
        self.torch_threads = torch.get_num_threads() if torch_threads is None else torch_threads
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads: must be >= 1, got {self.torch_threads}")
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        # Submitted jobs not yet taken by the thread, cancelled ones excepted (they gave
        # their place back); `_jobs` may still hold those, the thread skips them.
        self._waiting: set[Job] = set()
        # Jobs taken and not yet finished: those `ComputeThreadEnded` fails should it end.
        self._running: set[Job] = set()
        self._is_stopped = False
        self._has_ended = False  # something escaped the thread
        self._slot = SlotEstimate()
        self._thread = threading.Thread(target=self._run, name="holeblend-engine", daemon=True)
        # The quality proxies' hooks (step 5 of the module doc): after each completed
        # prefill (returns the blend's inline statistic or None), after each answered
        # request that blended cached KV (see `is_blended`), and before every step.
        self.on_prefilled: Callable[[Prefill], float | None] | None = None
        self.on_answered: Callable[[Answered], None] | None = None
        self.between_steps: Callable[[], None] | None = None
        # No more than max_batch sequences decode at once: the decode pool grows no further.
        engine.decode_pool.max_rows = max_batch
        engine.decode_pool.max_bytes = decode_pool_bytes

    @property
    def num_pending(self) -> int:
        """Waiting (not cancelled) plus running jobs."""
        with self._lock:
            self._release_cancelled()
            return len(self._waiting) + len(self._running)

    @property
    def mode(self) -> Mode:
        return ENGINE_MODES[self.live.current.mode]

    def start(self) -> None:
        self._thread.start()

    @property
    def has_died(self) -> bool:
        """The compute thread ended without `stop` (something escaped it): nothing is
        served any more, and the liveness probe says so (the kubelet restarts the pod)."""
        thread = self._thread
        return thread.ident is not None and not thread.is_alive() and not self._is_stopped

    def stop(self) -> None:
        """Finish the jobs submitted so far (running and waiting), then end the thread; a
        job submitted from now on is refused."""
        with self._lock:
            self._is_stopped = True
        self._jobs.put(None)
        self._thread.join()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._is_stopped:
                raise RuntimeError("the engine worker is stopped")
            has_ended = self._has_ended
            if not has_ended:
                self._check_room()
                self._waiting.add(job)
                self.metrics.queue_depth.set(len(self._waiting))
        if has_ended:  # nothing would ever take it
            _report(job, ComputeThreadEnded())
        else:
            self._jobs.put(job)

    def check_room(self, num_reserved: int = 0) -> None:
        """`QueueFull` if a job submitted now would be refused, with `num_reserved` more
        jobs to come counted as waiting (the route asks before it reads and tokenizes a
        request's body, counting those it let in that are not yet submitted)."""
        with self._lock:
            self._check_room(num_reserved)

    def _check_room(self, num_reserved: int = 0) -> None:
        """Under `_lock`: `QueueFull` while `queue_size` jobs wait (`num_reserved` more
        counted)."""
        self._release_cancelled()
        if len(self._waiting) + num_reserved >= self.queue_size:
            raise QueueFull(self._slot.retry_after_s(time.perf_counter()))

    def cancel(self, job: Job) -> None:
        """Stop `job` (no effect once it finished): a running job ends at its next token; a
        waiting one gives its queue place back now and is dropped without compute."""
        job.cancelled.set()
        with self._lock:
            if job in self._waiting:
                self._drop_waiting(job)
                self.metrics.queue_depth.set(len(self._waiting))

    def _release_cancelled(self) -> None:
        """Under `_lock`: give back the places of waiting jobs whose `cancelled` was set
        without `cancel`."""
        if dead := [job for job in self._waiting if job.cancelled.is_set()]:
            for job in dead:
                self._drop_waiting(job)
            self.metrics.queue_depth.set(len(self._waiting))

    def _drop_waiting(self, job: Job) -> None:
        """Under `_lock`: a cancelled waiting job leaves the queue now, not when the thread
        reaches it (with the batch full that may be minutes, its prompt held all along),
        and gets its `Finished`; one the thread already took is dropped there."""
        self._waiting.discard(job)
        with self._jobs.mutex:
            try:
                self._jobs.queue.remove(job)
            except ValueError:  # taken by the thread, or not yet put
                return
        _report(job, Finished("cancelled"))

    def _run(self) -> None:
        try:
            # Set here, not inherited: a thread that never ran torch starts with the count
            # the last `torch.set_num_threads` anywhere left, 1 after a serial thread's.
            compute_threads(self.torch_threads)
            while (job := self._jobs.get()) is not None:
                # Busy (background stores wait) from the first job in flight until none is.
                with self.engine.busy():
                    batch: list[_Running] = []
                    self._before_step()
                    self._admit(job, batch)
                    if self._serve(batch):
                        break
        except BaseException:
            self._fail_all()
            raise
        self._refuse_waiting()

    def _serve(self, batch: list[_Running]) -> bool:
        """Prefill first, else decode, until the batch is empty; True once told to stop
        (the jobs in the batch still finish). At most `max_batch` jobs are taken between
        two decode steps (the one that opened the batch counts): jobs that end at their
        prefill (max_tokens 1) take no place in the batch, and while they kept arriving
        the jobs decoding would get no token."""
        stopping, num_taken = False, len(batch)
        while batch:
            self._before_step()
            if not stopping and len(batch) < self.max_batch and num_taken < self.max_batch:
                try:
                    job = self._take()
                except queue.Empty:
                    pass
                else:
                    if job is None:
                        stopping = True
                    else:
                        self._admit(job, batch)
                        num_taken += 1
                    continue
            batch[:] = self._step(batch)
            num_taken = 0
        return stopping

    def _take(self) -> Job | None:
        """The next queued job to join the running batch (None: told to stop);
        `queue.Empty` when none is queued or the next does not fit the decode pool's byte
        budget beside the batch. That one stays first in line, where `cancel` still finds
        it, and is taken when it fits or, once the batch is empty, by `_run`. Checked and
        taken under the queue's lock, so a cancelled job removed meanwhile lets no
        unchecked one in."""
        with self._jobs.mutex:
            if not self._jobs.queue:
                raise queue.Empty
            job = self._jobs.queue[0]
            if job is not None and not self._fits(job):
                raise queue.Empty
            return self._jobs.queue.popleft()

    def _fits(self, job: Job) -> bool:
        """Whether `job` joins the batch now: the decode pool stays within its budget
        with it (`KVPool.can_start`), or it would be dropped without compute anyway."""
        pool = self.engine.decode_pool
        if pool.max_bytes is None or job.stop_reason() is not None:
            return True
        num_tokens = job.prompt.num_tokens
        return pool.can_start(num_tokens, self._token_limit(job, num_tokens))

    def _token_limit(self, job: Job, num_prompt_tokens: int) -> int:
        """The answer's token limit: `max_tokens` within what the context leaves."""
        return min(job.max_tokens, self.engine.config.context_length - num_prompt_tokens)

    def _before_step(self) -> None:
        if self.between_steps is not None:
            try:
                self.between_steps()
            except Exception:  # the proxies never stop serving
                log.exception("between_steps hook failed")

    def _admit(self, job: Job, batch: list[_Running]) -> None:
        """Take a queued job: prefill it, emit its first token and add it to `batch`
        unless it ended already. A job cancelled or past its deadline is dropped without
        compute; it counts neither as running nor in the Retry-After estimate."""
        with self._lock:
            self._waiting.discard(job)  # absent if cancelled while waiting
            self.metrics.queue_depth.set(len(self._waiting))
            reason = job.stop_reason()
            if reason is None:
                self._running.add(job)
                self._slot.started(time.perf_counter(), job, job.deadline)
        if reason is not None:
            _report(job, Finished(reason))
            return
        running = None
        try:
            running = self._prefill(job)
            if self._advance(running):
                batch.append(running)
                return
        except Exception as error:  # reported to the request; the thread serves on
            log.exception("request failed")
            if running is not None:
                running.sequence.close()
            _report(job, error)
        self._finish(job)

    def _prefill(self, job: Job) -> _Running:
        self.metrics.queue_wait.observe(time.perf_counter() - job.arrived)
        self._time_lookup(job.prompt)
        prefill = self.engine.prefill(job.prompt, self.mode, self.live.recompute_ratio)
        self.metrics.observe_prefill(prefill)
        job.emit(PrefillDone.of(prefill, time.perf_counter() - job.arrived))
        limit = self._token_limit(job, prefill.num_prompt_tokens)
        sequence = self.engine.start_decode(prefill, limit)
        running = _Running(job, prefill.mode, prefill.ratio, is_blended(prefill), sequence, limit)
        if self.on_prefilled is not None:
            try:
                running.inline_statistic = self.on_prefilled(prefill)
            except Exception:  # the proxies never fail a request
                log.exception("on_prefilled hook failed")
        return running

    def _step(self, batch: list[_Running]) -> list[_Running]:
        """One decode step for every job in the batch; the jobs still going."""
        started = time.perf_counter()
        try:
            self.engine.decode_step([r.sequence for r in batch], [r.answer[-1] for r in batch])
        except Exception as error:  # fails the jobs of this step; the thread serves on
            log.exception("decode step failed for %d requests", len(batch))
            for running in batch:
                self._fail(running, error)
            return []
        going = []
        for running in batch:
            try:
                if self._advance(running):
                    going.append(running)
                    continue
            except Exception as error:
                log.exception("request failed")
                self._fail(running, error)
                continue
            self._finish(running.job)
        self._bound_ends(going, time.perf_counter() - started)
        return going

    def _bound_ends(self, going: list[_Running], step_s: float) -> None:
        """When each job still going ends at the latest (for Retry-After): its tokens left
        at this step's time, or its deadline if that comes first."""
        now = time.perf_counter()
        with self._lock:
            for running in going:
                num_left = running.limit - len(running.answer)
                self._slot.ends_by(now + num_left * step_s, running.job)

    def _fail(self, running: _Running, error: Exception) -> None:
        """End a job with `error`: its KV row goes back to the decode pool (if `_end` has
        not given it back already) and the error goes to its request."""
        running.sequence.close()
        _report(running.job, error)
        self._finish(running.job)

    def _advance(self, running: _Running) -> bool:
        """Take the job's next token from its logits: emit it, or end the job (then
        emit `Finished`); whether it goes on (its token is to be fed)."""
        job, sequence = running.job, running.sequence
        token = sequence.next_token()
        if token == self.engine.config.eos_token_id and not job.ignore_eos:
            return self._end(running, self._end_of_answer(running), at_eos=True)
        if (reason := job.stop_reason()) is not None:
            return self._end(running, reason)
        job.emit(token)
        running.answer.append(token)
        sequence.produced()
        if sequence.is_at_limit:
            return self._end(running, self._end_of_answer(running))
        return True

    @staticmethod
    def _end_of_answer(running: _Running) -> str:
        """EOS or the limit: "length" when the answer has max_tokens, else "stop"."""
        return "length" if len(running.answer) == running.job.max_tokens else "stop"

    def _end(self, running: _Running, reason: str, at_eos: bool = False) -> bool:
        running.sequence.close()  # its KV row goes back to the decode pool
        running.job.emit(Finished(reason))
        if self.on_answered is not None and running.blended and reason in _SCORED_REASONS:
            answered = Answered(
                running.job.prompt, tuple(running.answer), running.ratio, at_eos,
                running.limit, running.inline_statistic, running.job.stop,
            )  # fmt: skip
            try:
                self.on_answered(answered)
            except Exception:  # the proxies never fail a request
                log.exception("on_answered hook failed")
        return False

    def _finish(self, job: Job) -> None:
        with self._lock:
            self._running.discard(job)
            self._slot.finished(time.perf_counter(), job)

    def _refuse_waiting(self) -> None:
        """Jobs still queued once the thread stops: an error each, so none waits on."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                continue
            with self._lock:
                self._waiting.discard(job)
                self.metrics.queue_depth.set(len(self._waiting))
            _report(job, RuntimeError("the server stopped before this request started"))

    def _fail_all(self) -> None:
        """Something escaped the thread, which ends: every job waiting (the one it had
        just taken included) or running gets `ComputeThreadEnded` now; nothing would
        ever answer it, and it would wait out its deadline for a 504."""
        with self._lock:
            self._has_ended = True
            jobs = [*self._waiting, *self._running]
            self._waiting.clear()
            self._running.clear()
            self.metrics.queue_depth.set(0)
        with self._jobs.mutex:
            self._jobs.queue.clear()
        for job in jobs:
            _report(job, ComputeThreadEnded())

    def _time_lookup(self, prompt: SegmentedPrompt) -> None:
        """Keys and store look-ups, as the prefill does them (the store is in-process)."""
        if self.mode is Mode.FULL:
            return
        started = time.perf_counter()
        keys = [key for key in self.engine.segment_keys(prompt) if key is not None]
        self.engine.store.contains_many(keys)  # one lookup-server call for the local misses
        self.metrics.lookup.observe(time.perf_counter() - started)


def _report(job: Job, event: Finished | Exception) -> None:
    """Emit a job's last event (its `Finished` or error). When that fails too, the job's
    loop is gone ("Event loop is closed") and nobody waits for the event: the failure is
    logged and the compute thread serves on (raised, it would end the thread, leaving the
    server ready but serving nothing)."""
    try:
        job.emit(event)
    except Exception:
        log.exception("cannot report the end of a request; its event loop is gone")


def is_blended(prefill: Prefill) -> bool:
    """Whether the request reused KV beyond an exact cached prefix: only then can its answer
    differ from full prefill's, so only then does a shadow sample measure the ratio (a full
    miss or an exact prefix hit would score 1.0 at any ratio and dilute the proxies)."""
    return prefill.num_reused_tokens > prefill.num_exact_prefix_tokens
