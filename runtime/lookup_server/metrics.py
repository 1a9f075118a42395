"""Prometheus metrics of the lookup server, on its own registry.

Index sizes, the lookup/hit counters and the shared calibration's pair counts are read
from the server's `stats()` at scrape time (no work on the hot path); request latency is
a histogram per operation; every error reply is counted by a fixed code: the wire error
code, or the server's own for framing, limits, timeouts, unknown paths, wrong methods and
internal errors. Never the path or other client text, so the label's values stay few.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from holeblend_runtime.lookup_server.wire import ERROR_CODES as WIRE_ERROR_CODES
from holeblend_runtime.lookup_server.wire import OPS

# Lookups answer in tens of microseconds; the buckets resolve that range.
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25)
# Every code an error is counted under: the wire error codes, then the server's own.
# Each is exported from the start, at 0 until counted, so a rate over it reads 0 (not
# "no data") and an alert on it can fire on the first error.
ERROR_CODES = (
    *WIRE_ERROR_CODES,
    "bad_http",
    "header_timeout",
    "body_timeout",
    "write_timeout",
    "write_budget",
    "memory_budget",
    "connection_limit",
    "not_found",
    "method_not_allowed",
    "internal",
)


class _StatsCollector:
    """The server's `stats()` (the index's and the shared calibration's), read at scrape."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.stats = stats

    def collect(self):
        stats = self.stats()
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
        yield _gauge(
            "holeblend_lookup_calibration_pairs",
            "Quality-proxy calibration pairs held for the pods (all scopes).",
            stats["calibration_pairs"],
        )
        for name, help_text in (
            ("lookups", "Keys looked up."),
            ("hits", "Keys found."),
            ("admits", "Segments admitted by pods."),
            ("resynced", "Segment entries pods announced again in resyncs (nothing new stored)."),
            ("evicts", "Segments evicted by pods."),
            ("capacity_evictions", "Segments dropped to stay within the index capacity."),
            ("pods_dropped", "Pods dropped after they stopped heartbeating."),
            ("calibration_pairs_added", "Quality-proxy calibration pairs pods published."),
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

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats))
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
            "Error replies (and connections dropped), by code.",
            ["code"],
            registry=self.registry,
        )
        for code in ERROR_CODES:
            self._errors.labels(code)

    def observe(self, op: str, seconds: float) -> None:
        self._latency[op].observe(seconds)

    def count_error(self, code: str) -> None:
        self._errors.labels(code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
