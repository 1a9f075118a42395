"""Which segments a full KV tier keeps: least-recently-used eviction, with or without
frequency-aware admission.

RAG traffic asks for a few documents far more often than the rest (Zipf popularity). A
tier that holds part of the corpus and stores every miss (plain LRU) lets each rarely used
document push a popular one out, which then comes back as a hole. Frequency admission
keeps the popular ones, in the way of W-TinyLFU (Caffeine's policy):

1. The tier's most recently used bytes, a `window` (a share of its capacity), take in
   every new segment, as plain LRU does: a document asked for again soon after (the next
   turn of a conversation, the question sent again with its hole filled) is there.
2. When a new segment pushes the window's oldest entries out of it, they meet the oldest
   entries of the rest (the main part): each candidate stays only if it was asked for
   more often, recently, than every entry it would evict; otherwise the candidates go and
   the main part keeps what it holds (counted as refused). A segment that fits in the
   bytes the window leaves free (its newest entry alone is larger than the window, or the
   next older entry did not fit) pushes nothing out: it is taken in, and the main part's
   oldest make room as in plain LRU. A segment larger than the window meets the main
   part's oldest itself and may be refused (not written; its request has already
   computed it, nothing is lost). While the tier has room every segment is taken in.
3. "Recently": every use (a hit served, a store offered) adds one to the key's count, and
   every `SAMPLE_FACTOR` x (entries held) uses (at least `MIN_SAMPLE`), a period, all
   counts are halved, so a document that stopped being asked for loses its advantage
   within a few periods and the tier follows a change of popularity. Counts that fall to
   zero are dropped: memory is bounded by the keys used within about one period.
4. The window's share adapts: at the end of each period it moves by a step in the
   direction that last raised the share of uses that were hits (hill climbing, from 20 %,
   the step shrinking from 0.1 to 0.01 and starting again when the hit share jumps by
   more than 0.1). A popularity-driven stream drives it towards 0 (the plain TinyLFU rule),
   a stream of short-lived documents towards a large window (nearly LRU).

Without the window (the first version of this rule), a stream whose documents are each
used a few times in a row and never again locked the tier: once full, every new document
(one use) lost to old ones (two uses), so nothing new was stored and every later request
missed (found live in the closed-loop benchmark: the tier stopped taking segments within
minutes). Replayed (tests/runtime/test_kv_admission.py), the share of document tokens
served from a tier: the vLLM load benchmark's Zipf stream (40 documents, 8 per request,
half the corpus fits) plain LRU 0.68-0.70, the unwindowed rule 0.77-0.78, this rule
0.71-0.76; a stream of questions whose 4 documents come twice in a row then never again,
LRU 0.43, the unwindowed rule 0.02, this rule 0.42 (0.38 after 1,000 Zipf requests first).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

from holeblend_contract.blend_settings import Admission

# Uses per halving period, per entry the tier holds (Caffeine's TinyLFU uses 10 x its
# maximum size), and the least period.
SAMPLE_FACTOR = 10
MIN_SAMPLE = 100
# The window (module doc): its share of the tier's bytes at start and at most; the climb's
# first step, its decay per period and its least step; a fall of the hit share within
# HIT_SHARE_NOISE does not turn the climb, and a change beyond RESTART_CHANGE restarts it
# with the first step (a new workload).
WINDOW_SHARE = 0.2
MAX_WINDOW_SHARE = 0.8
WINDOW_STEP = 0.1
STEP_DECAY = 0.9
MIN_WINDOW_STEP = 0.01
HIT_SHARE_NOISE = 0.02
RESTART_CHANGE = 0.1


class FrequencyAdmission:
    """Recent use counts of segment keys, the admission rule over them and the window's
    size; thread-safe (a store's reads and writes run on different threads).

    `adaptive`: at the end of every period the window moves in the direction that last
    raised the share of uses that were hits (hill climbing, `_adapt`); else it stays at
    `window_share`."""

    def __init__(
        self,
        sample_factor: int = SAMPLE_FACTOR,
        min_sample: int = MIN_SAMPLE,
        window_share: float = WINDOW_SHARE,
        adaptive: bool = True,
    ) -> None:
        if sample_factor < 1 or min_sample < 1:
            raise ValueError(
                f"sample_factor and min_sample: must be >= 1, got {sample_factor}, {min_sample}"
            )
        if not 0 <= window_share <= MAX_WINDOW_SHARE:
            raise ValueError(
                f"window_share: must be within [0, {MAX_WINDOW_SHARE}], got {window_share}"
            )
        self.sample_factor = sample_factor
        self.min_sample = min_sample
        self.window_share = window_share
        self.adaptive = adaptive
        self._counts: Counter[str] = Counter()
        self._uses = 0
        self._hits = 0
        self._last_hit_share: float | None = None
        self._direction = -1.0  # first move: a smaller window (more frequency)
        self._step = WINDOW_STEP
        self._lock = threading.Lock()

    def record(self, key: str, num_entries: int, hit: bool = False) -> None:
        """One use of `key` by a tier holding `num_entries` entries: a hit served
        (`hit`), or a store offered after a miss."""
        with self._lock:
            self._counts[key] += 1
            self._uses += 1
            self._hits += hit
            if self._uses >= max(self.min_sample, self.sample_factor * num_entries):
                if self.adaptive:
                    self._adapt(self._hits / self._uses)
                self._halve()

    def count(self, key: str) -> int:
        with self._lock:
            return self._counts[key]

    def admits(self, key: str, victims: Iterable[str]) -> bool:
        """Whether `key` may evict `victims`: it was used more often than each of them."""
        with self._lock:
            count = self._counts[key]
            return all(count > self._counts[victim] for victim in victims)

    def evictions(
        self,
        entries: Sequence[tuple[str, int]],
        num_bytes: int,
        new: tuple[str, int],
        capacity_bytes: int,
    ) -> tuple[list[str], list[str]] | None:
        """`windowed_evictions` with this policy's window (`window_share` of the tier)."""
        window = int(self.window_share * capacity_bytes)
        return windowed_evictions(self, entries, num_bytes, new, capacity_bytes, window)

    def _adapt(self, hit_share: float) -> None:
        """Hill climbing on the share of uses that were hits: keep moving the window while
        it does not fall, turn when it does or at a bound; the step shrinks each period (a
        settled climb stays near its best) and starts again where the share jumped."""
        last = self._last_hit_share
        step = self._step
        if last is not None and abs(hit_share - last) > RESTART_CHANGE:
            step = WINDOW_STEP
        if last is not None and hit_share < last - HIT_SHARE_NOISE:
            self._direction = -self._direction
        self._last_hit_share = hit_share
        self._step = max(MIN_WINDOW_STEP, step * STEP_DECAY)
        share = self.window_share + self._direction * step
        if not 0 < share < MAX_WINDOW_SHARE:  # at a bound: the next move goes back
            self._direction = -self._direction
        self.window_share = round(min(MAX_WINDOW_SHARE, max(0.0, share)), 4)

    def _halve(self) -> None:
        self._uses = self._hits = 0
        for key, count in list(self._counts.items()):
            if count > 1:
                self._counts[key] = count // 2
            else:
                del self._counts[key]


def windowed_evictions(
    policy: FrequencyAdmission,
    entries: Sequence[tuple[str, int]],
    num_bytes: int,
    new: tuple[str, int],
    capacity_bytes: int,
    window_bytes: int,
) -> tuple[list[str], list[str]] | None:
    """What a full tier evicts to take `new` (key, bytes) in, under the windowed rule
    (module doc): (evicted keys, of which the window's losers), or None when `new` itself
    is refused (it is larger than the window and lost to main's victims). `entries`
    (key, bytes) least recently used first, without `new`'s key."""
    key, size = new
    if num_bytes + size <= capacity_bytes:
        return [], []
    victims = lru_victims(entries, num_bytes, size, capacity_bytes)
    candidates = _pushed_out_of_window(entries, size, window_bytes)
    if candidates is None:  # larger than the window: `new` contends with main itself
        return (victims, []) if policy.admits(key, victims) else None
    if not candidates:  # `new` fits the window's free bytes: main's LRU makes room
        return victims, []
    leaving = set(candidates)
    if leaving & set(victims) or all(policy.admits(candidate, victims) for candidate in candidates):
        return victims, []
    # The window's oldest lose to main's: they go, and as much of main as still needs to.
    sizes = dict(entries)
    freed = sum(sizes[c] for c in candidates)
    rest = [(k, b) for k, b in entries if k not in leaving]
    more = lru_victims(rest, num_bytes - freed, size, capacity_bytes)
    return [*candidates, *more], list(candidates)


def _pushed_out_of_window(
    entries: Sequence[tuple[str, int]], new_bytes: int, window_bytes: int
) -> list[str] | None:
    """The window's oldest entries that a new entry of `new_bytes` pushes out of it (the
    window: the most recently used entries, newest first, up to the first that would take
    it past `window_bytes`); empty when the new entry fits the bytes the window leaves
    free (the newest entry alone is larger than the window, or the window is not full),
    None when the new entry alone exceeds the window."""
    if new_bytes > window_bytes:
        return None
    window, used = [], 0
    for key, size in reversed(entries):  # most recent first
        if used + size > window_bytes:
            break
        window.append((key, size))
        used += size
    pushed = []
    while window and used + new_bytes > window_bytes:
        key, size = window.pop()  # the oldest left in the window
        pushed.append(key)
        used -= size
    return pushed


def lru_victims(
    entries: Iterable[tuple[str, int]], num_bytes: int, new_bytes: int, capacity_bytes: int
) -> list[str]:
    """The keys evicted, least recently used first, to fit `new_bytes` more into a tier
    holding `num_bytes` of `capacity_bytes`; `entries` (key, bytes) oldest first."""
    victims: list[str] = []
    for key, size in entries:
        if num_bytes + new_bytes <= capacity_bytes:
            break
        victims.append(key)
        num_bytes -= size
    return victims


def admission_policy(admission: Admission | str) -> FrequencyAdmission | None:
    """The policy object a store uses for blend.json's `kv.admission` (None: admit all)."""
    admission = Admission(admission)
    return FrequencyAdmission() if admission is Admission.FREQUENCY else None


class _RefusingStore(Protocol):
    @property
    def num_refused(self) -> int: ...


class AdmissionMetrics:
    """A Prometheus collector of the segments stores' admission rules kept out (and, for
    the node directory, the writes that failed and the corrupt files it removed), read at
    scrape time and summed over the stores added."""

    def __init__(self, *stores: _RefusingStore) -> None:
        self.stores = list(stores)

    def add(self, store: _RefusingStore) -> None:
        self.stores.append(store)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        refused = CounterMetricFamily(
            "holeblend_kv_store_refused",
            "Segments the pod's own KV tier did not take in: it was full of segments used "
            "more often (spec.blend.kv.admission frequency)",
        )
        refused.add_metric([], sum(store.num_refused for store in self.stores))
        yield refused
        # The node directory's own troubles (vLLM pods; holeblend-serve's in-process tier
        # has neither): files it could not write, files it found unreadable.
        for name, help_text, figure in (
            (
                "holeblend_kv_store_write_failures",
                "Segments the pod's own KV tier could not write: its volume full even "
                "after evicting older files, or its directory removed or unwritable (the "
                "shared tier still takes them)",
                "num_write_failures",
            ),
            (
                "holeblend_kv_store_corrupt",
                "Files of the pod's own KV tier that could not be read: removed, and the "
                "segment computed instead",
                "num_corrupt",
            ),
        ):
            counted = [store for store in self.stores if hasattr(store, figure)]
            if counted:
                family = CounterMetricFamily(name, help_text)
                family.add_metric([], sum(getattr(store, figure) for store in counted))
                yield family
