"""A cached entry the engine refuses on load is stored afresh under `storePolicy: isolated`,
in every tier the store writes to, as `in-context` does; a usable one is not recomputed."""

import pytest
import torch

from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.kv.shared_tier import SharedTier, SharedTierConfig
from holeblend_runtime.kv.store import LocalKVStore, SegmentKV, dtype_name
from holeblend_runtime.kv.tiers import KVLayout, TieredKVStore, kv_blob_pieces
from holeblend_runtime.lookup_server.processes import RedisProcess

BAD = 2  # segment index of the second document


def _with_nan(kv: SegmentKV) -> SegmentKV:
    k = kv.k.clone()
    k[0, 0, 0, 0] = float("nan")
    return SegmentKV(kv.key, k, kv.v.clone(), kv.positions.clone(), kv.model_id)


def _engine_with_a_bad_entry(cached_engine, rag_texts, store):
    """An isolated engine over `store`, which holds every segment of the prompt, one
    document's with a NaN in its K."""
    engine, prompt = cached_engine(rag_texts, store_policy="isolated")
    keys = engine.segment_keys(prompt)
    for i, key in enumerate(keys):
        if key is not None:
            kv = engine.store.get(key)
            store.put(_with_nan(kv) if i == BAD else kv)
    engine.store = store
    return engine, prompt, keys[BAD]


def _rejections(engine, prompt, num_requests: int) -> list[int]:
    counts = []
    for _ in range(num_requests):
        counts.append(engine.prefill(prompt, "hole").num_rejected_segments)
        assert engine.wait_for_stores(timeout=60)
    return counts


def _is_finite(kv: SegmentKV | None) -> bool:
    return kv is not None and bool(torch.isfinite(kv.k).all() and torch.isfinite(kv.v).all())


@pytest.mark.parametrize("tier", ["local", "directory"])
def test_a_refused_entry_is_replaced_by_the_background_store(
    cached_engine, rag_texts, tmp_path, tier
):
    store = LocalKVStore(1 << 30) if tier == "local" else DirectoryKVStore(tmp_path, 1 << 30)
    engine, prompt, bad_key = _engine_with_a_bad_entry(cached_engine, rag_texts, store)
    try:
        assert _rejections(engine, prompt, 2) == [1, 0]
        assert _is_finite(store.get(bad_key))
        stats = engine.store_stats()
        assert (stats.num_submitted, stats.num_stored, stats.num_skipped) == (1, 1, 0)
    finally:
        engine.close()


def test_a_refused_copy_in_the_shared_tier_is_replaced_there(cached_engine, rag_texts):
    with RedisProcess(maxmemory="64mb") as redis:
        config = SharedTierConfig(redis.url, "ns/rag", timeout_s=5.0)
        engine, prompt = cached_engine(rag_texts, store_policy="isolated")
        layout = KVLayout.of(engine.config, engine.kv_dtype, dtype_name(engine.model.dtype))
        store = TieredKVStore(LocalKVStore(1 << 30), layout, SharedTier(config))
        keys = engine.segment_keys(prompt)
        for i, key in enumerate(keys):
            if key is not None and i != BAD:
                store.put(engine.store.get(key))
        # Only the shared tier holds the document, and its copy is bad.
        bad = _with_nan(engine.store.get(keys[BAD]))
        store.shared.put_pieces(bad.key, kv_blob_pieces(bad, config.deployment))
        engine.store = store
        other_pod = TieredKVStore(LocalKVStore(1 << 30), layout, SharedTier(config))
        try:
            assert _rejections(engine, prompt, 2) == [1, 0]
            assert _is_finite(other_pod.get(keys[BAD]))
        finally:
            engine.close()
            store.close()
            other_pod.close()


def test_a_usable_stored_entry_is_not_computed_again(cached_engine, rag_texts):
    """The background store still skips a key whose entry is fine when its turn comes:
    queued as a miss and stored meanwhile by someone else, it costs no forward pass."""
    engine, prompt = cached_engine(rag_texts, hole=BAD, store_policy="isolated")
    keys = engine.segment_keys(prompt)
    engine.store.remove(keys[BAD + 1])
    try:
        with engine.busy():  # the first job waits before its first layer, the second queued
            assert engine.prefill(prompt, "hole").num_queued_segments == 2
            engine.cache_segments(prompt, [BAD + 1])
        assert engine.wait_for_stores(timeout=60)
        stats = engine.store_stats()
        assert (stats.num_stored, stats.num_skipped) == (1, 1)
    finally:
        engine.close()
