"""The vLLM connector's KV tiers (no vLLM needed) against a real redis-server and a real
lookup server process: two nodes, each with its own directory tier; a segment one node's
worker stored is planned as reused by the other node's scheduler and loaded by its worker.
"""

import time

import pytest

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.keys import SegmentKeyer
from holeblend_runtime.blend.reuse import ReuseMode
from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.kv.tiers import TieredKVStore
from holeblend_runtime.vllm_connector.planning import ReusePlanner
from holeblend_runtime.vllm_connector.settings import ConnectorSettings
from holeblend_runtime.vllm_connector.store import close_store, open_store, tier_figures

from .test_shared_tier import LAYOUT, assert_same, segment

SEP = 9
PROMPT = [1, 2, 3, SEP, 10, 11, 12, SEP, 20, 21, 22, SEP, 30, 31, 32, SEP, 40, 41]
BLEND = BlendConfig(min_segment_tokens=2)


def settings(kv_dir, redis_url=None, lookup_url=None) -> ConnectorSettings:
    return ConnectorSettings(
        blend=BLEND, kv_dir=kv_dir, shared_url=redis_url, lookup_url=lookup_url
    )


def planner(store) -> ReusePlanner:
    return ReusePlanner([SEP], SegmentKeyer(LAYOUT.model_id, LAYOUT.dtype, BLEND), store)


@pytest.fixture
def stores():
    opened = []

    def open_(*args, **kwargs):
        store = open_store(*args, **kwargs)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        close_store(store)


def wait_for(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_without_remote_tiers_the_connector_keeps_the_node_directory(tmp_path, stores):
    store = stores(settings(tmp_path), LAYOUT, is_worker=True)
    assert isinstance(store, DirectoryKVStore)
    assert tier_figures(store) == {}


def test_a_segment_stored_on_one_node_is_reused_by_another_nodes_scheduler_and_worker(
    tmp_path, stores, redis_server, lookup_server
):
    keys = planner(DirectoryKVStore(tmp_path / "keys", 1 << 20)).plan(PROMPT).keys
    node_a = stores(
        settings(tmp_path / "a", redis_server.url, lookup_server.url), LAYOUT, is_worker=True
    )
    for index in (0, 1, 3):  # the system prompt, documents 1 and 3: document 2 is a hole
        assert node_a.put(segment(keys[index], seed=index))
    assert node_a.announcer.flush()

    b_settings = settings(tmp_path / "b", redis_server.url, lookup_server.url)
    scheduler = stores(b_settings, LAYOUT, is_worker=False)
    assert isinstance(scheduler, TieredKVStore) and scheduler.announcer is None
    plan = planner(scheduler).plan(PROMPT)
    assert plan.reuse.mode is ReuseMode.HOLE and not plan.is_lookup_failed
    assert plan.reuse.hole_ranges == ((8, 11),)
    assert plan.missing_segments == (2,)

    worker = stores(b_settings, LAYOUT, is_worker=True)
    loaded = worker.get_many([keys[0], keys[1], keys[2], keys[3]])
    assert [kv is not None for kv in loaded] == [True, True, False, True]
    assert_same(loaded[1], segment(keys[1], seed=1))
    assert tier_figures(worker)["shared_hits"] == 3
    # The loaded copies now sit in node B's directory: its scheduler finds them locally.
    assert DirectoryKVStore(tmp_path / "b", 1 << 20).contains(keys[3])
    calls = scheduler.lookup.stats.calls
    planner(scheduler).plan(PROMPT)
    assert scheduler.lookup.stats.calls == calls + 1  # only the hole was asked about


def test_lookup_server_down_plans_remote_segments_as_misses_and_local_ones_still_hit(
    tmp_path, stores, redis_server, lookup_server
):
    keys = planner(DirectoryKVStore(tmp_path / "keys", 1 << 20)).plan(PROMPT).keys
    node_a = stores(
        settings(tmp_path / "a", redis_server.url, lookup_server.url), LAYOUT, is_worker=True
    )
    for index in (0, 1, 2, 3):
        node_a.put(segment(keys[index], seed=index))
    assert node_a.announcer.flush()
    lookup_server.kill()

    b_settings = settings(tmp_path / "b", redis_server.url, lookup_server.url)
    DirectoryKVStore(tmp_path / "b", 1 << 20).put(segment(keys[0], seed=0))  # B's own copy
    scheduler = stores(b_settings, LAYOUT, is_worker=False)
    plan = planner(scheduler).plan(PROMPT)  # no exception: remote segments are misses
    assert plan.reuse.mode is not ReuseMode.FULL_MISS  # the system prompt, B's directory
    assert plan.reuse.reused_segments == (0,)
    assert plan.missing_segments == (1, 2, 3)
    assert tier_figures(scheduler)["lookup_degraded"] >= 1

    worker = stores(b_settings, LAYOUT, is_worker=True)
    loaded = worker.get_many(list(keys[:4]))
    assert [kv is not None for kv in loaded] == [True, False, False, False]

    lookup_server.start()  # back: node A re-announces when told to, reuse across nodes returns
    wait_for(lambda: planner(scheduler).plan(PROMPT).reuse.mode is ReuseMode.PURE_HIT)
