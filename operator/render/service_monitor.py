"""A prometheus-operator ServiceMonitor scraping the engine and lookup-server Services."""

from holeblend_operator.api import BlendDeployment
from holeblend_operator.render.engine import METRICS_PORT_NAME, exports_connector_metrics
from holeblend_operator.render.labels import (
    ENGINE,
    LOOKUP_SERVER,
    METRICS,
    instance_labels,
    object_meta,
)
from holeblend_operator.render.naming import service_monitor_name

SERVICE_MONITOR_API_VERSION = "monitoring.coreos.com/v1"


def service_monitor(bd: BlendDeployment) -> dict:
    settings = bd.spec.monitoring.service_monitor
    metadata = object_meta(bd, service_monitor_name(bd.metadata.name), METRICS)
    # Our labels win over the user's extra labels: the selector depends on them.
    metadata["labels"] = dict(sorted(settings.labels.items())) | metadata["labels"]
    components = [ENGINE, LOOKUP_SERVER] if bd.spec.lookup_server.enabled else [ENGINE]
    selector = {
        "matchLabels": instance_labels(bd),
        "matchExpressions": [
            {"key": "app.kubernetes.io/component", "operator": "In", "values": components}
        ],
    }
    interval = f"{settings.interval_seconds}s"
    endpoints = [{"port": "http", "path": "/metrics", "interval": interval}]
    if exports_connector_metrics(bd):  # the connector's holeblend_* series on vLLM pods
        endpoints.append({"port": METRICS_PORT_NAME, "path": "/metrics", "interval": interval})
    return {
        "apiVersion": SERVICE_MONITOR_API_VERSION,
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {"selector": selector, "endpoints": endpoints},
    }
