"""BlendDeployment status from what the children report: pure functions, no API calls.

The conditions follow the Kubernetes conventions (type/status/reason/message/
lastTransitionTime): Ready, Progressing, Degraded, LookupServerReady, and Tuned, which the
tuner writes (kept here as it is, or Disabled when tuning is off). status.recomputeRatio
is the ratio the pods run with (render's effective ratio); the tuner's history and metrics
are never written here. Messages say what is wrong and what to do about it, because a
person reads them in `kubectl describe`.
"""

import dataclasses
from typing import Any

from holeblend_operator.api import (
    CONDITION_MESSAGE_MAX_LENGTH,
    BlendDeployment,
    ConditionType,
    Phase,
)
from holeblend_operator.render import effective_recompute_ratio, selector_string

# Container waiting reasons that will not clear up by themselves.
STUCK_REASONS = (
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "CreateContainerConfigError",
    "InvalidImageName",
    "CreateContainerError",
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why the BlendDeployment is Degraded."""

    reason: str  # CamelCase, e.g. Unschedulable, InvalidSpec, ChildConflict
    message: str  # what happened and what to do


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the operator read from the cluster for one status computation."""

    engine: dict | None  # the engine Deployment as the API returned it, None if absent
    lookup: dict | None  # the lookup-server Deployment, None if absent or disabled
    engine_pods: list[dict]  # engine pods; read only while the engine is not available
    problem: Problem | None = None  # a failure of the reconcile itself (apply error, ...)


def is_ready(bd: BlendDeployment, observed: Observed) -> bool:
    """The Ready condition's rule: the engine, and the lookup server if enabled, available."""
    return is_available(observed.engine, bd.spec.replicas) and is_lookup_ready(bd, observed)


def is_lookup_ready(bd: BlendDeployment, observed: Observed) -> bool:
    return not bd.spec.lookup_server.enabled or is_available(observed.lookup, None)


def build_status(bd: BlendDeployment, observed: Observed, previous: list[dict], now: str) -> dict:
    """The full status to write, keeping lastTransitionTime of conditions that did not flip."""
    problem = (
        observed.problem
        or deployment_problem(observed.engine, observed.engine_pods, bd)
        or rollout_problem(observed.lookup, "lookup server")
    )
    engine_ready = is_available(observed.engine, bd.spec.replicas)
    lookup_ready = is_lookup_ready(bd, observed)
    conditions = [
        _ready(engine_ready, lookup_ready, bd),
        _progressing(observed.engine, engine_ready and lookup_ready, problem),
        _degraded(problem),
        _lookup_ready(bd, observed.lookup),
        *_tuned(bd, previous),
    ]
    engine_status = (observed.engine or {}).get("status", {})
    return {
        "observedGeneration": bd.metadata.generation,
        "replicas": engine_status.get("replicas", 0),
        "readyReplicas": engine_status.get("readyReplicas", 0),
        "selector": selector_string(bd),
        "phase": _phase(observed.engine, conditions).value,
        "conditions": stamp_transitions(conditions, previous, now, bd.metadata.generation),
        "recomputeRatio": effective_recompute_ratio(bd),
        # Merge-patched: only baseRatio is written, the tuner's history stays.
        "tuning": {"baseRatio": bd.spec.blend.recompute_ratio},
    }


def invalid_spec_status(
    generation: int | None, message: str, previous: list[dict], now: str
) -> dict:
    """Status for a spec the models reject: Degraded, children left as they were.

    Only Ready and Degraded are rewritten. The other conditions (LookupServerReady, Tuned,
    ...) are kept as they were, transition times and all: the children they describe still
    run, and the status patch replaces the conditions list whole."""
    problem = Problem(
        "InvalidSpec",
        f"{message}. Fix the manifest and apply it again; "
        "the running children are left as they were.",
    )
    conditions = [
        _condition(ConditionType.READY, False, "InvalidSpec", "the spec is invalid"),
        _degraded(problem),
    ]
    stamped = stamp_transitions(conditions, previous, now, generation)
    return {
        "observedGeneration": generation,
        "phase": Phase.DEGRADED.value,
        "conditions": replaced_conditions(previous, stamped),
    }


def replaced_conditions(previous: list[dict], conditions: list[dict]) -> list[dict]:
    """`previous` with each condition of `conditions` in the place of the one of its type
    (appended, in their order, where `previous` has none), so that the order stays the
    same from one write to the next."""
    new = {condition["type"]: condition for condition in conditions}
    kept = [new.pop(condition.get("type"), condition) for condition in previous or []]
    return kept + list(new.values())


def is_available(deployment: dict | None, replicas: int | None) -> bool:
    """The Deployment's rollout is complete: its controller has seen the current spec, the
    wanted replicas all run the current pod template, no pod of an older template is left,
    and every pod of the current one is available. `replicas` is the number wanted (None:
    the Deployment's own spec.replicas).

    This is the rule of `kubectl rollout status` (DeploymentStatusViewer.Status in
    kubernetes staging/src/k8s.io/kubectl/pkg/polymorphichelpers/rollout_status.go).
    readyReplicas alone does not tell it: the Deployment controller counts it over all
    ReplicaSets, old ones included, and updatedReplicas over the new one only
    (pkg/controller/deployment/sync.go, calculateStatus). During a surge rollout the old
    pods would pass for the new ones, e.g. `replicas 2, updatedReplicas 1, readyReplicas 1`
    while the new pod crash-loops. The API server leaves zero counts out of the status, so
    a missing count is 0."""
    if deployment is None:
        return False
    status = deployment.get("status") or {}
    wanted = deployment.get("spec", {}).get("replicas", 1) if replicas is None else replicas
    generation = deployment.get("metadata", {}).get("generation", 0)
    updated = status.get("updatedReplicas", 0)
    return (
        status.get("observedGeneration", 0) >= generation
        and updated >= wanted
        and status.get("replicas", 0) <= updated
        and status.get("availableReplicas", 0) >= updated
    )


def deployment_problem(
    engine: dict | None, pods: list[dict], bd: BlendDeployment
) -> Problem | None:
    """A failure the engine Deployment or its pods report, with what to do about it."""
    for pod in pods:
        if found := _pod_problem(pod, bd):
            return found
    return rollout_problem(engine, "engine")


def rollout_problem(deployment: dict | None, component: str) -> Problem | None:
    """A failure the Deployment of `component` reports in its own conditions (pods it cannot
    create, a rollout past its progress deadline). The lookup server's pods are not read:
    its Deployment says so once the deadline has passed."""
    for condition in (deployment or {}).get("status", {}).get("conditions", []):
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            return Problem(condition.get("reason", "ReplicaFailure"), condition.get("message", ""))
        if (
            condition.get("type") == "Progressing"
            and condition.get("reason") == "ProgressDeadlineExceeded"
        ):
            return Problem(
                "ProgressDeadlineExceeded",
                f"{condition.get('message', '')}; "
                f"check the {component} pods with `kubectl describe pod`",
            )
    return None


def _pod_problem(pod: dict, bd: BlendDeployment) -> Problem | None:
    status = pod.get("status", {})
    for condition in status.get("conditions", []):
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return Problem(
                "Unschedulable",
                f"engine pods cannot be scheduled: {condition.get('message', '')} "
                f"{_scheduling_hint(bd)}",
            )
    for container in status.get("containerStatuses", []):
        waiting = container.get("state", {}).get("waiting", {})
        if waiting.get("reason") in STUCK_REASONS:
            return Problem(
                waiting["reason"],
                f"engine container {container.get('name')}: "
                f"{waiting.get('message', waiting['reason'])}",
            )
    return None


def _scheduling_hint(bd: BlendDeployment) -> str:
    accelerator = bd.spec.accelerator
    if accelerator.type.value == "cpu":
        return "Lower spec.engine.resources or add nodes with free CPU and memory."
    resource = accelerator.effective_resource_name
    return (
        f"Check that nodes advertise {resource} (device plugin running, `kubectl describe node`), "
        "or set spec.accelerator.resourceName, nodeSelector and tolerations to match your nodes."
    )


def _ready(engine_ready: bool, lookup_ready: bool, bd: BlendDeployment) -> dict:
    if engine_ready and lookup_ready:
        if bd.spec.replicas == 0:
            return _condition(
                ConditionType.READY, True, "ScaledToZero", "spec.replicas is 0; nothing to serve"
            )
        return _condition(
            ConditionType.READY, True, "AllReplicasReady", f"{bd.spec.replicas} engine pod(s) ready"
        )
    if not engine_ready:
        return _condition(
            ConditionType.READY, False, "EngineNotReady", "waiting for engine pods to become ready"
        )
    return _condition(
        ConditionType.READY, False, "LookupServerNotReady", "waiting for the lookup server"
    )


def _progressing(engine: dict | None, ready: bool, problem: Problem | None) -> dict:
    if ready:
        return _condition(
            ConditionType.PROGRESSING, False, "RolloutComplete", "every child is up to date"
        )
    if problem is not None:
        return _condition(
            ConditionType.PROGRESSING, False, "Blocked", f"rollout blocked: {problem.reason}"
        )
    if engine is None:
        return _condition(
            ConditionType.PROGRESSING,
            True,
            "CreatingChildren",
            "creating the engine and its services",
        )
    return _condition(
        ConditionType.PROGRESSING, True, "RollingOut", "engine pods are starting or updating"
    )


def _degraded(problem: Problem | None) -> dict:
    if problem is None:
        return _condition(ConditionType.DEGRADED, False, "AsExpected", "no problems found")
    return _condition(ConditionType.DEGRADED, True, problem.reason, problem.message)


# The reason of a condition whose part the spec turned off (LookupServerReady, Tuned).
DISABLED = "Disabled"


def _lookup_ready(bd: BlendDeployment, lookup: dict | None) -> dict:
    if not bd.spec.lookup_server.enabled:
        return _condition(
            ConditionType.LOOKUP_SERVER_READY,
            False,
            DISABLED,
            "spec.lookupServer.enabled is false: each pod only reuses its own cache",
        )
    ready = _ready_replicas(lookup)
    if is_available(lookup, None):
        return _condition(
            ConditionType.LOOKUP_SERVER_READY,
            True,
            "Available",
            f"the lookup server answers lookups ({ready} pods pass GET /ready)",
        )
    return _condition(
        ConditionType.LOOKUP_SERVER_READY,
        False,
        "NotAvailable",
        f"lookup server pods are not ready ({ready} pass GET /ready); "
        "pods treat every segment as a miss until they are",
    )


def _ready_replicas(deployment: dict | None) -> str:
    """ "ready/wanted" of a Deployment, as its readiness probes report them."""
    if deployment is None:
        return "0/0"
    wanted = deployment.get("spec", {}).get("replicas", 1)
    return f"{deployment.get('status', {}).get('readyReplicas', 0)}/{wanted}"


def _tuned(bd: BlendDeployment, previous: list[dict]) -> list[dict]:
    """The tuner owns the Tuned condition (tuning_loop): kept as it is while tuning is on,
    so that rewriting the other conditions does not drop it; Disabled when it is off."""
    if not bd.spec.tuning.enabled:
        message = "spec.tuning.enabled is false: the pods run spec.blend.recomputeRatio"
        return [_condition(ConditionType.TUNED, False, DISABLED, message)]
    return [
        {k: v for k, v in c.items() if k not in ("lastTransitionTime", "observedGeneration")}
        for c in previous or []
        if c.get("type") == ConditionType.TUNED
    ]


def _phase(engine: dict | None, conditions: list[dict]) -> Phase:
    by_type = {c["type"]: c["status"] for c in conditions}
    if by_type[ConditionType.DEGRADED] == "True":
        return Phase.DEGRADED
    if by_type[ConditionType.READY] == "True":
        return Phase.READY
    return Phase.PENDING if engine is None else Phase.PROGRESSING


def _condition(kind: ConditionType, status: bool, reason: str, message: str) -> dict:
    return {
        "type": kind.value,
        "status": "True" if status else "False",
        "reason": reason,
        "message": bounded_message(message),
    }


def bounded_message(message: str) -> str:
    """`message`, cut to the length the status schema accepts, saying so at its end.

    The API server refuses the whole status patch when one message is longer (a pod's or an
    API error's text quoted in it), and the condition would then never show. The bound
    counts characters, as the API server does (Unicode code points), so a cut never falls
    inside a character's UTF-8 bytes."""
    if len(message) <= CONDITION_MESSAGE_MAX_LENGTH:
        return message
    marker = f" ... (cut: {len(message)} characters in all)"
    return message[: CONDITION_MESSAGE_MAX_LENGTH - len(marker)] + marker


def stamp_transitions(
    conditions: list[dict], previous: list[dict], now: str, generation: int | None
) -> list[dict]:
    """Keep the old lastTransitionTime where a condition's status did not change."""
    before = {c.get("type"): c for c in previous or []}
    stamped = []
    for condition in conditions:
        old = before.get(condition["type"], {})
        since = old.get("lastTransitionTime") if old.get("status") == condition["status"] else None
        stamped.append(
            {**condition, "lastTransitionTime": since or now, "observedGeneration": generation}
        )
    return stamped


def without_times(status: dict[str, Any]) -> dict[str, Any]:
    """Status minus the transition times, to tell a real change from a re-stamp."""
    conditions = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in status.get("conditions") or []
    ]
    return {**status, "conditions": conditions}
