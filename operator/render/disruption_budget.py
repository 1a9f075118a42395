"""The engine PodDisruptionBudget: drains take down at most maxUnavailable engine pods.

Unhealthy pods (running, not ready: crash-looping, or still loading the model) may always
be evicted. Under Kubernetes' default policy (IfHealthyBudget) they may be evicted only
while the budget holds, so a deployment whose pods all fail to become ready (a bad model
path, an OOM loop) would block every node drain forever, and evicting a pod that serves
nothing protects nothing.
"""

from holeblend_operator.api import BlendDeployment
from holeblend_operator.render.labels import ENGINE, engine_selector, object_meta
from holeblend_operator.render.naming import engine_name


def engine_disruption_budget(bd: BlendDeployment) -> dict:
    name = engine_name(bd.metadata.name)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(bd, name, ENGINE),
        "spec": {
            "maxUnavailable": bd.spec.disruption_budget.max_unavailable,
            "selector": {"matchLabels": engine_selector(bd)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
