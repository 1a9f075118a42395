"""The connector's asynchronous lookups against a real lookup server: the requests queued
while the lookup thread is busy are looked up together, in one round trip, each key once;
each keeps its own deadline, and a lookup that fails fails every request of its batch."""

import threading
import time

import pytest

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.keys import SegmentKeyer
from holeblend_runtime.blend.reuse import ReuseMode
from holeblend_runtime.blend.segments import SegmentSplitter
from holeblend_runtime.vllm_connector.planning import PENDING, AsyncReusePlanner, ReusePlanner
from holeblend_runtime.vllm_connector.settings import ConnectorSettings
from holeblend_runtime.vllm_connector.store import close_store, open_store

from .test_shared_tier import LAYOUT, segment

SEP = 9
BLEND = BlendConfig(min_segment_tokens=2)
SYSTEM = [1, 2, 3, SEP]


def prompt(first: int, second: int) -> list[int]:
    """The system prompt, two documents (named by their first token), a question."""
    return [*SYSTEM, first, first + 1, first + 2, SEP, second, second + 1, second + 2, SEP, 7, 8]


# The first is asked alone; the other four share the system prompt and some documents.
FIRST = prompt(10, 20)
QUEUED = [prompt(10, 30), prompt(30, 40), prompt(40, 50), prompt(50, 10)]


class GatedIndex:
    """The scheduler's store, whose first lookup waits until `release` is set: the
    lookup thread is then busy while the test queues more requests."""

    def __init__(self, inner):
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def contains_many(self, keys):
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10), "the test never released the first lookup"
        return self.inner.contains_many(keys)


class FailingIndex(GatedIndex):
    """Fails every lookup after the first (the index went down meanwhile)."""

    def contains_many(self, keys):
        is_first = not self.entered.is_set()
        found = super().contains_many(keys)
        if not is_first:
            raise ConnectionError("lookup server unreachable")
        return found


def planner(index) -> ReusePlanner:
    return ReusePlanner([SEP], SegmentKeyer(LAYOUT.model_id, LAYOUT.dtype, BLEND), index)


def keys_of(token_ids) -> list[str]:
    """The prompt's segment keys (the question has none)."""
    keyer = SegmentKeyer(LAYOUT.model_id, LAYOUT.dtype, BLEND)
    prompt = SegmentSplitter((SEP,), BLEND.min_segment_tokens).split(token_ids)
    return [key for key in keyer.keys(prompt) if key is not None]


@pytest.fixture
def scheduler_store(tmp_path, redis_server, lookup_server):
    """Node B's scheduler store; node A's worker stored the system prompt and documents
    10 and 40 and announced them to the lookup server."""

    def settings(kv_dir):
        return ConnectorSettings(
            blend=BLEND, kv_dir=kv_dir, shared_url=redis_url, lookup_url=lookup_server.url
        )

    redis_url = redis_server.url
    node_a = open_store(settings(tmp_path / "a"), LAYOUT, is_worker=True)
    scheduler = open_store(settings(tmp_path / "b"), LAYOUT, is_worker=False)
    try:
        stored = set(keys_of(prompt(10, 40)))
        for seed, key in enumerate(sorted(stored)):
            assert node_a.put(segment(key, seed=seed))
        assert node_a.announcer.flush()
        yield scheduler
    finally:
        close_store(node_a)
        close_store(scheduler)


def poll_all(lookups, prompts, timeout_s=10.0):
    """Poll every request until each has its plan (as vLLM asks again each step)."""
    plans, deadline = {}, time.monotonic() + timeout_s
    while len(plans) < len(prompts):
        assert time.monotonic() < deadline, "the lookups never finished"
        for request_id, token_ids in prompts.items():
            if (
                request_id not in plans
                and (plan := lookups.poll(request_id, token_ids)) is not PENDING
            ):
                plans[request_id] = plan
        time.sleep(0.005)
    return plans


