"""Status conditions from what the children report (pure, no API)."""

import asyncio
import copy
import pathlib

import pytest
import yaml

from holeblend_operator.handlers import FIRST_CREATE
from holeblend_operator.reconcile import InvalidSpec, has_unready_pods, parse, reconcile
from holeblend_operator.status import Observed, Problem, build_status, is_available

ROOT = pathlib.Path(__file__).parents[2]


def blend_deployment(**spec):
    body = yaml.safe_load((ROOT / "examples" / "cpu.yaml").read_text())
    body["metadata"].update(uid="u-1", generation=3, namespace="default")
    body["spec"].update(copy.deepcopy(spec))
    return parse(body)


def deployment(replicas=1, ready=1, generation=1, observed=1, conditions=()):
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": replicas,
            "conditions": list(conditions),
        },
    }


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_children_available_is_ready_with_the_spec_generation():
    status = build_status(blend_deployment(), Observed(deployment(), deployment(), []), [], "t")
    assert status["phase"] == "Ready" and status["observedGeneration"] == 3
    assert conditions(status)["Ready"] == ("True", "AllReplicasReady")
    assert conditions(status)["Progressing"] == ("False", "RolloutComplete")


def test_an_old_generation_is_not_ready_even_with_ready_pods():
    engine = deployment(generation=2, observed=1)
    status = build_status(blend_deployment(), Observed(engine, deployment(), []), [], "t")
    assert status["phase"] == "Progressing"
    assert conditions(status)["Progressing"] == ("True", "RollingOut")


def test_a_fresh_engine_has_no_pods_to_diagnose_yet():
    assert not has_unready_pods({"metadata": {}, "spec": {"replicas": 1}}, 1)
    assert has_unready_pods(deployment(ready=0), 1)


def test_progress_deadline_exceeded_is_degraded():
    stuck = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "x" has timed out progressing.',
    }
    engine = deployment(ready=0, conditions=[stuck])
    status = build_status(blend_deployment(), Observed(engine, deployment(), []), [], "t")
    assert conditions(status)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    assert status["phase"] == "Degraded"


def test_a_disabled_lookup_server_does_not_block_readiness():
    bd = blend_deployment(lookupServer={"enabled": False})
    status = build_status(bd, Observed(deployment(), None, []), [], "t")
    assert status["phase"] == "Ready"
    assert conditions(status)["LookupServerReady"] == ("False", "Disabled")


def test_scaled_to_zero_is_ready():
    bd = blend_deployment(replicas=0)
    status = build_status(bd, Observed(deployment(replicas=0, ready=0), deployment(), []), [], "t")
    assert conditions(status)["Ready"] == ("True", "ScaledToZero")


def test_a_reconcile_problem_wins_over_child_status():
    problem = Problem(
        "ChildConflict", "Service default/x exists and is not owned by this BlendDeployment"
    )
    status = build_status(
        blend_deployment(), Observed(deployment(), deployment(), [], problem), [], "t"
    )
    assert conditions(status)["Degraded"] == ("True", "ChildConflict")
    assert conditions(status)["Progressing"] == ("False", "RolloutComplete")


def mid_rollout(wanted=1, updated=1, old_ready=1, new_ready=0):
    """A surge rollout (maxSurge 1, maxUnavailable 0) as the Deployment controller reports
    it: updatedReplicas counts the new ReplicaSet's pods, replicas, readyReplicas and
    availableReplicas count the old ReplicaSet's too."""
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": wanted},
        "status": {
            "observedGeneration": 2,
            "replicas": updated + old_ready,
            "updatedReplicas": updated,
            "readyReplicas": old_ready + new_ready,
            "availableReplicas": old_ready + new_ready,
            "unavailableReplicas": updated - new_ready,
        },
    }


def test_old_pods_that_still_serve_do_not_make_a_rollout_complete():
    """readyReplicas counts the old ReplicaSet's pods: one new pod starting next to one old
    ready pod, or the last step of a larger rollout (two new ready, one old left), is not
    a finished rollout (`kubectl rollout status` waits for the old pods to go)."""
    assert not is_available(mid_rollout(), 1)
    assert not is_available(mid_rollout(wanted=2, updated=2, new_ready=1), 2)
    assert is_available(mid_rollout(old_ready=0, new_ready=1), 1)


def test_updated_pods_that_are_not_available_keep_the_rollout_going():
    """Every updated pod must be available, and a count the API server left out is 0."""
    engine = deployment()
    engine["status"]["availableReplicas"] = 0
    assert not is_available(engine, 1)
    del engine["status"]["updatedReplicas"]
    engine["status"]["availableReplicas"] = 1
    assert not is_available(engine, 1)


