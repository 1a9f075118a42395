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
"""

from __future__ import annotations

from holeblend_runtime.kv_directory import DirectoryKVStore
from holeblend_runtime.kv_store import KVStore
from holeblend_runtime.tiered_store import KVLayout, TieredKVStore, TierSettings, open_tiered_store
from holeblend_runtime.vllm_connector.settings import ConnectorSettings


def open_store(
    settings: ConnectorSettings, layout: KVLayout, is_worker: bool
) -> DirectoryKVStore | TieredKVStore:
    """The KV store of one connector process (see the module doc)."""
    local = DirectoryKVStore(settings.kv_dir, settings.kv_bytes)
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
