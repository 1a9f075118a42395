"""Local server processes for the benchmark and the tests: a lookup server, a redis-server.

Both bind 127.0.0.1 on a free port, keep their files in a temporary directory, and are
stopped (and their directory removed) when the context exits.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from holeblend_runtime import local_http


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until(check, timeout_s: float, what: str, process: subprocess.Popen) -> None:
    """Return once `check()` passes; else end `process` and raise. The caller's context
    manager is not entered yet, so a process left running after a failed start would
    hold its port (and, for redis, its memory) with nobody to stop it."""
    try:
        _poll(check, timeout_s, what, process)
    except BaseException:
        _end(process)
        raise


def _poll(check, timeout_s: float, what: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before it was ready")
        if check():
            return
        time.sleep(0.02)
    raise RuntimeError(f"{what} not ready after {timeout_s} s")


def _end(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it is still running after 10 s; reaped either way."""
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


class LookupProcess:
    """`python -m holeblend_runtime.lookup_server` on 127.0.0.1; restartable on one port."""

    def __init__(self, *extra_args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LookupProcess:
        command = [sys.executable, "-I", "-m", "holeblend_runtime.lookup_server"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "WARNING"]
        return self.start_command([*command, "--drain-seconds", "0", *self.extra_args])

    def start_command(self, command: list[str], timeout_s: float = 30.0) -> LookupProcess:
        """Start `command` (a lookup server listening on this port) and wait until it is
        ready; RuntimeError, and the process ended, when it is not within `timeout_s`."""
        self.process = subprocess.Popen(command)
        _wait_until(self.is_ready, timeout_s, "the lookup server", self.process)
        return self

    def is_ready(self) -> bool:
        try:
            with local_http.LOCAL.open(f"{self.url}/ready", timeout=0.5) as reply:
                return reply.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crashed pod: nothing is flushed."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LookupProcess:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


class RedisProcess:
    """Debian's `redis-server` on 127.0.0.1, no persistence, the eviction policy
    docs/shared-tier.md recommends (`allkeys-lfu`) unless told, a temp dir."""

    def __init__(
        self, maxmemory: str = "1gb", port: int | None = None, policy: str = "allkeys-lfu"
    ) -> None:
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.policy = policy
        self.dir = Path(tempfile.mkdtemp(prefix="holeblend-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError(
                "redis-server not found; run scripts/install-system-deps.sh (make tools)"
            )
        self.process = subprocess.Popen(
            [
                executable,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory",
                self.maxmemory,
                "--maxmemory-policy",
                self.policy,
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
        )
        _wait_until(self.is_ready, 30, "redis-server", self.process)
        return self

    def is_ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            _end(self.process)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
