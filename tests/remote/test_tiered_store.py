"""Two pods' tiered stores sharing a real redis-server and a real lookup server process."""

import threading
import time

import pytest
import torch

from holeblend_runtime.kv.tiers import TieredKVStore, TierSettings, open_tiered_store
from holeblend_runtime.lookup_server.client import AnnouncerConfig, ClientConfig
from holeblend_runtime.lookup_server.processes import RedisProcess
from tests.contention import run_contended

from .test_shared_tier import LAYOUT, assert_same, large_pieces, segment

FAST = dict(
    client=ClientConfig(timeout_ms=50, retries=1, breaker_failures=2, breaker_open_s=0.2),
    announcer=AnnouncerConfig(heartbeat_s=0.1, resync_s=30),
    shared_timeout_s=0.5,
)


def pod(
    name: str, redis_url: str | None, lookup_url: str | None, resync_s: float | None = None
) -> TieredKVStore:
    fast = dict(FAST)
    if resync_s is not None:
        fast["announcer"] = AnnouncerConfig(heartbeat_s=0.1, resync_s=resync_s)
    settings = TierSettings(1 << 24, redis_url, lookup_url, "ns/rag", name, **fast)
    store = open_tiered_store(settings, LAYOUT)
    if store.shared is not None:
        store.shared.breaker.open_s = 0.2
    return store


@pytest.fixture
def pods(redis_server, lookup_server):
    a = pod("pod-a", redis_server.url, lookup_server.url)
    b = pod("pod-b", redis_server.url, lookup_server.url)
    yield a, b
    a.close()
    b.close()


