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

    def load(name: str, **model) -> Server:
        path = tmp_path / f"blend-{len(servers)}.json"
        settings = {"formatVersion": 1, "model": {"name": name, "dtype": "float32", **model},
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


def test_max_model_len_caps_prompt_plus_answer_and_above_the_model_is_refused(load_server):
    """spec.model.maxModelLen reached vLLM's --max-model-len only: holeblend-serve (CPU
    pods) took the model's whole context whatever it said. It is now blend.json's
    model.maxModelLen there too: the engine's context, so prompts beyond it are refused
    before any compute (as tests/serve/test_server.py's over-the-context prompt) and
    answers stop at it; a limit above the model's context is refused at load, naming it."""
    from holeblend_runtime.serve.requests import BadRequest, parse_completion

    server = load_server("org/base", maxModelLen=256)
    assert server.engine.config.context_length == 256
    long_documents = [" The cat sat on the warm mat all day long." * 12] * 3
    body = {"model": "org/base", "prompt": " Who sat?", "documents": long_documents}
    rag = parse_completion(body, " # #", server._is_control)
    with pytest.raises(BadRequest, match="context of 256"):
        server._prompt(rag)
    short = parse_completion(body | {"documents": long_documents[:1]}, " # #", server._is_control)
    prompt, _ = server._prompt(short)
    assert prompt.num_tokens < 256
    with pytest.raises(
        ValueError, match=r"model.maxModelLen: 100000 exceeds the model's context of 8192"
    ):
        load_server("org/base", maxModelLen=100000)
