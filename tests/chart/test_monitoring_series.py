"""Every dashboard and alert expression returns a series from real metrics, scraped by a
real Prometheus: the operator's own tuning metrics after real tuning decisions, and the
engine's (holeblend-serve) after real requests."""

import concurrent.futures
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import prometheus_client
import pytest

from holeblend_contract.blend_settings import BlendSettings
from holeblend_devtools import prometheus
from holeblend_operator import tuning_loop
from holeblend_operator.api import TuningSpec
from holeblend_operator.tuner import Decision, State
from holeblend_runtime.blend.keys import keyed_model_id
from holeblend_runtime.lookup_server.client import LookupClient
from holeblend_runtime.lookup_server.processes import LookupProcess
from holeblend_runtime.model.gguf import find_smollm2_gguf
from holeblend_runtime.quality.inline_proxy import MIN_PAIRS
from holeblend_runtime.quality.shared_calibration import calibration_scope
from tests.chart.test_monitoring import (
    dashboard,
    dashboard_expressions,
    rule_expressions,
    substituted,
)

NAMESPACE, NAME = "default", "smollm2-demo"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpu.yaml"
OPERATOR_SERIES = "holeblend_operator_"


def is_operator_expression(expr: str) -> bool:
    return OPERATOR_SERIES in expr and "holeblend_f1_proxy" not in expr


def wait_for_series(url: str, expr: str, timeout_s: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = prometheus.query(url, expr)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.fixture(scope="module")
def operator_metrics():
    """The operator's registry after real decisions of the tuning loop's bookkeeping."""
    loop = tuning_loop.TuningLoop(operator=None)
    spec = TuningSpec(min_ratio=0.05, max_ratio=0.15)
    for direction, to in (("up", 0.15), ("hold", 0.15)):
        decision = Decision(direction, 0.1, to, "BelowTarget", "low", False, State())
        loop._record((NAMESPACE, NAME), spec, decision)
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1")
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=5)


OPERATOR_EXPRESSIONS = [
    e for e in dashboard_expressions(dashboard()) if is_operator_expression(e)
] + [
    "max by (namespace, name) (holeblend_operator_tuned_ratio) >= on (namespace, name) "
    "max by (namespace, name) (holeblend_operator_tuning_max_ratio)"
]


def test_operator_expressions_return_series_from_the_real_operator_metrics(operator_metrics):
    target = prometheus.ScrapeTarget(operator_metrics, {"job": "holeblend-operator"})
    with prometheus.running_prometheus([target]) as url:
        for expr in OPERATOR_EXPRESSIONS:
            if "changes(" in expr:
                # The annotation marks a counter that appeared or moved in the last 2 minutes;
                # its selector must find the counter of this BlendDeployment.
                expr = re.search(r"holeblend_operator_tuning_decisions_total\{[^}]*\}", expr)[0]
            assert wait_for_series(url, substituted(expr)), expr


def measured(expr: str) -> str:
    """An alert's measured quantity: the expression before its threshold comparison (the
    whole expression returns a series only while the alert fires)."""
    return re.split(r"\s(?:<|>|==|<=|>=)\s", expr, maxsplit=1)[0].strip()


ENGINE_EXPRESSIONS = [
    e for e in dashboard_expressions(dashboard()) if not is_operator_expression(e)
] + [measured(e) for e in rule_expressions() if not is_operator_expression(measured(e))]
# The lookup server's series need its server (tests of the lookup server cover them).
ENGINE_EXPRESSIONS = [e for e in ENGINE_EXPRESSIONS if "lookup-server" not in e]


@pytest.mark.slow
def test_engine_expressions_return_series_from_the_real_engine(tmp_path):
    serve = Path(sys.executable).parent / "holeblend-serve"
    if not serve.exists():
        pytest.fail("holeblend-serve is not installed: run `make venv`")
    rendered = subprocess.run(
        [
            sys.executable,
            "-I",
            "-m",
            "holeblend_operator.cli",
            "render",
            "-f",
            str(EXAMPLE),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    configmap = next(o for o in json.loads(rendered.stdout)["items"] if o["kind"] == "ConfigMap")
    settings = json.loads(configmap["data"]["blend.json"]) | {"shadowSampleRate": 1.0}
    # The inline proxy's series need a calibration: pairs the deployment's pods published
    # to its lookup server (here a real one, standing in for the rendered Service).
    with LookupProcess() as lookup:
        settings["lookupServerUrl"] = lookup.url
        _publish_pairs(lookup.url, settings)
        config = tmp_path / "blend.json"
        config.write_text(json.dumps(settings))
        port = prometheus.free_port()
        command = [str(serve), "--config", str(config), "--port", str(port)]
        engine = subprocess.Popen([*command, "--queue-size", "1", "--torch-threads", "1"])
        try:
            _wait_ready(f"http://127.0.0.1:{port}/ready")
            # What the rendered ServiceMonitor gives the engine's series: prometheus-
            # operator's namespace, service and pod, and its relabelings' blenddeployment
            # and component.
            labels = {
                "namespace": NAMESPACE,
                "service": f"{NAME}-engine",
                "pod": f"{NAME}-engine-0",
                "blenddeployment": NAME,
                "component": "engine",
            }
            target = prometheus.ScrapeTarget(f"127.0.0.1:{port}", labels)
            with prometheus.running_prometheus([target]) as url:
                _send_requests(port)
                missing = [
                    e for e in ENGINE_EXPRESSIONS if not wait_for_series(url, substituted(e), 15)
                ]
                assert not missing, missing
        finally:
            engine.send_signal(signal.SIGTERM)
            engine.wait(timeout=60)


def _publish_pairs(lookup_url: str, settings: dict) -> None:
    """`MIN_PAIRS` calibration pairs at the rendered ratio, under the scope of this engine
    (SmolLM2's GGUF, float32, one rank, the rendered selection and check layer)."""
    gguf = find_smollm2_gguf()
    blend = BlendSettings.model_validate(settings)
    model_id = keyed_model_id(blend.model.name, f"{gguf.stem}:{gguf.stat().st_size}")
    scope = calibration_scope(model_id, "float32", 1, blend)
    pairs = [[blend.recompute_ratio, 0.01 * i, 1.0 - 0.01 * i, 1.0] for i in range(MIN_PAIRS)]
    message = {"op": "pairs_add", "scope": scope, "pod": "earlier-pod", "pairs": pairs}
    assert LookupClient(lookup_url).call(message) == {"v": 1, "ok": True, "added": MIN_PAIRS}


def _wait_ready(url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(url)


def _complete(port: int, documents: list[str]) -> int:
    body = {"model": "smollm2", "prompt": " What is the code word?", "documents": documents}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body | {"max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _send_requests(port: int) -> None:
    """A first pass caches documents, a second reuses them around a hole (shadow samples);
    then a burst against a queue of one is partly turned away (429)."""
    docs = [f" Document {i} says that the code word of team {i} is w{i}x{i}." for i in range(4)]
    assert _complete(port, docs[:1] + docs[2:]) == 200
    for _ in range(2):
        assert _complete(port, docs) == 200
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: _complete(port, docs), range(6)))
    assert 429 in codes, codes
