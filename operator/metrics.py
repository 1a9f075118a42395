"""The operator's own Prometheus metrics (served on /metrics next to /healthz)."""

import threading
import time

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

RECONCILES = Counter(
    "holeblend_operator_reconciles_total",
    "Reconciles of a BlendDeployment, by what triggered them and how they ended.",
    ["trigger", "result"],
)
RECONCILE_SECONDS = Histogram(
    "holeblend_operator_reconcile_duration_seconds",
    "Wall time of one reconcile, API round trips included.",
    ["trigger"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CHILD_WRITES = Counter(
    "holeblend_operator_child_writes_total",
    "Child objects created, patched, left unchanged (no-op) or deleted.",
    ["kind", "action"],
)
STATUS_WRITES = Counter(
    "holeblend_operator_status_writes_total",
    "BlendDeployment status patches actually sent (unchanged status is not written).",
)
API_REQUESTS = Counter(
    "holeblend_operator_api_requests_total",
    "Kubernetes API requests by verb, resource and HTTP status (0: no answer).",
    ["verb", "resource", "code"],
)


class TuningSeries:
    """The tuner's series per BlendDeployment, kept as plain numbers and exposed when scraped.

    As labelled prometheus_client metrics, each series would be an object with its own lock
    and value object, about 0.7 KB, six per tuned BlendDeployment (4.4 KB each, and 18 MB at
    5,000): here a BlendDeployment costs a tuple of five numbers and a count per decision
    kind. Exposed exactly as those metrics were: the same names, help, types and labels."""

    GAUGES = (
        (
            "holeblend_operator_tuned_ratio",
            "The recompute ratio the tuner last decided, by BlendDeployment.",
        ),
        (
            "holeblend_operator_tuning_min_ratio",
            "spec.tuning.minRatio, by BlendDeployment (for the pinned-at-a-bound alert).",
        ),
        (
            "holeblend_operator_tuning_max_ratio",
            "spec.tuning.maxRatio, by BlendDeployment (for the pinned-at-a-bound alert).",
        ),
        (
            "holeblend_operator_tuning_target_f1_proxy",
            "spec.tuning.targetF1Proxy, by BlendDeployment (drawn against the proxies).",
        ),
        (
            "holeblend_operator_tuning_inline_proxy",
            "1 while the tuner acts on the engine's inline quality proxy (the shadow gave "
            "fewer than minSamples in the window), 0 on shadow samples, by BlendDeployment.",
        ),
    )
    DECISIONS = (
        "holeblend_operator_tuning_decisions",
        "Recompute-ratio tuner decisions by BlendDeployment, direction (up, down, hold) and reason.",
    )

    def __init__(self):
        self._lock = threading.Lock()  # /metrics may be served from another thread
        self._gauges: dict[tuple[str, str], tuple[float, ...]] = {}
        # (namespace, name) -> (direction, reason) -> [count, created (epoch s)]
        self._decisions: dict[tuple[str, str], dict[tuple[str, str], list[float]]] = {}

    def record(self, key: tuple[str, str], direction: str, reason: str, gauges: tuple) -> None:
        """One decision: count it; the tuned ratio, min and max ratio, target F1 proxy and
        whether it read the inline proxy (GAUGES' order)."""
        with self._lock:
            self._gauges[key] = tuple(float(value) for value in gauges)
            counts = self._decisions.setdefault(key, {})
            count = counts.setdefault((direction, reason), [0.0, time.time()])
            count[0] += 1

    def forget(self, key: tuple[str, str], decisions: bool = True) -> None:
        """A BlendDeployment deleted: its series go (only its gauges if not `decisions`: one
        no longer tuned keeps the count of its past decisions)."""
        with self._lock:
            self._gauges.pop(key, None)
            if decisions:
                self._decisions.pop(key, None)

    def describe(self):
        return [*self._gauge_families({}), self._decision_family({})]

    def collect(self):
        with self._lock:
            gauges = dict(self._gauges)
            decisions = {
                key: {k: tuple(v) for k, v in d.items()} for key, d in self._decisions.items()
            }
        return [*self._gauge_families(gauges), self._decision_family(decisions)]

    def collect_decisions(self):
        """The decision counter alone (a prometheus_client Counter's collect())."""
        with self._lock:
            decisions = {
                key: {k: tuple(v) for k, v in d.items()} for key, d in self._decisions.items()
            }
        return [self._decision_family(decisions)]

    def _gauge_families(self, gauges: dict) -> list:
        families = []
        for index, (name, documentation) in enumerate(self.GAUGES):
            family = GaugeMetricFamily(name, documentation, labels=["namespace", "name"])
            for key, values in gauges.items():
                family.add_metric(list(key), values[index])
            families.append(family)
        return families

    def _decision_family(self, decisions: dict):
        family = CounterMetricFamily(
            *self.DECISIONS, labels=["namespace", "name", "direction", "reason"]
        )
        for key, counts in decisions.items():
            for (direction, reason), (count, created) in counts.items():
                family.add_metric([*key, direction, reason], count, created=created)
        return family


class _Decisions:
    """TUNING_DECISIONS, read as the Counter it was (tests sum its samples)."""

    def collect(self):
        return TUNING.collect_decisions()


TUNING = TuningSeries()
REGISTRY.register(TUNING)
TUNING_DECISIONS = _Decisions()
