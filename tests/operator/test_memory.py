"""What the operator keeps per BlendDeployment: small, bounded, and released on delete.

RSS figures belong to `make bench-operator`; this checks the state the handlers keep (the
Python objects, measured with tracemalloc), which a change that caches whole bodies or
rendered manifests again would multiply (about 0.1 MB per BlendDeployment before)."""

import copy
import gc
import pathlib
import tracemalloc

import yaml

from holeblend_operator import handlers
from holeblend_operator.settings import OperatorSettings

ROOT = pathlib.Path(__file__).parents[2]
NUM_OWNERS = 200
# Measured: about 14.5 KB per owner (its body, render, two Deployments, child versions).
MAX_BYTES_PER_OWNER = 30_000


class Quiet(handlers.Operator):
    """The operator's state without its jobs (no event loop needed)."""

    def request(self, key, options, trigger, delay=None, refetch=False):
        pass


def owner(index: int) -> dict:
    with open(ROOT / "examples" / "cpu.yaml") as file:
        body = yaml.safe_load(file)
    body["metadata"] = {
        "name": f"bd-{index:04d}",
        "namespace": "default",
        "uid": f"uid-{index}",
        "generation": 1,
        "resourceVersion": str(index),
        "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}] * 20,
        "annotations": {handlers.KUBECTL_LAST_APPLIED: "x" * 4000},
    }
    body["status"] = {
        "observedGeneration": 1,
        "recomputeRatio": 0.15,
        "tuning": {"baseRatio": 0.15},
    }
    return body


def live(child: dict, version: int) -> dict:
    """A child as the API server returns it: server fields, and a status for Deployments."""
    obj = copy.deepcopy(child)
    obj["metadata"].update(uid=f"c-{version}", resourceVersion=str(version), generation=1)
    obj["metadata"]["managedFields"] = [{"manager": "holeblend", "fieldsV1": {}}] * 10
    if obj["kind"] == "Deployment":
        replicas = obj["spec"].get("replicas", 1)
        obj["status"] = {"observedGeneration": 1, "readyReplicas": replicas, "replicas": replicas}
    return obj


def watch(operator: handlers.Operator, bodies: list[dict]) -> list[dict]:
    """Every owner and its children through the handlers, as the watches deliver them."""
    children = []
    for index, body in enumerate(bodies):
        operator.owner_event(body, "ADDED")
        _, desired = operator.prepared(body)
        for number, child in enumerate(desired):
            obj = live(child, index * 10 + number)
            operator.child_event(obj, "ADDED")
            children.append(obj)
    return children


def test_the_state_kept_per_blend_deployment_is_small():
    operator = Quiet(OperatorSettings())
    bodies = [owner(index) for index in range(NUM_OWNERS)]
    watch(operator, bodies[:1])  # imports, caches and interned names: not per owner
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        children = watch(operator, bodies[1:])
        del children
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(operator.owners) == NUM_OWNERS
    # the bodies passed in are the watch's: the kept copies must not hold on to what is large
    del bodies
    assert kept / (NUM_OWNERS - 1) < MAX_BYTES_PER_OWNER, kept / (NUM_OWNERS - 1)


def test_kept_copies_leave_out_what_nothing_reads():
    operator = Quiet(OperatorSettings())
    (deployment, *_) = [c for c in watch(operator, [owner(0)]) if c["kind"] == "Deployment"]
    kept = operator.owners[("default", "bd-0000")]
    assert "managedFields" not in kept["metadata"]
    assert handlers.KUBECTL_LAST_APPLIED not in kept["metadata"]["annotations"]
    assert kept["status"]["recomputeRatio"] == 0.15  # what render reads stays
    slim = operator._deployments[("default", deployment["metadata"]["name"])]
    assert slim["status"] == deployment["status"]
    assert slim["spec"] == {"replicas": deployment["spec"]["replicas"]}
    assert "template" not in slim["spec"] and "annotations" not in slim["metadata"]


def test_deleting_releases_everything_kept_for_the_owner_and_its_children():
    operator = Quiet(OperatorSettings())
    bodies = [owner(index) for index in range(3)]
    children = watch(operator, bodies)
    for body in bodies:
        operator.lock(handlers._key(body))  # a reconcile ran
        operator.owner_event(body, "DELETED")
    for child in children:  # the garbage collector deletes the children
        operator.child_event(child, "DELETED")
    tables = (
        operator._owners,
        operator._inputs,
        operator._pending,
        operator._retries,
        operator._locks,
        operator._rendered,
        operator._current,
        operator._deployments,
        operator.tuning._due,
    )
    assert all(not table for table in tables), [len(t) for t in tables]
