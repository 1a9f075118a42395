"""What a lookup server can make its client hold, and what the client counts against it.

A reply is read only up to a bound sized from the largest reply a server sends, so a
broken server, or another service at its port, cannot make every engine pod allocate
without end. A call whose own deadline was spent before it sent a byte is the caller's
failure, not the server's: it never opens the breaker for a healthy server. Nor can
a server's refusals with ever new codes add a log line per call.
"""

import itertools
import logging
import socket
import threading
import time

import msgpack
import pytest

from holeblend_runtime.kv.circuit_breaker import CircuitBreaker
from holeblend_runtime.lookup_server import wire
from holeblend_runtime.lookup_server.client import (
    MAX_REPLY_BYTES,
    ClientConfig,
    LookupClient,
    LookupConnection,
)

MIB = 1 << 20
HEARTBEAT = {"op": "heartbeat", "pod": "pod-a"}


class StreamingServer:
    """Answers the first request with `head`, then with bytes that do not end until
    `num_bytes` were sent or the client hung up; counts what it sent."""

    def __init__(self, head: bytes, num_bytes: int) -> None:
        self.head = head
        self.num_bytes = num_bytes
        self.num_sent = 0
        self.done = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        connection = self.sock.accept()[0]
        chunk = b"x" * (64 << 10)
        try:
            with connection:
                _read_request(connection)
                connection.sendall(self.head)
                while self.num_sent < self.num_bytes:
                    connection.sendall(chunk)
                    self.num_sent += len(chunk)
                connection.settimeout(10)
                connection.recv(1)  # until the client hangs up
        except OSError:
            pass  # the client hung up
        finally:
            self.done.set()

    def close(self) -> None:
        self.sock.close()


def _read_request(connection: socket.socket) -> bool:
    """Read one request whole; False when the client hung up instead."""
    request = b""
    while b"\r\n\r\n" not in request:
        if not (chunk := connection.recv(65536)):
            return False
        request += chunk
    head, _, body = request.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        if not (chunk := connection.recv(65536)):
            return False
        body += chunk
    return True


@pytest.mark.parametrize(
    "head",
    [b"", b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 40)],
    ids=["bytes-without-a-head", "a-terabyte-body"],
)
def test_a_reply_without_end_is_refused_and_its_connection_closed(head):
    """Bytes that never end a head, or a head announcing a body larger than any reply,
    were read for as long as the budget lasted: 128 MiB of them reached the client's
    memory. The client stops at the bound, hangs up, and counts the server as failed."""
    server = StreamingServer(head, num_bytes=128 * MIB)
    config = ClientConfig(timeout_ms=2000, retries=0, breaker_failures=1)
    client = LookupClient(server.url, config)
    try:
        assert client.call(HEARTBEAT) is None
        assert server.done.wait(10)
        assert server.num_sent < 64 * MIB  # the kernel's buffers, not the client, took the rest
        assert client.stats.failures == 1 and client.breaker.num_opened == 1
    finally:
        client.close()
        server.close()


def test_a_reply_is_read_up_to_max_reply_bytes_and_no_further(lookup_server):
    connection = LookupConnection("127.0.0.1", lookup_server.port, timeout_s=5.0)
    try:
        reply_bytes = len(wire.encode({"ok": True, "resync": True}))
        connection.max_reply_bytes = reply_bytes
        assert connection.call(HEARTBEAT)["resync"] is True
        connection.max_reply_bytes = reply_bytes - 1
        with pytest.raises(ConnectionError, match="max_reply_bytes"):
            connection.call(HEARTBEAT)
        assert connection._sock is None
    finally:
        connection.shutdown()


def test_the_reply_bound_holds_a_lookup_of_max_keys_each_held_by_250_pods():
    """The largest reply a server sends is a lookup's: `max_keys` hits, each naming the
    pods that hold the segment, by names of up to `max_name_chars`."""
    limits = wire.Limits()
    pods = [f"{i:03d}".ljust(limits.max_name_chars, "p") for i in range(250)]
    hits = [[(1 << 48) - 1, True, pods]] * limits.max_keys
    assert len(wire.encode({"ok": True, "hits": hits})) <= MAX_REPLY_BYTES
    assert ClientConfig().max_reply_bytes == MAX_REPLY_BYTES


