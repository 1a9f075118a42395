"""The connector's metrics port listens where `$HOLEBLEND_METRICS_HOST` says: with "::"
(the operator's --pod-listen-address ::) on IPv6 and IPv4 alike."""

import socket

from holeblend_runtime import local_http
from holeblend_runtime.vllm_connector import metrics


def free_port() -> int:
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as sock:
        return sock.getsockname()[1]


def test_every_address_takes_ipv6_and_ipv4_scrapes(monkeypatch):
    port = free_port()
    monkeypatch.setenv(metrics.METRICS_PORT_ENV, str(port))
    monkeypatch.setenv(metrics.METRICS_HOST_ENV, "::")
    assert metrics.serve_metrics() == port
    for host in ("[::1]", "127.0.0.1"):
        with local_http.LOCAL.open(f"http://{host}:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200 and b"holeblend_" in reply.read()
