"""An owner's lock against a namesake: a BlendDeployment deleted and created again at once
(same namespace and name, a new uid) while a job of the old one is still under way."""

import asyncio
import copy

from holeblend_operator import handlers
from holeblend_operator.settings import OperatorSettings
from tests.operator.test_watch_gaps import KEY, Cluster


class SlowCluster(Cluster):
    """The cluster, with the first create of the old owner's children held until `release`
    is set; each create notes which owner's creates were under way when it began."""

    def __init__(self):
        super().__init__()
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.under_way: list[str] = []  # owner uid per create under way
        self.beside: list[tuple[str, list[str]]] = []  # (uid, the others' under way) per create

    async def create(self, kind, body):
        uid = body["metadata"]["ownerReferences"][0]["uid"]
        self.beside.append((uid, [other for other in self.under_way if other != uid]))
        self.under_way.append(uid)
        try:
            if uid == "uid-bd" and not self.held.is_set():
                self.held.set()
                await self.release.wait()
            return await super().create(kind, body)
        finally:
            self.under_way.remove(uid)


async def run_until_stuck() -> None:
    """Let every task run as far as it can (nothing here waits on a clock or a socket)."""
    for _ in range(100):
        await asyncio.sleep(0)


def test_a_namesakes_reconcile_waits_for_the_deleted_owners_running_one():
    """The old owner's reconcile is inside an API call when its DELETED event comes and the
    namesake's ADDED follows. The namesake's reconcile must wait for the old one's lock to
    be released: two at once would interleave their creates and patches of the same
    children."""

    async def scenario():
        cluster = SlowCluster()
        operator = handlers.Operator(OperatorSettings(status_debounce_s=0, requeue_s=3600))
        operator.client = cluster
        operator.owner_event(copy.deepcopy(cluster.owner), "ADDED")
        await cluster.held.wait()
        operator.owner_event(copy.deepcopy(cluster.owner), "DELETED")
        cluster.owner["metadata"]["uid"] = "uid-bd-2"
        operator.owner_event(copy.deepcopy(cluster.owner), "ADDED")
        await run_until_stuck()
        cluster.release.set()
        await run_until_stuck()
        for job in operator._pending.values():
            job.task.cancel()
        return cluster, operator

    cluster, operator = asyncio.run(scenario())
    assert [uid for uid, _ in cluster.beside if uid == "uid-bd-2"]  # the namesake's ran
    assert [(uid, others) for uid, others in cluster.beside if others] == []
    assert operator.owners[KEY].inputs[0] == "uid-bd-2"  # the old one's end kept it
    assert operator._locks == {}
