"""/healthz fails when a kopf watch stream has died, since kopf carries on without it."""

import asyncio
import socket

import aiohttp
import pytest
from kopf._cogs.aiokits.aiotasks import create_guarded_task  # how kopf runs its watchers

from holeblend_operator import run_command, settings
from holeblend_operator.health import HealthServer


async def watch_until(stop: asyncio.Event, error: Exception | None) -> None:
    await stop.wait()
    if error is not None:
        raise error


async def probe(health: HealthServer) -> tuple[int, str]:
    url = f"http://127.0.0.1:{health.port}/healthz"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def started_health_server() -> tuple[HealthServer, asyncio.Task]:
    operator = asyncio.create_task(asyncio.Event().wait())  # kopf's operator, still running
    ready = asyncio.Event()
    ready.set()
    health = HealthServer(operator, ready)
    await health.start("127.0.0.1", 0)
    return health, operator


async def test_a_watcher_that_failed_for_good_makes_the_operator_unhealthy():
    health, operator = await started_health_server()
    stop = asyncio.Event()
    name = "watcher for blenddeployments.v1alpha1.blend.holeblend.io@None"
    watcher = create_guarded_task(watch_until(stop, PermissionError("403")), name, cancellable=True)
    try:
        assert await probe(health) == (200, "ok\n")
        stop.set()
        await asyncio.wait([watcher])
        assert isinstance(watcher.exception(), PermissionError)
        status, text = await probe(health)
    finally:
        operator.cancel()
        await health.stop()
    assert status == 503 and name in text


async def test_watchers_that_kopf_stops_on_purpose_leave_the_operator_healthy():
    health, operator = await started_health_server()
    name = "watcher for deployments.v1.apps@gone-namespace"
    watcher = create_guarded_task(watch_until(asyncio.Event(), None), name, cancellable=True)
    try:
        assert await probe(health) == (200, "ok\n")
        watcher.cancel()  # kopf stops the watchers of a namespace that was deleted
        await asyncio.wait([watcher])
        assert await probe(health) == (200, "ok\n")
    finally:
        operator.cancel()
        await health.stop()


async def test_a_health_port_in_use_stops_the_start_with_one_line_naming_the_flag():
    """The port is taken: a clean error naming --health-port, and kopf's task ended rather
    than left running beside a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = settings.OperatorSettings(health_host="127.0.0.1", health_port=port)
        before = set(asyncio.all_tasks())
        with pytest.raises(
            run_command.StartError, match=f"--health-port: cannot listen on 127.0.0.1:{port}"
        ):
            await run_command.serve(config)
        assert not [t for t in asyncio.all_tasks() - before if not t.done()]


async def test_an_address_not_of_this_host_names_the_health_host_flag():
    """An address the pod does not have is --health-host's fault, not the port's."""
    config = settings.OperatorSettings(health_host="192.0.2.1", health_port=0)
    with pytest.raises(run_command.StartError, match="--health-host: cannot listen on '192.0.2.1'"):
        await run_command.serve(config)
