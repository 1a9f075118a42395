"""A real Prometheus (Debian's package) on 127.0.0.1 with a temp data dir, for tests.

`PrometheusProcess(targets, workdir)` scrapes the given `host:port` targets every second;
`query(promql)` returns the instant vector as `{labels-tuple: value}`; `stop()` ends it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

from holeblend_devtools.background import stop_process
from holeblend_devtools.serve_process import free_port, get

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


class PrometheusProcess:
    def __init__(self, targets: list[str], workdir: Path, interval_s: float = 1.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        scrape = {"job_name": "holeblend", "static_configs": [{"targets": targets}]}
        interval = f"{round(interval_s * 1000)}ms"
        config.write_text(json.dumps({
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [scrape],
        }))  # fmt: skip
        self._log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [
                PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def query(self, promql: str) -> dict[tuple, float]:
        url = f"{self.url}/api/v1/query?query={urllib.parse.quote(promql)}"
        status, body = get(url)
        if status != 200:
            return {}
        result = json.loads(body)["data"]["result"]
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in result}

    def wait_for(self, promql: str, predicate, timeout: float = 60) -> dict[tuple, float]:
        """Poll `promql` until `predicate(result)` holds; the last result otherwise."""
        deadline = time.monotonic() + timeout
        result: dict[tuple, float] = {}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}")
            result = self.query(promql)
            if result and predicate(result):
                return result
            time.sleep(0.5)
        return result

    def stop(self) -> None:
        stop_process(self.process, timeout=20)
        self._log.close()