def test_requests_queued_behind_a_lookup_share_one_round_trip_and_each_key_is_asked_once(
    scheduler_store,
):
    gate = GatedIndex(scheduler_store)
    lookups = AsyncReusePlanner(planner(gate), deadline_s=30.0)
    stats = scheduler_store.lookup.stats
    calls, keys_asked = stats.calls, stats.keys_looked_up
    try:
        assert lookups.poll("first", FIRST) is PENDING
        assert gate.entered.wait(10)  # the lookup thread is busy with the first request
        queued = {f"r{i}": token_ids for i, token_ids in enumerate(QUEUED)}
        for request_id, token_ids in queued.items():
            assert lookups.poll(request_id, token_ids) is PENDING
        gate.release.set()
        plans = poll_all(lookups, {"first": FIRST, **queued})
    finally:
        lookups.shutdown()

    assert stats.calls - calls == 2  # the first request's round trip, one for the rest
    unique = {key for token_ids in QUEUED for key in keys_of(token_ids)}
    assert stats.keys_looked_up - keys_asked == len(keys_of(FIRST)) + len(unique)
    for request_id, token_ids in {"first": FIRST, **queued}.items():
        assert plans[request_id] == planner(scheduler_store).plan(token_ids), request_id
    # Hits from the other node's announcements, per request: documents 10 and 40 only.
    assert plans["first"].reuse.reused_segments == (0, 1)
    assert plans["r1"].reuse.mode is ReuseMode.HOLE and plans["r1"].missing_segments == (1,)
    assert plans["r1"].reuse.reused_segments == (0, 2)


def test_a_queued_request_past_its_deadline_is_a_late_full_miss_and_the_batch_goes_on(
    scheduler_store,
):
    now = [0.0]
    gate = GatedIndex(scheduler_store)
    lookups = AsyncReusePlanner(planner(gate), deadline_s=1.0, clock=lambda: now[0])
    try:
        assert lookups.poll("first", FIRST) is PENDING
        assert gate.entered.wait(10)
        assert lookups.poll("early", QUEUED[0]) is PENDING
        now[0] = 0.5
        assert lookups.poll("later", QUEUED[2]) is PENDING
        now[0] = 1.2  # past the first two requests' deadlines, not the third's
        late = lookups.poll("early", QUEUED[0])
        assert late.is_lookup_late and late.num_covered_tokens == 0
        gate.release.set()
        plans = poll_all(lookups, {"later": QUEUED[2]})
        first = lookups.poll("first", FIRST)
    finally:
        lookups.shutdown()
    assert plans["later"] == planner(scheduler_store).plan(QUEUED[2])
    assert not plans["later"].is_lookup_late and plans["later"].num_covered_tokens > 0
    # Its answer came in before it was polled again: used, deadline or not (as before).
    assert first == planner(scheduler_store).plan(FIRST)
    assert lookups.num_pending == 0


def test_a_failed_batch_lookup_plans_each_of_its_requests_as_a_failed_lookup(scheduler_store):
    gate = FailingIndex(scheduler_store)
    lookups = AsyncReusePlanner(planner(gate), deadline_s=30.0)
    try:
        assert lookups.poll("first", FIRST) is PENDING
        assert gate.entered.wait(10)
        queued = {f"r{i}": token_ids for i, token_ids in enumerate(QUEUED)}
        for request_id, token_ids in queued.items():
            assert lookups.poll(request_id, token_ids) is PENDING
        gate.release.set()
        plans = poll_all(lookups, {"first": FIRST, **queued})
    finally:
        lookups.shutdown()
    assert not plans["first"].is_lookup_failed and plans["first"].num_covered_tokens > 0
    for request_id in queued:
        plan = plans[request_id]
        assert plan.is_lookup_failed and plan.reuse.mode is ReuseMode.FULL_MISS, request_id
        assert plan.missing_segments == (0, 1, 2), request_id


def test_shutdown_ends_the_lookup_thread_and_drops_the_queued_lookups(scheduler_store):
    def lookup_threads():
        return {t for t in threading.enumerate() if t.name == "holeblend-lookup"}

    before = lookup_threads()
    gate = GatedIndex(scheduler_store)
    lookups = AsyncReusePlanner(planner(gate), deadline_s=30.0)
    assert lookups.poll("first", FIRST) is PENDING
    assert gate.entered.wait(10)
    assert lookups.poll("queued", QUEUED[0]) is PENDING
    calls = scheduler_store.lookup.stats.calls
    lookups.shutdown()
    gate.release.set()
    deadline = time.monotonic() + 10
    while lookup_threads() - before:
        assert time.monotonic() < deadline, "the lookup thread outlived its planner"
        time.sleep(0.01)
    assert scheduler_store.lookup.stats.calls == calls + 1  # the first's, not the queued one's
