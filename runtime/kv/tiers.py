"""A `KVStore` over three places: this pod's memory, the shared tier, and the lookup server.

Reading a segment (`get`, `get_many`):
1. the local tier (in-process LRU): a hit is returned at once;
2. otherwise the lookup server is asked (one batch for all local misses) whether the
   shared tier holds it; with no lookup server configured, the shared tier is asked
   directly. An unreachable or slow lookup server answers "all miss";
3. a shared-tier hit is fetched and checked (format, model, dtype, shape, checksum);
   it is kept in the local tier too. A blob that fails to load or check is a miss:
   the engine computes that segment, and the lookup server is told the copy is gone.

Writing a segment (`put`): the local tier, then the shared tier, and only after both
stores returned is the segment admitted to the lookup server (off the request path,
by the `Announcer`), so an advertised segment was loadable when it was advertised.
Local evictions are not announced one by one; the periodic full resync corrects them.
A resync lists the shared copies this pod wrote or loaded without asking Redis again;
the lookup server does not advertise again a copy some pod reported gone
(docs/shared-tier.md, "Copies found gone").
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from holeblend_contract.shared_tier import DEPLOYMENT_ENV
from holeblend_runtime.kv.shared_tier import (
    DTYPE_SIZES,
    BlobHeader,
    SharedTier,
    SharedTierConfig,
    blob_pieces,
    decode_blob,
)
from holeblend_runtime.kv.store import LocalKVStore, SegmentKV, dtype_name
from holeblend_runtime.lookup_server.client import (
    Announcer,
    AnnouncerConfig,
    ClientConfig,
    LookupClient,
)
from holeblend_runtime.lookup_server.wire import Entry
from holeblend_runtime.model.config import ModelConfig

log = logging.getLogger(__name__)

# The torch dtype of each name a blob header may carry (the wire format's one list).
_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES}


class LocalTier(Protocol):
    """This pod's own tier: an in-process `LocalKVStore`, or the directory a vLLM pod's
    scheduler and worker processes share (`kv.directory.DirectoryKVStore`)."""

    capacity_bytes: int

    @property
    def num_bytes(self) -> int: ...

    def __len__(self) -> int: ...

    def get(self, key: str) -> SegmentKV | None: ...

    def put(self, kv: SegmentKV) -> bool: ...

    def contains(self, key: str) -> bool: ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]: ...


@dataclass(frozen=True)
class KVLayout:
    """What every segment's KV of this engine looks like (checked on every remote load)."""

    # Model identity (`ModelConfig.model_id`).
    model_id: str
    # Documents' KV dtype name: float32, float16, bfloat16 or float8_e4m3fn.
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # The system prompt's, the model's own (None: the same); the engine checks whose is whose.
    system_dtype: str | None = None

    @classmethod
    def of(cls, config: ModelConfig, dtype: str, system_dtype: str | None = None) -> KVLayout:
        """The layout of `config`'s KV cache in `dtype` (the engine's `kv_dtype`)."""
        return cls(
            config.model_id, dtype, config.num_layers, config.num_kv_heads, config.head_dim,
            system_dtype,
        )  # fmt: skip

    @property
    def other_dtypes(self) -> tuple[str, ...]:
        """Dtypes a segment may be held in besides `dtype`."""
        return () if self.system_dtype in (None, self.dtype) else (self.system_dtype,)

    def header(self, key: str, num_tokens: int = 0) -> BlobHeader:
        shape = (self.num_layers, self.num_kv_heads, num_tokens, self.head_dim)
        return BlobHeader(key, self.model_id, self.dtype, shape)


def kv_to_blob(kv: SegmentKV, deployment: str = "") -> bytes:
    """The shared-tier blob of one segment (K, V and positions, checksummed with the
    writing deployment's identity)."""
    return b"".join(kv_blob_pieces(kv, deployment))


def kv_blob_pieces(kv: SegmentKV, deployment: str = "") -> list:
    """The blob of one segment in pieces that share the tensors' memory (no copy)."""
    header = BlobHeader(kv.key, kv.model_id, dtype_name(kv.k.dtype), tuple(kv.k.shape))
    parts = [_raw_bytes(t) for t in (kv.k, kv.v, kv.positions)]
    return blob_pieces(header, parts, deployment)


def blob_to_kv(blob: bytes, expected: BlobHeader | None = None, deployment: str = "") -> SegmentKV:
    """The segment in `blob`; `shared_tier.BlobError` when it is not usable."""
    header, payload = decode_blob(blob, expected, deployment)
    return _payload_to_kv(header, payload)


