"""Status conditions from what the children report (pure, no API)."""

import copy
import pathlib

import yaml

from holeblend_operator.reconcile import has_unready_pods, parse
from holeblend_operator.status import Observed, Problem, build_status

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