def test_a_crash_looping_new_pod_behind_a_ready_old_one_is_degraded_not_ready():
    """Mid-rollout the pods are listed (the rollout is not complete), so a new pod that
    crash-loops while the old one still serves shows as Degraded instead of Ready and
    RolloutComplete."""
    bd = blend_deployment()
    engine = mid_rollout()
    crashing = {
        "status": {
            "containerStatuses": [
                {"name": "engine", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
            ]
        }
    }
    assert has_unready_pods(engine, bd.spec.replicas)
    status = build_status(bd, Observed(engine, deployment(), [crashing]), [], "t")
    assert conditions(status)["Ready"] == ("False", "EngineNotReady")
    assert conditions(status)["Degraded"] == ("True", "CrashLoopBackOff")
    assert status["phase"] == "Degraded"


def test_a_healthy_surge_rollout_is_progressing():
    """While the new pod starts and the old one serves, the status says RollingOut."""
    status = build_status(blend_deployment(), Observed(mid_rollout(), deployment(), []), [], "t")
    assert conditions(status)["Ready"] == ("False", "EngineNotReady")
    assert conditions(status)["Progressing"] == ("True", "RollingOut")
    assert status["phase"] == "Progressing"


def test_a_lookup_server_mid_rollout_is_not_available():
    """The lookup server's Deployment (default strategy: surge 1 at one replica) follows the
    same rule, so LookupServerReady waits for its new pod."""
    status = build_status(blend_deployment(), Observed(deployment(), mid_rollout(), []), [], "t")
    assert conditions(status)["LookupServerReady"] == ("False", "NotAvailable")
    assert conditions(status)["Ready"] == ("False", "LookupServerNotReady")


@pytest.mark.parametrize(
    "failure",
    [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": 'ReplicaSet "rag-lookup-6f7d" has timed out progressing.',
        },
        {
            "type": "ReplicaFailure",
            "status": "True",
            "reason": "FailedCreate",
            "message": 'pods "rag-lookup-6f7d-x" is forbidden: exceeded quota: compute',
        },
    ],
)
def test_a_stuck_lookup_server_is_degraded(failure):
    """A lookup server that never comes up (a wrong image, a quota) is something a person
    must fix, as it would be for the engine: not a rollout still under way."""
    lookup = deployment(ready=0, conditions=[failure])
    status = build_status(blend_deployment(), Observed(deployment(), lookup, []), [], "t")
    assert conditions(status)["Degraded"][0] == "True"
    assert failure["message"] in next(
        c["message"] for c in status["conditions"] if c["type"] == "Degraded"
    )
    assert conditions(status)["Progressing"] == ("False", "Blocked")
    assert status["phase"] == "Degraded"


class StatusWrites:
    """Holds the owner's status as the API server would, merge-patching each status write."""

    def __init__(self, status: dict):
        self.status = copy.deepcopy(status)
        self.writes: list[dict] = []

    async def patch_status(self, namespace, name, status):
        self.writes.append(status)
        self.status |= copy.deepcopy(status)  # top-level keys; the conditions list is replaced
        return {}


def invalid_spec_reconcile(client: StatusWrites) -> None:
    body = yaml.safe_load((ROOT / "examples" / "cpu.yaml").read_text())
    body["metadata"].update(uid="u-1", generation=4, namespace="default")
    body["spec"]["blend"]["recomputeRatio"] = 2
    body["status"] = copy.deepcopy(client.status)
    with pytest.raises(InvalidSpec, match="recomputeRatio"):
        asyncio.run(reconcile(client, body, FIRST_CREATE, "t1"))


def test_an_invalid_spec_rewrites_ready_and_degraded_and_keeps_the_other_conditions():
    """The children keep running as they were, so what the other conditions say about them
    (and the tuner's Tuned, and a condition someone else writes) stays, transition times
    included; the order stays too, so a second reconcile of the same spec writes nothing."""
    tuned = {"type": "Tuned", "status": "True", "reason": "Holding", "message": "on target"}
    running = build_status(
        blend_deployment(), Observed(deployment(), deployment(), []), [tuned], "t0"
    )
    available = {"type": "Available", "status": "True", "reason": "X", "lastTransitionTime": "t0"}
    previous = [*running["conditions"], available]
    client = StatusWrites(running | {"conditions": previous})

    invalid_spec_reconcile(client)
    invalid_spec_reconcile(client)

    (written,) = client.writes
    assert [c["type"] for c in written["conditions"]] == [c["type"] for c in previous]
    assert conditions(written)["Degraded"] == ("True", "InvalidSpec")
    assert conditions(written)["Ready"] == ("False", "InvalidSpec")
    kept = [c for c in written["conditions"] if c["type"] not in ("Ready", "Degraded")]
    assert kept == [c for c in previous if c["type"] not in ("Ready", "Degraded")]
    assert {c["type"] for c in kept} == {"Progressing", "LookupServerReady", "Tuned", "Available"}
