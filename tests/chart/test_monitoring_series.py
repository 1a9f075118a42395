"""Every dashboard and alert expression returns a series from real metrics, scraped by a
real Prometheus: the operator's own tuning metrics after real tuning decisions, and the
engine's (holeblend-serve) after real requests."""

import importlib.util
import json
import re
import shutil
import subprocess
import time
import urllib.request

import prometheus_client
import pytest

from holeblend_devtools import prometheus
from holeblend_operator import tuning_loop
from holeblend_operator.api import TuningSpec
from holeblend_operator.tuner import Decision, State
from tests.chart.test_monitoring import (
    dashboard,
    dashboard_expressions,
    rule_expressions,
    substituted,
)

NAMESPACE, NAME = "default", "smollm2-demo"
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
                # The annotation fires only when the counter moves between scrapes 2 minutes
                # apart; its selector must find the counter of this BlendDeployment.
                expr = re.search(r"holeblend_operator_tuning_decisions_total\{[^}]*\}", expr)[0]
            assert wait_for_series(url, substituted(expr)), expr


def _serve_command() -> list[str] | None:
    if (
        shutil.which("holeblend-serve") is None
        and importlib.util.find_spec("holeblend_runtime.serve") is None
    ):
        return None
    return ["holeblend-serve"]


@pytest.mark.slow
def test_engine_expressions_return_series_from_the_real_engine(tmp_path):
    command = _serve_command()
    if command is None:
        pytest.skip("holeblend-serve (the engine's server) is not part of this tree yet")
    config = tmp_path / "blend.json"
    rendered = subprocess.run(
        ["holeblend-operator", "render", "-f", "examples/cpu.yaml", "-o", "json"],
        capture_output=True,
        text=True,
    )
    assert rendered.returncode == 0, rendered.stderr
    configmap = next(o for o in json.loads(rendered.stdout)["items"] if o["kind"] == "ConfigMap")
    config.write_text(configmap["data"]["blend.json"])
    port = prometheus.free_port()
    engine = subprocess.Popen(
        [*command, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    )
    try:
        _wait_ready(f"http://127.0.0.1:{port}/ready")
        labels = {"namespace": NAMESPACE, "service": f"{NAME}-engine", "pod": f"{NAME}-engine-0"}
        target = prometheus.ScrapeTarget(f"127.0.0.1:{port}", labels)
        with prometheus.running_prometheus([target]) as url:
            _send_requests(port)
            time.sleep(3)
            engine_exprs = [
                e
                for e in dashboard_expressions(dashboard()) + rule_expressions()
                if not is_operator_expression(e) and "-lookup" not in e
            ]
            missing = [e for e in engine_exprs if not wait_for_series(url, substituted(e), 10)]
            assert not missing, missing
    finally:
        engine.terminate()
        engine.wait(timeout=30)


def _wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def _send_requests(port: int) -> None:
    docs = [f" Document {i} says the code word is w{i}." for i in range(4)]
    for documents in (docs[:3], docs):
        body = {"model": "smollm2", "prompt": " What is the code word?", "documents": documents}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body | {"max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
