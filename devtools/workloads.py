"""A stand-in for the Deployment controller and the scheduler on one emulated node.

Given a Deployment and the node's allocatable resources and labels, say what a cluster
would report: Available with all replicas ready, or pods Pending as Unschedulable with
the scheduler's message. Pure functions; the emulator writes the results.
"""

import dataclasses
from typing import Any

_NATIVE_PREFIXES = ("cpu", "memory", "ephemeral-storage", "hugepages-")


@dataclasses.dataclass(frozen=True)
class Node:
    allocatable: dict[str, int]  # extended resources the node offers, e.g. nvidia.com/gpu: 1
    labels: dict[str, str]  # node labels that nodeSelectors are matched against


def unschedulable_reason(deployment: dict[str, Any], node: Node) -> str | None:
    """The scheduler's message if the pods cannot be placed, else None."""
    pod_spec = deployment.get("spec", {}).get("template", {}).get("spec", {})
    for key, value in (pod_spec.get("nodeSelector") or {}).items():
        if node.labels.get(key) != value:
            return "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
    for name, count in _extended_requests(pod_spec).items():
        if node.allocatable.get(name, 0) < count:
            return f"0/1 nodes are available: 1 Insufficient {name}."
    return None


def deployment_status(deployment: dict[str, Any], reason: str | None) -> dict[str, Any]:
    """The status the Deployment controller would write once pods settle."""
    replicas = deployment.get("spec", {}).get("replicas", 1)
    ready = 0 if reason else replicas
    available = ready >= replicas or replicas == 0
    return {
        "observedGeneration": deployment.get("metadata", {}).get("generation", 1),
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": ready,
        "availableReplicas": ready,
        "unavailableReplicas": replicas - ready,
        "conditions": [
            _condition("Available", available, *_available_reason(available)),
            _condition("Progressing", True, "NewReplicaSetAvailable", "ReplicaSet is progressing."),
        ],
    }


def pending_pods(deployment: dict[str, Any], reason: str) -> list[dict[str, Any]]:
    """Pods that stay Pending with PodScheduled=False, as `kubectl describe pod` would show."""
    meta = deployment["metadata"]
    labels = deployment.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
    replicas = deployment.get("spec", {}).get("replicas", 1)
    return [_pending_pod(meta, labels, index, reason) for index in range(replicas)]


def _pending_pod(meta: dict, labels: dict, index: int, reason: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{meta['name']}-{index}",
            "namespace": meta["namespace"],
            "labels": labels,
        },
        "status": {
            "phase": "Pending",
            "conditions": [_condition("PodScheduled", False, "Unschedulable", reason)],
        },
    }


def _extended_requests(pod_spec: dict[str, Any]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for container in pod_spec.get("containers", []):
        resources = container.get("resources") or {}
        merged = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        for name, value in merged.items():
            if not name.startswith(_NATIVE_PREFIXES):
                totals[name] = totals.get(name, 0) + int(value)
    return totals


def _available_reason(available: bool) -> tuple[str, str]:
    if available:
        return "MinimumReplicasAvailable", "Deployment has minimum availability."
    return "MinimumReplicasUnavailable", "Deployment does not have minimum availability."


def _condition(kind: str, status: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": kind, "status": str(status), "reason": reason, "message": message}
