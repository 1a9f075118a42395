"""A KV store whose writes and reads run on I/O threads, off the model's thread.

The vLLM connector's worker stores segments after a forward (`wait_for_save`) and fetches
a load's segments before its blend; both run on vLLM's model thread, where a safetensors
write, a Redis SET of several MiB or a round trip to the shared tier delays every request
of the step. `AsyncKVStore` wraps the worker's store (`KVStore`, same protocol):

1. `put` hands the entry to a writer thread and returns at once (True: accepted for
   writing). The writer puts entries in order into the inner store. A `put` for a key
   whose entry still waits (not yet being written) takes that entry's place: the segment
   is written once, the later entry, as two writes in order would leave it. The entries
   waiting are bounded in bytes: a `put` beyond the bound waits for room (back-pressure,
   nothing dropped). A put that fails is logged and counted (`num_failed`, `on_failure`),
   never raised: a segment not stored is a future miss.
2. An entry waiting to be written is already visible: `get`/`get_many` return it and
   `contains` counts it, so a store followed by a load of the same segment never misses.
3. `prefetch(keys)` starts reading entries on a reader thread (one batched `get_many`);
   the next `get_many` that asks for them takes the result, waiting for it if it is not
   in yet. A `put` drops its key's read ahead (it may have read the tier before the
   write). Unclaimed prefetches are bounded (oldest dropped) and `discard` drops them.
4. `flush` waits until every accepted entry is written; `close` flushes (bounded) and
   stops the threads (a read ahead not started by then is read when a `get_many` claims
   it). What a flush out of time leaves is dropped then: the entries still waiting are
   counted as failed (`num_failed`, `on_failure`) and no longer served, a `put` waiting
   for room is refused (False), a `flush` returns False at once, and the entry being
   written finishes its write. A `put` after `close` raises.

On an accelerator the entry's tensors may still be computed by the device when `put`
returns: the writer waits for an event recorded at `put` before reading them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from holeblend_runtime.kv.store import KVStore, SegmentKV
from holeblend_runtime.model.threads import serial_pool, serial_thread

log = logging.getLogger(__name__)

# Entries waiting to be written at most, in bytes (a SmolLM2 segment of 200 tokens in
# float32 is ~9 MiB; an 8B model's in bf16 ~25 MiB).
DEFAULT_MAX_PENDING_BYTES = 512 << 20
# Prefetched keys nobody claimed yet, at most.
DEFAULT_MAX_PREFETCHED = 256
DEFAULT_CLOSE_TIMEOUT_S = 30.0


class AsyncKVStore:
    """`inner`'s entries, written behind and read ahead on I/O threads (module doc)."""

    def __init__(
        self,
        inner: KVStore,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        max_prefetched: int = DEFAULT_MAX_PREFETCHED,
        on_failure: Callable[[SegmentKV], None] | None = None,
    ) -> None:
        if max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes: must be >= 1, got {max_pending_bytes}")
        if max_prefetched < 0:
            raise ValueError(f"max_prefetched: must be >= 0, got {max_prefetched}")
        self.inner = inner
        self.max_pending_bytes = max_pending_bytes
        self.max_prefetched = max_prefetched
        self._on_failure = on_failure
        self._condition = threading.Condition()
        # Entries accepted and not yet written, in order; by key for reads.
        self._queue: deque[tuple[SegmentKV, object | None]] = deque()
        self._pending: dict[str, SegmentKV] = {}
        self._pending_bytes = 0
        # Whether the writer is writing the first entry of the queue.
        self._is_writing = False
        self._is_closed = False
        self.num_written = 0
        self.num_failed = 0
        self._prefetched: OrderedDict[str, Future[SegmentKV | None]] = OrderedDict()
        # Both threads copy tensors serially, beside the engine's thread (model/threads.py),
        # which is most likely this one.
        self._reader = serial_pool(1, "holeblend-kv-read")
        self._writer = serial_thread(self._write_loop, "holeblend-kv-write")

    # --- writes -------------------------------------------------------------------------

    def put(self, kv: SegmentKV) -> bool:
        """Accept `kv` for writing (waits while the entries waiting exceed the bound); False:
        the store closed while it waited, `kv` is not written."""
        ready = _device_event(kv.k)
        with self._condition:
            if self._is_closed:
                raise RuntimeError("put: the store is closed")
            # A read ahead of the key may have read the tier before this entry's write.
            self._prefetched.pop(kv.key, None)
            if self._replace_waiting(kv, ready):
                return True
            # An entry larger than the bound alone waits for an empty queue.
            while (
                not self._is_closed
                and self._queue
                and self._pending_bytes + kv.num_bytes > self.max_pending_bytes
            ):
                self._condition.wait()
            if self._is_closed:
                log.debug("segment %s: the store closed before it had room", kv.key)
                return False
            self._queue.append((kv, ready))
            self._pending[kv.key] = kv
            self._pending_bytes += kv.num_bytes
            self._condition.notify_all()
        return True

    def _replace_waiting(self, kv: SegmentKV, ready: object | None) -> bool:
        """Put `kv` in the place of the entry waiting under its key, if one waits and is not
        being written; whether it did (the lock held)."""
        waiting = self._pending.get(kv.key)
        if waiting is None:
            return False
        for i, (queued, _) in enumerate(self._queue):
            if queued is waiting:
                if i == 0 and self._is_writing:
                    return False
                self._queue[i] = (kv, ready)
                self._pending[kv.key] = kv
                self._pending_bytes += kv.num_bytes - waiting.num_bytes
                return True
        return False

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every accepted entry is written (or failed); False on timeout, or once
        the store is closed with a write unfinished. The entry being written stays first
        in the queue until its write returns."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            while self._queue and not self._is_closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._condition.wait(left)
            return not self._queue

    @property
    def num_pending(self) -> int:
        with self._condition:
            return len(self._queue)

    @property
    def num_prefetched(self) -> int:
        """Prefetched entries not claimed yet."""
        with self._condition:
            return len(self._prefetched)

    def _write_loop(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._is_closed:
                    self._condition.wait()
                if self._is_closed:  # `close` dropped what was left
                    return
                kv, ready = self._queue[0]
                self._is_writing = True
            try:
                if ready is not None:
                    ready.synchronize()  # type: ignore[attr-defined]
                is_written = self.inner.put(kv)
                error = None
            except Exception as caught:  # a failed write is a future miss, never raised
                is_written, error = False, caught
            with self._condition:
                self._queue.popleft()
                self._is_writing = False
                self._forget(kv)
                self.num_written += error is None
                self.num_failed += error is not None
                self._condition.notify_all()
            if error is not None:
                log.error("storing segment %s failed: %s", kv.key, error)
                if self._on_failure is not None:
                    self._on_failure(kv)
            elif not is_written:
                log.debug("segment %s: the store did not hold it", kv.key)

    def _forget(self, kv: SegmentKV) -> None:
        """Drop `kv`, taken out of the queue, from the entries waiting (the lock held)."""
        if self._pending.get(kv.key) is kv:
            del self._pending[kv.key]
        self._pending_bytes -= kv.num_bytes

    # --- reads --------------------------------------------------------------------------

    def prefetch(self, keys: Sequence[str]) -> None:
        """Start reading `keys` (those neither waiting to be written nor being read)."""
        with self._condition:
            wanted = [
                k
                for k in dict.fromkeys(keys)
                if k not in self._pending and k not in self._prefetched
            ]
        if not wanted or self.max_prefetched == 0:
            return
        try:
            batch = self._reader.submit(self.inner.get_many, wanted)
        except RuntimeError:  # closed: the reads happen when asked for
            return
        with self._condition:
            for i, key in enumerate(wanted):
                self._prefetched[key] = _item(batch, i)
            while len(self._prefetched) > self.max_prefetched:
                self._prefetched.popitem(last=False)

    def discard(self, keys: Sequence[str]) -> None:
        """Drop prefetched entries nobody will claim (an aborted request's)."""
        with self._condition:
            for key in keys:
                self._prefetched.pop(key, None)

    def get(self, key: str) -> SegmentKV | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[SegmentKV | None]:
        found: dict[str, SegmentKV | None] = {}
        claimed: dict[str, Future[SegmentKV | None]] = {}
        with self._condition:
            for key in keys:
                if key in self._pending:
                    found[key] = self._pending[key]
                elif key in self._prefetched:
                    claimed[key] = self._prefetched.pop(key)
        for key, future in claimed.items():
            try:
                found[key] = future.result()
            except Exception as error:  # read again below, on this thread
                log.warning("prefetching segment %s failed: %s", key, error)
        rest = [key for key in dict.fromkeys(keys) if key not in found]
        if rest:
            found.update(zip(rest, self.inner.get_many(rest), strict=True))
        return [found[key] for key in keys]

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        with self._condition:
            waiting = [key in self._pending for key in keys]
        rest = [key for key, is_waiting in zip(keys, waiting, strict=True) if not is_waiting]
        stored = iter(self.inner.contains_many(rest) if rest else [])
        return [True if is_waiting else next(stored) for is_waiting in waiting]

    # --- lifetime -----------------------------------------------------------------------

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> bool:
        """Write what was accepted (up to `timeout_s`), then stop; whether all was written.
        Entries still waiting then are dropped and counted as failed (module doc)."""
        self.flush(timeout_s)
        with self._condition:
            self._is_closed = True
            # The entry being written stays first in the queue until its write returns.
            kept = 1 if self._is_writing else 0
            dropped = [kv for kv, _ in list(self._queue)[kept:]]
            while len(self._queue) > kept:
                self._forget(self._queue.pop()[0])
            self.num_failed += len(dropped)
            is_flushed = not self._queue and not dropped
            self._condition.notify_all()
        self._reader.shutdown(wait=False, cancel_futures=True)
        if not is_flushed:
            log.error(
                "closing the KV store: %d segments left unwritten, %d still being written",
                len(dropped), kept,
            )  # fmt: skip
        if self._on_failure is not None:
            for kv in dropped:
                self._on_failure(kv)
        return is_flushed


def _item(batch: Future[list[SegmentKV | None]], index: int) -> Future[SegmentKV | None]:
    """A future of one entry of a batched read."""
    item: Future[SegmentKV | None] = Future()

    def settle(done: Future[list[SegmentKV | None]]) -> None:
        if done.cancelled():  # `close` dropped the read before it ran: read when claimed
            item.set_exception(RuntimeError("the store closed before this read ahead ran"))
            return
        error = done.exception()
        if error is not None:
            item.set_exception(error)
        else:
            item.set_result(done.result()[index])

    batch.add_done_callback(settle)
    return item


def _device_event(tensor: torch.Tensor) -> object | None:
    """An event the device reaches once `tensor` is computed (None on the host)."""
    if tensor.device.type == "cpu":
        return None
    event = torch.Event(device=tensor.device)
    event.record()
    return event
