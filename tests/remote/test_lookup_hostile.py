"""The lookup server under hostile and careless clients, as a real process.

Pipelining floods, half-sent heads and bodies, idle and never-reading connections, forged
log lines and odd framing: each gets a bounded, documented answer, and the other clients'
lookups go on within their budget.
"""

import asyncio
import contextlib
import logging
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest

from holeblend_runtime.lookup_server import processes
from holeblend_runtime.lookup_server import server as server_module
from holeblend_runtime.lookup_server.client import ClientConfig, LookupClient
from holeblend_runtime.lookup_server.index import IndexLimits
from holeblend_runtime.lookup_server.server import (
    WRITE_HIGH_WATER,
    LookupServer,
    ServerConfig,
    _Connection,
)
from holeblend_runtime.lookup_server.wire import Entry

MIB = 1 << 20


class LoggedLookupProcess(processes.LookupProcess):
    """A lookup server process whose stderr (its log) goes to `log_path`."""

    def __init__(self, *extra_args: str, log_path: Path | None = None) -> None:
        super().__init__(*extra_args)
        self.log_path = log_path

    def start_command(self, command: list[str]) -> processes.LookupProcess:
        stderr = self.log_path.open("wb") if self.log_path else None
        self.process = subprocess.Popen(command, stderr=stderr)
        processes._wait_until(self.is_ready, 30, "the lookup server", self.process)
        return self

    def peak_rss_bytes(self) -> int:
        return _status_kib(self.process.pid, "VmHWM") * 1024

    def rss_bytes(self) -> int:
        return _status_kib(self.process.pid, "VmRSS") * 1024


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.fixture(scope="module")
def quick_server():
    """Short timeouts, so the timeout tests take about a second each."""
    with LoggedLookupProcess(
        "--idle-timeout", "0.6", "--header-timeout", "0.5", "--body-timeout", "0.5"
    ) as server:
        yield server


def entry(key: str, pod_shared: bool = True) -> dict:
    return Entry(key, 12, "model", "float32", None, 1000, pod_shared).to_wire()


def lookup_request(keys: list[str]) -> bytes:
    body = msgpack.packb({"v": 1, "op": "lookup", "keys": keys})
    return b"POST /v1 HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def connect(port: int, timeout_s: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float = 5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and the seconds that took."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    reply = b""
    try:
        while chunk := sock.recv(65536):
            reply += chunk
    except ConnectionResetError:
        pass
    return reply, time.monotonic() - started


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def metric(server: processes.LookupProcess, line_start: str) -> float:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=5).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start)]
    return values[0] if values else 0.0


# --- fairness -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_pipelining_client_that_reads_nothing_does_not_delay_the_others():
    with LoggedLookupProcess() as server:
        client = LookupClient(server.url, ClientConfig(timeout_ms=5000, retries=0))
        entries = [entry(f"seg-{i}") for i in range(2000)]
        assert client.call({"op": "admit", "pod": "pod-a", "entries": entries})["admitted"] == 2000
        flood = b"".join(
            lookup_request([f"seg-{(i * 16 + j) % 2500}" for j in range(16)]) for i in range(20_000)
        )
        flooder = connect(server.port, timeout_s=60)
        sender = threading.Thread(target=_send_ignoring_errors, args=(flooder, flood))
        sender.start()
        try:
            time.sleep(0.02)  # the flood is on its way
            latencies = []
            for i in range(50):
                started = time.perf_counter()
                hits = client.lookup([f"seg-{i}", "missing"])
                latencies.append(time.perf_counter() - started)
                assert hits[0] is not None and hits[1] is None
                time.sleep(0.005)
            assert client.stats.degraded_lookups == 0
            print(f"flood: max lookup round trip {max(latencies) * 1000:.2f} ms")
            assert max(latencies) < 0.050, f"max {max(latencies) * 1000:.1f} ms: {latencies}"
        finally:
            flooder.shutdown(socket.SHUT_RDWR)  # wakes the blocked sender
            flooder.close()
            sender.join(10)


