"""Pure rules of the live operator: patches, drift, RBAC from the access table, settings."""

import asyncio
import pathlib

import pytest

from holeblend_operator import kube, rbac_command, settings
from holeblend_operator.reconcile import LAST_APPLIED_ANNOTATION, contains, merge_patch
from holeblend_operator.status import Observed, deployment_problem, stamp_transitions

ROOT = pathlib.Path(__file__).parents[2]


def test_merge_patch_removes_fields_applied_before_and_no_longer_rendered():
    before = {"spec": {"nodeSelector": {"npu": "yes"}, "replicas": 1}}
    live = {
        "metadata": {
            "annotations": {
                LAST_APPLIED_ANNOTATION: '{"spec": {"nodeSelector": {"npu": "yes"}, "replicas": 1}}'
            }
        },
        "spec": before["spec"] | {"revisionHistoryLimit": 10},
    }
    patch = merge_patch(live, {"spec": {"replicas": 2}})
    assert patch == {"spec": {"replicas": 2, "nodeSelector": None}}  # server defaults untouched


def test_merge_patch_carries_only_what_differs():
    desired = {"metadata": {"labels": {"a": "1"}}, "spec": {"replicas": 3, "ports": [{"port": 80}]}}
    live = {
        "metadata": {"labels": {"a": "1", "extra": "x"}},
        "spec": {"replicas": 1, "ports": [{"port": 80, "protocol": "TCP"}]},
    }
    assert merge_patch(live, desired) == {"spec": {"replicas": 3}}
    live["spec"]["ports"] = [{"port": 81}]
    assert merge_patch(live, desired) == {"spec": {"replicas": 3, "ports": [{"port": 80}]}}


def test_contains_ignores_server_defaults_but_sees_hand_edits():
    desired = {"spec": {"replicas": 1, "ports": [{"port": 8000}]}}
    assert contains(
        {"spec": {"replicas": 1, "ports": [{"port": "8000", "protocol": "TCP"}], "x": 1}}, desired
    )
    assert not contains({"spec": {"replicas": 5, "ports": [{"port": 8000}]}}, desired)
    assert not contains({"spec": {"replicas": 1, "ports": []}}, desired)


def test_committed_rbac_manifest_matches_the_access_table():
    committed = (ROOT / "deploy" / "rbac.yaml").read_text()
    assert committed == rbac_command.render(rbac_command.DEFAULT_NAMESPACE), "run `make rbac`"


def test_committed_chart_rbac_template_matches_the_access_table():
    committed = (ROOT / "charts" / "holeblend" / "templates" / "rbac.yaml").read_text()
    assert committed == rbac_command.render_helm(), "run `make rbac`"


def test_every_child_kind_has_the_verbs_reconcile_uses():
    for kind in kube.CHILD_KINDS.values():
        assert {"get", "list", "create", "patch", "delete", "watch"} <= set(kind.verbs), kind.kind


def test_requests_outside_the_access_table_are_refused_before_sending():
    client = kube.Client.__new__(kube.Client)  # no connection: the check comes first
    with pytest.raises(PermissionError, match="delete pods"):
        asyncio.run(client._call("delete", kube.PODS, "DELETE", "/api/v1/namespaces/x/pods/y"))


def test_settings_flags_override_env_and_bad_values_name_the_field():
    env = {"HOLEBLEND_OPERATOR_REQUEUE_S": "5", "HOLEBLEND_OPERATOR_NAMESPACES": "a, b"}
    config = settings.from_sources(None, env)
    assert config.requeue_s == 5.0 and config.namespaces == ("a", "b")
    with pytest.raises(ValueError, match="api_concurrency"):
        settings.from_sources(None, {"HOLEBLEND_OPERATOR_API_CONCURRENCY": "0"})
    with pytest.raises(ValueError, match="requeue_s"):
        settings.from_sources(None, {"HOLEBLEND_OPERATOR_REQUEUE_S": "soon"})


def test_transition_time_is_kept_while_a_condition_holds():
    previous = [{"type": "Ready", "status": "True", "lastTransitionTime": "t0"}]
    kept = stamp_transitions([{"type": "Ready", "status": "True"}], previous, "t1", 2)
    flipped = stamp_transitions([{"type": "Ready", "status": "False"}], previous, "t1", 2)
    assert kept[0]["lastTransitionTime"] == "t0" and flipped[0]["lastTransitionTime"] == "t1"


def test_crash_looping_engine_is_a_problem_with_its_reason():
    pod = {
        "status": {
            "containerStatuses": [
                {
                    "name": "engine",
                    "state": {
                        "waiting": {
                            "reason": "CrashLoopBackOff",
                            "message": "back-off 5m0s restarting failed container",
                        }
                    },
                }
            ]
        }
    }
    problem = deployment_problem({"status": {}}, [pod], bd=None)
    assert problem.reason == "CrashLoopBackOff" and "back-off" in problem.message
    assert Observed(engine=None, lookup=None, engine_pods=[]).problem is None
