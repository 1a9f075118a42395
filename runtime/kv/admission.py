"""Which segments a full KV tier takes in: least-recently-used eviction, with or without
frequency-aware admission.

RAG traffic asks for a few documents far more often than the rest (Zipf popularity). A
tier that holds part of the corpus and stores every miss (plain LRU) lets each rarely used
document push a popular one out, which then comes back as a hole. With frequency admission
(the TinyLFU rule), a segment that would evict others is admitted only if it was asked for
more often, recently, than every entry it would evict; otherwise the tier keeps what it
holds and the new segment is refused (its request has already computed it; nothing is
lost). While the tier has room every segment is admitted, so a cold tier fills as before.

"Recently": every use (a hit served, a store offered) adds one to the key's count, and
every `SAMPLE_FACTOR` x (entries held) uses all counts are halved (at least every
`MIN_SAMPLE`), so a document that stopped being asked for loses its advantage within a few
such periods and the tier follows a change of popularity. Counts of keys that fall to zero
are dropped: memory is bounded by the keys used within about one period.

Replayed on the vLLM load benchmark's stream (40 documents of 200-260 tokens, 8 per
request, Zipf 1.1, a tier holding half the corpus; tests/runtime/test_kv_admission.py):
plain LRU served 0.68-0.70 of the document tokens from the tier, frequency admission
0.77-0.78 (docs/shared-tier.md).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from holeblend_contract.blend_settings import Admission

# Uses per halving period, per entry the tier holds (Caffeine's TinyLFU uses 10 x its
# maximum size), and the least period.
SAMPLE_FACTOR = 10
MIN_SAMPLE = 100


class FrequencyAdmission:
    """Recent use counts of segment keys and the admission rule over them; thread-safe
    (a store's reads and writes run on different threads)."""

    def __init__(self, sample_factor: int = SAMPLE_FACTOR, min_sample: int = MIN_SAMPLE) -> None:
        if sample_factor < 1 or min_sample < 1:
            raise ValueError(
                f"sample_factor and min_sample: must be >= 1, got {sample_factor}, {min_sample}"
            )
        self.sample_factor = sample_factor
        self.min_sample = min_sample
        self._counts: Counter[str] = Counter()
        self._uses = 0
        self._lock = threading.Lock()

    def record(self, key: str, num_entries: int) -> None:
        """One use of `key` (a hit served or a store offered) by a tier holding
        `num_entries` entries."""
        with self._lock:
            self._counts[key] += 1
            self._uses += 1
            if self._uses >= max(self.min_sample, self.sample_factor * num_entries):
                self._halve()

    def count(self, key: str) -> int:
        with self._lock:
            return self._counts[key]

    def admits(self, key: str, victims: Iterable[str]) -> bool:
        """Whether `key` may evict `victims`: it was used more often than each of them."""
        with self._lock:
            count = self._counts[key]
            return all(count > self._counts[victim] for victim in victims)

    def _halve(self) -> None:
        self._uses = 0
        for key, count in list(self._counts.items()):
            if count > 1:
                self._counts[key] = count // 2
            else:
                del self._counts[key]


def admission_policy(admission: Admission | str) -> FrequencyAdmission | None:
    """The policy object a store uses for blend.json's `kv.admission` (None: admit all)."""
    admission = Admission(admission)
    return FrequencyAdmission() if admission is Admission.FREQUENCY else None


class _RefusingStore(Protocol):
    @property
    def num_refused(self) -> int: ...


class AdmissionMetrics:
    """A Prometheus collector of the segments stores' admission rules kept out, read at
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
