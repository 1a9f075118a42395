"""The lookup client's costs grow with the size of what it handles, not with its square."""

import socket
import threading

import msgpack
import pytest

from holeblend_runtime.lookup_server import wire
from holeblend_runtime.lookup_server.client import (
    Announcer,
    AnnouncerConfig,
    LookupClient,
    LookupConnection,
)
from holeblend_runtime.lookup_server.wire import Entry

READ_BYTES = 4096


class CopyCounter:
    """Bytes the client copied to put received chunks together."""

    def __init__(self) -> None:
        self.num_bytes = 0


class Chunk(bytes):
    """A received chunk that counts what joining it to the reply so far copies: a new
    bytes object copies both sides, a bytearray extended in place only the chunk."""

    counter: CopyCounter

    def __radd__(self, other: object) -> object:
        self.counter.num_bytes += len(self)
        if isinstance(other, bytearray):
            return NotImplemented  # bytearray's own in-place extend
        self.counter.num_bytes += len(other)
        return bytes(other) + bytes(self)


class SmallReadSocket(socket.socket):
    """A real socket whose reads return at most READ_BYTES, as counted chunks."""

    counter: CopyCounter

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(min(bufsize, READ_BYTES), flags)
        chunk = Chunk(data)
        chunk.counter = self.counter
        return chunk


def _serve_one_reply(sock: socket.socket, reply: bytes) -> None:
    request = b""
    while b"\r\n\r\n" not in request:
        request += sock.recv(1 << 16)
    head, _, body = request.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(1 << 16)
    sock.sendall(reply)


def test_a_multi_megabyte_reply_is_copied_a_bounded_number_of_times():
    """A lookup of many keys with locations, or a stats reply, runs to megabytes: each
    read must not copy the whole reply read so far (quadratic in the reply's size)."""
    hits = [[64, True, [f"pod-{i % 7}"] * 3] for i in range(50_000)]
    body = msgpack.packb({"v": wire.WIRE_VERSION, "ok": True, "hits": hits})
    reply = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    assert len(reply) > 1_000_000
    client_end, server_end = socket.socketpair()
    counter = CopyCounter()
    sock = SmallReadSocket(fileno=client_end.detach())
    sock.counter = counter
    server = threading.Thread(target=_serve_one_reply, args=(server_end, reply), daemon=True)
    server.start()
    connection = LookupConnection("127.0.0.1", 1, timeout_s=5.0)
    connection._sock = sock
    try:
        answer = connection.call({"op": "lookup", "keys": ["k"]})
    finally:
        connection.shutdown()
        server.join(5)
        server_end.close()
    assert answer["hits"] == hits
    assert counter.num_bytes <= 2 * len(reply)


@pytest.mark.parametrize("head_split_at", [1, 17, 37, 38, 39, 40])
def test_a_reply_head_split_across_reads_is_found(head_split_at):
    """The head's end is searched for only in new bytes: a `\\r\\n\\r\\n` cut across two
    reads is still found."""
    body = msgpack.packb({"v": wire.WIRE_VERSION, "ok": True, "n": 1})
    reply = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    client_end, server_end = socket.socketpair()
    connection = LookupConnection("127.0.0.1", 1, timeout_s=5.0)
    connection._sock = client_end

    def serve() -> None:
        _serve_one_reply(server_end, b"")
        for start in range(0, len(reply), head_split_at):
            server_end.sendall(reply[start : start + head_split_at])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        assert connection.call({"op": "heartbeat", "pod": "p"})["n"] == 1
    finally:
        connection.shutdown()
        server.join(5)
        server_end.close()


def test_a_full_announcer_queue_drops_the_oldest_in_order():
    """Past `max_pending`, each new announcement drops the oldest one, counts it and asks
    for a resync; the rest keep their order (the queue drops from its head in O(1))."""
    config = AnnouncerConfig(max_pending=1000)
    client = LookupClient("http://127.0.0.1:9")
    announcer = Announcer(client, "pod-a", lambda: [], config)
    num_sent = 50_000
    for i in range(num_sent):
        if i % 2:
            announcer.evict(f"k{i}")
        else:
            announcer.admit(Entry(f"k{i}", 4, "m", "float32", None, 64, True))
    queued = list(announcer._pending)
    assert announcer.num_dropped == num_sent - 1000
    assert announcer._needs_resync
    kept = [value if kind == "evict" else value.key for kind, value in queued]
    assert kept == [f"k{i}" for i in range(num_sent - 1000, num_sent)]
    client.close()
