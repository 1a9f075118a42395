"""Segment KV entries and the byte-budgeted LRU store."""

import threading

import pytest
import torch

from holeblend_runtime.kv.store import KVStore, LocalKVStore, SegmentKV


def _kv(key: str, num_tokens: int = 4, *, num_layers: int = 2, model_id: str = "m") -> SegmentKV:
    shape = (num_layers, 3, num_tokens, 8)
    return SegmentKV(
        key=key,
        k=torch.randn(shape),
        v=torch.randn(shape),
        positions=torch.arange(num_tokens, dtype=torch.int64),
        model_id=model_id,
    )


ENTRY_BYTES = _kv("x").num_bytes  # 2 * (2*3*4*8 floats * 4 bytes) + 4 int64 = 1568


def test_num_bytes_counts_k_v_and_positions():
    assert ENTRY_BYTES == 2 * (2 * 3 * 4 * 8 * 4) + 4 * 8
    assert _kv("x").num_tokens == 4


def test_entry_rejects_mismatched_tensors():
    k = torch.zeros(2, 3, 4, 8)
    positions = torch.arange(4)
    with pytest.raises(ValueError, match="k: expected 4 dims"):
        SegmentKV("a", torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), positions, "m")
    with pytest.raises(ValueError, match="v: shape"):
        SegmentKV("a", k, torch.zeros(2, 3, 5, 8), positions, "m")
    with pytest.raises(ValueError, match="v: dtype"):
        SegmentKV("a", k, k.to(torch.float16), positions, "m")
    with pytest.raises(ValueError, match="positions"):
        SegmentKV("a", k, k, torch.arange(5), "m")
    with pytest.raises(ValueError, match="positions"):
        SegmentKV("a", k, k, torch.arange(4, dtype=torch.int32), "m")
    with pytest.raises(ValueError, match="key"):
        SegmentKV("", k, k, positions, "m")


def test_put_marks_entries_with_non_finite_values():
    store = LocalKVStore(10 * ENTRY_BYTES)
    kv = _kv("a")
    kv.v[0, 0, 0, 0] = float("inf")
    assert store.put(kv) and store.get("a").is_finite is False


def test_put_waits_for_no_device_value_and_get_reads_the_verdict():
    # On the meta device any read of a value raises: a put that waited for the KV's
    # finiteness (a host wait after every prefill on an accelerator) would fail here.
    store = LocalKVStore(10 * ENTRY_BYTES)
    meta = torch.zeros(2, 1, 3, 4, device="meta")
    assert store.put(SegmentKV("m", meta, meta.clone(), torch.arange(3), "m"))
    assert store.contains("m") and store.keys() == ("m",)
    with pytest.raises(RuntimeError, match="meta"):
        store.get("m")  # the verdict is read on the first get
    # Taken from the tensors put, once: a later change to them is not seen.
    kv = _kv("a")
    assert store.put(kv)
    kv.k[0, 0, 0, 0] = float("nan")
    assert store.get("a").is_finite is True and store.get("a").is_finite is True
    # Removed or evicted entries leave no verdict behind.
    assert store.remove("a") and store.remove("m") and not store._unsettled


def test_put_then_get_returns_the_entry():
    store = LocalKVStore(10 * ENTRY_BYTES)
    kv = _kv("a")
    assert store.put(kv)
    # The same tensors, no copy; the store adds its finiteness verdict.
    got = store.get("a")
    assert got.k is kv.k and got.v is kv.v and got.key == "a" and got.is_finite
    assert store.contains("a")
    assert store.get("b") is None and not store.contains("b")
    assert store.num_bytes == ENTRY_BYTES and len(store) == 1


def test_local_store_satisfies_the_protocol():
    store: KVStore = LocalKVStore(ENTRY_BYTES)
    assert store.put(_kv("a"))


def test_least_recently_used_is_evicted_when_over_budget():
    store = LocalKVStore(3 * ENTRY_BYTES)
    for key in "abc":
        assert store.put(_kv(key))
    assert store.put(_kv("d"))
    assert store.keys() == ("b", "c", "d")
    assert store.num_bytes == 3 * ENTRY_BYTES
    assert store.num_evictions == 1


def test_get_touches_the_entry_so_it_survives_eviction():
    store = LocalKVStore(3 * ENTRY_BYTES)
    for key in "abc":
        store.put(_kv(key))
    store.get("a")
    store.put(_kv("d"))
    assert store.keys() == ("c", "a", "d")


def test_contains_does_not_touch_the_entry():
    store = LocalKVStore(2 * ENTRY_BYTES)
    store.put(_kv("a"))
    store.put(_kv("b"))
    assert store.contains("a")
    store.put(_kv("c"))
    assert not store.contains("a")


def test_contains_many_answers_per_key_in_order_without_touching_entries():
    store = LocalKVStore(2 * ENTRY_BYTES)
    store.put(_kv("a"))
    store.put(_kv("b"))
    assert store.contains_many(["b", "x", "a"]) == [True, False, True]
    assert store.contains_many([]) == []
    store.put(_kv("c"))  # "a" is still the oldest: contains_many did not use it
    assert store.contains_many(["a", "b", "c"]) == [False, True, True]


def test_a_large_entry_evicts_as_many_as_needed():
    store = LocalKVStore(4 * ENTRY_BYTES)
    for key in "abcd":
        store.put(_kv(key))
    big = _kv("big", num_tokens=12)
    assert big.num_bytes == 3 * ENTRY_BYTES
    assert store.put(big)
    assert store.keys() == ("d", "big")
    assert store.num_bytes == store.capacity_bytes
    assert store.num_evictions == 3


def test_oversize_entry_is_rejected_and_nothing_is_evicted():
    store = LocalKVStore(2 * ENTRY_BYTES)
    store.put(_kv("a"))
    assert not store.put(_kv("huge", num_tokens=100))
    assert store.keys() == ("a",)
    assert store.num_evictions == 0


def test_putting_an_existing_key_replaces_it_without_double_counting():
    store = LocalKVStore(3 * ENTRY_BYTES)
    store.put(_kv("a"))
    store.put(_kv("b"))
    replacement = _kv("a")
    store.put(replacement)
    assert store.keys() == ("b", "a")
    assert store.get("a").k is replacement.k
    assert store.num_bytes == 2 * ENTRY_BYTES


def test_remove_frees_the_bytes():
    store = LocalKVStore(3 * ENTRY_BYTES)
    store.put(_kv("a"))
    assert store.remove("a")
    assert not store.remove("a")
    assert store.num_bytes == 0 and len(store) == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity_bytes"):
        LocalKVStore(0)


def test_concurrent_puts_keep_the_byte_count_consistent():
    store = LocalKVStore(5 * ENTRY_BYTES)
    entries = [_kv(f"k{i}") for i in range(40)]

    def put_all(offset: int) -> None:
        for kv in entries[offset::4]:
            store.put(kv)
            store.get(kv.key)

    threads = [threading.Thread(target=put_all, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store) == 5
    assert store.num_bytes == 5 * ENTRY_BYTES