def _send_ignoring_errors(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the test or the server closed it
        sock.sendall(data)


def test_a_client_that_never_reads_its_replies_is_dropped_after_the_write_timeout():
    with LoggedLookupProcess("--write-timeout", "0.5") as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        # About 10 MB of replies for 60 KB of requests: more than the kernel buffers hold.
        requests = b"GET /metrics HTTP/1.1\r\n\r\n" * 2500
        threading.Thread(target=_send_ignoring_errors, args=(sock, requests), daemon=True).start()
        deadline = time.monotonic() + 10
        while metric(server, 'holeblend_lookup_errors_total{code="write_timeout"}') < 1:
            assert time.monotonic() < deadline, "the never-reading client was not dropped"
            time.sleep(0.1)
        assert server.rss_bytes() < 256 * MIB
        assert LookupClient(server.url).lookup(["k"]) == [None]
        sock.close()


def test_clients_that_never_read_large_replies_cannot_lock_the_others_out_of_lookups(tmp_path):
    """Unread replies count against the request-memory budget, but like large bodies they may
    use only seven eighths of it: a few connections that send legal 1024-key lookups (replies
    of about 4 MB here) and never read them are aborted once they reach that share, instead of
    filling the budget so that every other client's lookup is refused 503 until the write
    timeout drops them (and they reconnect)."""
    log_path = tmp_path / "server.log"
    with LoggedLookupProcess(
        "--max-buffer-bytes", str(8 * MIB), "--pod-timeout", "600", log_path=log_path
    ) as server:
        keys = [f"{i:064x}" for i in range(1024)]
        setup = LookupClient(server.url, ClientConfig(timeout_ms=5000, retries=0))
        for p in range(16):  # every segment held by 16 pods with long names
            pod = f"pod{p:03d}" + "x" * 240
            reply = setup.call({"op": "admit", "pod": pod, "entries": [entry(k) for k in keys]})
            assert reply["admitted"] == 1024
        hostile = []
        try:
            for _ in range(
                8
            ):  # 8 connections x 4 MB replies, less what the kernel buffers: over the 8 MiB budget
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", server.port))
                _send_ignoring_errors(sock, lookup_request(keys) * 2)  # and never read
                hostile.append(sock)
            deadline = time.monotonic() + 5
            while metric(server, 'holeblend_lookup_errors_total{code="write_budget"}') < 1:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            client = LookupClient(server.url, ClientConfig(timeout_ms=2000, retries=0))
            for _ in range(5):
                hits = client.lookup(keys[:4])
                assert all(hit is not None for hit in hits)
            assert client.stats.degraded_lookups == 0
            fresh = connect(server.port)
            fresh.sendall(lookup_request(keys[:4]))
            assert fresh.recv(64).startswith(b"HTTP/1.1 200 ")
            fresh.close()
            assert metric(server, 'holeblend_lookup_errors_total{code="write_budget"}') >= 1
            assert metric(server, 'holeblend_lookup_errors_total{code="memory_budget"}') == 0
        finally:
            for sock in hostile:
                sock.close()
    assert "Traceback" not in log_path.read_text()


# --- memory ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_half_sent_large_requests_stay_within_the_memory_budget():
    with LoggedLookupProcess() as server:
        client = LookupClient(server.url, ClientConfig(timeout_ms=2000))
        client.call({"op": "admit", "pod": "p", "entries": [entry("kept")]})
        head = b"POST /v1 HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (4 * MIB)
        part = b"\x00" * (2 * MIB)
        sockets, refused = [], 0
        try:
            for _ in range(120):
                sock = connect(server.port)
                sockets.append(sock)
                sock.sendall(head + part[: 64 << 10])
                if select.select([sock], [], [], 0.15)[0]:
                    reply = sock.recv(4096)
                    assert reply.startswith(b"HTTP/1.1 503 "), reply
                    assert b"memory budget" in reply and b"retry" in reply
                    refused += 1
                _send_ignoring_errors(sock, part[64 << 10 :])
            # Every accepted connection holds 2 MiB of its 4 MiB body now.
            assert client.lookup(["kept", "other"])[0] is not None
            assert client.stats.degraded_lookups == 0
            peak = server.peak_rss_bytes()
        finally:
            for sock in sockets:
                sock.close()
        print(f"half-sent bodies: peak RSS {peak / MIB:.1f} MiB, {refused} of 120 refused")
        assert peak < 256 * MIB, f"peak RSS {peak / MIB:.0f} MiB"
        assert 100 <= refused < 120
        assert (
            refused <= metric(server, 'holeblend_lookup_errors_total{code="memory_budget"}') < 120
        )


# --- timeouts -------------------------------------------------------------------------------


def test_an_idle_connection_is_closed_and_the_client_reconnects_transparently(quick_server):
    with connect(quick_server.port) as sock:
        reply, waited = read_until_closed(sock)
    assert reply == b"" and 0.4 < waited < 2.0
    # No retry to hide behind: the client sees the closed socket before it sends.
    client = LookupClient(quick_server.url, ClientConfig(retries=0))
    assert client.lookup(["a"]) == [None]  # a kept-alive connection now
    time.sleep(1.0)  # the server closes it as idle
    assert client.lookup(["a"]) == [None]
    assert client.stats.degraded_lookups == 0 and client.stats.failures == 0


def test_a_connection_in_use_is_not_closed_as_idle(quick_server):
    with connect(quick_server.port) as sock:
        for _ in range(8):  # 1.6 s in all, longer than the idle timeout
            sock.sendall(lookup_request(["k"]))
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
            time.sleep(0.2)


def test_a_half_sent_head_is_closed_after_the_header_timeout(quick_server):
    with connect(quick_server.port) as sock:
        sock.sendall(b"POST /v1 HTTP/1.1\r\nContent-Le")
        reply, waited = read_until_closed(sock)
    assert status_of(reply) == 408 and b"request head" in reply
    assert 0.4 < waited < 2.0


def test_a_trickled_head_is_timed_from_its_first_byte(quick_server):
    with connect(quick_server.port) as sock:
        started = time.monotonic()
        for byte in b"POST /v1 HTTP/1.1\r\nX-Slow: " + b"a" * 200:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if select.select([sock], [], [], 0.05)[0]:
                break
        reply, _ = read_until_closed(sock)
        waited = time.monotonic() - started
    assert status_of(reply) == 408 and waited < 2.0


def test_a_half_sent_body_is_closed_after_the_body_timeout(quick_server):
    with connect(quick_server.port) as sock:
        sock.sendall(b"POST /v1 HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b"\x80" * 10)
        reply, waited = read_until_closed(sock)
    assert status_of(reply) == 408 and b"request body" in reply
    assert 0.4 < waited < 2.0


# --- framing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "status", "says"),
    [
        # A head over 8 KiB that arrives complete, in one piece.
        (b"GET /healthz HTTP/1.1\r\nX-Pad: " + b"a" * 9000 + b"\r\n\r\n", 413, b"8192"),
        # Just within the limit.
        (b"GET /healthz HTTP/1.1\r\nX-Pad: " + b"a" * 8000 + b"\r\n\r\n", 200, b"ok"),
        (
            b"GET /healthz HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 2\r\n\r\nab",
            400,
            b"Content-Length",
        ),
        (b"GET /healthz HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab", 200, b"ok"),
        (b"GET /healthz HTTP/1.1\n\n", 400, b"CRLF"),
        (b"GET /healthz HTTP/1.1\nHost: x\r\n\r\n", 400, b"CRLF"),
        (b"GET /healthz HTTP/1.1\r\nHost: x\rY: z\r\n\r\n", 400, b"CRLF"),
        (b"GET /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 400, b"chunked"),
    ],
)
def test_framing_rules(quick_server, request_bytes, status, says):
    with connect(quick_server.port, timeout_s=2) as sock:
        sock.sendall(request_bytes)
        reply = sock.recv(65536)
    assert status_of(reply) == status and says in reply.partition(b"\r\n\r\n")[2], reply
    assert LookupClient(quick_server.url).lookup(["k"]) == [None]


def test_a_bare_lf_head_is_refused_before_the_header_timeout(quick_server):
    with connect(quick_server.port) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1 HTTP/1.1\nContent-Length: 5\n")
        reply, _ = read_until_closed(sock)
    assert status_of(reply) == 400 and time.monotonic() - started < 0.3


def test_pipelined_requests_then_a_half_close_are_all_answered(quick_server):
    with connect(quick_server.port) as sock:
        sock.sendall(lookup_request(["k"]) * 100)
        sock.shutdown(socket.SHUT_WR)
        reply, _ = read_until_closed(sock)
    assert reply.count(b"HTTP/1.1 200 OK") == 100


# --- logs -----------------------------------------------------------------------------------


def test_a_pod_name_cannot_forge_a_log_line(tmp_path):
    log_path = tmp_path / "server.log"
    server = LoggedLookupProcess("--pod-timeout", "0.4", "--log-level", "INFO", log_path=log_path)
    with server:
        client = LookupClient(server.url)
        for op in ("heartbeat", "admit"):
            with connect(server.port) as sock:
                body = msgpack.packb(
                    {"v": 1, "op": op, "pod": "pod-1\nFORGED: admin logged in", "entries": []}
                )
                sock.sendall(b"POST /v1 HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                reply = sock.recv(65536)
            assert status_of(reply) == 400
            error = msgpack.unpackb(reply.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "bad_request" and error["message"].startswith("pod:")
        assert client.call({"op": "heartbeat", "pod": "pod-2 \u00e9"})["resync"] is True
        deadline = time.monotonic() + 5
        while b"stopped heartbeating" not in log_path.read_bytes():
            assert time.monotonic() < deadline, "the silent pod was not logged"
            time.sleep(0.05)
    lines = log_path.read_text().splitlines()
    assert not [line for line in lines if line.startswith("FORGED")]
    assert any("'pod-2 \\xe9' stopped heartbeating" in line for line in lines)


def test_log_lines_escape_client_text(caplog, monkeypatch):
    """In-process: names that bypass the wire checks, and an internal error's message."""
    import gc

    monkeypatch.setattr(gc, "freeze", lambda: None)
    server = LookupServer(ServerConfig(index=IndexLimits(pod_timeout_s=0.001)))
    server.index.heartbeat("pod\nFORGED line\r\x1b[2J")
    time.sleep(0.01)
    with caplog.at_level(logging.INFO):
        server.sweep_silent_pods()

        def broken(method, path, body):
            raise ValueError(f"bad thing\nFORGED {path}")

        monkeypatch.setattr(server, "handle", broken)
        connection = _Connection(server, _FakeLoop())
        transport = _FakeTransport()
        connection.connection_made(transport)
        connection.data_received(b"GET /x\x85FORGED HTTP/1.1\r\n\r\n")
    assert transport.written.startswith(b"HTTP/1.1 500 ")
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert "'pod\\nFORGED line\\r\\x1b[2J' stopped heartbeating" in messages[0]
    for message in messages:
        assert not [line for line in message.splitlines() if "FORGED" in line[:8]]


class _FakeLoop:
    def time(self) -> float:
        return time.monotonic()

    def call_at(self, when, callback):
        return _FakeTimer()

    def call_soon(self, callback):
        callback()


class _FakeTimer:
    def cancel(self) -> None:
        pass


class _FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.closing = False

    def set_write_buffer_limits(self, high, low) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


# --- connections that close with their replies unread ---------------------------------------


@contextlib.contextmanager
def server_on_a_thread(host: str = "127.0.0.1", **config):
    """An in-process server on an event loop of its own (uvloop, as served), so that a test
    can watch its open connections."""
    loop = server_module.new_event_loop()
    server = LookupServer(
        ServerConfig(host=host, port=0, index=IndexLimits(pod_timeout_s=600), **config)
    )
    loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server, loop
    finally:
        on_loop(loop, server.stop)
        asyncio.run_coroutine_threadsafe(server.serve_forever(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def on_loop(loop, function):
    """`function()` run on the server's loop (its state is the loop's alone)."""

    async def call():
        return function()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(5)


def wait_until_closed(server: LookupServer, loop, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while on_loop(loop, lambda: len(server.connections)):
        assert time.monotonic() < deadline, "the server still holds the connection"
        time.sleep(0.02)


def test_a_half_closed_client_that_never_reads_its_replies_is_disconnected(monkeypatch):
    """A client sends requests, half-closes and reads nothing: the server closes once the
    replies are written, and aborts when they are not within the linger time. Before, a
    reply left unsent below the write high-water mark (so no write timeout applied) held
    the connection, its socket and the reply for good: closing on the client's EOF armed
    nothing, and the idle timer found the transport already closing and gave up."""
    monkeypatch.setattr(server_module, "LINGER_S", 0.3)
    with server_on_a_thread(idle_timeout_s=0.3) as (server, loop):
        pod = "pod-" + "x" * 250
        on_loop(
            loop,
            lambda: server.index.admit(
                pod, [Entry(f"k{i}", 1, "m", "d", None, 1, True) for i in range(100)]
            ),
        )
        request = lookup_request([f"k{i}" for i in range(100)])  # a reply of about 26 KB
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        with sock:
            # Ask until the kernel's buffers are full and the server holds part of a reply.
            for _ in range(1000):
                sock.sendall(request)
                time.sleep(0.002)
                held = on_loop(
                    loop,
                    lambda: [c.transport.get_write_buffer_size() for c in server.connections],
                )
                if held and held[0]:
                    break
            assert 0 < held[0] < WRITE_HIGH_WATER, held  # no write timeout applies
            sock.shutdown(socket.SHUT_WR)
            wait_until_closed(server, loop, timeout_s=2.0)


@pytest.mark.parametrize("keep_alive", [True, False])
def test_replies_left_unread_after_the_last_answer_of_a_turn_are_dropped_in_time(
    monkeypatch, keep_alive
):
    """The 16th request answered in one event-loop turn (the last of the turn) gets a reply
    the client does not read. Before, the turn's end replaced the write deadline (or, for
    `Connection: close`, the linger deadline) with the idle one: the never-reading client
    kept its replies for the idle timeout instead of the write timeout, uncounted, and with
    `Connection: close` for good."""
    monkeypatch.setattr(server_module, "LINGER_S", 0.3)
    with server_on_a_thread(idle_timeout_s=30, write_timeout_s=0.3) as (server, loop):
        keys = [f"k{i}" for i in range(1024)]
        entries = [Entry(key, 1, "m", "d", None, 1, True) for key in keys]
        for p in range(32):  # a reply of about 8 MB, more than the kernel buffers hold
            on_loop(loop, lambda p=p: server.index.admit(f"pod{p}-" + "x" * 250, entries))
        body = msgpack.packb({"v": 1, "op": "lookup", "keys": keys})
        close = b"" if keep_alive else b"Connection: close\r\n"
        big = b"POST /v1 HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n" % (close, len(body)) + body
        requests = b"GET /healthz HTTP/1.1\r\n\r\n" * (server.config.requests_per_turn - 1) + big
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        with sock:
            sock.sendall(requests)  # and never read
            wait_until_closed(server, loop, timeout_s=2.0)
        if keep_alive:
            metrics = on_loop(loop, server.metrics.render).decode()
            assert 'holeblend_lookup_errors_total{code="write_timeout"} 1.0' in metrics


# --- connections ----------------------------------------------------------------------------


def test_connections_over_the_limit_are_refused_and_a_client_is_answered_once_others_close():
    """There was no limit: a client that opened thousands of idle connections took the
    process's file descriptors (and stopped it accepting any), and kept them for the idle
    timeout."""
    with server_on_a_thread(max_connections=4) as (server, loop):
        idle = [connect(server.port) for _ in range(4)]
        try:
            deadline = time.monotonic() + 5
            while on_loop(loop, lambda: len(server.connections)) < 4:
                assert time.monotonic() < deadline, "the idle connections were not accepted"
                time.sleep(0.02)
            with connect(server.port) as over:
                reply, _ = read_until_closed(over)
            assert status_of(reply) == 503 and b"4 connections" in reply
            config = ClientConfig(timeout_ms=2000, retries=0)
            client = LookupClient(f"http://127.0.0.1:{server.port}", config)
            assert client.lookup(["k"]) == [None] and client.stats.degraded_lookups == 1
            idle.pop().close()
            wait_until_fewer(server, loop, 4)
            assert client.lookup(["k"]) == [None] and client.stats.degraded_lookups == 1
            assert on_loop(loop, lambda: len(server.connections)) == 4
            metrics = on_loop(loop, server.metrics.render).decode()
            assert 'holeblend_lookup_errors_total{code="connection_limit"} 2.0' in metrics
            client.close()
        finally:
            for sock in idle:
                sock.close()


def wait_until_fewer(server: LookupServer, loop, num_connections: int) -> None:
    deadline = time.monotonic() + 5
    while on_loop(loop, lambda: len(server.connections)) >= num_connections:
        assert time.monotonic() < deadline, "the closed connection is still held"
        time.sleep(0.02)


def test_the_connection_limit_must_be_positive():
    with pytest.raises(ValueError, match="max_connections: must be >= 1, got 0"):
        ServerConfig(max_connections=0)


def test_the_server_raises_a_low_open_file_limit_to_hold_its_connections():
    """A container's soft open-file limit may be 1024, under the connection limit: the
    descriptors would run out before the limit refused anyone."""
    script = (
        "import resource\n"
        "from holeblend_runtime.lookup_server.server import fit_open_file_limit\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "fit_open_file_limit(1000)\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1000 + server_module.SPARE_FDS:
        pytest.skip(f"the hard open-file limit here is {hard}")
    done = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, check=True)
    assert int(done.stdout) == 1000 + server_module.SPARE_FDS


# --- error replies in the metrics ----------------------------------------------------------


def test_unknown_paths_and_wrong_methods_are_counted_by_a_fixed_code(lookup_server):
    """404 and 405 replies were counted nowhere, so `holeblend_lookup_errors_total` showed
    no sign of a client calling a wrong path or method. The label is a fixed word, never
    the path: a client that tries many paths adds no series."""
    requests = (
        b"GET /nope-1 HTTP/1.1\r\n\r\n"
        b"GET /nope-2?x=1 HTTP/1.1\r\n\r\n"
        b"POST /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
        b"PUT /v1 HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    with connect(lookup_server.port) as sock:
        sock.sendall(requests)
        reply, _ = read_until_closed(sock)
    assert statuses_of(reply) == [404, 404, 405, 405]
    errors = error_counts(urllib.request.urlopen(lookup_server.url + "/metrics", timeout=5))
    assert errors == {"not_found": 2.0, "method_not_allowed": 2.0}


def test_an_internal_error_costs_one_reply_and_is_counted(monkeypatch):
    """A bug in an operation is answered 500 and the connection goes on serving; it was
    not counted, so an alert on `holeblend_lookup_errors_total` missed the server's own
    failures. No request causes one on purpose, so here the index fails."""

    def broken(keys, model=None):
        raise RuntimeError("the index is broken")

    with server_on_a_thread() as (server, loop):
        monkeypatch.setattr(server.index, "lookup", broken)
        with connect(server.port) as sock:
            sock.sendall(
                lookup_request(["k"]) + b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"
            )
            reply, _ = read_until_closed(sock)
        assert statuses_of(reply) == [500, 200]
        metrics = on_loop(loop, server.metrics.render)
    assert error_counts(metrics.splitlines()) == {"internal": 1.0}


def statuses_of(replies: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"^HTTP/1\.1 (\d{3}) ", replies, re.MULTILINE)]


def error_counts(lines) -> dict[str, float]:
    """The counted `holeblend_lookup_errors_total` series of a scrape: {code: value}
    (every known code is exported from the start, at 0)."""
    pattern = re.compile(rb'^holeblend_lookup_errors_total\{code="([^"]*)"\} (\S+)$')
    matches = (pattern.match(line.rstrip(b"\n")) for line in lines)
    return {match[1].decode(): float(match[2]) for match in matches if match and float(match[2])}


# --- shutdown -------------------------------------------------------------------------------


def test_sigterm_exits_within_the_drain_time_despite_stalled_clients():
    server = LoggedLookupProcess("--drain-seconds", "1").start()
    stalled = []
    try:
        for i in range(30):
            sock = connect(server.port)
            if i % 3 == 1:
                sock.sendall(b"POST /v1 HTTP/1.1\r\nContent-Len")
            elif i % 3 == 2:
                sock.sendall(b"POST /v1 HTTP/1.1\r\nContent-Length: 1000\r\n\r\nabc")
            stalled.append(sock)
        never_reads = socket.socket()
        never_reads.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        never_reads.connect(("127.0.0.1", server.port))
        stalled.append(never_reads)
        never_reads.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            never_reads.send(b"GET /metrics HTTP/1.1\r\n\r\n" * 2000)
        time.sleep(0.3)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(10) == 0
        print(f"SIGTERM with stalled clients: exited after {time.monotonic() - started:.2f} s")
        assert time.monotonic() - started < 1 + 3
    finally:
        for sock in stalled:
            sock.close()
        server.stop()
