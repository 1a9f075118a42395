"""AsyncKVStore: a read ahead and a store of the same key, against a real directory tier."""

from __future__ import annotations

import threading

import pytest
import torch

from holeblend_runtime.kv.async_store import AsyncKVStore
from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.kv.store import SegmentKV

WAIT_S = 10.0


def _entry(key: str, seed: int) -> SegmentKV:
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 2, 8, 4, generator=generator)
    v = torch.randn(2, 2, 8, 4, generator=generator)
    return SegmentKV(key, k, v, torch.arange(8, dtype=torch.int64), "model")


class SignallingStore:
    """A directory tier that says when a batched read has returned."""

    def __init__(self, inner: DirectoryKVStore) -> None:
        self.inner = inner
        self.read = threading.Event()

    def put(self, kv: SegmentKV) -> bool:
        return self.inner.put(kv)

    def get(self, key: str) -> SegmentKV | None:
        return self.get_many([key])[0]

    def get_many(self, keys):
        found = self.inner.get_many(keys)
        self.read.set()
        return found

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def contains_many(self, keys):
        return self.inner.contains_many(keys)


@pytest.mark.parametrize("is_held", [False, True], ids=["absent", "replaced"])
def test_a_load_after_a_store_gets_the_stored_entry_not_an_earlier_read_ahead(tmp_path, is_held):
    """A read ahead of a key, then a store of it written before the load: the load claimed
    the read ahead, a miss or the entry the store replaced (an entry refused on load that
    the background store writes over), instead of what was just written."""
    tier = SignallingStore(DirectoryKVStore(tmp_path, 1 << 30))
    if is_held:
        tier.inner.put(_entry("a1", seed=1))
    store = AsyncKVStore(tier)
    store.prefetch(["a1"])
    assert tier.read.wait(WAIT_S)
    stored = _entry("a1", seed=2)
    assert store.put(stored)
    assert store.flush(WAIT_S)
    loaded = store.get("a1")
    assert loaded is not None and torch.equal(loaded.k, stored.k)
    assert store.num_prefetched == 0
    assert store.close(WAIT_S)
