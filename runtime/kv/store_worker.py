"""Storing missing documents off the request path, at low priority.

The `isolated` store policy recomputes each missing document alone after the system
prompt, so that its cached KV matches its key's context exactly. That costs a forward
pass per document, which must not delay requests. This module runs it:

1. `Activity` counts foreground work: every prefill, generate and score of the engines
   sharing it, plus holds a server takes while requests wait in its queue
   (`BlendEngine.busy()`).
2. The engine submits one `StoreJob` per missing segment to an `IsolatedStoreWorker`.
   Its queue is bounded: a full queue drops the job (counted), a key already queued is
   not queued twice (a replacing job for it makes the queued one replace, point 4).
3. One daemon thread takes jobs in order. Before each layer of its forward pass it waits
   until the activity has been idle for a short grace period, so a request that arrives
   waits at most for one layer of one document (a few milliseconds), and under
   constant load the worker makes no progress at all: it cannot starve serving; the
   stores are what gives.
4. The entry is put into the store unless the store holds the key by then (computed
   meanwhile by a request, another engine or pod: a usable entry is not computed twice).
   A job for a key whose stored entry the engine refused on load (non-finite values, a
   wrong shape) stores over it instead, in every tier the store writes to, as the
   `in-context` policy's store does: the key is held, but by an entry nobody can use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from holeblend_runtime.kv.store import KVStore, SegmentKV
from holeblend_runtime.model.threads import serial_thread

log = logging.getLogger(__name__)

# Jobs waiting at most; more are dropped (each holds a reference to its prompt).
DEFAULT_MAX_PENDING = 64
# Idle time required before a background layer starts: back-to-back requests from one
# client leave gaps shorter than this, and a layer started in such a gap delays the next.
DEFAULT_IDLE_GRACE_S = 0.005


class Activity:
    """How many foreground calls are running; background work waits for zero."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._num_active = 0
        self._idle_since = time.monotonic()

    @property
    def is_idle(self) -> bool:
        with self._condition:
            return self._num_active == 0

    @contextmanager
    def foreground(self) -> Iterator[None]:
        """Marks the machine busy while the block runs (nests, thread-safe)."""
        with self._condition:
            self._num_active += 1
        try:
            yield
        finally:
            with self._condition:
                self._num_active -= 1
                if self._num_active == 0:
                    self._idle_since = time.monotonic()
                    self._condition.notify_all()

    def wait_idle(self, stop: threading.Event, grace_s: float = DEFAULT_IDLE_GRACE_S) -> bool:
        """Block until idle for `grace_s`; False when `stop` was set first."""
        with self._condition:
            while not stop.is_set():
                idle_for = time.monotonic() - self._idle_since
                if self._num_active == 0 and idle_for >= grace_s:
                    return True
                timeout = 0.1 if self._num_active else grace_s - idle_for
                self._condition.wait(timeout)
            return False


@dataclass(frozen=True)
class StoreJob:
    """One segment to compute and store in the background."""

    # The segment key the entry is stored under.
    key: str
    # Computes the entry; calls its argument before every layer (it may block there).
    compute: Callable[[Callable[[int], None]], SegmentKV]
    # Whether the store's entry under the key was refused on load: the job replaces it
    # rather than skipping a key the store holds.
    is_replacing: bool = False


@dataclass(frozen=True)
class StoreStats:
    """Counters of the background store (totals since the engine started)."""

    num_submitted: int
    num_stored: int
    # Dropped because the queue was full.
    num_dropped: int
    # Skipped because the store held the key when the job's turn came (and the job was
    # not replacing a refused entry).
    num_skipped: int
    num_failed: int
    # Jobs queued or running now.
    num_pending: int
    # Seconds spent computing (waits for idleness excluded).
    compute_s: float


class _Stopped(Exception):
    """Raised inside a job's forward pass when the worker is closing."""


class IsolatedStoreWorker:
    """A bounded queue of store jobs and one low-priority thread that runs them."""

    def __init__(
        self,
        store: KVStore,
        activity: Activity,
        max_pending: int = DEFAULT_MAX_PENDING,
        idle_grace_s: float = DEFAULT_IDLE_GRACE_S,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        self.store = store
        self.activity = activity
        self.max_pending = max_pending
        self.idle_grace_s = idle_grace_s
        self._condition = threading.Condition()
        self._jobs: deque[StoreJob] = deque()
        self._pending_keys: set[str] = set()
        # Pending keys a replacing job was submitted for after their first job.
        self._replacing_keys: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._counts = dict.fromkeys(("submitted", "stored", "dropped", "skipped", "failed"), 0)
        self._compute_s = 0.0

    def submit(self, job: StoreJob) -> bool:
        """Queue `job`; False when it is dropped (queue full, or closed)."""
        with self._condition:
            if job.key in self._pending_keys:
                if job.is_replacing:
                    self._replacing_keys.add(job.key)
                return True
            if self._stop.is_set() or len(self._pending_keys) >= self.max_pending:
                self._counts["dropped"] += 1
                return False
            self._counts["submitted"] += 1
            self._jobs.append(job)
            self._pending_keys.add(job.key)
            self._start_thread()
            self._condition.notify_all()
            return True

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is done; False on timeout. The caller must not
        hold the activity busy meanwhile (the worker waits for idleness)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while self._pending_keys:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._condition.wait(left)
            return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; queued jobs are dropped, a running one is abandoned."""
        self._stop.set()
        with self._condition:
            self._counts["dropped"] += len(self._jobs)
            self._jobs.clear()
            self._pending_keys.clear()
            self._replacing_keys.clear()
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> StoreStats:
        with self._condition:
            c = self._counts
            return StoreStats(
                c["submitted"], c["stored"], c["dropped"], c["skipped"], c["failed"],
                num_pending=len(self._pending_keys), compute_s=self._compute_s,
            )  # fmt: skip

    def _start_thread(self) -> None:
        if self._thread is None:
            # Serially, beside the engine's thread (model/threads.py): half the speed of a
            # background store, none of the engine's.
            self._thread = serial_thread(self._run, "holeblend-isolated-store")

    def _run(self) -> None:
        while (job := self._next_job()) is not None:
            outcome = "failed"
            try:
                outcome = self._run_job(job)
            except _Stopped:
                outcome = "dropped"
                return
            except Exception:
                log.exception("background store of segment %s failed", job.key)
            finally:
                self._finish(job, outcome)

    def _next_job(self) -> StoreJob | None:
        with self._condition:
            while not self._jobs and not self._stop.is_set():
                self._condition.wait()
            return None if self._stop.is_set() else self._jobs[0]

    def _run_job(self, job: StoreJob) -> str:
        with self._condition:
            is_replacing = job.is_replacing or job.key in self._replacing_keys
        if not is_replacing and self.store.contains(job.key):
            return "skipped"
        waited = 0.0

        def gate(_layer: int) -> None:
            nonlocal waited
            started = time.perf_counter()
            if not self.activity.wait_idle(self._stop, self.idle_grace_s):
                raise _Stopped
            waited += time.perf_counter() - started

        started = time.perf_counter()
        with torch.inference_mode():
            kv = job.compute(gate)
        with self._condition:
            self._compute_s += time.perf_counter() - started - waited
        return "stored" if self.store.put(kv) else "failed"

    def _finish(self, job: StoreJob, outcome: str) -> None:
        with self._condition:
            if self._jobs and self._jobs[0] is job:
                self._jobs.popleft()
                self._counts[outcome] += 1
            self._pending_keys.discard(job.key)
            self._replacing_keys.discard(job.key)
            self._condition.notify_all()
