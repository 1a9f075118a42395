"""Servers for the serving tests: the installed `holeblend-serve` on the real SmolLM2 model,
configured by the CPU example's blend.json as the operator renders it, and the handler of
the stand-in servers that play an engine."""

from __future__ import annotations

import contextlib
import http.server
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from holeblend_devtools.serve_process import ServeProcess
from holeblend_operator.api import BlendDeployment
from holeblend_operator.render.runtime_config import blend_settings

CPU_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpu.yaml"
# One torch thread, tiny answers: the tests check behaviour, not speed.
FAST = {"torch_threads": 1, "default_max_tokens": 2, "reload_interval": 0.2}


class StandInHandler(http.server.BaseHTTPRequestHandler):
    """A request handler for a stand-in server (an engine, a pod's metrics port): `reply`
    sends a whole answer with its length, and no request is logged to stderr."""

    def reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_) -> None:
        pass


def example_settings_json(**wire_overrides) -> str:
    bd = BlendDeployment.model_validate(yaml.safe_load(CPU_EXAMPLE.read_text()))
    settings = blend_settings(bd)
    if wire_overrides:
        settings = type(settings).model_validate(settings.to_wire() | wire_overrides)
    return settings.to_json()


def replace_file(path: Path, text: str) -> None:
    """Write and rename, so the server never reads a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def start_server(folder: Path, config_text: str, **flags) -> ServeProcess:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "blend.json"
    config.write_text(config_text)
    server = ServeProcess(config, folder / "serve.log", **(FAST | flags))
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    server.config = config
    return server


@contextlib.contextmanager
def in_process_server(folder: Path, **settings) -> Iterator:
    """A server in this process, loaded as holeblend-serve loads it (full prefill, so equal
    prompts get equal answers; no quality proxies, no lookup server), ready; `settings`:
    ServeSettings fields."""
    from holeblend_runtime.serve.app import Server
    from holeblend_runtime.serve.settings import ServeSettings

    config = folder / "blend.json"
    config.write_text(example_settings_json(mode="off", qualityProxies=False, lookupServerUrl=None))
    server = Server(ServeSettings(config, torch_threads=1, **settings))
    server.load()
    server.is_ready = True
    try:
        yield server
    finally:
        server.worker.stop()
        server.engine.close()
        server.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServeProcess]:
    server = start_server(tmp_path_factory.mktemp("serve"), example_settings_json())
    yield server
    assert server.stop() == 0, server.log()
