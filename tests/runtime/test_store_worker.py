"""The background store of the isolated policy: it yields to foreground work, stays bounded."""

import threading
import time

import pytest
import torch

from holeblend_runtime.kv.store import LocalKVStore, SegmentKV
from holeblend_runtime.kv.store_worker import Activity, IsolatedStoreWorker, StoreJob


def _entry(key: str) -> SegmentKV:
    k = torch.zeros(2, 1, 3, 4)
    return SegmentKV(key, k, k.clone(), torch.arange(3), "model:1")


def _job(key: str, layers_run: list | None = None, num_layers: int = 3) -> StoreJob:
    def compute(before_layer):
        for layer in range(num_layers):
            before_layer(layer)
            if layers_run is not None:
                layers_run.append((key, layer, time.monotonic()))
        return _entry(key)

    return StoreJob(key, compute)


@pytest.fixture
def worker():
    made = []

    def make(**kwargs):
        store = LocalKVStore(1 << 20)
        made.append(IsolatedStoreWorker(store, kwargs.pop("activity", Activity()), **kwargs))
        return made[-1]

    yield make
    for w in made:
        w.close()


def test_queued_jobs_are_stored_when_idle(worker):
    w = worker()
    assert w.submit(_job("a")) and w.submit(_job("b"))
    assert w.drain(timeout=5)
    assert w.store.contains("a") and w.store.contains("b")
    stats = w.stats()
    assert (stats.num_submitted, stats.num_stored, stats.num_pending) == (2, 2, 0)


def test_no_layer_runs_while_the_engine_is_busy(worker):
    activity = Activity()
    w = worker(activity=activity)
    layers_run: list = []
    with activity.foreground():
        w.submit(_job("a", layers_run))
        time.sleep(0.3)
        assert layers_run == [] and not w.store.contains("a")
        released = time.monotonic()
    assert w.drain(timeout=5)
    assert len(layers_run) == 3 and all(t >= released for _, _, t in layers_run)


def test_a_request_arriving_mid_job_pauses_it_between_layers(worker):
    activity = Activity()
    w = worker(activity=activity)
    hold = threading.Event()
    layers_run: list = []

    def compute(before_layer):
        before_layer(0)
        layers_run.append(0)
        hold.set()
        time.sleep(0.05)  # a request arrives while layer 0 runs
        before_layer(1)
        layers_run.append(1)
        return _entry("a")

    w.submit(StoreJob("a", compute))
    assert hold.wait(5)
    with activity.foreground():
        time.sleep(0.2)
        assert layers_run == [0]
    assert w.drain(timeout=5) and layers_run == [0, 1]


def test_a_full_queue_drops_and_counts(worker):
    activity = Activity()
    w = worker(activity=activity, max_pending=2)
    with activity.foreground():
        assert w.submit(_job("a")) and w.submit(_job("b"))
        assert not w.submit(_job("c"))
        assert w.submit(_job("a"))  # already queued: not queued twice, not dropped
    assert w.drain(timeout=5)
    stats = w.stats()
    assert (stats.num_stored, stats.num_dropped) == (2, 1)
    assert not w.store.contains("c")


def test_a_key_the_store_already_holds_is_skipped(worker):
    w = worker()
    w.store.put(_entry("a"))
    w.submit(_job("a"))
    assert w.drain(timeout=5)
    assert w.stats().num_skipped == 1 and w.stats().num_stored == 0


def test_a_job_replacing_a_refused_entry_stores_over_it(worker):
    w = worker()
    refused = _entry("a")
    refused.k[0, 0, 0, 0] = float("nan")
    w.store.put(refused)
    w.submit(StoreJob("a", _job("a").compute, is_replacing=True))
    assert w.drain(timeout=5)
    assert w.stats().num_stored == 1 and w.stats().num_skipped == 0
    assert w.store.get("a").is_finite


def test_a_replacing_job_for_a_queued_key_is_not_dropped_as_a_duplicate(worker):
    """A refused entry stored while a plain job for its key waits: the replacing job that
    follows is merged into the queued one, which stores over the entry instead of skipping."""
    w = worker()
    release = threading.Event()

    def blocked(before_layer):
        assert release.wait(5)
        return _job("first").compute(before_layer)

    w.submit(StoreJob("first", blocked))
    assert w.submit(_job("a"))
    refused = _entry("a")
    refused.k[0, 0, 0, 0] = float("nan")
    w.store.put(refused)
    assert w.submit(StoreJob("a", _job("a").compute, is_replacing=True))
    release.set()
    assert w.drain(timeout=5)
    stats = w.stats()
    assert (stats.num_submitted, stats.num_stored, stats.num_skipped) == (2, 2, 0)
    assert w.store.get("a").is_finite


def test_close_stops_the_thread_and_drops_what_is_queued(worker):
    activity = Activity()
    w = worker(activity=activity)
    with activity.foreground():
        w.submit(_job("a"))
        w.submit(_job("b"))
        w.close(timeout=5)
    assert not w._thread.is_alive()
    assert w.stats().num_dropped == 2 and w.drain(timeout=1)
    assert not w.submit(_job("c"))


def test_a_failing_job_is_counted_and_the_worker_goes_on(worker):
    w = worker()

    def broken(_before_layer):
        raise RuntimeError("boom")

    w.submit(StoreJob("bad", broken))
    w.submit(_job("good"))
    assert w.drain(timeout=5)
    assert w.stats().num_failed == 1 and w.store.contains("good")


def test_bad_queue_size_is_refused():
    with pytest.raises(ValueError, match="max_pending"):
        IsolatedStoreWorker(LocalKVStore(1), Activity(), max_pending=0)
