"""A real Prometheus (Debian's `prometheus` binary) on 127.0.0.1 for tests and the demo.

`running_prometheus(targets, ...)` writes a config that scrapes each target every second
with the labels a prometheus-operator ServiceMonitor would give it (namespace, service,
pod), starts Prometheus with a temporary data directory, waits until it answers, and
stops it (by its pid) on exit. `query` runs an instant PromQL query and raises
`QueryError` with Prometheus's message when the expression does not parse.
"""

import contextlib
import dataclasses
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

from holeblend_runtime import local_http


@dataclasses.dataclass(frozen=True)
class ScrapeTarget:
    address: str  # host:port serving /metrics
    labels: dict[str, str]  # e.g. namespace, service, pod


class QueryError(Exception):
    """Prometheus refused a query (the message is its own, e.g. a parse error)."""


def is_installed() -> bool:
    return shutil.which("prometheus") is not None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config(targets: list[ScrapeTarget], rule_files: list[str], interval_s: float = 1) -> dict:
    interval = f"{interval_s:g}s"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": rule_files,
        "scrape_configs": [
            {
                "job_name": "holeblend",
                "static_configs": [{"targets": [t.address], "labels": t.labels} for t in targets],
            }
        ],
    }


@contextlib.contextmanager
def running_prometheus(
    targets: list[ScrapeTarget], rule_files: tuple[str, ...] = (), timeout_s: float = 30
) -> Iterator[str]:
    """Yield the URL of a Prometheus scraping `targets`; stop it on exit."""
    if not is_installed():
        raise RuntimeError("prometheus is not installed: run `make tools` (Debian's package)")
    with tempfile.TemporaryDirectory(prefix="holeblend-prometheus-") as tmp:
        config_path = Path(tmp) / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config(targets, list(rule_files))))
        port = free_port()
        command = [
            "prometheus",
            f"--config.file={config_path}",
            f"--storage.tsdb.path={Path(tmp) / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        log = open(Path(tmp) / "prometheus.log", "w")  # noqa: SIM115 - closed below
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, process, timeout_s, Path(tmp) / "prometheus.log")
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()


def _wait_ready(url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited: {log.read_text()[-2000:]}")
        with (
            contextlib.suppress(OSError),
            local_http.LOCAL.open(f"{url}/-/ready", timeout=1) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"prometheus at {url} not ready after {timeout_s} s")


def query(url: str, promql: str) -> list[dict]:
    """The result of an instant query (a list of {metric, value}; a scalar as one item)."""
    full = f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with local_http.LOCAL.open(full, timeout=10) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        answer = json.loads(exc.read() or b"{}")
    if answer.get("status") != "success":
        raise QueryError(f"{promql}: {answer.get('errorType')}: {answer.get('error')}")
    data = answer["data"]
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    return data["result"]


def vector(url: str, promql: str) -> dict[tuple, float]:
    """An instant query as `{sorted label items: value}`."""
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in query(url, promql)}


def wait_for(url: str, promql: str, predicate, timeout_s: float = 60) -> dict[tuple, float]:
    """Poll `promql` until its non-empty result satisfies `predicate`; the last result
    otherwise (the caller's assertion then says what was seen)."""
    deadline = time.monotonic() + timeout_s
    result: dict[tuple, float] = {}
    while time.monotonic() < deadline:
        result = vector(url, promql)
        if result and predicate(result):
            return result
        time.sleep(0.5)
    return result


def rules(url: str) -> list[dict]:
    """The loaded alerting and recording rules with their health (ok / err / unknown)."""
    with local_http.LOCAL.open(f"{url}/api/v1/rules", timeout=10) as response:
        groups = json.loads(response.read())["data"]["groups"]
    return [rule for group in groups for rule in group["rules"]]
