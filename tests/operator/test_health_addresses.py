"""/healthz and /metrics answer on IPv6 and IPv4 alike by default: the kubelet probes a pod
on its own address, an IPv6 one alone in an IPv6-only cluster."""

import asyncio
import socket

import aiohttp
import pytest

from holeblend_operator import run_command, settings
from holeblend_operator.health import HealthServer


async def status_at(host: str, port: int) -> int:
    url = f"http://{host}:{port}/healthz"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status


async def test_the_default_address_answers_on_ipv6_and_ipv4():
    operator = asyncio.create_task(asyncio.Event().wait())  # kopf's operator, still running
    ready = asyncio.Event()
    ready.set()
    health = HealthServer(operator, ready)
    await health.start(settings.OperatorSettings().health_host, 0)
    try:
        assert await status_at("[::1]", health.port) == 200
        assert await status_at("127.0.0.1", health.port) == 200
    finally:
        operator.cancel()
        await health.stop()


async def test_a_port_taken_on_ipv4_stops_the_start_with_the_default_address():
    """Listening on IPv6 alone instead would leave the probes on IPv4 nodes unanswered."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = settings.OperatorSettings(health_port=port)
        with pytest.raises(run_command.StartError, match="--health-port: cannot listen on"):
            await run_command.serve(config)
