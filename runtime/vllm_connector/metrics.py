"""Prometheus metrics of the connector (`holeblend_` prefix), in their own registry.

The scheduler side records one observation per finished request (reuse figures planned
by the lookup, completed by the worker's outcome), the worker's blend time and the segments
the workers stored (from vLLM's connector stats). vLLM runs the scheduler in its engine-core
process, so `serve_metrics` exports this registry on its own port there
(`$HOLEBLEND_METRICS_PORT`), next to vLLM's own /metrics. What a worker records itself
(load and store failures, the store queue, its tiers' and admission counters) is in that
registry only at tensor parallel 1, where vLLM runs the worker in the engine-core process;
at tensor parallel > 1 the scheduler side counts the load and store failures from the
connector stats, and the store queue is absent (`StoreQueue`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from holeblend_runtime.kv.admission import AdmissionMetrics
from holeblend_runtime.kv.tiers import TierMetrics
from holeblend_runtime.quality.inline_proxy import InlineProxyMetrics
from holeblend_runtime.quality.shadow import ShadowMetrics

log = logging.getLogger(__name__)

METRICS_PORT_ENV = "HOLEBLEND_METRICS_PORT"
METRICS_HOST_ENV = "HOLEBLEND_METRICS_HOST"

REGISTRY = CollectorRegistry(auto_describe=True)
REQUESTS = Counter("holeblend_requests", "Requests by reuse mode", ["mode"], registry=REGISTRY)
PROMPT_TOKENS = Counter("holeblend_prompt_tokens", "Prompt tokens", registry=REGISTRY)
REUSED_TOKENS = Counter(
    "holeblend_reused_tokens", "Prompt tokens whose KV came from the cache", registry=REGISTRY
)
HOLE_TOKENS = Counter(
    "holeblend_hole_tokens", "Tokens of missing segments between reused ones", registry=REGISTRY
)
RECOMPUTED_TOKENS = Counter(
    "holeblend_recomputed_tokens",
    "Tokens the blend computed in every layer (selected, holes, separators)",
    registry=REGISTRY,
)
REJECTED_SEGMENTS = Counter(
    "holeblend_rejected_segments",
    "Planned segments whose KV was missing or unusable at load time (computed fresh)",
    registry=REGISTRY,
)
LOAD_FAILURES = Counter(
    "holeblend_load_failures",
    "Loads that failed; their blocks were reported to vLLM, which recomputes them",
    registry=REGISTRY,
)
STORE_FAILURES = Counter(
    "holeblend_store_failures",
    "Missing segments whose store failed (a future miss; the request is unaffected)",
    registry=REGISTRY,
)
STORED_SEGMENTS = Counter(
    "holeblend_stored_segments",
    "Missing segments stored, by where their KV came from: blend (the holes a load "
    "computed), forward (captured from vLLM's forward, no compute), computed (a forward "
    "pass of their own in canonical context); counted by the scheduler side from the workers' "
    "connector stats (tensor-parallel rank 0's)",
    ["source"],
    registry=REGISTRY,
)


class StoreQueue:
    """`holeblend_store_queue_segments`, read at scrape time from the store of the worker in
    this process (`set_function`); absent where no worker shares the process: the
    engine-core process at tensor parallel > 1, whose workers run in processes of their
    own, would otherwise export a 0 that reads as an empty queue."""

    NAME = "holeblend_store_queue_segments"
    HELP = (
        "Segments accepted for storing and not yet written (the writer thread's queue); "
        "lookups of other processes find a segment only once it is written"
    )

    def __init__(self) -> None:
        self._num_pending: Callable[[], int] | None = None

    def set_function(self, num_pending: Callable[[], int]) -> None:
        self._num_pending = num_pending

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.NAME, self.HELP)]

    def collect(self) -> list[GaugeMetricFamily]:
        if self._num_pending is None:
            return []
        return [GaugeMetricFamily(self.NAME, self.HELP, value=self._num_pending())]


STORE_QUEUE = StoreQueue()
REGISTRY.register(STORE_QUEUE)
LOOKUP_FAILURES = Counter(
    "holeblend_lookup_failures", "Lookups that failed and ran as a full miss", registry=REGISTRY
)
LOOKUP_LATE = Counter(
    "holeblend_lookup_late",
    "Lookups that missed their deadline; the request ran as a full miss",
    registry=REGISTRY,
)
BLEND_SECONDS = Histogram(
    "holeblend_blend_seconds", "Worker time to blend and write one request's KV", registry=REGISTRY
)
RECOMPUTE_RATIO = Gauge(
    "holeblend_recompute_ratio", "The recompute ratio in force", registry=REGISTRY
)
SHADOW_STEPS = Counter(
    "holeblend_shadow_steps",
    "vLLM steps in which the shadow requests yielded (scheduler.py): paused (a user request "
    "needed the step), chunked (a shadow prefilled at most shadowChunkTokens beside decoding "
    "user requests), alone (only shadows ran, the step capped at shadowChunkTokens), "
    "preempted (shadows whose KV blocks a user request needed)",
    ["action"],
    registry=REGISTRY,
)
# The quality proxies of the shadow full prefill (shadow.py) and the inline proxy
# (quality/inline_proxy.py), as holeblend-serve exports them.
SHADOW = ShadowMetrics(REGISTRY)
INLINE = InlineProxyMetrics(REGISTRY)
# Shared tier and lookup server counters of this process's connectors (scheduler, worker).
TIERS = TierMetrics()
REGISTRY.register(TIERS)
# Segments the workers' node directory refused (kv.admission).
ADMISSION = AdmissionMetrics()
REGISTRY.register(ADMISSION)


def serve_metrics() -> int | None:
    """Export the registry on `$HOLEBLEND_METRICS_PORT` if set, on `$HOLEBLEND_METRICS_HOST`
    (default 0.0.0.0; the operator sets "::" with --pod-listen-address ::, one IPv6 socket
    that takes IPv4 too where net.ipv6.bindv6only is 0, as vLLM's own); the port or None."""
    port = os.environ.get(METRICS_PORT_ENV)
    if not port:
        return None
    try:
        start_http_server(int(port), os.environ.get(METRICS_HOST_ENV, "0.0.0.0"), REGISTRY)
    except (OSError, ValueError) as error:
        log.warning("cannot export holeblend metrics on port %s: %s", port, error)
        return None
    return int(port)


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    """The current value of a counter or gauge sample (tests, the benchmark)."""
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0
