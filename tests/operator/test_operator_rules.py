"""Pure rules of the live operator: patches, drift, RBAC from the access table, settings."""

import asyncio
import copy
import pathlib

import pytest
import yaml

from holeblend_operator import handlers, kube, rbac_command, reconcile, settings
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


def _engine(owner: dict) -> dict:
    _, children = reconcile.prepare(owner)
    return next(
        c for c in children if c["kind"] == "Deployment" and "engine" in c["metadata"]["name"]
    )


def test_merge_patch_removes_a_field_no_longer_rendered_inside_a_list():
    """A limit dropped from spec.engine.resources lives in a container, inside a list: the
    live container still "contains" the new one, yet the limit must go (the patch carries
    the list whole, as merge patches replace lists)."""
    from kmock._internal.dicts import merge_patch_dict  # the emulator's merge patch

    with open(ROOT / "examples" / "cpu.yaml") as file:
        owner = yaml.safe_load(file)
    owner["metadata"].update(namespace="default", uid="uid-1", generation=1)
    live = copy.deepcopy(_engine(owner))
    for container in live["spec"]["template"]["spec"]["containers"]:  # server defaults
        container |= {
            "terminationMessagePath": "/dev/termination-log",
            "imagePullPolicy": "IfNotPresent",
        }
    del owner["spec"]["engine"]["resources"]["limits"]["memory"]
    desired = _engine(owner)
    assert not reconcile.is_current(live, desired)

    patched = merge_patch_dict(live, merge_patch(live, desired))

    container = patched["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"cpu": "2"}
    assert reconcile.is_current(patched, desired)


class Cluster:
    """Children by (kind, name), as an API server holds them: POST answers None (409
    AlreadyExists) for a name that is taken; status writes are recorded."""

    def __init__(self, objects: list[dict]):
        self.objects = {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in objects}
        self.statuses: list[dict] = []

    async def create(self, kind, body):
        key = (body["kind"], body["metadata"]["name"])
        if key in self.objects:
            return None
        self.objects[key] = copy.deepcopy(body)
        return copy.deepcopy(body)

    async def get(self, kind, namespace, name):
        return copy.deepcopy(self.objects.get((kind.kind, name)))

    async def list(self, kind, namespace, selector):
        return []

    async def patch_status(self, namespace, name, status):
        self.statuses.append(status)
        return {}


def _example(uid: str) -> dict:
    with open(ROOT / "examples" / "cpu.yaml") as file:
        owner = yaml.safe_load(file)
    owner["metadata"].update(namespace="default", uid=uid, generation=1)
    return owner


@pytest.mark.parametrize(
    ("owner_ref", "raised"),
    [
        # deleted and applied again: the garbage collector takes the old children soon
        ({"uid": "uid-old"}, kube.Unavailable),
        # someone else's object: a person must act
        ({"kind": "Deployment", "name": "other", "uid": "uid-x"}, reconcile.Blocked),
    ],
)
def test_children_of_a_deleted_namesake_are_waited_for_not_reported_as_conflicts(owner_ref, raised):
    _, left = reconcile.prepare(_example("uid-old"))
    for child in left:
        child["metadata"]["ownerReferences"][0].update(owner_ref)
    cluster = Cluster(left)

    with pytest.raises(raised):
        asyncio.run(reconcile.reconcile(cluster, _example("uid-new"), handlers.FIRST_CREATE, "now"))

    degraded = [c for s in cluster.statuses for c in s["conditions"] if c["type"] == "Degraded"]
    reasons = {c["reason"] for c in degraded}
    assert reasons == (set() if raised is kube.Unavailable else {"ChildConflict"})


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


def cpu_owner(**spec) -> dict:
    body = yaml.safe_load((ROOT / "examples" / "cpu.yaml").read_text())
    body["metadata"].update(uid="u-1", generation=3, namespace="default")
    body["spec"].update(copy.deepcopy(spec))
    return body


class ApplyClient:
    """Children as rendered from an older spec; records when each write starts and ends,
    and fails the PATCH of the kinds in `failing` with `error`."""

    def __init__(self, live: dict, failing=(), error=None):
        self.live, self.failing, self.error = live, failing, error
        self.log: list[tuple[str, str]] = []

    async def create(self, kind, body):
        return None

    async def get(self, kind, namespace, name):
        return copy.deepcopy(self.live.get((kind.kind, name)))

    async def patch(self, kind, namespace, name, patch):
        self.log.append(("start", kind.kind))
        await asyncio.sleep(0.01 if kind.kind == "ConfigMap" else 0)
        if kind.kind in self.failing:
            raise self.error
        self.log.append(("end", kind.kind))
        return {"kind": kind.kind, "metadata": {"name": name}}

    async def list(self, kind, namespace, selector):
        return []

    async def delete(self, kind, namespace, name):
        return True

    async def patch_status(self, namespace, name, status):
        return {}


def updated_children(**client_args) -> tuple[ApplyClient, Exception | None]:
    """A full reconcile of a spec whose blend.selection (read by the pods at start only)
    changed: the ConfigMap and the engine Deployment (its config hash) both need a patch.
    The client, and what the reconcile raised."""
    old = cpu_owner()
    new = cpu_owner(blend={**old["spec"].get("blend", {}), "selection": "sinks"})
    _, children = reconcile.prepare(old)
    live = {(child["kind"], child["metadata"]["name"]): child for child in children}
    client = ApplyClient(live, **client_args)
    options = reconcile.Options(create_first=False, prune=True)
    try:
        asyncio.run(reconcile.reconcile(client, new, options, "t"))
    except Exception as exc:
        return client, exc
    return client, None


def test_deployments_are_patched_only_once_their_configmap_is_written():
    """Pods read blend.json once, at start: the Deployment rolls to the new config hash only
    after the ConfigMap holds the new file, or its new pods would keep the old one."""
    client, raised = updated_children()
    assert raised is None
    assert client.log.index(("end", "ConfigMap")) < client.log.index(("start", "Deployment"))


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        (kube.Unavailable("patch configmaps: HTTP 503"), kube.Unavailable),
        (kube.Invalid("patch configmaps: HTTP 422"), reconcile.Blocked),
    ],
    ids=["unavailable", "rejected"],
)
def test_a_failed_configmap_write_leaves_the_deployments_as_they_were(error, raised):
    """Retried (backoff) or blocked (ChildRejected), the reconcile stops before the
    Deployments: pods started now would mount the old blend.json, and nothing would
    restart them once the ConfigMap is written (the config hash would not change again)."""
    client, exc = updated_children(failing=("ConfigMap",), error=error)
    assert isinstance(exc, raised)
    assert ("start", "Deployment") not in client.log
