"""What the operator's cleanup does to reconciles under way when it stops: it lets them
finish before it closes the API client, within a bound, and schedules nothing more."""

import asyncio
import contextlib
import pathlib

import kmock
import pytest
import yaml

from holeblend_devtools.emulator import ClusterEmulator, Fault
from holeblend_operator import handlers, kube
from holeblend_operator.settings import OperatorSettings

ROOT = pathlib.Path(__file__).parents[2]
BD = "blend.holeblend.io/v1alpha1/blenddeployments"
CHILDREN = ("apps/v1/deployments", "v1/services", "v1/configmaps")


@contextlib.asynccontextmanager
async def emulated_cluster(*faults: Fault):
    """The API emulator, serving the BlendDeployment CRD and `faults`, and a real client."""
    async with ClusterEmulator(faults=list(faults)) as api, kmock.Server(api) as server:
        with open(ROOT / "crds" / "blenddeployments.blend.holeblend.io.yaml") as file:
            api.install_crd(yaml.safe_load(file))
        config = kube.kubernetes.client.Configuration()
        config.host = str(server.url).rstrip("/")
        yield api, kube.Client.from_configuration(config, 10.0, 4)


async def reconciling(api, client, warned: list) -> handlers.Operator:
    """An operator whose first reconcile of the example has a request on the wire now."""
    with open(ROOT / "examples" / "cpu.yaml") as file:
        owner = await api.put_object(BD, yaml.safe_load(file))
    operator = handlers.Operator(OperatorSettings())
    operator.client = client
    operator._warn = lambda key, reason, message: warned.append(reason)
    operator.owner_event(owner, "ADDED")
    while not api.take_requests():  # the first request of the reconcile has arrived
        await asyncio.sleep(0.01)
    return operator


async def test_cleanup_lets_a_running_reconcile_finish_before_closing_the_client():
    """SIGTERM while a reconcile is half-way: closed under it, the client would fail the
    reconcile's next request ("Session is closed"), or that of the status refresh it asks
    for, which would report the failure on the user's object and schedule a retry that kopf
    cancels as a leftover task."""
    warned: list = []
    slow_deployment = Fault("create", "deployments", status=None, delay=0.3)
    async with emulated_cluster(slow_deployment) as (api, client):
        operator = await reconciling(api, client, warned)
        await operator.cleanup()
        children = {plural: api.list_objects(plural, "default") for plural in CHILDREN}
    assert warned == []
    assert all(children.values()), children
    assert operator._pending == {}  # neither a retry nor a status refresh left behind


async def test_cleanup_cancels_a_reconcile_that_outlasts_the_grace_without_a_warning(
    monkeypatch,
):
    monkeypatch.setattr(handlers, "SHUTDOWN_GRACE_S", 0.2, raising=False)
    warned: list = []
    stuck = Fault("create", "deployments", status=None, delay=3.0)
    async with emulated_cluster(stuck) as (api, client):
        operator = await reconciling(api, client, warned)
        running = set(operator._running)
        await operator.cleanup()
        assert running and all(task.cancelled() for task in running)
    assert warned == []
    assert operator._pending == {}


@pytest.mark.parametrize("trigger", ["retry", "child-status"])
async def test_nothing_is_scheduled_once_cleanup_has_begun(trigger):
    operator = handlers.Operator(OperatorSettings())
    await operator.cleanup()
    operator.request(("default", "demo"), handlers.FULL, trigger, delay=0)
    assert operator._pending == {}


async def test_a_job_waiting_for_its_turn_when_cleanup_begins_starts_no_reconcile():
    """In a burst, many jobs wait for the owner's lock or a slot: once the operator stops,
    none starts a reconcile that the grace period would only cut."""
    warned: list = []
    async with emulated_cluster() as (api, client):
        with open(ROOT / "examples" / "cpu.yaml") as file:
            owner = await api.put_object(BD, yaml.safe_load(file))
        operator = handlers.Operator(OperatorSettings())
        operator.client = client
        operator._warn = lambda key, reason, message: warned.append(reason)
        key = ("default", owner["metadata"]["name"])
        async with operator.lock(key):
            operator.owner_event(owner, "ADDED")
            while operator._pending:  # the job has left the queue and waits for the lock
                await asyncio.sleep(0.01)
            api.take_requests()
            stopping = asyncio.create_task(operator.cleanup())
            await asyncio.sleep(0)
        await stopping
        sent = api.take_requests()
    assert [(r.method, r.resource.plural) for r in sent] == []
    assert warned == []
