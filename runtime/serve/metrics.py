"""The engine's Prometheus series (listed in docs/serving.md, "Metrics"; `holeblend_` prefix).

One registry per server, so two servers in one process (tests) never share series.
Labels: `mode` is the engine mode a request ran in (`full`, `prefix`, `hole`); `outcome` is
`ok`, `bad_request`, `rejected` (queue full or draining), `timeout`, `cancelled` (the client
went away) or `error`. The prompt-side token counters and `holeblend_kv_deviation` count
completed prefills only; `holeblend_completion_tokens` counts the tokens of the answers as
the routes end them (`usage.completion_tokens`, the end-of-sequence token an answer ended
at included, as vLLM counts it), not the tokens decoded past a stop sequence.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from holeblend_runtime.engine import Prefill

# Seconds: from a few ms (a pure hit on a short prompt) to minutes (a long prompt on CPU).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
# Check-layer K deviation (mean squared difference per reused token).
DEVIATION_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100)


class ServeMetrics:
    """Every series the server exports, on its own registry."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        mode = ["mode"]
        self.requests = Counter(
            "holeblend_requests", "Requests by engine mode and outcome.",
            ["mode", "outcome"], registry=registry,
        )  # fmt: skip
        self.prompt_tokens = _tokens("prompt", "Prompt tokens of completed prefills.", registry)
        self.reused_tokens = _tokens(
            "reused", "Prompt tokens whose cached KV was reused.", registry
        )
        self.hole_tokens = _tokens(
            "hole", "Tokens of missing segments between reused ones.", registry
        )
        self.recomputed_tokens = _tokens(
            "recomputed", "Tokens computed in every layer (the recompute set).", registry
        )
        self.completion_tokens = _tokens(
            "completion", "Tokens of the answers (usage.completion_tokens).", registry
        )
        self.ttft = Histogram(
            "holeblend_ttft_seconds", "Arrival to the first token's logits, queue wait included.",
            mode, buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.request_duration = Histogram(
            "holeblend_request_duration_seconds", "Arrival to the last token.",
            mode, buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "holeblend_queue_wait_seconds", "Arrival to the start of compute.",
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.lookup = Histogram(
            "holeblend_lookup_seconds", "Keying a prompt's segments and looking them up.",
            buckets=LOOKUP_BUCKETS, registry=registry,
        )  # fmt: skip
        self.kv_deviation = Histogram(
            "holeblend_kv_deviation", "Check-layer K deviation of each reused token.",
            buckets=DEVIATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.recompute_ratio = Gauge(
            "holeblend_recompute_ratio", "Recompute ratio in force.", registry=registry
        )
        self.kv_store_bytes = Gauge(
            "holeblend_kv_store_bytes", "Bytes held by the local KV tier.", registry=registry
        )
        self.kv_store_capacity_bytes = Gauge(
            "holeblend_kv_store_capacity_bytes", "Byte budget of the local KV tier.",
            registry=registry,
        )  # fmt: skip
        self.kv_store_entries = Gauge(
            "holeblend_kv_store_entries", "Segments held by the local KV tier.", registry=registry
        )
        self.shadow_time_share = Gauge(
            "holeblend_shadow_time_share",
            "Most of the engine's time the shadow may take while the engine serves, now: "
            "shadowBudget (at most 0.1), raised while the inline proxy gives no estimate "
            "for the requests served (0: no shadow).",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "holeblend_queue_depth", "Requests waiting for the compute thread.", registry=registry
        )
        self.config_reload_errors = Counter(
            "holeblend_config_reload_errors", "blend.json changes refused (last good kept).",
            registry=registry,
        )  # fmt: skip
        self.config_reloads = Counter(
            "holeblend_config_reloads", "blend.json changes applied.", registry=registry
        )

    def observe_prefill(self, prefill: Prefill) -> None:
        """Token counters and the deviation histogram of one completed prefill."""
        mode = str(prefill.mode)
        self.prompt_tokens.labels(mode).inc(prefill.num_prompt_tokens)
        self.reused_tokens.labels(mode).inc(prefill.num_reused_tokens)
        self.hole_tokens.labels(mode).inc(prefill.num_hole_tokens)
        self.recomputed_tokens.labels(mode).inc(prefill.num_recomputed_tokens)
        for value in prefill.deviation.tolist():
            self.kv_deviation.observe(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _tokens(kind: str, documentation: str, registry: CollectorRegistry) -> Counter:
    return Counter(f"holeblend_{kind}_tokens", documentation, ["mode"], registry=registry)
