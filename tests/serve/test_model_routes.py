"""`GET /v1/models` and `GET /v1/models/{model}` (the `openai` package's `models.list` and
`models.retrieve`), answered in-process: neither needs the model loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.settings import ServeSettings
from tests.serve.conftest import example_settings_json


async def serving(tmp_path: Path, served_name: str):
    wire = json.loads(example_settings_json())
    wire["model"]["servedName"] = served_name
    config = tmp_path / "blend.json"
    config.write_text(json.dumps(wire))
    server = Server(ServeSettings(config=config, torch_threads=1))
    return server, TestClient(TestServer(server.app()))


@pytest.mark.parametrize("served_name", ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"])
async def test_the_served_model_is_retrieved_by_its_name(tmp_path, served_name):
    """`models.retrieve` was the router's 404 "Not Found" for the served model itself."""
    server, client = await serving(tmp_path, served_name)
    async with client:
        listed = await (await client.get("/v1/models")).json()
        response = await client.get(f"/v1/models/{served_name}")
        assert response.status == 200, await response.text()
        assert await response.json() == listed["data"][0]
        assert listed["data"][0]["id"] == served_name
    server.close()


async def test_an_unknown_model_is_a_404_naming_the_field(tmp_path):
    server, client = await serving(tmp_path, "smollm2")
    async with client:
        response = await client.get("/v1/models/gpt-4o")
        assert response.status == 404
        error = (await response.json())["error"]
        assert (error["type"], error["param"]) == ("not_found_error", "model")
        assert "'gpt-4o' does not exist" in error["message"]
    server.close()
