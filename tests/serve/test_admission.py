"""Admission before a body is read (runtime/serve/app.py): a request holds its queue place
from the queue check until it is queued or refused, and a client that sends
`Expect: 100-continue` gets its refusal before it sends the body; on a server in this
process with the real model and a queue of one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from holeblend_runtime.serve.app import MAX_BODY_BYTES, Server
from tests.serve.conftest import in_process_server

BODY = {"model": "smollm2", "prompt": "Which lake shrank?", "max_tokens": 2}
BODY_BYTES = json.dumps(BODY).encode()


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
    with in_process_server(tmp_path_factory.mktemp("admission"), queue_size=1) as server:
        yield server


def requests_counted(server: Server, outcome: str) -> float:
    labels = {"mode": "full", "outcome": outcome}
    return server.metrics.registry.get_sample_value("holeblend_requests_total", labels) or 0.0


async def until(predicate, what: str) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {what}")


@contextlib.asynccontextmanager
async def one_parse_held(server: Server, client: TestClient) -> AsyncIterator[asyncio.Task]:
    """One request sent on `client`, its parse held at the gate, so that it holds the
    queue's one place until the block ends and the gate opens; yields the request's task."""
    with ParseGate(server) as gate:
        request = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await until(lambda: gate.num_started == 1, "parsed")
        yield request


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
        async with one_parse_held(server, client) as leaving:
            other = await asyncio.wait_for(client.post("/v1/completions", json=BODY), 10)
            assert other.status == 429
            leaving.cancel()
            await until(lambda: requests_counted(server, "cancelled") > cancelled, "cancelled")
        assert (await client.post("/v1/completions", json=BODY)).status == 200


# --- Expect: 100-continue --------------------------------------------------------------


async def send_head(client: TestClient, length: int, expect: str = "100-continue"):
    """A raw POST's head with `Expect`, none of its body: what curl (for a large body) and
    many HTTP clients send first, waiting for `100 Continue` before the body."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nExpect: {expect}\r\n\r\n"
    )
    writer.write(head.encode())
    await writer.drain()
    return reader, writer


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The next answer on the connection: status, headers (lower-case names), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode().split("\r\n")[:-2]
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 10)
    return int(status_line.split()[1]), headers, body


async def test_an_upload_that_expects_100_continue_gets_it_then_its_answer(in_process):
    async with TestClient(TestServer(in_process.app())) as client:
        reader, writer = await send_head(client, len(BODY_BYTES))
        assert (await read_answer(reader))[0] == 100
        writer.write(BODY_BYTES)
        status, _, body = await read_answer(reader)
        writer.close()
        assert status == 200, body
        assert json.loads(body)["choices"][0]["finish_reason"]


async def test_a_full_queue_refuses_an_upload_before_its_body_is_sent(in_process):
    """aiohttp answered `100 Continue` before the route's checks: a client waiting for it
    sent its whole body, only to get the 429 the server knew of before. The 429 now comes
    instead of `100 Continue`, with its Retry-After and JSON body, and the connection
    closes (the body was never sent)."""
    server = in_process
    rejected = requests_counted(server, "rejected")
    async with TestClient(TestServer(server.app())) as client:
        async with one_parse_held(server, client) as holding:
            reader, writer = await send_head(client, len(BODY_BYTES))
            status, headers, body = await read_answer(reader)
            writer.close()
            assert status == 429, body
            assert int(headers["retry-after"]) >= 1
            assert headers["connection"].lower() == "close"
            assert json.loads(body)["error"]["type"] == "rate_limit_error"
            assert requests_counted(server, "rejected") == rejected + 1
        assert (await holding).status == 200


async def test_a_server_not_ready_refuses_an_upload_before_its_body_is_sent(in_process):
    server = in_process
    server.is_ready = False
    try:
        async with TestClient(TestServer(server.app())) as client:
            reader, writer = await send_head(client, len(BODY_BYTES))
            status, headers, body = await read_answer(reader)
            writer.close()
    finally:
        server.is_ready = True
    assert status == 503, body
    assert int(headers["retry-after"]) >= 1
    assert json.loads(body)["error"]["message"] == "the model is still loading"


async def test_an_announced_body_over_the_limit_is_a_413_before_it_is_sent(in_process):
    async with TestClient(TestServer(in_process.app())) as client:
        reader, writer = await send_head(client, MAX_BODY_BYTES + 1)
        status, headers, body = await read_answer(reader)
        writer.close()
    assert status == 413, body
    assert headers["connection"].lower() == "close"
    assert str(MAX_BODY_BYTES) in json.loads(body)["error"]["message"]


async def test_an_unknown_expectation_is_a_json_417(in_process):
    async with TestClient(TestServer(in_process.app())) as client:
        reader, writer = await send_head(client, len(BODY_BYTES), expect="200-ok")
        status, _, body = await read_answer(reader)
        writer.close()
    assert status == 417, body
    error = json.loads(body)["error"]
    assert "200-ok" in error["message"] and error["type"] == "invalid_request_error"
