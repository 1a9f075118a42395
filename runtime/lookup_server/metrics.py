"""Prometheus metrics of the lookup server, on its own registry.

Index sizes and the lookup/hit counters are read from the index at scrape time (no
work on the hot path); request latency is a histogram per operation; error replies are
counted by their wire error code.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from holeblend_runtime.lookup_server.index import SegmentIndex
from holeblend_runtime.lookup_server.wire import OPS

# Lookups answer in tens of microseconds; the buckets resolve that range.
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25)


class _IndexCollector:
    def __init__(self, index: SegmentIndex) -> None:
        self.index = index

    def collect(self):
        stats = self.index.stats()
        yield _gauge("holeblend_lookup_index_entries", "Segments in the index.", stats["entries"])
        yield _gauge(
            "holeblend_lookup_index_bytes", "KV bytes of the indexed segments.", stats["bytes"]
        )
        yield _gauge("holeblend_lookup_pods", "Pods heartbeating to this server.", stats["pods"])
        yield _gauge(
            "holeblend_lookup_shared_entries",
            "Indexed segments in the shared tier.",
            stats["shared_entries"],
        )
        for name, help_text in (
            ("lookups", "Keys looked up."),
            ("hits", "Keys found."),
            ("admits", "Segments admitted by pods."),
            ("evicts", "Segments evicted by pods."),
            ("capacity_evictions", "Segments dropped to stay within the index capacity."),
            ("pods_dropped", "Pods dropped after they stopped heartbeating."),
        ):
            counter = CounterMetricFamily(f"holeblend_lookup_{name}", help_text)
            counter.add_metric([], stats[name])
            yield counter


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, help_text)
    gauge.add_metric([], value)
    return gauge


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, index: SegmentIndex) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_IndexCollector(index))
        latency = Histogram(
            "holeblend_lookup_request_seconds",
            "Time to answer one wire request, by operation.",
            ["op"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self._latency = {op: latency.labels(op) for op in OPS}
        self._errors = Counter(
            "holeblend_lookup_errors",
            "Error replies, by wire error code.",
            ["code"],
            registry=self.registry,
        )

    def observe(self, op: str, seconds: float) -> None:
        self._latency[op].observe(seconds)

    def count_error(self, code: str) -> None:
        self._errors.labels(code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
