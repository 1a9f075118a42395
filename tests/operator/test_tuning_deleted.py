"""A BlendDeployment deleted while the tuner evaluates it: its DELETED event forgets its
series, and the evaluation under way must not export them again when it ends, wherever in
it the deletion falls (a deleted owner would stay in /metrics for the life of the process).
A namesake created after the deletion starts with series of its own."""

import asyncio
import copy
import time

import pytest

from holeblend_operator import handlers, metrics
from holeblend_operator.settings import OperatorSettings
from holeblend_operator.tuner import Reading
from holeblend_operator.tuning_loop import TuningLoop

SPEC = {
    "model": {"name": "m", "source": {"hub": {"id": "org/m"}}},
    "accelerator": {"type": "cpu", "count": 0},
    "blend": {"recomputeRatio": 0.15},
}
KEY = ("ns", "deleted-while-tuned")
LOW = Reading(0.2, 0.9, 40, 75.0, 0.4, 2.0, (0.15,))  # below target: the law raises 0.15
WAIT_S = 10.0  # a bound for a hang, never reached when the loop works


def _body(uid: str) -> dict:
    return {
        "apiVersion": "blend.holeblend.io/v1alpha1",
        "kind": "BlendDeployment",
        "metadata": {"name": KEY[1], "namespace": KEY[0], "generation": 1, "uid": uid},
        "spec": SPEC,
        "status": {},
    }


class _Client:
    """The API server with one BlendDeployment; the evaluation stops at the step named
    `pause` until the test sets `resume` (the object answered for is the one before)."""

    def __init__(self, pause: str | None):
        self.body, self.pause = _body("u"), pause
        self.paused, self.resume = asyncio.Event(), asyncio.Event()
        self.reads = 0

    async def get(self, kind, namespace, name):
        self.reads += 1
        answer = copy.deepcopy(self.body)
        await self.stop_at("locked read" if self.reads == 2 else "read")
        return answer

    async def patch_status(self, namespace, name, patch):
        if self.body is None:
            return None  # 404: kube.Client.patch_status's None
        self.body["status"] = self.body["status"] | patch
        answer = copy.deepcopy(self.body)
        await self.stop_at("status write")
        return answer

    async def stop_at(self, step: str) -> None:
        if step == self.pause:
            self.paused.set()
            await self.resume.wait()

    def delete(self) -> dict:
        """The object gone, as its DELETED event carries it."""
        gone, self.body = self.body, None
        return gone

    def create(self, uid: str) -> dict:
        self.body = _body(uid)
        return copy.deepcopy(self.body)


class _Loop(TuningLoop):
    async def read(self, bd, ratio):
        await self.operator.client.stop_at("metrics read")
        return LOW


class _Operator(handlers.Operator):
    """The operator with the owners as its watch delivers them; its jobs are not run."""

    def __init__(self, client):
        super().__init__(OperatorSettings())
        self.client = client
        self.tuning = _Loop(self)

    def request(self, key, options, trigger, delay=None, refetch=False):
        pass


def _series(key: tuple) -> dict:
    """The tuner's samples exported for `key`: name (and decision labels) -> value."""
    return {
        (sample.name, sample.labels.get("direction"), sample.labels.get("reason")): sample.value
        for family in metrics.TUNING.collect()
        for sample in family.samples
        if (sample.labels["namespace"], sample.labels["name"]) == key
        and not sample.name.endswith("_created")
    }


async def _evaluate(operator: _Operator, during=None) -> None:
    """One evaluation of KEY, due now, through the loop's tick; `during` runs while it is
    stopped at its client's pause, which then ends."""
    loop, client = operator.tuning, operator.client
    loop._last[KEY] = time.monotonic() - operator.owners[KEY].interval
    tick = asyncio.create_task(loop.tick())
    try:
        if during is not None:
            await asyncio.wait_for(client.paused.wait(), WAIT_S)
            during()
            client.resume.set()
        await asyncio.wait_for(tick, WAIT_S)
        await asyncio.wait_for(asyncio.gather(*loop._running.values()), WAIT_S)
    finally:
        client.resume.set()
        await asyncio.gather(tick, *loop._running.values(), return_exceptions=True)


@pytest.mark.parametrize("step", ["read", "metrics read", "locked read", "status write"])
async def test_an_owner_deleted_during_its_evaluation_leaves_no_series(step):
    client = _Client(step)
    operator = _Operator(client)
    operator.owner_event(copy.deepcopy(client.body), None)
    try:
        await _evaluate(operator, lambda: operator.owner_event(client.delete(), "DELETED"))
        left = _series(KEY)
    finally:
        metrics.TUNING.forget(KEY)
    assert KEY not in operator.owners
    assert left == {}


async def test_a_namesake_created_while_the_deleted_one_was_evaluated_gets_series_of_its_own():
    """`kubectl delete` and `apply` again while the old object's status write is under way:
    the new object's first decision is the only one counted under the name."""
    client = _Client("status write")
    operator = _Operator(client)
    operator.owner_event(copy.deepcopy(client.body), None)

    def recreate():
        operator.owner_event(client.delete(), "DELETED")
        operator.owner_event(client.create("u-new"), "ADDED")

    try:
        await _evaluate(operator, recreate)
        client.pause = None
        await _evaluate(operator)
        series = _series(KEY)
    finally:
        metrics.TUNING.forget(KEY)
    decisions = {k: v for k, v in series.items() if k[0].endswith("_decisions_total")}
    assert decisions == {("holeblend_operator_tuning_decisions_total", "up", "BelowTarget"): 1.0}
    assert (
        series[("holeblend_operator_tuned_ratio", None, None)]
        == client.body["status"]["recomputeRatio"]
    )
    assert client.body["metadata"]["uid"] == "u-new"
