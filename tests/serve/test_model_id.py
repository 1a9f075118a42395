"""holeblend-serve keys segments by blend.json's model.name with the GGUF's identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from holeblend_runtime.serve import cli
from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.settings import ServeSettings


@pytest.fixture
def load_server(tmp_path: Path):
    """load_server(model_name) -> a loaded in-process Server whose blend.json names it."""
    servers: list[Server] = []

    def load(name: str) -> Server:
        path = tmp_path / f"blend-{len(servers)}.json"
        settings = {"formatVersion": 1, "model": {"name": name, "dtype": "float32"},
                    "qualityProxies": False}  # fmt: skip
        path.write_text(json.dumps(settings))
        server = Server(ServeSettings(config=path, torch_threads=1))
        servers.append(server)
        server.load()
        return server

    yield load
    for server in servers:
        server.close()
        cli._stop_threads(server)


def test_model_name_is_part_of_the_keys_over_the_same_gguf(load_server):
    """Two model names over the same GGUF file (a fine-tune under the same file name and
    size): other model ids, other keys; the same name: the same keys."""
    base, tuned, base_again = (load_server(n) for n in ("org/base", "org/tuned", "org/base"))
    assert base.engine.config.model_id.startswith("org/base|SmolLM2-135M-Instruct")
    assert base.engine.config.model_id != tuned.engine.config.model_id
    texts = (
        "Answer briefly.",
        [" The cat sat on the warm mat all day.", " The dog slept by the door."],
        " Who sat?",
    )
    prompt = base.engine.build_prompt(*texts)
    keys = [key for key in base.engine.segment_keys(prompt) if key is not None]
    assert keys and keys == [k for k in base_again.engine.segment_keys(prompt) if k]
    assert not set(keys) & set(tuned.engine.segment_keys(prompt))
