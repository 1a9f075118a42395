"""API failures, bad specs, unschedulable pods and restarts: the operator converges or says why."""

import asyncio

from holeblend_devtools.emulator import Fault
from holeblend_operator import handlers, kube
from tests.e2e.conftest import (
    BD,
    DEPLOYMENTS,
    FAST,
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


def test_api_errors_timeouts_and_conflicts_are_retried_until_converged(cluster):
    cluster.api.faults.extend(
        [
            Fault("create", "deployments", status=503, times=2),
            Fault("create", "services", status=409, times=1),  # a write conflict, not AlreadyExists
            Fault(
                "get", "deployments", status=None, delay=2.0, times=1
            ),  # longer than the 1 s timeout
            Fault("patch", "blenddeployments", status=500, times=2),
        ]
    )
    with running_operator():
        bd = create(cluster, example())
        cluster.wait_for(lambda: is_ready(cluster, generation=None), timeout=20)
    assert all(fault.times == 0 for fault in cluster.api.faults)
    assert len(owned_children(cluster, bd["metadata"]["uid"])) == 6
    failures = warnings(cluster, "ReconcileFailed")
    assert failures and all(e["involvedObject"]["uid"] == bd["metadata"]["uid"] for e in failures)
    assert any("HTTP 503" in e["message"] for e in failures)


def warnings(cluster, reason):
    """Warning events with this reason, as `kubectl describe bd` would list them."""
    events = cluster.list("v1/events", "default")
    return [e for e in events if e.get("type") == "Warning" and e.get("reason") == reason]


def test_unschedulable_accelerator_shows_as_degraded_with_the_scheduler_reason(cluster):
    bd = example()
    bd["spec"]["accelerator"] = {"type": "ascend", "count": 1}
    with running_operator():
        create(cluster, bd)
        cluster.wait_for(lambda: condition(cluster, NAME, "Degraded").get("status") == "True")
    degraded = condition(cluster, NAME, "Degraded")
    assert degraded["reason"] == "Unschedulable"
    assert "Insufficient huawei.com/Ascend910" in degraded["message"]
    assert "resourceName" in degraded["message"]  # says what to do
    assert status_of(cluster, NAME)["phase"] == "Degraded"


def test_invalid_spec_becomes_degraded_and_is_not_retried(cluster):
    bd = example()
    bd["spec"]["blend"]["recomputeRatio"] = 1.5
    before = invalid_count()
    with running_operator():
        create(cluster, bd)
        cluster.wait_for(
            lambda: condition(cluster, NAME, "Degraded").get("reason") == "InvalidSpec"
        )
        cluster.wait_for(lambda: invalid_count() > before)
        import time

        time.sleep(1.5)  # several backoff periods: a retry loop would show up in the count
    assert invalid_count() - before == 1
    assert "blend.recomputeRatio" in condition(cluster, NAME, "Degraded")["message"]
    assert len(warnings(cluster, "InvalidSpec")) == 1
    assert cluster.get(DEPLOYMENTS, "default", f"{NAME}-engine") is None


def invalid_count():
    return reconciles()[("create", "invalid")]


def test_restart_mid_way_resumes_without_duplicates_or_orphans(cluster):
    # The first operator never gets the PodDisruptionBudget created, then stops; meanwhile
    # the lookup server is turned off. The second operator must finish and clean up.
    cluster.api.faults.append(Fault("create", "poddisruptionbudgets", status=503, times=10_000))
    with running_operator():
        bd = create(cluster, example())
        cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "default", f"{NAME}-lookup") is not None)
    cluster.api.faults.clear()
    edit(cluster, BD, NAME, {"spec": {"lookupServer": {"enabled": False}}})
    with running_operator():
        cluster.wait_for(
            lambda: (
                is_ready(cluster, generation=None)
                and cluster.get(DEPLOYMENTS, "default", f"{NAME}-lookup") is None
            ),
            timeout=15,
        )
    children = owned_children(cluster, bd["metadata"]["uid"])
    assert children == sorted({*children})  # no duplicates
    assert children == [
        ("ConfigMap", f"{NAME}-runtime"),
        ("Deployment", f"{NAME}-engine"),
        ("PodDisruptionBudget", f"{NAME}-engine"),
        ("Service", f"{NAME}-engine"),
    ]


SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "ServiceMonitor",
            "plural": "servicemonitors",
            "singular": "servicemonitor",
        },
        "versions": [{"name": "v1", "served": True, "storage": True}],
    },
}


def test_service_monitor_without_its_crd_is_degraded_until_the_crd_appears(cluster):
    bd = example()
    bd["spec"]["monitoring"] = {"serviceMonitor": {"enabled": True}}
    with running_operator():
        create(cluster, bd)
        cluster.wait_for(
            lambda: condition(cluster, NAME, "Degraded").get("reason") == "ResourceNotServed"
        )
        assert (
            cluster.get(DEPLOYMENTS, "default", f"{NAME}-engine") is not None
        )  # the rest is applied
        crds = "apiextensions.k8s.io/v1/customresourcedefinitions"
        cluster.call(cluster.api.put_object(crds, SERVICE_MONITOR_CRD))  # as `kubectl apply`
        monitors = "monitoring.coreos.com/v1/servicemonitors"
        cluster.wait_for(
            lambda: cluster.get(monitors, "default", f"{NAME}-metrics") is not None, timeout=15
        )
        cluster.wait_for(lambda: is_ready(cluster, generation=None), timeout=15)
        # Once its CRD is there, the ServiceMonitor is watched like the other children.
        edit(cluster, monitors, f"{NAME}-metrics", {"spec": {"endpoints": []}})
        cluster.wait_for(
            lambda: cluster.get(monitors, "default", f"{NAME}-metrics")["spec"]["endpoints"],
            timeout=15,
        )


def test_retries_read_the_owner_afresh_instead_of_a_stale_watched_copy(cluster):
    # An HA replica that kopf paused for a peer keeps its pending retries, but its watches
    # stopped: what it last saw may be old. A retry must apply the spec as it is now.
    stale = create(cluster, example())
    edit(cluster, BD, NAME, {"spec": {"replicas": 3}})
    key = ("default", NAME)

    async def retry_with_stale_copy():
        operator = handlers.Operator(FAST)
        operator.client = kube.Client.from_configuration(kube.load_configuration(), 1.0, 4)
        operator.owner_event(stale, "MODIFIED")  # the copy it last watched
        operator._pending.pop(key).task.cancel()
        operator._retry(key, 0.0, kube.Unavailable("injected"))  # as after a failed reconcile
        await operator._pending[key].task
        await operator.cleanup()

    asyncio.run(retry_with_stale_copy())
    engine = cluster.get(DEPLOYMENTS, "default", f"{NAME}-engine")
    assert engine["spec"]["replicas"] == 3