def _payload_to_kv(header: BlobHeader, payload: memoryview) -> SegmentKV:
    buffer = bytearray(payload)  # one copy, writable, shared by K, V and positions
    dtype, count = _DTYPES[header.dtype], header.kv_bytes // DTYPE_SIZES[header.dtype]
    k = torch.frombuffer(buffer, dtype=dtype, count=count, offset=0).view(header.shape)
    v = torch.frombuffer(buffer, dtype=dtype, count=count, offset=header.kv_bytes).view(
        header.shape
    )
    positions = torch.frombuffer(
        buffer, dtype=torch.int64, count=header.num_tokens, offset=2 * header.kv_bytes
    )
    return SegmentKV(header.key, k, v, positions, header.model)


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in host memory (a KV computed on an accelerator is copied
    down first: the wire format is host bytes)."""
    host = tensor.detach().to("cpu").contiguous()
    return memoryview(host.reshape(-1).view(torch.uint8).numpy())


@dataclass
class TierStats:
    local_hits: int = 0
    shared_hits: int = 0
    misses: int = 0
    # Segments the lookup server advertised in the shared tier that did not load.
    load_failures: int = 0
    shared_stores: int = 0


class TieredKVStore:
    """Local LRU + shared tier + lookup server, behind the engine's `KVStore` protocol."""

    def __init__(
        self,
        local: LocalTier,
        layout: KVLayout,
        shared: SharedTier | None = None,
        lookup: LookupClient | None = None,
        announcer: Announcer | None = None,
        max_remembered: int = 1 << 18,
    ) -> None:
        self.local = local
        self.layout = layout
        self.shared = shared
        self.lookup = lookup
        self.announcer = announcer
        self.stats = TierStats()
        self._max_remembered = max_remembered
        self._announced: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()

    # --- sizes of the local tier (what the engine's metrics report) -----------------------

    @property
    def num_bytes(self) -> int:
        return self.local.num_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.local.capacity_bytes

    def __len__(self) -> int:
        return len(self.local)

    # --- the KVStore protocol --------------------------------------------------------------

    def get(self, key: str) -> SegmentKV | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[SegmentKV | None]:
        """Entries for `keys` in order: local tier, then (one batch lookup) the shared tier."""
        found = [self.local.get(key) for key in keys]
        missing = [i for i, kv in enumerate(found) if kv is None]
        self._count(local_hits=len(keys) - len(missing))
        for i, kv in zip(missing, self._remote_many([keys[i] for i in missing]), strict=True):
            found[i] = kv
        self._count(misses=sum(kv is None for kv in found))
        return found

    def contains(self, key: str) -> bool:
        """In the local tier, or advertised in the shared tier (no load, no use); with no
        lookup server, held by the shared tier (Redis asked, no blob read)."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """`contains` of each key: the local tier, then one lookup (or, with no lookup
        server, one pipelined EXISTS in the shared tier) for the local misses."""
        found = self.local.contains_many(keys)
        missing = [i for i, is_local in enumerate(found) if not is_local]
        if not missing:
            return found
        wanted = [keys[i] for i in missing]
        if self.shared is not None and self.lookup is None:
            # `_in_shared` says "try it" for every key here, right for a load (a GET of a
            # missing key is a miss) but not for `contains`: callers skip computing and
            # storing what is "contained", so nothing would ever be stored.
            held = self.shared.contains_many(wanted)
        else:
            held = self._in_shared(wanted)
        for i, is_shared in zip(missing, held, strict=True):
            found[i] = is_shared
        return found

    def put(self, kv: SegmentKV) -> bool:
        """Store in the local and shared tiers, then admit to the lookup server. A local
        tier that cannot write (a read-only or vanished directory) does not keep the
        segment from the shared tier."""
        is_local = self._put_local(kv)
        is_shared = self.shared is not None and self.shared.put_pieces(
            kv.key, kv_blob_pieces(kv, self.shared.deployment)
        )
        self._count(shared_stores=int(is_shared))
        if is_local or is_shared:
            self._announce(kv, is_shared)
        return is_local or is_shared

    # --- remote reads ---------------------------------------------------------------------

    def _remote_many(self, keys: Sequence[str]) -> list[SegmentKV | None]:
        if not keys or self.shared is None:
            return [None] * len(keys)
        return [
            self._load_shared(key) if is_advertised else None
            for key, is_advertised in zip(keys, self._in_shared(keys), strict=True)
        ]

    def _in_shared(self, keys: Sequence[str]) -> list[bool]:
        """Whether the shared tier should hold each key (all True with no lookup server)."""
        if self.shared is None:
            return [False] * len(keys)
        if self.lookup is None:
            return [True] * len(keys)
        return [loc is not None and loc.in_shared_tier for loc in self.lookup.lookup(keys)]

    def _load_shared(self, key: str) -> SegmentKV | None:
        assert self.shared is not None
        checked, is_answer = self.shared.load(self.layout.header(key), self.layout.other_dtypes)
        if checked is None:
            self._load_failed(key, is_gone=is_answer)
            return None
        kv = _payload_to_kv(*checked)
        self._count(shared_hits=1)
        if self._put_local(kv):
            self._announce(kv, shared=True)
        return kv

    def _put_local(self, kv: SegmentKV) -> bool:
        """`local.put`; False when the local tier cannot write (logged): the segment still
        goes to (or came from) the shared tier."""
        try:
            return self.local.put(kv)
        except OSError as error:
            log.warning("local KV tier failed to store %s: %s", kv.key, error)
            return False

    def _load_failed(self, key: str, is_gone: bool) -> None:
        """An advertised segment did not load: it is computed. When Redis said it is gone
        (evicted, corrupt, foreign), the lookup server stops advertising it (and remembers
        that, so the writer's resyncs do not advertise it again) and this pod forgets it
        held the copy; after a failed call it may still be there, and nothing is said."""
        if self.lookup is None:
            return  # nothing advertised it: a plain miss
        self._count(load_failures=1)
        if not is_gone:
            return
        with self._lock:  # this pod's resyncs no longer announce the copy
            entry = self._announced.get(key)
            if entry is not None and entry.shared:
                self._announced[key] = replace(entry, shared=False)
        if self.announcer is not None:
            self.announcer.evict(key, shared=True)

    def _count(self, **deltas: int) -> None:
        """Add to `stats`; under the lock, since the store is read and written from
        several threads (an `AsyncKVStore`'s reader and writer, the engine's) and an
        unlocked `+=` loses counts."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    # --- announcements --------------------------------------------------------------------

    def _announce(self, kv: SegmentKV, shared: bool) -> None:
        entry = Entry(
            key=kv.key,
            num_tokens=kv.num_tokens,
            model=kv.model_id,
            dtype=dtype_name(kv.k.dtype),
            context=None,  # the key already hashes the context; see segments.segment_key
            num_bytes=kv.num_bytes,
            shared=shared,
        )
        with self._lock:
            self._announced[kv.key] = entry
            self._announced.move_to_end(kv.key)
            while len(self._announced) > self._max_remembered:
                self._announced.popitem(last=False)
        if self.announcer is not None:
            self.announcer.admit(entry)

    def figures(self) -> dict[str, int]:
        """Every counter of the tiers and the lookup client (metrics, tests, the probe)."""
        stats, shared, lookup = self.stats, self.shared, self.lookup
        return {
            "local_hits": stats.local_hits,
            "shared_hits": stats.shared_hits,
            "misses": stats.misses,
            "load_failures": stats.load_failures,
            "shared_stores": stats.shared_stores,
            "shared_errors": shared.stats.errors if shared is not None else 0,
            "shared_bad_blobs": shared.stats.bad_blobs if shared is not None else 0,
            "lookup_failures": lookup.stats.failures if lookup is not None else 0,
            "lookup_degraded": lookup.stats.degraded_lookups if lookup is not None else 0,
        }

    def holdings(self) -> list[Entry]:
        """What this pod announces in a full resync: local segments and its shared copies."""
        with self._lock:
            remembered: Iterable[Entry] = list(self._announced.values())
        return [entry for entry in remembered if entry.shared or self.local.contains(entry.key)]

    def close(self) -> None:
        if self.announcer is not None:
            self.announcer.stop()
        for part in (self.lookup, self.shared):
            if part is not None:
                part.close()


@dataclass(frozen=True)
class TierSettings:
    """Where the tiers are; from blend.json (`kv`, `lookupServerUrl`) and the pod's env."""

    # Byte budget of the local tier.
    local_bytes: int
    # Shared tier URL (no password; that comes from the env), None: no shared tier.
    shared_url: str | None = None
    # Lookup server URL, None: no lookup server.
    lookup_url: str | None = None
    # "namespace/name" of the BlendDeployment (shared-tier key prefix).
    deployment: str = "default/holeblend"
    # This pod's name in the index.
    pod: str = ""
    # Lookup client timeouts and breaker; announcer periods.
    client: ClientConfig = ClientConfig()
    announcer: AnnouncerConfig = AnnouncerConfig()
    # Seconds one shared-tier command may take.
    shared_timeout_s: float = 2.0

    @classmethod
    def from_env(
        cls, local_bytes: int, shared_url: str | None, lookup_url: str | None, **more
    ) -> TierSettings:
        """Settings with the deployment and pod name the operator renders into the env."""
        deployment = os.environ.get(DEPLOYMENT_ENV) or "default/holeblend"
        return cls(local_bytes, shared_url, lookup_url, deployment, pod_name(), **more)


def pod_name() -> str:
    """This process's name towards the lookup server: host (the pod's name) and pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


def open_tiered_store(
    settings: TierSettings,
    layout: KVLayout,
    local: LocalTier | None = None,
    is_announcing: bool = True,
) -> TieredKVStore:
    """The store for these settings (over `local`, or a new local tier), its announcer
    started when there is a lookup server and `is_announcing` (a process that only looks
    up, such as vLLM's scheduler, announces nothing: its holdings are its workers')."""
    local = local if local is not None else LocalKVStore(settings.local_bytes)
    shared = None
    if settings.shared_url:
        config = SharedTierConfig(
            settings.shared_url, settings.deployment, settings.shared_timeout_s
        )
        shared = SharedTier(config)
    if not settings.lookup_url:
        return TieredKVStore(local, layout, shared)
    pod = settings.pod or pod_name()
    # Two connections: announcements never hold up a request's lookup.
    lookup = LookupClient(settings.lookup_url, settings.client, model=layout.model_id)
    announcing = LookupClient(settings.lookup_url, settings.client)
    store = TieredKVStore(local, layout, shared, lookup)
    if not is_announcing:
        return store
    store.announcer = Announcer(announcing, pod, store.holdings, settings.announcer).start()
    return store


class TierMetrics:
    """A Prometheus collector of `TieredKVStore` counters, read at scrape time; summed over
    the stores added (a vLLM engine-core process holds the scheduler's and the worker's)."""

    def __init__(self, *stores: TieredKVStore) -> None:
        self.stores = list(stores)

    def add(self, store: TieredKVStore) -> None:
        self.stores.append(store)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        figures = [store.figures() for store in self.stores]

        def total(name: str) -> int:
            return sum(f[name] for f in figures)

        hits = CounterMetricFamily(
            "holeblend_kv_tier_hits", "Segments found, by tier.", labels=["tier"]
        )
        hits.add_metric(["local"], total("local_hits"))
        hits.add_metric(["shared"], total("shared_hits"))
        yield hits
        for name, help_text, figure in (
            ("kv_tier_misses", "Segments found in no tier (computed).", "misses"),
            (
                "kv_load_failures",
                "Advertised shared-tier segments that did not load.",
                "load_failures",
            ),
            ("kv_shared_stores", "Segments written to the shared tier.", "shared_stores"),
            ("kv_shared_errors", "Shared-tier commands that failed or timed out.", "shared_errors"),
            (
                "kv_shared_bad_blobs",
                "Shared-tier blobs refused (corrupt, truncated, foreign).",
                "shared_bad_blobs",
            ),
            (
                "lookup_client_failures",
                "Lookup server calls that failed after retries, or that found the shared "
                "connection busy past their time budget.",
                "lookup_failures",
            ),
            (
                "lookup_client_degraded",
                "Lookups answered all-miss (server failed, breaker open, or the call out of time).",
                "lookup_degraded",
            ),
        ):
            counter = CounterMetricFamily(f"holeblend_{name}", help_text)
            counter.add_metric([], total(figure))
            yield counter


def with_remote_tiers(engine, settings, local: LocalKVStore, registry=None):
    """`local`, or a `TieredKVStore` over it when blend.json names a shared tier or a lookup
    server (`settings`: the runtime's `BlendSettings`); its counters go to `registry`."""
    shared_url, lookup_url = settings.kv.shared_url, settings.lookup_server_url
    if not shared_url and not lookup_url:
        return local
    tiers = TierSettings.from_env(local.capacity_bytes, shared_url, lookup_url)
    layout = KVLayout.of(engine.config, engine.kv_dtype, dtype_name(engine.model.dtype))
    store = open_tiered_store(tiers, layout, local)
    if registry is not None:
        registry.register(TierMetrics(store))
    log.info(
        "KV tiers: local %d bytes, shared %s, lookup server %s",
        local.capacity_bytes,
        shared_url,
        lookup_url,
    )
    return store
