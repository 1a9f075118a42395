"""The operator's lookup-server container is a command line the runtime serves, probes included."""

import sys
import time
import urllib.error
import urllib.request

import yaml

from holeblend_operator.api import BlendDeployment
from holeblend_operator.render import render_children
from holeblend_runtime.lookup_server.client import LookupClient
from holeblend_runtime.lookup_server.processes import LookupProcess, free_port
from tests.operator.test_render import ROOT, make_bd


def lookup_container(bd: BlendDeployment | None = None) -> dict:
    example = ROOT / "examples" / "cpu.yaml"
    bd = bd or BlendDeployment.model_validate(yaml.safe_load(example.read_text()))
    [deployment] = [
        c
        for c in render_children(bd)
        if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-lookup")
    ]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_the_rendered_command_starts_the_server_and_its_probes_answer():
    container = lookup_container()
    assert container["command"] == ["python", "-m", "holeblend_runtime.lookup_server"]
    args = list(container["args"])
    port = free_port()
    # Run the rendered command line here, on loopback and a free port instead of the pod's.
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    server = LookupProcess(port=port)
    server.start_command([sys.executable, "-I", *container["command"][1:], *args])
    try:
        for probe in ("readinessProbe", "livenessProbe"):
            path = container[probe]["httpGet"]["path"]
            with urllib.request.urlopen(f"{server.url}{path}", timeout=5) as reply:
                assert reply.status == 200
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as reply:
            assert b"holeblend_lookup_index_entries" in reply.read()
        # SIGTERM: /ready fails at once (the Service stops routing here), lookups go on
        # being answered while the server drains, then it exits by itself.
        server.process.terminate()
        _wait_for_status(f"{server.url}/ready", 503)
        assert LookupClient(server.url).lookup(["k"]) == [None]
        assert server.process.wait(30) == 0
    finally:
        server.stop()


def _wait_for_status(url: str, status: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
        except urllib.error.HTTPError as error:
            if error.code == status:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url} never answered {status}")


def test_the_lookup_pod_has_resources_by_default():
    resources = lookup_container(make_bd())["resources"]
    assert resources["requests"] == {"cpu": "250m", "memory": "256Mi"}
    assert resources["limits"] == {"memory": "1Gi"}
