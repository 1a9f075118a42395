"""`holeblend-serve` as a child process on 127.0.0.1, and a small JSON client for it.

Used by `make demo` and the serving tests: `ServeProcess(config, **flags)` starts the
installed console script on a free port, `wait_ready()` polls `/ready`, `stop()` sends
SIGTERM (the graceful drain) and returns the exit status.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from holeblend_devtools.background import stop_process
from holeblend_runtime import local_http

SERVE = str(Path(sys.executable).parent / "holeblend-serve")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """One server; flags are ServeSettings names (`queue_size=8` -> `--queue-size 8`)."""

    def __init__(self, config: Path, log_path: Path, **flags: object) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [SERVE, "--config", str(config), "--port", str(self.port)]
        for name, value in flags.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"holeblend-serve exited: {self.log_path.read_text()}")
            if get(self.url + "/ready")[0] == 200:
                return
            time.sleep(0.2)
        raise TimeoutError(f"holeblend-serve not ready in {timeout} s: {self.log_path.read_text()}")

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            stop_process(self.process, timeout)
        self._log.close()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text()


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    """(status, body); status 0 when nothing answered."""
    try:
        with local_http.LOCAL.open(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def post_json(url: str, body: object, timeout: float = 120) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST; the body may be any JSON value or raw bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with local_http.LOCAL.open(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}"), dict(error.headers)
