"""The operator's own Prometheus metrics (served on /metrics next to /healthz)."""

from prometheus_client import Counter, Gauge, Histogram

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
TUNING_DECISIONS = Counter(
    "holeblend_operator_tuning_decisions_total",
    "Recompute-ratio tuner decisions by BlendDeployment, direction (up, down, hold) and reason.",
    ["namespace", "name", "direction", "reason"],
)
TUNED_RATIO = Gauge(
    "holeblend_operator_tuned_ratio",
    "The recompute ratio the tuner last decided, by BlendDeployment.",
    ["namespace", "name"],
)
TUNING_MIN_RATIO = Gauge(
    "holeblend_operator_tuning_min_ratio",
    "spec.tuning.minRatio, by BlendDeployment (for the pinned-at-a-bound alert).",
    ["namespace", "name"],
)
TUNING_MAX_RATIO = Gauge(
    "holeblend_operator_tuning_max_ratio",
    "spec.tuning.maxRatio, by BlendDeployment (for the pinned-at-a-bound alert).",
    ["namespace", "name"],
)
TUNING_TARGET = Gauge(
    "holeblend_operator_tuning_target_f1_proxy",
    "spec.tuning.targetF1Proxy, by BlendDeployment (drawn against the proxies).",
    ["namespace", "name"],
)
