"""The segment index of one BlendDeployment: which cached segments exist and where.

1. Pods `admit` segments after storing them (in their local tier and/or the shared tier)
   and `evict` them when they drop them; `lookup` answers hit flags and locations.
2. A segment lives while some pod holds it or the shared tier does; the index keeps
   at most `max_entries` segments and `max_bytes` of their KV, dropping the least
   recently used (admitted or hit) first. A segment larger than `max_bytes` on its own
   is not indexed: making room for it would drop every other segment, then it.
3. Pods heartbeat. A pod whose full announcement (a `resync` with `reset`) the index has
   not had since it started or dropped the pod is told to resync, on every heartbeat until
   that announcement arrives: it re-announces everything it holds, so a restarted server
   is whole again within one heartbeat period. Admits and evicts from such a pod are
   indexed but do not count as its announcement (after a restart a pod's first message
   is often an admit of a segment it just stored). A pod silent for `pod_timeout_s` is
   dropped with its locations; shared-tier copies outlive it.
4. An announcement ends with the pod's next message of another kind (the announcer sends
   its chunks back to back); what the pod held before and did not list again is dropped
   then. It is no use of the segments: they keep their place in the LRU order, and one the
   index does not hold (dropped for capacity) comes back as the least recently used, or
   every periodic resync would make a pod's segments newer than the ones just looked up.
5. A shared copy a pod reported gone (`evict` with `shared`) is remembered as gone (at
   most `max_shared_gone` keys): a resync that still lists it as shared (the writer does
   not know another pod found it gone) does not advertise it again. Only an `admit` with
   `shared`, sent after a pod wrote or loaded the copy, advertises it again.

Not thread-safe by design: one event loop owns it (the only writer), and lookups run
inline on that loop with no queue in front of them.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

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
    # Keys whose shared copies were reported gone that are remembered at most, oldest
    # forgotten first (about 12 MiB at 65,536). A forgotten one that a resync advertises
    # again costs one failed load, whose evict remembers it again.
    max_shared_gone: int = 1 << 16

    def __post_init__(self) -> None:
        for field in ("max_entries", "max_bytes", "max_shared_gone"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}: must be >= 1, got {getattr(self, field)}")
        if not 0 < self.pod_timeout_s < math.inf:
            # NaN or inf would keep every silent pod (and its locations) for good.
            raise ValueError(f"pod_timeout_s: must be > 0 and finite, got {self.pod_timeout_s}")


class SegmentIndex:
    def __init__(
        self, limits: IndexLimits | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits or IndexLimits()
        self._clock = clock
        self._entries: OrderedDict[str, IndexEntry] = OrderedDict()
        self._pod_keys: dict[str, set[str]] = {}
        self._pod_seen: dict[str, float] = {}
        # Pods whose full announcement (resync with reset) arrived since they were last
        # unknown: the others are told to resync on every heartbeat.
        self._synced: set[str] = set()
        # Per pod whose full announcement is under way: the keys it held before and has
        # not listed again yet (dropped from its locations when the announcement ends).
        self._unlisted: dict[str, set[str]] = {}
        # Keys whose shared copies a pod reported gone, oldest first (values unused).
        self._shared_gone: OrderedDict[str, None] = OrderedDict()
        self.num_bytes = 0
        # Entries in the shared tier, kept up to date on every change so `stats` (the
        # /stats endpoint, every /metrics scrape) costs the same at any index size.
        self.num_shared = 0
        # `admits` counts the entries of admits (segments pods just stored); `resynced` those
        # of resyncs, which re-announce what pods hold already: no new stores.
        self.counters = dict.fromkeys(
            (
                "lookups",
                "hits",
                "admits",
                "resynced",
                "evicts",
                "capacity_evictions",
                "pods_dropped",
            ),
            0,
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
        """Record that `pod` stored `entries` (locally and/or in the shared tier).

        An entry with `shared` is a copy the pod just wrote or loaded: it is advertised even
        if a shared copy of that key was reported gone before. An admit does not make an
        unknown pod synced: its heartbeats still ask it to resync.
        """
        self._end_resync(pod)
        return self._admit(pod, entries, is_resync=False)

    def _admit(self, pod: str, entries: Iterable[Entry], is_resync: bool) -> int:
        self.touch_pod(pod)
        now = self._clock()
        pod_keys = self._pod_keys[pod]
        shared_gone = self._shared_gone
        unlisted = self._unlisted.get(pod) if is_resync else None
        num = 0
        for item in entries:
            if item.num_bytes > self.limits.max_bytes:
                # Counted when admitted: each resync lists it again, and is no new store.
                self.counters["capacity_evictions"] += not is_resync
                continue
            if item.shared and shared_gone:
                if is_resync:
                    if item.key in shared_gone:
                        item = replace(item, shared=False)  # remembered, not written anew
                else:
                    shared_gone.pop(item.key, None)
            entry = self._upsert(item, now, is_use=not is_resync)
            if unlisted is not None:
                unlisted.discard(item.key)
            entry.pods.add(pod)
            pod_keys.add(item.key)
            num += 1
        self.counters["resynced" if is_resync else "admits"] += num
        self._enforce_capacity()
        return num

    def evict(self, pod: str, keys: Iterable[str], shared: bool = False) -> int:
        """`pod` dropped `keys`; with `shared`, their shared-tier copies are gone too (and
        remembered as gone, so that a resync does not advertise them again)."""
        self._end_resync(pod)
        self.touch_pod(pod)
        pod_keys = self._pod_keys[pod]
        num = 0
        for key in keys:
            if shared:
                self._remember_shared_gone(key)
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
        """Note that `pod` is alive; True when it must resync: its full announcement has not
        arrived since this index started or dropped it."""
        self._end_resync(pod)
        self.touch_pod(pod)
        return pod not in self._synced

    def resync(self, pod: str, entries: Sequence[Entry], reset: bool) -> int:
        """A chunk of `pod`'s full announcement; `reset` (the first chunk) starts it and
        makes the pod synced. What the pod held before and no chunk lists again is dropped
        when the announcement ends (`_end_resync`). Shared copies reported gone stay
        unadvertised."""
        if reset:
            self._end_resync(pod)
            self.touch_pod(pod)
            self._synced.add(pod)
            self._unlisted[pod] = set(self._pod_keys[pod])
        return self._admit(pod, entries, is_resync=True)

    def _end_resync(self, pod: str) -> None:
        """End `pod`'s full announcement, if one is under way: drop the locations it did
        not list again (a segment only it held goes, shared copies stay)."""
        unlisted = self._unlisted.pop(pod, None)
        if not unlisted:
            return
        pod_keys = self._pod_keys[pod]
        for key in unlisted:
            pod_keys.discard(key)
            entry = self._entries.get(key)
            if entry is not None:
                entry.pods.discard(pod)
                self._drop_if_unheld(key, entry)

    def touch_pod(self, pod: str) -> None:
        self._pod_seen[pod] = self._clock()
        self._pod_keys.setdefault(pod, set())

    def forget_pod(self, pod: str) -> None:
        """Drop `pod` and its locations; segments only it held go, shared copies stay."""
        self._pod_seen.pop(pod, None)
        self._synced.discard(pod)
        self._unlisted.pop(pod, None)
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

    def _upsert(self, item: Entry, now: float, is_use: bool) -> IndexEntry:
        entry = self._entries.get(item.key)
        if entry is None:
            entry = IndexEntry(item, now)
            self._entries[item.key] = entry
            if not is_use:
                self._entries.move_to_end(item.key, last=False)
            self.num_bytes += entry.num_bytes
            self.num_shared += entry.shared
            return entry
        if item.shared and not entry.shared:
            entry.shared = True
            self.num_shared += 1
        if is_use:
            entry.last_use = now
            self._entries.move_to_end(item.key)
        return entry

    def _remember_shared_gone(self, key: str) -> None:
        shared_gone = self._shared_gone
        shared_gone[key] = None
        shared_gone.move_to_end(key)
        while len(shared_gone) > self.limits.max_shared_gone:
            shared_gone.popitem(last=False)

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
