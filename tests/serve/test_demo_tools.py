"""`make demo`'s tools as a user's machine runs them: an HTTP proxy in the environment, an
engine that answers the request stream with errors, a kill of the serve demo."""

import argparse
import contextlib
import http.server
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from holeblend_devtools import closed_loop, demo, kubelet
from holeblend_runtime.bench.workload import WorkloadConfig
from tests.serve.conftest import StandInHandler

# Where a corporate machine's proxy would be: here nothing listens, so a request sent
# through it fails.
DEAD_PROXY = "http://127.0.0.1:9"


class Engine(http.server.ThreadingHTTPServer):
    """Answers /ready and every POST with `status`."""

    def __init__(self, address: str, status: int):
        super().__init__((address, 0), Handler)
        self.status = status

    @property
    def port(self) -> int:
        return self.server_address[1]


class Handler(StandInHandler):
    def do_GET(self):
        self.answer()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer()

    def answer(self):
        self.reply(self.server.status, b'{"usage": {"prompt_tokens": 10}}')


def serving(address: str, status: int = 200):
    engine = Engine(address, status)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    return engine


@pytest.fixture
def behind_a_proxy(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, DEAD_PROXY)
    monkeypatch.setenv("no_proxy", "localhost,127.0.0.1")


def test_a_pod_probe_goes_to_the_pod_not_to_the_environments_proxy(behind_a_proxy):
    engine = serving("127.0.0.2")
    container = {"name": "engine", "readinessProbe": {"httpGet": {"path": "/ready"}}}
    container["readinessProbe"]["httpGet"]["port"] = engine.port
    pod = kubelet.Pod("engine-0", "default", "127.0.0.2", "hash", "engine", container, {}, {})
    try:
        assert kubelet.probe(pod)
    finally:
        engine.shutdown()
        engine.server_close()


def test_a_rag_stream_reaches_the_engine_with_a_proxy_in_the_environment(
    behind_a_proxy, monkeypatch
):
    monkeypatch.delenv("no_proxy")
    engine = serving("127.0.0.1")
    stream = closed_loop.RagStream(f"http://127.0.0.1:{engine.port}", WorkloadConfig(seed=1))
    try:
        sent = stream.send("system", ["a document"], "a question?")
    finally:
        engine.shutdown()
        engine.server_close()
    assert sent.status == 200


class EngineOnly:
    """What the demo's loop stage reads of its stack: the engine Service's local URL and
    the BlendDeployment's status (empty: no operator here)."""

    env: dict = {}

    def __init__(self, url: str):
        self.url = url

    def engine_url(self, name: str) -> str:
        return self.url

    def status(self, name: str) -> dict:
        return {}

    def start_prometheus(self, name: str) -> str:
        return DEAD_PROXY


@pytest.mark.parametrize("status", [200, 503])
def test_the_demo_fails_when_the_engine_fails_its_requests(tmp_path, monkeypatch, status):
    monkeypatch.setattr(demo, "KUBECTL", shutil.which("true"))
    engine = serving("127.0.0.1", status)
    args = argparse.Namespace(stream_seconds=0.2, png=str(tmp_path / "loop.png"))
    try:
        succeeded = demo.loop_stage(EngineOnly(f"http://127.0.0.1:{engine.port}"), args)
    finally:
        engine.shutdown()
        engine.server_close()
    assert succeeded is (status == 200)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as file:
                if int(file.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper that may never come)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/1"), reason="reads processes from /proc")
def test_the_serve_demo_killed_with_sigterm_stops_its_server():
    """A CI timeout or a kill sends SIGTERM to the demo only; its server must not outlive it,
    holding its port and the model's memory."""
    command = [sys.executable, "-I", "-m", "holeblend_devtools.serve_demo"]
    demo_process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not servers and time.monotonic() < deadline and demo_process.poll() is None:
            servers = children_of(demo_process.pid)
            time.sleep(0.05)
        assert servers, "the serve demo started no server"
        demo_process.send_signal(signal.SIGTERM)
        demo_process.wait(timeout=60)
        assert not [pid for pid in servers if is_running(pid)]
    finally:
        demo_process.kill()
        demo_process.wait()
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_waiting_for_ready_ends_at_its_timeout_when_kubectl_gets_no_answer(tmp_path, monkeypatch):
    """kubectl waits for an API server that accepted the connection but never answers for
    as long as it takes; the demo's wait must still end at its --timeout."""
    hanging = tmp_path / "kubectl"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(0o755)
    monkeypatch.setattr(demo, "KUBECTL", str(hanging))
    started = time.monotonic()
    assert not demo.wait_ready({}, "smollm2-demo", timeout=0.5)
    assert time.monotonic() - started < 30
