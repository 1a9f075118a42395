"""A prometheus-operator ServiceMonitor scraping the engine and lookup-server Services.

Every series it scrapes carries, besides prometheus-operator's namespace/service/pod labels,
`blenddeployment` (the BlendDeployment's name exactly as the operator's tuning series carry
it in `name`) and `component` (`engine` or `lookup-server`, from the Service's
app.kubernetes.io/component label). Service names and the instance label cannot serve as a
join key: a name with a dot or a leading digit, or a long one, gives hashed Service names
(naming.bounded_name), and a name over 63 characters a hashed instance label. A relabeling's
replacement has no such limit, and the chart's alerts and dashboard select on these two labels.
"""

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
BLENDDEPLOYMENT_LABEL = "blenddeployment"
COMPONENT_LABEL = "component"
# Kubernetes service discovery's copy of the Service's app.kubernetes.io/component label.
SERVICE_COMPONENT_META_LABEL = "__meta_kubernetes_service_label_app_kubernetes_io_component"


def relabelings(bd: BlendDeployment) -> list[dict]:
    """Target relabelings adding `blenddeployment` and `component` to every scraped series."""
    return [
        {
            "action": "replace",
            "targetLabel": BLENDDEPLOYMENT_LABEL,
            "replacement": bd.metadata.name,
        },
        {
            "action": "replace",
            "sourceLabels": [SERVICE_COMPONENT_META_LABEL],
            "targetLabel": COMPONENT_LABEL,
        },
    ]


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
    ports = ["http"]
    if exports_connector_metrics(bd):  # the connector's holeblend_* series on vLLM pods
        ports.append(METRICS_PORT_NAME)
    endpoints = [
        {"port": port, "path": "/metrics", "interval": interval, "relabelings": relabelings(bd)}
        for port in ports
    ]
    return {
        "apiVersion": SERVICE_MONITOR_API_VERSION,
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {"selector": selector, "endpoints": endpoints},
    }
