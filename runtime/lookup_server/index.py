"""The segment index of one BlendDeployment: which cached segments exist and where.

1. Pods `admit` segments after storing them (in their local tier and/or the shared tier)
   and `evict` them when they drop them; `lookup` answers hit flags and locations.
2. A segment lives while some pod holds it or the shared tier does; the index keeps
   at most `max_entries` segments and `max_bytes` of their KV, dropping the least
   recently used (admitted or hit) first.
3. Pods heartbeat. A pod the index does not know (it restarted, or this server did) is
   told to resync: it re-announces everything it holds, so a restarted server is whole
   again within one heartbeat period. A pod silent for `pod_timeout_s` is dropped with
   its locations; shared-tier copies outlive it.

Not thread-safe by design: one event loop owns it (the only writer), and lookups run
inline on that loop with no queue in front of them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from holeblend_runtime.lookup_server.wire import Entry


class IndexEntry:
    """One segment in the index (mutable: locations and last use change)."""

    __slots__ = (
        "context",
        "dtype",
        "last_use",
        "model",
        "num_bytes",
        "num_tokens",
        "pods",
        "shared",
    )

    def __init__(self, entry: Entry, now: float) -> None:
        self.num_tokens = entry.num_tokens
        self.model = entry.model
        self.dtype = entry.dtype
        self.context = entry.context
        self.num_bytes = entry.num_bytes
        self.shared = entry.shared
        self.pods: set[str] = set()
        self.last_use = now

    def location(self) -> list:
        """The wire form of a hit: [num_tokens, in_shared_tier, pods]."""
        return [self.num_tokens, self.shared, sorted(self.pods)]


@dataclass(frozen=True)
class IndexLimits:
    # Segments the index holds at most.
    max_entries: int = 1_000_000
    # Sum of the segments' KV bytes the index tracks at most.
    max_bytes: int = 1 << 50
    # Seconds without a heartbeat after which a pod and its locations are dropped.
    pod_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        for field in ("max_entries", "max_bytes"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}: must be >= 1, got {getattr(self, field)}")
        if self.pod_timeout_s <= 0:
            raise ValueError(f"pod_timeout_s: must be > 0, got {self.pod_timeout_s}")


class SegmentIndex:
    def __init__(
        self, limits: IndexLimits | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits or IndexLimits()
        self._clock = clock
        self._entries: OrderedDict[str, IndexEntry] = OrderedDict()
        self._pod_keys: dict[str, set[str]] = {}
        self._pod_seen: dict[str, float] = {}
        self.num_bytes = 0
        # Entries in the shared tier, kept up to date on every change so `stats` (the
        # /stats endpoint, every /metrics scrape) costs the same at any index size.
        self.num_shared = 0
        self.counters = dict.fromkeys(
            ("lookups", "hits", "admits", "evicts", "capacity_evictions", "pods_dropped"), 0
        )

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_pods(self) -> int:
        return len(self._pod_seen)

    # --- reads --------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str], model: str | None = None) -> list[list | None]:
        """Per key: None (miss) or [num_tokens, in_shared_tier, pods]; a hit is a use."""
        now = self._clock()
        entries = self._entries
        hits: list[list | None] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or (model is not None and entry.model != model):
                hits.append(None)
                continue
            entry.last_use = now
            entries.move_to_end(key)
            hits.append(entry.location())
        self.counters["lookups"] += len(keys)
        self.counters["hits"] += sum(hit is not None for hit in hits)
        return hits

    def get(self, key: str) -> IndexEntry | None:
        return self._entries.get(key)

    # --- writes -------------------------------------------------------------------------

    def admit(self, pod: str, entries: Iterable[Entry]) -> int:
        """Record that `pod` stored `entries` (locally and/or in the shared tier)."""
        self.touch_pod(pod)
        now = self._clock()
        pod_keys = self._pod_keys[pod]
        num = 0
        for item in entries:
            entry = self._upsert(item, now)
            entry.pods.add(pod)
            pod_keys.add(item.key)
            num += 1
        self.counters["admits"] += num
        self._enforce_capacity()
        return num

    def evict(self, pod: str, keys: Iterable[str], shared: bool = False) -> int:
        """`pod` dropped `keys`; with `shared`, their shared-tier copies are gone too."""
        self.touch_pod(pod)
        pod_keys = self._pod_keys[pod]
        num = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            num += key in pod_keys
            pod_keys.discard(key)
            entry.pods.discard(pod)
            if shared and entry.shared:
                entry.shared = False
                self.num_shared -= 1
            self._drop_if_unheld(key, entry)
        self.counters["evicts"] += num
        return num

    def heartbeat(self, pod: str) -> bool:
        """Note that `pod` is alive; True when it must resync (the index does not know it)."""
        is_known = pod in self._pod_seen
        self.touch_pod(pod)
        return not is_known

    def resync(self, pod: str, entries: Sequence[Entry], reset: bool) -> int:
        """A chunk of `pod`'s full announcement; `reset` forgets what it held before."""
        if reset:
            self.forget_pod(pod)
        return self.admit(pod, entries)

    def touch_pod(self, pod: str) -> None:
        self._pod_seen[pod] = self._clock()
        self._pod_keys.setdefault(pod, set())

    def forget_pod(self, pod: str) -> None:
        """Drop `pod` and its locations; segments only it held go, shared copies stay."""
        self._pod_seen.pop(pod, None)
        for key in self._pod_keys.pop(pod, ()):
            entry = self._entries.get(key)
            if entry is not None:
                entry.pods.discard(pod)
                self._drop_if_unheld(key, entry)

    def drop_silent_pods(self) -> list[str]:
        """Forget pods whose last heartbeat is older than the pod timeout."""
        deadline = self._clock() - self.limits.pod_timeout_s
        silent = [pod for pod, seen in self._pod_seen.items() if seen < deadline]
        for pod in silent:
            self.forget_pod(pod)
        self.counters["pods_dropped"] += len(silent)
        return silent

    def stats(self) -> dict:
        return {
            "entries": len(self._entries),
            "bytes": self.num_bytes,
            "pods": len(self._pod_seen),
            "shared_entries": self.num_shared,
            "max_entries": self.limits.max_entries,
            "max_bytes": self.limits.max_bytes,
            **self.counters,
        }

    # --- internals ----------------------------------------------------------------------

    def _upsert(self, item: Entry, now: float) -> IndexEntry:
        entry = self._entries.get(item.key)
        if entry is None:
            entry = IndexEntry(item, now)
            self._entries[item.key] = entry
            self.num_bytes += entry.num_bytes
            self.num_shared += entry.shared
            return entry
        if item.shared and not entry.shared:
            entry.shared = True
            self.num_shared += 1
        entry.last_use = now
        self._entries.move_to_end(item.key)
        return entry

    def _drop_if_unheld(self, key: str, entry: IndexEntry) -> None:
        if not entry.pods and not entry.shared:
            self._remove(key)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        self.num_bytes -= entry.num_bytes
        self.num_shared -= entry.shared
        for pod in entry.pods:
            self._pod_keys.get(pod, set()).discard(key)

    def _enforce_capacity(self) -> None:
        limits = self.limits
        while len(self._entries) > limits.max_entries or self.num_bytes > limits.max_bytes:
            self._remove(next(iter(self._entries)))
            self.counters["capacity_evictions"] += 1
