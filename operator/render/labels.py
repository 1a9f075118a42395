"""Standard `app.kubernetes.io/*` labels and the immutable selector subset.

Deployment selectors cannot change after creation, so selectors use only labels that are
fixed for the life of a BlendDeployment (name, instance, component); the version label
appears on objects and pod templates but never in a selector.
"""

from holeblend_operator.api import BlendDeployment
from holeblend_operator.render.images import HOLEBLEND_VERSION
from holeblend_operator.render.naming import bounded_label_value

APP_NAME = "holeblend"
MANAGED_BY = "holeblend-operator"
ENGINE = "engine"
LOOKUP_SERVER = "lookup-server"
RUNTIME_CONFIG = "runtime-config"
METRICS = "metrics"


def instance_label(bd: BlendDeployment) -> str:
    # Label values are limited to 63 characters; a BlendDeployment name may be longer.
    return bounded_label_value(bd.metadata.name)


def instance_labels(bd: BlendDeployment) -> dict[str, str]:
    """Every pod of this BlendDeployment, whatever its component."""
    return {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": instance_label(bd)}


def selector_labels(bd: BlendDeployment, component: str) -> dict[str, str]:
    return instance_labels(bd) | {"app.kubernetes.io/component": component}


def standard_labels(bd: BlendDeployment, component: str) -> dict[str, str]:
    return selector_labels(bd, component) | {
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/part-of": APP_NAME,
        "app.kubernetes.io/version": HOLEBLEND_VERSION,
    }


def engine_selector(bd: BlendDeployment) -> dict[str, str]:
    """matchLabels of the engine pods (Deployment, Service, PodDisruptionBudget)."""
    return selector_labels(bd, ENGINE)


def selector_string(bd: BlendDeployment) -> str:
    """The engine selector as `k=v,...` for status.selector and the scale subresource."""
    return ",".join(f"{key}={value}" for key, value in sorted(engine_selector(bd).items()))


def object_meta(bd: BlendDeployment, name: str, component: str) -> dict:
    return {
        "name": name,
        "namespace": bd.metadata.namespace,
        "labels": standard_labels(bd, component),
    }
