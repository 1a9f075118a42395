"""The connector's KV tiers, without vLLM: a node directory, and the fleet's when named.

vLLM's scheduler and its workers run in different processes. Both open the same
directory tier (`DirectoryKVStore`), so what a worker stores the scheduler finds. When
blend.json names a shared tier (`kv.sharedUrl`) or a lookup server (`lookupServerUrl`),
that directory becomes the local tier of a `TieredKVStore`:

- the scheduler's lookup asks the directory first, then the lookup server (one batch) for
  the rest; a lookup server that is down or slow answers "all miss", so the request is
  planned with holes where remote segments were, never failed;
- the worker loads a segment from the directory, else from the shared tier (checked:
  format, model, dtype, shape, checksum; a bad blob is a miss, computed fresh) and keeps
  a copy in the directory; it stores new segments in both tiers and announces them to
  the lookup server. Only workers announce: the scheduler holds nothing of its own.

Once the directory is full, a worker admits a new segment only as blend.json's
`kv.admission` says (frequency: only if it was used more often than what it would evict;
`holeblend_runtime.kv.admission`); a refused segment is counted
(`holeblend_kv_store_refused_total`), not written.

Under tensor parallelism every rank stores its own heads' KV of a segment: one entry per
rank in the same tiers, under the segment key plus the layout (`shard_key`), so a blob of
one rank or of another tensor-parallel size is never read as another's. The scheduler's
lookup counts a segment as cached only when every rank's entry is (`AllShardsIndex`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from holeblend_runtime.kv.admission import admission_policy
from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.kv.store import KVStore, SegmentKV
from holeblend_runtime.kv.tiers import KVLayout, TieredKVStore, TierSettings, open_tiered_store
from holeblend_runtime.vllm_connector.settings import ConnectorSettings


def open_store(
    settings: ConnectorSettings, layout: KVLayout, is_worker: bool
) -> DirectoryKVStore | TieredKVStore:
    """The KV store of one connector process (see the module doc)."""
    admission = admission_policy(settings.kv_admission) if is_worker else None
    local = DirectoryKVStore(settings.kv_dir, settings.kv_bytes, admission)
    if not settings.has_remote_tiers:
        return local
    tiers = TierSettings.from_env(settings.kv_bytes, settings.shared_url, settings.lookup_url)
    return open_tiered_store(tiers, layout, local, is_announcing=is_worker)


def tier_figures(store: KVStore) -> dict[str, int]:
    """Counters of the remote tiers (empty for the directory alone): tests, the probe."""
    return store.figures() if isinstance(store, TieredKVStore) else {}


def close_store(store: KVStore) -> None:
    if isinstance(store, TieredKVStore):
        store.close()


def shard_key(key: str, rank: int, num_shards: int) -> str:
    """The key of one tensor-parallel rank's entry of segment `key` (alphanumeric, as
    every tier's keys are)."""
    return f"{key}tp{num_shards}r{rank}"


@dataclasses.dataclass(frozen=True)
class ShardedKVStore:
    """One tensor-parallel rank's view of the tiers the ranks share: the engine reads and
    writes segment keys; the tiers hold `shard_key`s."""

    inner: KVStore
    rank: int
    num_shards: int

    def _key(self, key: str) -> str:
        return shard_key(key, self.rank, self.num_shards)

    def get(self, key: str) -> SegmentKV | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[SegmentKV | None]:
        entries = self.inner.get_many([self._key(key) for key in keys])
        return [
            None if entry is None else dataclasses.replace(entry, key=key)
            for key, entry in zip(keys, entries, strict=True)
        ]

    def put(self, kv: SegmentKV) -> bool:
        return self.inner.put(dataclasses.replace(kv, key=self._key(kv.key)))

    def contains(self, key: str) -> bool:
        return self.inner.contains(self._key(key))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.contains_many([self._key(key) for key in keys])


@dataclasses.dataclass(frozen=True)
class AllShardsIndex:
    """The scheduler's index under tensor parallelism: a segment is cached when every
    rank's entry is (one batched lookup for all of them)."""

    inner: KVStore
    num_shards: int

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        ranks = range(self.num_shards)
        found = self.inner.contains_many(
            [shard_key(k, r, self.num_shards) for k in keys for r in ranks]
        )
        return [all(found[i : i + self.num_shards]) for i in range(0, len(found), self.num_shards)]
