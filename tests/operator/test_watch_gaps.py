"""What the operator does when its watch misses events: after a watch gap (410 Gone, a
pause for a peer) kopf lists the objects again and sends no DELETED event for those deleted
meanwhile, and a status write's own watch event may arrive after the next refresh."""

import asyncio
import copy
import itertools
import pathlib
import time

import yaml
from kmock._internal.dicts import merge_patch_dict  # the emulator's merge patch

from holeblend_operator import handlers
from holeblend_operator.render import engine_name, lookup_name
from holeblend_operator.settings import OperatorSettings

ROOT = pathlib.Path(__file__).parents[2]
KEY = ("default", "smollm2-demo")
ENGINE, LOOKUP = engine_name(KEY[1]), lookup_name(KEY[1])


class Cluster:
    """One BlendDeployment (the example) and its children as an API server keeps them:
    uid, resourceVersion and generation set on each write; nothing is sent on a watch
    unless a test delivers it. `on_status_write` runs inside each status write."""

    def __init__(self):
        with open(ROOT / "examples" / "cpu.yaml") as file:
            self.owner = yaml.safe_load(file)
        self.owner["metadata"].update(namespace=KEY[0], uid="uid-bd", generation=1)
        self.owner["status"] = {}
        self.objects: dict[tuple[str, str], dict] = {}
        self.versions = itertools.count(100)
        self.on_status_write = None

    def _stored(self, obj: dict) -> dict:
        obj["metadata"]["resourceVersion"] = str(next(self.versions))
        return copy.deepcopy(obj)

    async def get(self, kind, namespace, name):
        if kind.kind == "BlendDeployment":
            return copy.deepcopy(self.owner) if self.owner is not None else None
        return copy.deepcopy(self.objects.get((kind.kind, name)))

    async def create(self, kind, body):
        key = (body["kind"], body["metadata"]["name"])
        if key in self.objects:
            return None
        obj = copy.deepcopy(body)
        obj["metadata"].update(uid=f"uid-{next(self.versions)}", generation=1)
        self.objects[key] = obj
        return self._stored(obj)

    async def patch(self, kind, namespace, name, patch):
        obj = merge_patch_dict(self.objects[(kind.kind, name)], patch)
        obj["metadata"]["generation"] += 1
        self.objects[(kind.kind, name)] = obj
        return self._stored(obj)

    async def list(self, kind, namespace, selector):
        return [copy.deepcopy(o) for (k, _), o in self.objects.items() if k == kind.kind]

    async def delete(self, kind, namespace, name):
        return self.objects.pop((kind.kind, name), None) is not None

    async def patch_status(self, namespace, name, status):
        self.owner["status"] = merge_patch_dict(self.owner["status"], copy.deepcopy(status))
        answer = self._stored(self.owner)
        if self.on_status_write is not None:
            self.on_status_write()
        return answer

    def roll_out(self, name: str, available: bool = True) -> dict:
        """The Deployment `name` with its rollout complete (or its pods not available), as
        its watch event carries it."""
        obj = self.objects[("Deployment", name)]
        replicas = obj["spec"].get("replicas", 1)
        count = replicas if available else 0
        obj["status"] = {
            "observedGeneration": obj["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": count,
            "availableReplicas": count,
        }
        return self._stored(obj)

    def ready(self) -> tuple[str, str]:
        ready = next(c for c in self.owner["status"]["conditions"] if c["type"] == "Ready")
        return ready["status"], ready["reason"]


async def settle(operator: handlers.Operator, horizon_s: float = 60.0) -> None:
    """Run the jobs due within `horizon_s` (a requeue after requeue_s is not), and those
    they schedule, until none is left pending or running."""
    for _ in range(100):
        later = {j.task for j in operator._pending.values() if j.due > time.monotonic() + horizon_s}
        busy = asyncio.all_tasks() - later - {asyncio.current_task()}
        if not busy:
            return
        await asyncio.wait(busy)
    raise AssertionError("jobs kept coming")


async def come_due(operator: handlers.Operator) -> None:
    """The pending jobs run as if their time had come (a requeue after requeue_s)."""
    for key, job in list(operator._pending.items()):
        job.task.cancel()
        job.due = 0.0
        job.task = asyncio.get_running_loop().create_task(operator._later(key, 0.0))
    await settle(operator)


async def watched_ready() -> tuple[handlers.Operator, Cluster]:
    """An operator that created the example's children, watched them roll out and wrote
    Ready; the watch has delivered every event, its own status writes included."""
    cluster = Cluster()
    operator = handlers.Operator(OperatorSettings(status_debounce_s=0, requeue_s=3600))
    operator.client = cluster
    operator.owner_event(copy.deepcopy(cluster.owner), "ADDED")
    await settle(operator)
    for obj in list(cluster.objects.values()):
        operator.child_event(copy.deepcopy(obj), "ADDED")
    for name in (ENGINE, LOOKUP):
        operator.child_event(cluster.roll_out(name), "MODIFIED")
    await settle(operator)
    operator.owner_event(copy.deepcopy(cluster.owner), "MODIFIED")
    assert cluster.ready() == ("True", "AllReplicasReady")
    return operator, cluster


def relist(operator: handlers.Operator, cluster: Cluster) -> None:
    """kopf's listing after a watch gap: what is there now, as events of type None."""
    for obj in list(cluster.objects.values()):
        operator.child_event(copy.deepcopy(obj), None)
    if cluster.owner is not None:
        operator.owner_event(copy.deepcopy(cluster.owner), None)


def test_a_deployment_deleted_while_the_watch_was_down_is_created_again():
    """`kubectl delete deploy NAME-engine` during a watch gap: no DELETED event comes. The
    relist must not leave the owner Ready on the engine's watched copy, with no engine."""

    async def scenario():
        operator, cluster = await watched_ready()
        del cluster.objects[("Deployment", ENGINE)]
        relist(operator, cluster)
        await settle(operator)
        for job in operator._pending.values():
            job.task.cancel()
        return cluster

    cluster = asyncio.run(scenario())
    assert ("Deployment", ENGINE) in cluster.objects
    assert cluster.ready() == ("False", "EngineNotReady")


def test_an_owner_found_gone_after_a_watch_gap_leaves_nothing_of_its_children():
    """The owner and its children deleted during a watch gap; the tuner's read finds the
    owner gone. What was kept of its children goes with it, as their DELETED events would
    have dropped it: nothing else ever would."""

    async def scenario():
        operator, cluster = await watched_ready()
        cluster.owner, cluster.objects = None, {}
        operator.gone(KEY, operator.owners[KEY])
        return operator

    operator = asyncio.run(scenario())
    assert KEY not in operator.owners
    assert [key for key in operator._current if key[1] == KEY[0]] == []
    assert operator._deployments == {}


def test_a_lookup_server_ready_again_during_the_status_write_is_reported_ready():
    """The lookup server's pod fails its readiness probe for a moment: a refresh writes
    Ready False (LookupServerNotReady), and the pod is ready again before that write's
    own watch event arrives. The refresh that follows compares with the watched status,
    Ready True still, and writes nothing: the owner must be looked at again, as one
    whose engine is not ready is, or it stays not Ready for good."""

    async def scenario():
        operator, cluster = await watched_ready()

        def lookup_back():  # during the first write only
            cluster.on_status_write = None
            operator.child_event(cluster.roll_out(LOOKUP), "MODIFIED")

        cluster.on_status_write = lookup_back
        operator.child_event(cluster.roll_out(LOOKUP, available=False), "MODIFIED")
        await settle(operator)
        operator.owner_event(copy.deepcopy(cluster.owner), "MODIFIED")  # the write's, late
        await come_due(operator)
        for job in operator._pending.values():
            job.task.cancel()
        return cluster

    cluster = asyncio.run(scenario())
    assert cluster.ready() == ("True", "AllReplicasReady")


def test_an_untuned_owner_deleted_while_its_own_watch_was_down_is_forgotten_by_the_sweep():
    """The owner and its children deleted during a gap on every watch: the listing after it
    sends nothing for them, and no tuner reads an untuned owner. The sweep reads each owner
    no event has shown for a while and forgets this one with what was kept of it."""

    async def scenario():
        operator, cluster = await watched_ready()
        cluster.owner, cluster.objects = None, {}
        relist(operator, cluster)
        await settle(operator)
        await operator.sweep(time.monotonic())
        return operator

    operator = asyncio.run(scenario())
    tables = (operator._owners, operator._inputs, operator._applied, operator._rendered)
    assert [KEY in table for table in tables] == [False] * len(tables)
    assert operator._current == {} and operator._deployments == {}


def test_the_sweep_reads_an_owner_still_there_once_and_keeps_it():
    """An owner whose watch is quiet costs one read per sweep period: the read shows it, and
    a second sweep for the same age reads nothing."""

    async def scenario():
        operator, cluster = await watched_ready()
        reads = []
        get = cluster.get

        async def counted_get(kind, namespace, name):
            reads.append(kind.kind)
            return await get(kind, namespace, name)

        cluster.get = counted_get
        quiet_since = time.monotonic()
        await operator.sweep(quiet_since)
        await operator.sweep(quiet_since)
        return operator, reads

    operator, reads = asyncio.run(scenario())
    assert reads == ["BlendDeployment"]
    assert KEY in operator.owners
