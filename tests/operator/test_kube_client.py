"""The client waits as long as an overloaded API server asks, and lets answers on their way
arrive before it closes."""

import asyncio
import contextlib
import time

import aiohttp.web
import pytest

from holeblend_operator import kube

PODS_PATH = "/api/v1/namespaces/default/pods"
STATUS_PATH = kube.BLEND_DEPLOYMENT.path("default", "x", "status")


@contextlib.asynccontextmanager
async def api_server(method: str, path: str, handler):
    """A stand-in API server answering `method path` with `handler`, and a client for it."""
    app = aiohttp.web.Application()
    app.router.add_route(method, path, handler)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
    config = kube.kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = kube.Client.from_configuration(config, 5.0, 4)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()


def too_many_requests(retry_after: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response(
        {"message": "too many requests"}, status=429, headers={"Retry-After": retry_after}
    )


async def test_a_429_is_sent_again_no_sooner_than_its_retry_after_says():
    sent_at = []

    async def get_pod_list(_):
        sent_at.append(time.monotonic())
        if len(sent_at) == 1:
            return too_many_requests("1")
        return aiohttp.web.json_response({"items": [{"metadata": {"name": "p"}}]})

    async with api_server("GET", PODS_PATH, get_pod_list) as client:
        found = await client.list(kube.PODS, "default", "app=x")
    assert [pod["metadata"]["name"] for pod in found] == ["p"]
    assert sent_at[1] - sent_at[0] >= 0.9


@pytest.mark.parametrize("retry_after", [None, "Wed, 21 Oct 2015 07:28:00 GMT", "soon", "-1"])
async def test_a_503_without_a_retry_after_in_seconds_is_left_to_the_handlers_backoff(
    retry_after,
):
    sent = []

    async def get_pod_list(_):
        sent.append(1)
        headers = {} if retry_after is None else {"Retry-After": retry_after}
        return aiohttp.web.json_response({"message": "busy"}, status=503, headers=headers)

    async with api_server("GET", PODS_PATH, get_pod_list) as client:
        with pytest.raises(kube.Unavailable, match="HTTP 503"):
            await client.list(kube.PODS, "default", "app=x")
    assert len(sent) == 1


async def test_a_server_that_keeps_asking_to_wait_gets_a_bounded_number_of_resends():
    sent = []

    async def patch_status(_):
        sent.append(1)
        return too_many_requests("0")

    async with api_server("PATCH", STATUS_PATH, patch_status) as client:
        with pytest.raises(kube.Unavailable, match="HTTP 429"):
            await client.patch_status("default", "x", {"recomputeRatio": "0.2"})
    assert len(sent) == 1 + kube.RETRY_AFTER_RESENDS


def test_a_retry_after_longer_than_the_cap_waits_the_cap():
    assert kube._retry_after(429, {"Retry-After": "3600"}) == kube.RETRY_AFTER_MAX_S


async def test_closing_lets_a_write_on_its_way_get_its_answer():
    received = asyncio.Event()
    written = []

    async def patch_status(request):
        received.set()
        written.append(await request.json())
        await asyncio.sleep(0.2)  # the API server is slow to answer
        return aiohttp.web.json_response(written[-1])

    async with api_server("PATCH", STATUS_PATH, patch_status) as client:
        write = asyncio.create_task(client.patch_status("default", "x", {"phase": "Ready"}))
        await received.wait()
        await client.close()  # the operator stops while the write is on its way
        answer = await write
    assert answer == {"status": {"phase": "Ready"}} == written[0]
