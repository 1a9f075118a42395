"""What the operator keeps per BlendDeployment: small, bounded, and released on delete.

RSS figures belong to `make bench-operator`; this checks the state the handlers and the
tuner keep (the Python objects, measured with tracemalloc), which a change that keeps whole
bodies, rendered manifests or labelled metrics per object again would multiply (about
0.1 MB per BlendDeployment before the first cut, 14.5 KB before the second)."""

import asyncio
import copy
import gc
import pathlib
import tracemalloc

import prometheus_client
import yaml

from holeblend_operator import handlers, metrics, tuning_loop
from holeblend_operator.api import TuningSpec
from holeblend_operator.settings import OperatorSettings
from holeblend_operator.tuner import Decision, State

ROOT = pathlib.Path(__file__).parents[2]
NUM_OWNERS = 200
# Measured: about 7 KB per owner (its packed body and render, two packed Deployments,
# child versions, its tuner series). Kept as dicts and labelled metrics: about 18 KB.
MAX_BYTES_PER_OWNER = 12_000


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
        obj["status"] = {
            "observedGeneration": 1,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
        }
    return obj


def watch(operator: handlers.Operator, bodies: list[dict]) -> list[dict]:
    """Every owner and its children through the handlers, as the watches deliver them, and
    a tuning decision for each."""
    children = []
    decision = Decision("hold", 0.15, 0.15, "NotEnoughSamples", "few", False, State())
    for index, body in enumerate(bodies):
        operator.owner_event(body, "ADDED")
        _, desired = operator.prepared(body)
        for number, child in enumerate(desired):
            obj = live(child, index * 10 + number)
            operator.child_event(obj, "ADDED")
            children.append(obj)
        operator.tuning._record(handlers._key(body), TuningSpec(), decision)
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
    kept = operator.owner(("default", "bd-0000"))
    assert "managedFields" not in kept["metadata"]
    assert handlers.KUBECTL_LAST_APPLIED not in kept["metadata"]["annotations"]
    assert kept["status"]["recomputeRatio"] == 0.15  # what render reads stays
    slim = operator.deployment("default", deployment["metadata"]["name"])
    assert slim["status"] == deployment["status"]
    assert slim["spec"] == {"replicas": deployment["spec"]["replicas"]}
    assert "template" not in slim["spec"] and "annotations" not in slim["metadata"]


def tuner_series(key: tuple[str, str]) -> list[str]:
    text = prometheus_client.generate_latest().decode()
    return [line for line in text.splitlines() if f'name="{key[1]}"' in line]


def test_deleting_releases_everything_kept_for_the_owner_and_its_children():
    operator = Quiet(OperatorSettings())
    bodies = [owner(index) for index in range(3)]
    children = watch(operator, bodies)
    assert tuner_series(handlers._key(bodies[0]))  # the tuner's gauges and decision count

    async def reconcile_ran(key):
        async with operator.lock(key):
            assert key in operator._locks

    for body in bodies:
        asyncio.run(reconcile_ran(handlers._key(body)))
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
        operator.tuning._last,
    )
    assert all(not table for table in tables), [len(t) for t in tables]
    assert all(not tuner_series(handlers._key(body)) for body in bodies)


def test_an_owners_lock_is_kept_only_while_held_or_awaited_and_still_excludes():
    operator = Quiet(OperatorSettings())
    order = []

    async def hold(name, delay):
        async with operator.lock(("default", "a")):
            order.append(f"{name} in")
            await asyncio.sleep(delay)
            order.append(f"{name} out")

    async def scenario():
        first = asyncio.create_task(hold("first", 0.05))
        await asyncio.sleep(0)
        second = asyncio.create_task(hold("second", 0))
        await asyncio.sleep(0.01)
        waiting = len(operator._locks)
        await asyncio.gather(first, second)
        return waiting

    assert asyncio.run(scenario()) == 1
    assert order == ["first in", "first out", "second in", "second out"]
    assert operator._locks == {}


def test_a_tuning_switched_off_drops_its_gauges_and_keeps_its_decision_count():
    key = ("default", "untuned")
    decision = Decision("up", 0.1, 0.15, "BelowTarget", "low", False, State())
    loop = tuning_loop.TuningLoop(operator=None)
    loop._record(key, TuningSpec(min_ratio=0.05, max_ratio=0.15), decision)
    sample = prometheus_client.REGISTRY.get_sample_value
    labels = {"namespace": key[0], "name": key[1]}
    decided = labels | {"direction": "up", "reason": "BelowTarget"}
    assert sample("holeblend_operator_tuned_ratio", labels) == 0.15
    assert sample("holeblend_operator_tuning_min_ratio", labels) == 0.05
    assert sample("holeblend_operator_tuning_decisions_total", decided) == 1
    metrics.TUNING.forget(key, decisions=False)
    assert sample("holeblend_operator_tuned_ratio", labels) is None
    assert sample("holeblend_operator_tuning_decisions_total", decided) == 1
    loop.forget(key)  # deleted
    assert sample("holeblend_operator_tuning_decisions_total", decided) is None
