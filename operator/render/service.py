"""ClusterIP Services of the engine and the lookup server: a port named http each, and the
connector's metrics port on vLLM engines."""

from holeblend_operator.api import BlendDeployment
from holeblend_operator.render.engine import METRICS_PORT_NAME, exports_connector_metrics
from holeblend_operator.render.labels import (
    ENGINE,
    LOOKUP_SERVER,
    object_meta,
    selector_labels,
)
from holeblend_operator.render.naming import engine_name, lookup_name


def cluster_ip_service(
    bd: BlendDeployment, name: str, component: str, port: int, more_ports: tuple = ()
) -> dict:
    http = {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(bd, name, component),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(bd, component),
            "ports": [http, *more_ports],
        },
    }


def engine_service(bd: BlendDeployment) -> dict:
    name = engine_name(bd.metadata.name)
    metrics = ()
    if exports_connector_metrics(bd):
        port = bd.spec.engine.metrics_port
        metrics = ({"name": METRICS_PORT_NAME, "port": port, "targetPort": METRICS_PORT_NAME}
                   | {"protocol": "TCP"},)  # fmt: skip
    return cluster_ip_service(bd, name, ENGINE, bd.spec.engine.port, metrics)


def lookup_service(bd: BlendDeployment) -> dict:
    name = lookup_name(bd.metadata.name)
    return cluster_ip_service(bd, name, LOOKUP_SERVER, bd.spec.lookup_server.port)