def wait_for(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_a_segment_stored_by_one_pod_is_loaded_by_another(pods):
    a, b = pods
    kv = segment("doc-1")
    assert a.put(kv)
    assert a.announcer.flush()
    found = b.get("doc-1")
    assert found is not None
    assert_same(found, kv)
    assert b.stats.shared_hits == 1 and b.local.contains("doc-1")


def test_lookup_asks_the_server_once_per_batch_of_local_misses(pods):
    a, b = pods
    for i in range(5):
        a.put(segment(f"doc-{i}", seed=i))
    a.announcer.flush()
    calls_before = b.lookup.stats.calls
    found = b.get_many([f"doc-{i}" for i in range(7)])
    assert [kv is not None for kv in found] == [True] * 5 + [False] * 2
    assert b.lookup.stats.calls == calls_before + 1


def test_lookup_server_killed_and_restarted_nothing_fails_and_reuse_recovers(pods, lookup_server):
    a, b = pods
    a.put(segment("doc-1"))
    a.announcer.flush()
    lookup_server.kill()
    assert b.get("doc-1") is None  # remote reuse lost while it is down, and no exception
    assert a.get("doc-1") is not None  # the local tier still serves
    lookup_server.start()
    # After the restart pod A is unknown to the server, is told to resync, re-announces.
    wait_for(lambda: b.get("doc-1") is not None)


def test_redis_restarted_empty_is_a_miss_and_the_index_stops_advertising(pods, redis_server):
    a, b = pods
    a.put(segment("doc-1"))
    a.announcer.flush()
    redis_server.stop()
    redis_server.start()  # empty: nothing is persisted
    assert b.get("doc-1") is None
    assert b.stats.load_failures == 1
    assert a.get("doc-1") is not None  # the pod that computed it still has it locally
    b.announcer.flush()
    wait_for(lambda: not b.lookup.lookup(["doc-1"])[0].in_shared_tier)


def test_redis_down_leaves_the_local_tier_serving(pods, redis_server):
    a, _ = pods
    redis_server.stop()
    assert a.put(segment("doc-1"))  # stored locally; the shared write fails quietly
    assert a.get("doc-1") is not None
    assert a.shared.stats.errors >= 1


def test_a_corrupted_shared_copy_is_a_miss(pods):
    a, b = pods
    a.put(segment("doc-1"))
    a.announcer.flush()
    key = a.shared.redis_key("doc-1")
    blob = bytearray(a.shared.client.get(key))
    blob[100] ^= 0x10
    a.shared.client.set(key, bytes(blob))
    assert b.get("doc-1") is None
    assert b.shared.stats.bad_blobs == 1


def test_another_models_blob_under_the_key_is_a_miss(pods):
    a, b = pods
    a.put(segment("doc-1", model="model-b"))
    a.announcer.flush()
    assert b.get("doc-1") is None


def test_without_a_lookup_server_the_shared_tier_is_asked_directly(redis_server):
    a, b = pod("pod-a", redis_server.url, None), pod("pod-b", redis_server.url, None)
    try:
        kv = segment("doc-1")
        a.put(kv)
        assert_same(b.get("doc-1"), kv)
    finally:
        a.close()
        b.close()


def test_a_pod_with_only_a_local_tier_behaves_like_the_local_store():
    store = pod("solo", None, None)
    kv = segment("doc-1")
    assert store.put(kv) and store.get("doc-1").k is kv.k and store.get("other") is None


def test_holdings_are_what_a_resync_announces(pods):
    a, _ = pods
    a.put(segment("doc-1"))
    assert [entry.key for entry in a.holdings()] == ["doc-1"]
    assert a.holdings()[0].shared and a.holdings()[0].num_bytes == segment("doc-1").num_bytes
    assert torch.equal(a.get("doc-1").k, segment("doc-1").k)


def test_lookups_under_load_survive_a_lookup_server_restart(pods, lookup_server):
    a, b = pods
    keys = [f"doc-{i}" for i in range(8)]
    for i, key in enumerate(keys):
        a.put(segment(key, seed=i))
    a.announcer.flush()
    outcomes: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            try:
                found = b.get_many(keys)
            except BaseException as error:  # the test fails on any
                errors.append(error)
                return
            outcomes.append(sum(kv is not None for kv in found))
            for key in keys:  # keep B's local tier empty: every round asks the remote tiers
                b.local.remove(key)

    worker = threading.Thread(target=hammer)
    worker.start()
    try:
        wait_for(lambda: len(outcomes) > 5)
        lookup_server.kill()
        num_before_restart = len(outcomes)
        wait_for(lambda: len(outcomes) > num_before_restart + 5)
        lookup_server.start()
        wait_for(lambda: outcomes[-1] == len(keys))
    finally:
        stop.set()
        worker.join(10)
    assert not errors
    assert 0 in outcomes[num_before_restart:]  # all miss while it was down
    assert outcomes[-1] == len(keys)  # and full reuse after the resync


def test_redis_down_does_not_make_the_index_forget_the_shared_copy(pods, redis_server):
    a, b = pods
    a.put(segment("doc-1"))
    a.announcer.flush()
    redis_server.stop()
    assert b.get("doc-1") is None  # a failed call: computed, but maybe still in Redis
    assert b.stats.load_failures == 1
    b.announcer.flush()
    assert b.lookup.lookup(["doc-1"])[0].in_shared_tier


def test_a_copy_gone_from_redis_is_reported_gone_while_another_threads_store_fails(
    lookup_server,
):
    """A full Redis (`noeviction`) refuses stores all the time. A copy it no longer holds
    is still reported gone when the pod's GET for it is answered "no such key" while a
    store on another thread (the pod's writer) fails: that GET's own answer decides, so
    the lookup server stops advertising the copy and no other pod plans on it."""
    with RedisProcess(maxmemory="2mb", policy="noeviction") as server:
        a = pod("pod-a", server.url, lookup_server.url)
        b = pod("pod-b", server.url, lookup_server.url)
        try:
            a.put(segment("doc-1"))
            a.announcer.flush()
            a.shared.client.delete(a.shared.redis_key("doc-1"))  # gone from Redis
            pieces = large_pieces(b.shared.deployment)
            real_get = b.shared.client.get

            def get_while_a_store_fails(key):
                reply = real_get(key)
                writer = threading.Thread(target=b.shared.put_pieces, args=("large", pieces))
                writer.start()
                writer.join()
                return reply

            b.shared.client.get = get_while_a_store_fails
            assert b.get("doc-1") is None and b.stats.load_failures == 1
            assert b.shared.stats.errors_by_kind == {"OutOfMemoryError": 1}
            b.announcer.flush()
            wait_for(lambda: not b.lookup.lookup(["doc-1"])[0].in_shared_tier)
        finally:
            a.close()
            b.close()


def test_the_writers_resyncs_do_not_advertise_again_a_copy_another_pod_found_gone(
    redis_server, lookup_server
):
    """Pod A wrote a segment to Redis; Redis restarted empty, pod B's load failed and B
    reported the copy gone. A still remembers writing it and lists it as shared in its
    periodic resyncs, but the lookup server keeps it unadvertised: otherwise every pod that
    looks it up pays a GET, a failed load and an evict, every resync period. B, which had
    loaded the copy before, stops listing it too. Writing it again advertises it again."""
    a = pod("pod-a", redis_server.url, lookup_server.url, resync_s=0.3)
    b = pod("pod-b", redis_server.url, lookup_server.url, resync_s=0.3)
    try:
        a.put(segment("doc-1"))
        a.announcer.flush()
        assert b.get("doc-1") is not None and b.stats.shared_hits == 1
        b.local.remove("doc-1")  # B keeps only its memory of the shared copy
        redis_server.stop()
        redis_server.start()  # empty
        assert b.get("doc-1") is None and b.stats.load_failures == 1
        assert [entry.key for entry in b.holdings()] == []
        b.announcer.flush()
        wait_for(lambda: not b.lookup.lookup(["doc-1"])[0].in_shared_tier)
        resynced = b.lookup.call({"op": "stats"})["stats"]["resynced"]
        # A's resyncs (one entry each) arrive every 0.3 s: wait for two.
        wait_for(lambda: b.lookup.call({"op": "stats"})["stats"]["resynced"] >= resynced + 2)
        assert [(e.key, e.shared) for e in a.holdings()] == [("doc-1", True)]
        hit = b.lookup.lookup(["doc-1"])[0]
        assert hit.pods == ("pod-a",) and not hit.in_shared_tier
        assert b.get("doc-1") is None and b.stats.load_failures == 1  # not asked again
        a.put(segment("doc-1"))  # written again
        a.announcer.flush()
        assert b.lookup.lookup(["doc-1"])[0].in_shared_tier
        assert b.get("doc-1") is not None
    finally:
        a.close()
        b.close()


def test_a_local_directory_that_cannot_write_keeps_nothing_from_the_shared_tier(
    redis_server, lookup_server, tmp_path
):
    """A pod whose own directory tier fails to write (here: removed under it, as a wiped
    volume is) still stores the segment in the shared tier and announces it, and a pod in
    the same state still gets a segment it loaded from the shared tier."""
    import shutil

    from holeblend_runtime.kv.directory import DirectoryKVStore

    def broken_pod(name: str) -> TieredKVStore:
        local = DirectoryKVStore(tmp_path / name, 1 << 24)
        settings = TierSettings(
            1 << 24, redis_server.url, lookup_server.url, "ns/rag", name, **FAST
        )
        shutil.rmtree(local.root)
        return open_tiered_store(settings, LAYOUT, local)

    a, b = broken_pod("pod-a"), broken_pod("pod-b")
    try:
        kv = segment("doc1")
        assert a.put(kv)
        assert a.stats.shared_stores == 1
        assert a.announcer.flush()
        found = b.get("doc1")
        assert found is not None and b.stats.shared_hits == 1
        assert_same(found, kv)
    finally:
        a.close()
        b.close()


def test_a_local_file_evicted_by_another_process_meanwhile_keeps_nothing_from_the_shared_tier(
    redis_server, lookup_server, tmp_path, monkeypatch
):
    """Another worker sharing the directory evicts a file while this one lists it (vLLM's
    tensor-parallel ranks make room at once): the put stores the segment in both tiers (it
    raised out of the directory, and the shared tier was never written)."""
    from holeblend_runtime.kv import directory

    local = directory.DirectoryKVStore(tmp_path / "kv", 1 << 24)
    for key in ("doc1", "doc2"):
        assert local.put(segment(key))
    settings = TierSettings(1 << 24, redis_server.url, lookup_server.url, "ns/rag", "a", **FAST)
    store = open_tiered_store(settings, LAYOUT, local)
    mtime = directory._mtime

    def evicted_meanwhile(path):
        if path.name == "doc1.safetensors":
            path.unlink(missing_ok=True)
        return mtime(path)

    monkeypatch.setattr(directory, "_mtime", evicted_meanwhile)
    try:
        assert store.put(segment("doc3"))
        assert store.stats.shared_stores == 1 and local.contains("doc3")
    finally:
        store.close()


def test_without_a_lookup_server_contains_asks_the_shared_tier_what_it_holds(redis_server):
    # `contains` decides what gets computed and stored (the background store worker skips
    # a contained key, vLLM's connector plans a contained document as a hit): answering
    # True for every key meant a pod with a shared tier and no lookup server never stored.
    a, b = pod("pod-a", redis_server.url, None), pod("pod-b", redis_server.url, None)
    try:
        a.put(segment("doc-1"))
        assert b.contains_many(["doc-1", "never-stored"]) == [True, False]
        assert not b.contains("never-stored") and b.contains("doc-1")
        assert a.contains("doc-1")  # the local tier's answer, Redis not asked
    finally:
        a.close()
        b.close()


def test_without_a_lookup_server_a_refused_blob_is_not_contained_until_stored_again(
    redis_server,
):
    """Redis still holds a blob the tier refused (corrupt, foreign), so EXISTS said it was
    held: the store worker and the vLLM worker skip storing what is contained, and with no
    lookup server to hear that the copy is unusable the segment missed on every request."""
    a, b = pod("pod-a", redis_server.url, None), pod("pod-b", redis_server.url, None)
    try:
        a.put(segment("doc-1"))
        key = a.shared.redis_key("doc-1")
        blob = bytearray(a.shared.client.get(key))
        blob[100] ^= 0x10
        a.shared.client.set(key, bytes(blob))
        assert b.get("doc-1") is None and b.shared.stats.bad_blobs == 1
        assert b.contains_many(["doc-1", "never-stored"]) == [False, False]
        assert b.put(segment("doc-1"))  # over the refused blob
        assert b.shared.contains_many(["doc-1"]) == [True]
        assert b.shared.get_checked(LAYOUT.header("doc-1")) is not None
    finally:
        a.close()
        b.close()


def test_without_a_lookup_server_contains_is_false_while_redis_is_down():
    from holeblend_runtime.lookup_server.processes import free_port

    store = pod("pod-a", f"redis://127.0.0.1:{free_port()}", None)
    try:
        started = time.perf_counter()
        assert store.contains_many(["doc-1", "doc-2"]) == [False, False]
        assert time.perf_counter() - started < 1.0
    finally:
        store.close()


def test_tier_counters_lose_nothing_under_concurrent_reads():
    kv = segment("doc-1")

    class OneSegment:  # a local tier of one segment, without a lock of its own
        def get(self, key):
            return kv if key == kv.key else None

    store = TieredKVStore(OneSegment(), LAYOUT)
    threads, rounds = 8, 3000
    run_contended(lambda: store.get_many(["doc-1", "other"]), threads, rounds)
    assert store.stats.local_hits == threads * rounds
    assert store.stats.misses == threads * rounds
