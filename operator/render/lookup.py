"""The lookup-server Deployment: the fleet-wide index of cached segments."""

from holeblend_operator.api import BlendDeployment
from holeblend_operator.render.images import lookup_image
from holeblend_operator.render.labels import (
    LOOKUP_SERVER,
    object_meta,
    selector_labels,
    standard_labels,
)
from holeblend_operator.render.naming import lookup_name
from holeblend_operator.render.pods import (
    POD_HARDENING,
    RESTRICTED_CONTAINER_SECURITY,
    RESTRICTED_POD_SECURITY,
    health_probe,
    resources,
)
from holeblend_operator.settings import DEFAULT_POD_LISTEN_ADDRESS

# The runtime module that serves the index; the contract with holeblend_runtime.
LOOKUP_SERVER_MODULE = "holeblend_runtime.lookup_server"
HEALTH_PATH = "/healthz"
# Fails while the server drains after SIGTERM, so the Service stops routing to it first.
READY_PATH = "/ready"


def lookup_container(bd: BlendDeployment, listen_address: str = DEFAULT_POD_LISTEN_ADDRESS) -> dict:
    server = bd.spec.lookup_server
    container = {
        "name": "lookup-server",
        "image": lookup_image(server.image),
        "command": ["python", "-m", LOOKUP_SERVER_MODULE],
        "args": ["--host", listen_address, "--port", str(server.port)],
        "ports": [{"name": "http", "containerPort": server.port, "protocol": "TCP"}],
        "readinessProbe": health_probe(READY_PATH, periodSeconds=2, failureThreshold=2),
        "livenessProbe": health_probe(
            HEALTH_PATH, periodSeconds=10, timeoutSeconds=3, failureThreshold=3
        ),
    }
    container["securityContext"] = dict(RESTRICTED_CONTAINER_SECURITY)
    return container | {"resources": resources(server.resources.requests, server.resources.limits)}


def lookup_deployment(
    bd: BlendDeployment, listen_address: str = DEFAULT_POD_LISTEN_ADDRESS
) -> dict:
    """`listen_address`: where the server listens (the operator's --pod-listen-address)."""
    name = lookup_name(bd.metadata.name)
    pod_spec = {
        "containers": [lookup_container(bd, listen_address)],
        **POD_HARDENING,
        "securityContext": dict(RESTRICTED_POD_SECURITY),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(bd, name, LOOKUP_SERVER),
        "spec": {
            "replicas": bd.spec.lookup_server.replicas,
            "selector": {"matchLabels": selector_labels(bd, LOOKUP_SERVER)},
            "template": {
                "metadata": {"labels": standard_labels(bd, LOOKUP_SERVER)},
                "spec": pod_spec,
            },
        },
    }
