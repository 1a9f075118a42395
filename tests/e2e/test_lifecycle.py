"""Create, update, scale and delete BlendDeployments with the operator running against the emulator."""

import dataclasses
import subprocess
import time

from tests.e2e.conftest import (
    BD,
    DEPLOYMENTS,
    FAST,
    KUBECTL,
    NAME,
    condition,
    create,
    edit,
    example,
    is_ready,
    owned_children,
    reconciles,
    running_operator,
    status_of,
)

CHILDREN = [
    ("ConfigMap", f"{NAME}-runtime"),
    ("Deployment", f"{NAME}-engine"),
    ("Deployment", f"{NAME}-lookup"),
    ("PodDisruptionBudget", f"{NAME}-engine"),
    ("Service", f"{NAME}-engine"),
    ("Service", f"{NAME}-lookup"),
]


def engine(cluster, name=NAME):
    return cluster.get(DEPLOYMENTS, "default", f"{name}-engine")


def test_create_makes_owned_children_and_ready_status(cluster):
    with running_operator():
        bd = create(cluster, example())
        cluster.wait_for(lambda: is_ready(cluster))
    uid = bd["metadata"]["uid"]
    assert owned_children(cluster, uid) == CHILDREN
    ref = engine(cluster)["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["controller"]) == ("BlendDeployment", NAME, True)
    status = status_of(cluster, NAME)
    assert status["selector"] == engine_selector(cluster)
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert condition(cluster, NAME, "Ready")["status"] == "True"
    assert condition(cluster, NAME, "LookupServerReady")["status"] == "True"
    assert condition(cluster, NAME, "Degraded")["status"] == "False"


def engine_selector(cluster):
    labels = engine(cluster)["spec"]["selector"]["matchLabels"]
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def test_update_patches_children_and_removes_fields_no_longer_rendered(cluster):
    with running_operator():
        create(cluster, example())
        cluster.wait_for(lambda: is_ready(cluster))
        gpu = {"type": "nvidia", "count": 1, "nodeSelector": {"gpu": "yes"}}
        edit(
            cluster,
            BD,
            NAME,
            {"spec": {"replicas": 3, "accelerator": gpu, "blend": {"recomputeRatio": 0.3}}},
        )
        cluster.wait_for(lambda: engine(cluster)["spec"]["replicas"] == 3)
        pod = engine(cluster)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"gpu": "yes"}
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] in (1, "1")
        config = cluster.get("v1/configmaps", "default", f"{NAME}-runtime")
        assert "0.3" in str(config["data"])
        cluster.wait_for(lambda: status_of(cluster, NAME).get("recomputeRatio") == 0.3)
        assert status_of(cluster, NAME)["tuning"]["baseRatio"] == 0.3
        edit(
            cluster,
            BD,
            NAME,
            {"spec": {"accelerator": {"type": "cpu", "count": 0, "nodeSelector": None}}},
        )
        cluster.wait_for(lambda: "nodeSelector" not in engine(cluster)["spec"]["template"]["spec"])
        limits = engine(cluster)["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert "nvidia.com/gpu" not in limits


def test_kubectl_scale_goes_through_the_scale_subresource(cluster):
    env = {"KUBECONFIG": cluster.kubeconfig, "HOME": cluster.kubeconfig + ".home"}
    with running_operator():
        create(cluster, example())
        cluster.wait_for(lambda: is_ready(cluster))
        done = subprocess.run(
            [KUBECTL, "scale", f"bd/{NAME}", "--replicas=4"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        cluster.wait_for(lambda: engine(cluster)["spec"]["replicas"] == 4)
        cluster.wait_for(lambda: status_of(cluster, NAME).get("readyReplicas") == 4)
    selector = subprocess.run(
        [
            KUBECTL,
            "get",
            "--raw",
            f"/apis/{BD.rpartition('/')[0]}/namespaces/default/blenddeployments/{NAME}/scale",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert engine_selector(cluster) in selector


def test_disabling_the_lookup_server_deletes_its_children(cluster):
    with running_operator():
        bd = create(cluster, example())
        cluster.wait_for(lambda: is_ready(cluster))
        edit(cluster, BD, NAME, {"spec": {"lookupServer": {"enabled": False}}})
        cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "default", f"{NAME}-lookup") is None)
        cluster.wait_for(
            lambda: condition(cluster, NAME, "LookupServerReady").get("reason") == "Disabled"
        )
    names = owned_children(cluster, bd["metadata"]["uid"])
    assert ("Service", f"{NAME}-lookup") not in names
    assert ("Deployment", f"{NAME}-engine") in names


def test_deleting_the_owner_collects_children_by_owner_reference(cluster):
    env = {"KUBECONFIG": cluster.kubeconfig, "HOME": cluster.kubeconfig + ".home"}
    with running_operator():
        create(cluster, example())
        cluster.wait_for(lambda: is_ready(cluster))
        subprocess.run([KUBECTL, "delete", "bd", NAME], env=env, check=True, capture_output=True)
        cluster.wait_for(lambda: engine(cluster) is None)
    assert cluster.get(BD, "default", NAME) is None  # no finalizer held it back
    assert cluster.list("v1/services", "default") == []


def test_hand_edited_and_deleted_children_are_put_back(cluster):
    with running_operator():
        create(cluster, example())
        cluster.wait_for(lambda: is_ready(cluster))
        edit(cluster, DEPLOYMENTS, f"{NAME}-engine", {"spec": {"replicas": 7}})
        cluster.wait_for(lambda: engine(cluster)["spec"]["replicas"] == 1)
        edit(cluster, "v1/configmaps", f"{NAME}-runtime", {"data": None})
        cluster.wait_for(
            lambda: (cluster.get("v1/configmaps", "default", f"{NAME}-runtime") or {}).get("data")
        )


def test_children_are_watched_through_a_server_side_label_selector(cluster):
    with running_operator():
        create(cluster, example())
        cluster.wait_for(lambda: is_ready(cluster))
    requests = cluster.run(lambda: list(cluster.api))  # kmock iterates its request log
    watches = {r.url.path: r.params.get("labelSelector") for r in requests if r.params.get("watch")}
    for path in ("/apis/apps/v1/deployments", "/api/v1/services", "/api/v1/configmaps"):
        assert watches[path] == "app.kubernetes.io/managed-by=holeblend-operator"


def test_the_operator_writes_nothing_but_status_to_the_blend_deployment(cluster):
    """No kopf annotations, finalizers or diff bases on the owner; one reconcile per change."""
    before = reconciles()
    with running_operator():
        create(cluster, example())
        cluster.wait_for(lambda: is_ready(cluster))
        time.sleep(0.5)  # several debounce periods: a write caused by our own write would show
        edit(cluster, BD, NAME, {"spec": {"replicas": 2}})
        cluster.wait_for(lambda: is_ready(cluster, generation=2))
        time.sleep(0.5)
    writes = [
        (str(request.method.value), request.url.path)
        for request in cluster.run(cluster.api.take_requests)
        if "blenddeployments" in request.url.path and str(request.method.value) != "GET"
    ]
    assert writes and all(path.endswith(f"/{NAME}/status") for _, path in writes), writes
    meta = cluster.get(BD, "default", NAME)["metadata"]
    assert not meta.get("finalizers")
    assert not [key for key in meta.get("annotations") or {} if "kopf" in key or "operator." in key]
    done = reconciles() - before
    # One successful reconcile per change (a retry after a slow request would count as one);
    # none caused by our own writes to the children or the status.
    assert sum(count for (_, result), count in done.items() if result == "ok") == 2, done
    assert not [trigger for trigger, _ in done if trigger in ("drift", "resume")], done


def test_ready_shows_once_the_deployments_settle_without_waiting_out_the_debounce(cluster):
    slow_debounce = dataclasses.replace(FAST, status_debounce_s=30.0)
    with running_operator(slow_debounce):
        create(cluster, example())
        cluster.wait_for(lambda: is_ready(cluster), timeout=10)  # well before 30 s
        edit(cluster, BD, NAME, {"spec": {"replicas": 2}})
        cluster.wait_for(lambda: is_ready(cluster, generation=2), timeout=10)
    assert status_of(cluster, NAME)["readyReplicas"] == 2
