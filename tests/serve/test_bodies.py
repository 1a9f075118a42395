"""Request bodies the HTTP layer cannot decode, answered in-process (no model needed: the
body is read before anything touches the engine)."""

from __future__ import annotations

import gzip
import json
import logging
import re
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.settings import ServeSettings
from tests.serve.conftest import example_settings_json


@pytest.fixture
async def client(tmp_path: Path):
    config = tmp_path / "blend.json"
    config.write_text(example_settings_json())
    server = Server(ServeSettings(config=config, torch_threads=1))
    server.is_ready = True  # the body is refused before the (absent) engine is needed
    async with TestClient(TestServer(server.app())) as client:
        client.server_state = server
        yield client
    server.close()


def requests_counted(server: Server, outcome: str) -> float:
    text = server.metrics.exposition().decode()
    pattern = rf'^holeblend_requests_total{{mode="unknown",outcome="{outcome}"}} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_whose_content_encoding_does_not_decode_is_a_400(client, encoding, caplog):
    """A body that says gzip (or deflate) but is not was a 500 "internal error" with a
    traceback in the log (and a client that retries 5xx, as the openai package does, sent
    it again): it is the client's fault, a JSON 400, the connection closes, and nothing is
    logged as an error."""
    body = json.dumps({"model": "smollm2", "prompt": "Hi"}).encode()
    response = await client.post(
        "/v1/completions",
        data=body,  # sent as is: not compressed
        headers={"Content-Encoding": encoding, "Content-Type": "application/json"},
    )
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert "cannot be read" in error["message"]
    assert response.headers.get("Connection", "").lower() == "close"
    server = client.server_state
    assert requests_counted(server, "bad_request") == 1
    assert requests_counted(server, "error") == 0
    await client.close()  # the connection's end: what aiohttp would log, it has logged
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_well_encoded_body_is_read(client):
    """A body that is gzip indeed is decoded and parsed (here: not JSON, the parser's 400)."""
    response = await client.post(
        "/v1/completions",
        data=gzip.compress(b"not json"),
        headers={"Content-Encoding": "gzip"},
    )
    assert response.status == 400
    assert "not valid JSON" in (await response.json())["error"]["message"]
