"""Admission before a body is read (runtime/serve/app.py): a request holds its queue place
from the queue check until it is queued or refused, on a server in this process with the
real model and a queue of one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.settings import ServeSettings
from tests.serve.conftest import example_settings_json

BODY = {"model": "smollm2", "prompt": "Which lake shrank?", "max_tokens": 2}


class ParseGate:
    """Wraps the server's parse (run on its parse threads): each parse waits until the gate
    opens; `num_started` counts the parses that reached it."""

    def __init__(self, server: Server) -> None:
        self.server, self.parse = server, server._parse
        self.opened = threading.Event()
        self.num_started = 0

    def __call__(self, body: bytes, parse):
        self.num_started += 1
        self.opened.wait(10)
        return self.parse(body, parse)

    def __enter__(self) -> ParseGate:
        self.server._parse = self
        return self

    def __exit__(self, *_) -> None:
        self.opened.set()
        del self.server._parse


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("admission") / "blend.json"
    config.write_text(example_settings_json(mode="off", qualityProxies=False, lookupServerUrl=None))
    server = Server(ServeSettings(config, torch_threads=1, queue_size=1))
    server.load()
    server.is_ready = True
    yield server
    server.worker.stop()
    server.engine.close()
    server.close()


def requests_counted(server: Server, outcome: str) -> float:
    labels = {"mode": "full", "outcome": outcome}
    return server.metrics.registry.get_sample_value("holeblend_requests_total", labels) or 0.0


async def until(predicate, what: str) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {what}")


async def test_a_burst_beyond_the_queue_is_refused_before_its_bodies_are_parsed(in_process):
    """A request was checked against the queue before its body was read, but counted in
    it only once parsed: a burst arriving at an empty queue all passed the check, and every
    body was held and parsed (on two threads) before its 429. The requests being read or
    parsed now hold their places: with the parse held, all but the queue's one are 429."""
    server = in_process
    async with TestClient(TestServer(server.app())) as client:
        with ParseGate(server) as gate:
            posts = [
                asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(4)
            ]
            refused = []
            for post in asyncio.as_completed(posts, timeout=10):
                refused.append(await post)
                if len(refused) == 3:
                    break
            assert [response.status for response in refused] == [429] * 3
            for response in refused:
                assert int(response.headers["Retry-After"]) >= 1
                assert (await response.json())["error"]["type"] == "rate_limit_error"
            assert gate.num_started <= 1
            gate.opened.set()
            statuses = sorted([(await post).status for post in posts])
        assert statuses == [200, 429, 429, 429]


@pytest.mark.parametrize(
    "body",
    [b"{not json", b'{"model": "other", "prompt": "Which lake shrank?"}'],
    ids=["invalid-json", "unknown-model"],
)
async def test_a_refused_body_gives_its_queue_place_back(in_process, body):
    server = in_process
    async with TestClient(TestServer(server.app())) as client:
        response = await client.post(
            "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        assert response.status in (400, 404)
        assert (await client.post("/v1/completions", json=BODY)).status == 200


async def test_a_client_that_leaves_while_its_body_is_parsed_gives_its_place_back(in_process):
    """While its body is parsed a request holds the queue's one place; once its client has
    gone the place is free again, though its parse still runs."""
    server = in_process
    cancelled = requests_counted(server, "cancelled")
    async with TestClient(TestServer(server.app())) as client:
        with ParseGate(server) as gate:
            leaving = asyncio.create_task(client.post("/v1/completions", json=BODY))
            await until(lambda: gate.num_started == 1, "parsed")
            other = await asyncio.wait_for(client.post("/v1/completions", json=BODY), 10)
            assert other.status == 429
            leaving.cancel()
            await until(lambda: requests_counted(server, "cancelled") > cancelled, "cancelled")
        assert (await client.post("/v1/completions", json=BODY)).status == 200