def test_max_reply_bytes_must_be_positive():
    with pytest.raises(ValueError, match="max_reply_bytes"):
        ClientConfig(max_reply_bytes=0)


def test_a_call_whose_deadline_was_spent_before_it_started_does_not_open_the_breaker(
    lookup_server,
):
    """A caller that comes with its deadline already spent fails its call (a lookup
    answers all miss): that counted against the server, and a slow caller opened the
    breaker for a healthy one, skipping every other thread's lookups."""
    client = LookupClient(lookup_server.url, ClientConfig(breaker_failures=1))
    try:
        for _ in range(3):
            assert client.call(HEARTBEAT, deadline=time.monotonic() - 1) is None
        assert client.stats.failures == 3
        assert client.breaker.num_opened == 0 and not client.breaker.is_open
        assert client.call(HEARTBEAT) is not None
    finally:
        client.close()


def test_a_spent_deadline_keeps_the_kept_alive_connection(lookup_server):
    """Nothing was sent: the socket is as good as before, and the next call needs no new
    connection."""
    connection = LookupConnection("127.0.0.1", lookup_server.port, timeout_s=5.0)
    try:
        connection.call(HEARTBEAT)
        sock = connection._sock
        with pytest.raises(TimeoutError):
            connection.call(HEARTBEAT, deadline=time.monotonic() - 1)
        assert connection._sock is sock
        assert "resync" in connection.call(HEARTBEAT)
        assert connection._sock is sock
    finally:
        connection.shutdown()


def test_a_trial_call_whose_deadline_was_spent_lets_the_next_call_be_the_trial(
    lookup_server,
):
    """Half-open, the breaker lets one call through as its trial. One that came with its
    deadline spent reopened the breaker for another `breaker_open_s`, with the server up."""
    now = [0.0]
    config = ClientConfig(breaker_failures=1, breaker_open_s=10)
    client = LookupClient(lookup_server.url, config, clock=lambda: now[0])
    try:
        assert client.breaker.failed()  # the server failed once: open
        now[0] = 11.0  # half-open
        assert client.call(HEARTBEAT, deadline=time.monotonic() - 1) is None
        assert client.call(HEARTBEAT) is not None
        assert client.stats.skipped_by_breaker == 0 and not client.breaker.is_open
        assert client.breaker.num_opened == 1
    finally:
        client.close()


def test_a_trial_that_did_not_reach_the_remote_lets_the_next_caller_through():
    now = [0.0]
    breaker = CircuitBreaker(1, 2.0, clock=lambda: now[0])
    assert breaker.failed()
    now[0] = 2.5
    assert not breaker.is_open  # the trial
    assert breaker.is_open  # the others wait for it
    breaker.not_tried()
    assert not breaker.is_open  # the next trial
    assert breaker.is_open


class RefusingServer:
    """Answers every request on a kept-alive connection with an error reply whose code
    is new each time, and whose message is long: a server of another build, or a broken
    one."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        connection = self.sock.accept()[0]
        with connection:
            for number in itertools.count():
                if not _read_request(connection):
                    return
                error = {"code": f"refused-{number}", "message": "no " * 100_000}
                body = msgpack.packb({"v": 1, "ok": False, "error": error})
                head = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body)
                connection.sendall(head + body)

    def close(self) -> None:
        self.sock.close()


def test_refusals_with_ever_new_codes_are_logged_and_remembered_a_bounded_number_of_times(
    caplog,
):
    """Refusals are logged once per operation and code, and the pairs logged are kept:
    with a new code in every reply, every call logged a line (of the whole message) and
    the set grew for good."""
    server = RefusingServer()
    client = LookupClient(server.url, ClientConfig(timeout_ms=2000))
    try:
        with caplog.at_level(logging.WARNING, logger="holeblend_runtime.lookup_server.client"):
            for _ in range(50):
                assert client.call(HEARTBEAT) is None
        assert client.stats.refused == 50 and not client.breaker.is_open
        assert len(caplog.records) == 1 and len(caplog.records[0].getMessage()) < 1000
        assert len(client._refusals_logged) == 1
    finally:
        client.close()
        server.close()
