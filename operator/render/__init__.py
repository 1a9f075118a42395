"""Pure render functions: a BlendDeployment in, its child objects out as plain dicts.

No clock, environment or Kubernetes API here: the reconcile step adds owner references
and applies the objects; `holeblend-operator render` prints them. One module per child kind.
"""

from holeblend_operator.api import BlendDeployment
from holeblend_operator.render.disruption_budget import engine_disruption_budget
from holeblend_operator.render.engine import CONFIG_HASH_ANNOTATION, engine_deployment
from holeblend_operator.render.labels import engine_selector, selector_string, standard_labels
from holeblend_operator.render.lookup import lookup_deployment
from holeblend_operator.render.naming import (
    bounded_name,
    child_name,
    engine_name,
    lookup_name,
    runtime_config_name,
    service_monitor_name,
)
from holeblend_operator.render.runtime_config import (
    config_hash,
    effective_ratio,
    effective_recompute_ratio,
    runtime_config,
    runtime_configmap,
)
from holeblend_operator.render.service import engine_service, lookup_service
from holeblend_operator.render.service_monitor import service_monitor
from holeblend_operator.settings import DEFAULT_POD_LISTEN_ADDRESS

__all__ = [
    "CONFIG_HASH_ANNOTATION",
    "bounded_name",
    "child_name",
    "config_hash",
    "effective_ratio",
    "effective_recompute_ratio",
    "engine_name",
    "engine_selector",
    "lookup_name",
    "render_children",
    "runtime_config",
    "runtime_config_name",
    "selector_string",
    "service_monitor_name",
    "standard_labels",
]


def render_children(
    bd: BlendDeployment, pod_listen_address: str = DEFAULT_POD_LISTEN_ADDRESS
) -> list[dict]:
    """Every child of `bd` in a stable order; optional children only when enabled. The
    engine and lookup servers listen on `pod_listen_address` (the operator's setting)."""
    spec = bd.spec
    engine = engine_deployment(bd, pod_listen_address)
    children = [engine, engine_service(bd), runtime_configmap(bd)]
    if spec.lookup_server.enabled:
        children += [lookup_deployment(bd, pod_listen_address), lookup_service(bd)]
    if spec.disruption_budget.enabled:
        children.append(engine_disruption_budget(bd))
    if spec.monitoring.service_monitor.enabled:
        children.append(service_monitor(bd))
    return children
