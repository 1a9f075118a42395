"""`holeblend-operator run` as a process: /healthz, /metrics, graceful stop on SIGTERM."""

import signal
import socket
import subprocess
import time
import urllib.request

from holeblend_devtools.background import operator_command
from tests.e2e.conftest import create, example, status_of


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except OSError:
        return 0, ""


def test_run_serves_health_and_metrics_and_stops_on_sigterm(cluster):
    port = free_port()
    command = operator_command(
        "--health-port",
        str(port),
        "--health-host",
        "127.0.0.1",
        "--status-debounce-s",
        "0.05",
    )
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cluster.wait_for(lambda: fetch(f"http://127.0.0.1:{port}/healthz")[0] == 200, timeout=20)
        create(cluster, example())
        cluster.wait_for(
            lambda: status_of(cluster, "smollm2-demo").get("phase") == "Ready", timeout=20
        )
        code, text = fetch(f"http://127.0.0.1:{port}/metrics")
        assert code == 200
        assert 'holeblend_operator_reconciles_total{result="ok",trigger="create"} 1.0' in text
        assert "holeblend_operator_api_requests_total" in text
    finally:
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        output, _ = process.communicate(timeout=20)
    assert process.returncode == 0, output[-2000:]
    assert time.monotonic() - started < 15
    assert '"message"' in output  # structured (JSON) log lines
