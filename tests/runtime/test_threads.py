"""One thread of a process runs torch's parallel loops (runtime/model/threads.py): a thread
that called `serial_torch` starts no OpenMP team of its own, whatever default another
thread sets before or after, and a thread that called `compute_threads` keeps its count
even when a serial thread set the process default to 1 first. Then every thread the
runtime starts beside the engine's (the shadow scorer, the isolated store, the KV tier's
reader and writer, holeblend-serve's parsers and loader) runs serially or ends."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from holeblend_runtime.model.threads import compute_threads, serial_torch

needs_two_cpus = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="an OpenMP team needs two CPUs to have workers"
)


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _in_thread(setup: Callable[[], None], *, before: Callable[[], None] | None = None) -> dict:
    """Run `setup`, then `before`, then a parallel loop on a new thread; what it saw."""
    seen: dict = {}
    done, release = threading.Event(), threading.Event()

    def body() -> None:
        setup()
        if before is not None:
            before()
        seen["tasks_before"] = _tasks()
        x = torch.ones(8_000_000)
        seen["sum"] = float((x * 2).sum())  # far above ATen's grain size: a parallel loop
        # The threads the loop started (the team's workers live as long as this thread;
        # other threads ending meanwhile do not count).
        seen["started"] = len(_tasks() - seen.pop("tasks_before"))
        seen["threads"] = torch.get_num_threads()
        done.set()
        release.wait(10)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    assert done.wait(60)
    release.set()
    thread.join(10)
    return seen


@needs_two_cpus
def test_a_compute_thread_starts_a_team_and_a_serial_thread_does_not() -> None:
    # The control: a thread running torch with 2 threads adds a worker to the process.
    computing = _in_thread(lambda: compute_threads(2))
    assert computing["threads"] == 2
    assert computing["started"] == 1
    serial = _in_thread(serial_torch)
    assert serial["threads"] == 1
    assert serial["started"] == 0
    assert serial["sum"] == computing["sum"] == 16_000_000.0


@needs_two_cpus
def test_each_keeps_its_count_whatever_default_the_other_sets_later() -> None:
    # The serial thread takes its count, then a compute thread sets the default to 2
    # before the serial thread's first parallel loop: it stays serial.
    serial = _in_thread(serial_torch, before=lambda: _in_thread(lambda: compute_threads(2)))
    assert serial["threads"] == 1
    assert serial["started"] == 0
    # And the other way round: a serial thread leaves the default at 1 in between.
    computing = _in_thread(lambda: compute_threads(2), before=lambda: _in_thread(serial_torch))
    assert computing["threads"] == 2
    assert computing["started"] == 1


def test_compute_threads_refuses_zero() -> None:
    with pytest.raises(ValueError, match="num_threads: must be >= 1, got 0"):
        compute_threads(0)


@pytest.fixture
def default_of_two() -> None:
    """The process default at 2 threads, set by a thread that ends (the test's own keeps
    its count): a thread that did not pin its count would compute with 2."""
    setter = threading.Thread(target=lambda: compute_threads(2))
    setter.start()
    setter.join()


def test_the_shadow_scorer_runs_serially(default_of_two) -> None:
    from holeblend_runtime.quality.shadow import ShadowSampler, ShadowScore

    recorded = threading.Event()
    counts: list[int] = []

    class Recording(ShadowSampler):
        def score(self, request) -> ShadowScore:
            counts.append(torch.get_num_threads())
            recorded.set()
            return ShadowScore(1.0, 1.0, 0.15, 0.0)

    sampler = Recording(1.0)
    try:
        assert sampler.offer(object()) == "queued"
        assert recorded.wait(30)
    finally:
        sampler.close()
    assert counts == [1]


def test_the_kv_tiers_reader_and_writer_and_the_isolated_store_run_serially(
    default_of_two,
) -> None:
    from holeblend_runtime.kv.async_store import AsyncKVStore
    from holeblend_runtime.kv.store import LocalKVStore, SegmentKV
    from holeblend_runtime.kv.store_worker import Activity, IsolatedStoreWorker, StoreJob

    counts: dict[str, int] = {}

    class Recording(LocalKVStore):
        def put(self, kv: SegmentKV) -> bool:
            counts.setdefault("write", torch.get_num_threads())
            return super().put(kv)

        def get_many(self, keys):
            counts["read"] = torch.get_num_threads()
            return super().get_many(keys)

    def entry(key: str) -> SegmentKV:
        zeros = torch.zeros(2, 1, 3, 4)
        return SegmentKV(key, zeros, zeros.clone(), torch.arange(3), "model")

    def compute(before_layer) -> SegmentKV:
        counts["isolated"] = torch.get_num_threads()
        return entry("b")

    store = AsyncKVStore(Recording(1 << 20))
    worker = IsolatedStoreWorker(LocalKVStore(1 << 20), Activity(), idle_grace_s=0.0)
    try:
        assert store.put(entry("a"))
        assert store.flush(30)
        store.prefetch(["a"])
        assert store.get("a") is not None
        assert worker.submit(StoreJob("b", compute))
        deadline = time.monotonic() + 30
        while "isolated" not in counts and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        store.close()
        worker.close()
    assert counts == {"write": 1, "read": 1, "isolated": 1}


def test_holeblend_serve_loads_on_a_thread_that_ends(tmp_path: Path) -> None:
    import asyncio

    from holeblend_runtime.serve import cli

    loaders: list[threading.Thread] = []

    class Server:
        model_name = "m"
        is_ready = False

        def load(self) -> None:
            loaders.append(threading.current_thread())

    assert asyncio.run(cli._load(Server(), asyncio.Event())) == 0
    assert len(loaders) == 1 and loaders[0] is not threading.main_thread()
    loaders[0].join(10)
    assert not loaders[0].is_alive()


def test_the_thread_that_starts_serial_threads_keeps_the_count_it_had(default_of_two) -> None:
    """A thread that has not run torch yet (vLLM's model thread when it builds the KV tier)
    starts the tier's serial reader and writer, whose start sets the process default to 1:
    it still computes with the 2 threads the default gave it before."""
    from holeblend_runtime.kv.async_store import AsyncKVStore
    from holeblend_runtime.kv.store import LocalKVStore, SegmentKV

    def build_then_compute() -> None:
        store = AsyncKVStore(LocalKVStore(1 << 20))
        try:
            zeros = torch.zeros(2, 1, 3, 4)
            assert store.put(SegmentKV("a", zeros, zeros.clone(), torch.arange(3), "model"))
            assert store.flush(30)  # the writer has started (and set the default to 1)
        finally:
            store.close()

    seen = _in_thread(build_then_compute)
    assert seen["threads"] == 2
