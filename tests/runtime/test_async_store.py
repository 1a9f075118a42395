"""AsyncKVStore: writes behind and reads ahead on I/O threads, against a real directory tier."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch

from holeblend_runtime.kv.async_store import AsyncKVStore
from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.kv.store import SegmentKV

WAIT_S = 10.0


def _entry(key: str, num_tokens: int = 8, seed: int = 0) -> SegmentKV:
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 2, num_tokens, 4, generator=generator)
    v = torch.randn(2, 2, num_tokens, 4, generator=generator)
    return SegmentKV(key, k, v, torch.arange(num_tokens, dtype=torch.int64), "model")


class GatedStore:
    """A directory tier whose puts wait for `gate` and may fail; records the threads that
    read and wrote it."""

    def __init__(self, inner: DirectoryKVStore) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.failing: set[str] = set()
        self.writers: set[str] = set()
        # Keys in the order their puts reached this store.
        self.written: list[str] = []
        self.readers: list[str] = []
        self.num_gets = 0

    def put(self, kv: SegmentKV) -> bool:
        self.writers.add(threading.current_thread().name)
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        self.written.append(kv.key)
        if kv.key in self.failing:
            raise OSError(f"disk full writing {kv.key}")
        return self.inner.put(kv)

    def get(self, key: str) -> SegmentKV | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[SegmentKV | None]:
        self.readers.append(threading.current_thread().name)
        self.num_gets += 1
        return self.inner.get_many(keys)

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.contains_many(keys)


@pytest.fixture
def gated(tmp_path) -> GatedStore:
    return GatedStore(DirectoryKVStore(tmp_path, 1 << 30))


@pytest.fixture
def store(gated):
    store = AsyncKVStore(gated)
    yield store
    gated.gate.set()
    store.close(timeout_s=WAIT_S)


def test_put_returns_before_the_write_and_the_entry_is_readable_meanwhile(gated, store):
    gated.gate.clear()
    entry = _entry("a1")
    assert store.put(entry) is True
    # Not on disk yet (the writer waits for the gate), yet visible to readers.
    assert not gated.inner.contains("a1")
    assert store.contains_many(["a1", "b2"]) == [True, False]
    assert store.get("a1") is entry
    assert store.num_pending == 1
    gated.gate.set()
    assert store.flush(WAIT_S)
    assert store.num_pending == 0 and store.num_written == 1
    written = gated.inner.get("a1")
    assert torch.equal(written.k, entry.k) and torch.equal(written.v, entry.v)
    assert gated.writers == {"holeblend-kv-write"}


def test_a_put_for_a_key_still_waiting_takes_its_place_and_it_is_written_once(gated, store):
    """Two requests storing the same segment close together: one write (of the later
    entry), one entry waiting, one counted."""
    gated.gate.clear()
    store.put(_entry("a1"))
    first, later = _entry("b2", seed=1), _entry("b2", seed=2)
    store.put(first)
    store.put(later)
    assert store.num_pending == 2 and store.get("b2") is later
    gated.gate.set()
    assert store.flush(WAIT_S)
    assert gated.written == ["a1", "b2"] and store.num_written == 2
    assert torch.equal(gated.inner.get("b2").k, later.k)


def test_a_put_for_the_key_being_written_is_written_after_it(gated, store):
    gated.gate.clear()
    first, later = _entry("b2", seed=1), _entry("b2", seed=2)
    store.put(first)
    deadline = time.monotonic() + WAIT_S
    while not gated.writers:  # the writer is inside the first put
        assert time.monotonic() < deadline
        time.sleep(0.01)
    store.put(later)
    gated.gate.set()
    assert store.flush(WAIT_S)
    assert gated.written == ["b2", "b2"] and store.num_written == 2
    assert torch.equal(gated.inner.get("b2").k, later.k)


def test_a_put_beyond_the_byte_bound_waits_for_room_and_nothing_is_dropped(gated, tmp_path):
    size = _entry("x0").num_bytes
    store = AsyncKVStore(gated, max_pending_bytes=2 * size)
    gated.gate.clear()
    store.put(_entry("a1"))
    store.put(_entry("a2"))
    third = threading.Thread(target=store.put, args=(_entry("a3"),))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "a put beyond the bound returned without waiting"
    gated.gate.set()
    third.join(WAIT_S)
    assert not third.is_alive()
    assert store.close(WAIT_S)
    assert sorted(gated.inner.keys()) == ["a1", "a2", "a3"]


def test_an_entry_larger_than_the_bound_still_gets_written(gated):
    store = AsyncKVStore(gated, max_pending_bytes=1)
    store.put(_entry("a1"))
    store.put(_entry("a2"))
    assert store.close(WAIT_S)
    assert sorted(gated.inner.keys()) == ["a1", "a2"]


def test_a_failed_write_is_counted_and_reported_and_later_writes_go_on(gated):
    failed: list[str] = []
    store = AsyncKVStore(gated, on_failure=lambda kv: failed.append(kv.key))
    gated.failing.add("bad")
    for key in ("a1", "bad", "a2"):
        store.put(_entry(key))
    assert store.close(WAIT_S)
    assert failed == ["bad"]
    assert (store.num_written, store.num_failed) == (2, 1)
    assert sorted(gated.inner.keys()) == ["a1", "a2"]
    assert not store.contains("bad")


def test_reads_racing_the_writers_evictions_are_hits_or_misses_never_errors(tmp_path):
    """The writer thread's puts evict files while the model's thread reads the same
    directory (as another tensor-parallel rank's evictions do): a file removed right after
    it was read is a hit all the same, never an error that loses the whole batch."""
    keys = [f"w{i}" for i in range(6)]
    size = _entry("w0").num_bytes
    directory = DirectoryKVStore(tmp_path, int(2.5 * size))  # every put evicts
    store = AsyncKVStore(directory, max_pending_bytes=2 * size)  # puts keep pace with writes
    errors: list[str] = []
    deadline = time.monotonic() + 3.0
    i = 0
    while time.monotonic() < deadline and not errors:
        store.put(_entry(keys[i % len(keys)], seed=i))
        i += 1
        try:
            found = store.get_many(keys)
        except Exception as error:  # the assertion below names it
            errors.append(repr(error))
            break
        assert len(found) == len(keys)
        assert all(kv is None or kv.key == key for kv, key in zip(found, keys, strict=True))
    assert errors == []
    assert store.close(WAIT_S)
    assert directory.num_bytes <= directory.capacity_bytes


def test_prefetch_reads_on_the_reader_thread_in_one_batch_and_get_many_claims_it(gated, store):
    for key in ("a1", "a2"):
        gated.inner.put(_entry(key, seed=len(key)))
    store.prefetch(["a1", "a2", "zz"])
    entries = store.get_many(["a1", "zz", "a2"])
    assert [e is not None for e in entries] == [True, False, True]
    assert torch.equal(entries[0].k, gated.inner.get("a1").k)
    # One batched read, on the reader thread; nothing read again on the caller's.
    assert len(gated.readers) == 1 and gated.readers[0].startswith("holeblend-kv-read")
    assert store.num_prefetched == 0
    store.get_many(["a1"])  # not prefetched any more: read on this thread
    assert gated.readers[-1] == threading.current_thread().name


def _held_reads(gated) -> threading.Event:
    """Makes `gated`'s batched reads wait until the returned event is set."""
    release = threading.Event()
    inner_get_many = gated.get_many

    def slow(keys):
        assert release.wait(WAIT_S)
        return inner_get_many(keys)

    gated.get_many = slow
    return release


def test_a_prefetch_waiting_on_a_slow_read_is_waited_for_not_read_twice(gated, store):
    gated.inner.put(_entry("a1"))
    release = _held_reads(gated)
    store.prefetch(["a1"])
    threading.Timer(0.2, release.set).start()
    started = time.monotonic()
    assert store.get("a1") is not None
    assert time.monotonic() - started >= 0.15
    assert gated.num_gets == 1


def test_prefetches_are_bounded_and_can_be_discarded(gated):
    store = AsyncKVStore(gated, max_prefetched=2)
    store.prefetch(["a1", "a2", "a3"])
    assert store.num_prefetched == 2
    store.discard(["a2", "a3"])
    assert store.num_prefetched == 0
    store.close(WAIT_S)


def test_a_pending_entry_is_not_prefetched_and_a_failed_prefetch_is_read_again(gated, store):
    gated.gate.clear()
    store.put(_entry("a1"))
    store.prefetch(["a1"])
    assert store.num_prefetched == 0
    gated.gate.set()
    store.flush(WAIT_S)

    def broken(keys):
        raise ConnectionError("tier down")

    inner_get_many, gated.get_many = gated.get_many, broken
    store.prefetch(["a1"])
    gated.get_many = inner_get_many
    assert store.get("a1") is not None


def test_a_read_ahead_that_close_dropped_before_it_ran_is_read_when_claimed(gated):
    """`close` stops the reader thread and drops the reads ahead queued behind the one it
    runs; a `get_many` that claims such a read (the model thread of an engine shutting
    down) reads the entry itself instead of waiting forever for a read that never runs."""
    gated.inner.put(_entry("a2"))
    release = _held_reads(gated)
    store = AsyncKVStore(gated)
    store.prefetch(["a1"])  # held in the reader thread (or queued) until released
    store.prefetch(["a2"])  # queued behind it
    assert store.close(WAIT_S)
    release.set()
    found: list[SegmentKV | None] = []
    reader = threading.Thread(target=lambda: found.append(store.get("a2")), daemon=True)
    reader.start()
    reader.join(WAIT_S)
    assert not reader.is_alive(), "a read ahead dropped by close is waited for forever"
    assert found[0] is not None and torch.equal(found[0].k, gated.inner.get("a2").k)


def test_close_writes_what_was_accepted_or_says_it_could_not(gated):
    store = AsyncKVStore(gated)
    store.put(_entry("a1"))
    assert store.close(WAIT_S)
    assert gated.inner.contains("a1")
    with pytest.raises(RuntimeError, match="closed"):
        store.put(_entry("a2"))
    store.prefetch(["a1"])  # nothing read ahead once closed; a read still works
    assert store.num_prefetched == 0 and store.get("a1") is not None
    stuck = AsyncKVStore(gated)
    gated.gate.clear()
    stuck.put(_entry("a3"))
    assert stuck.close(timeout_s=0.2) is False
    gated.gate.set()


def test_a_close_out_of_time_refuses_a_put_waiting_for_room_and_drops_what_waits(gated):
    """Shutdown while the inner store hangs (a slow Redis SET): close gives up after its
    timeout. A put waiting for room then returns False at once instead of waiting for a
    writer that has stopped; the entries still waiting are dropped, counted as failed and
    no longer served; the entry being written finishes its write."""
    failed: list[str] = []
    size = _entry("x0").num_bytes
    store = AsyncKVStore(
        gated, max_pending_bytes=2 * size, on_failure=lambda kv: failed.append(kv.key)
    )
    gated.gate.clear()
    store.put(_entry("a1"))  # being written, stuck at the gate
    store.put(_entry("a2"))
    results: list[bool] = []
    waiting = threading.Thread(target=lambda: results.append(store.put(_entry("a3"))), daemon=True)
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive(), "a put beyond the bound returned without waiting"
    assert store.close(timeout_s=0.2) is False
    waiting.join(WAIT_S)
    assert not waiting.is_alive(), "a put waiting for room outlived close"
    assert results == [False]
    assert failed == ["a2"] and store.num_failed == 1
    assert store.contains_many(["a2", "a3"]) == [False, False]
    with pytest.raises(RuntimeError, match="closed"):
        store.put(_entry("a4"))
    gated.gate.set()
    deadline = time.monotonic() + WAIT_S
    while store.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.num_pending == 0 and store.num_written == 1
    assert gated.inner.keys() == ["a1"]


def test_a_flush_without_timeout_returns_once_the_store_is_closed(gated):
    """A flush waiting when close gives up, or called after it, does not wait for a writer
    that has stopped: it says at once whether everything was written."""
    store = AsyncKVStore(gated)
    gated.gate.clear()
    store.put(_entry("a1"))
    store.put(_entry("a2"))
    results: list[bool] = []
    flusher = threading.Thread(target=lambda: results.append(store.flush()), daemon=True)
    flusher.start()
    assert store.close(timeout_s=0.2) is False
    flusher.join(WAIT_S)
    assert not flusher.is_alive(), "flush() waits forever once the store is closed"
    assert results == [False]
    assert store.flush() is False  # "a1" is still being written
    gated.gate.set()
    deadline = time.monotonic() + WAIT_S
    while store.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.flush() is True and (store.num_written, store.num_failed) == (1, 1)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_pending_bytes"):
        AsyncKVStore(None, max_pending_bytes=0)
    with pytest.raises(ValueError, match="max_prefetched"):
        AsyncKVStore(None, max_prefetched=-1)
