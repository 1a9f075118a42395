"""The last eighth of the request-memory budget stays free for lookups: no client can hold
it with requests it never finishes sending, heads alone or heads with part of a body."""

import socket
import time

from holeblend_runtime.lookup_server.client import ClientConfig, LookupClient
from holeblend_runtime.lookup_server.wire import Limits

from .test_lookup_hostile import connect, error_counts, on_loop, server_on_a_thread

# A 1 MiB budget, bodies of 200,000 bytes at most (the probe's settings).
SETTINGS = {"max_buffer_bytes": 1 << 20, "limits": Limits(max_body_bytes=200_000)}
# Bodies the probe announced: over and under the 64 KiB that large bodies start above.
ANNOUNCED = [200_000] * 4 + [65_536] * 3 + [51_500]


def hold_half_sent_requests(server, loop, body_bytes: list[bytes]) -> list[socket.socket]:
    """One connection per announced body, each sending its head and `body_bytes`, then
    waiting; returns once the server has parsed each head or refused it."""
    sockets = []
    for length, sent in zip(ANNOUNCED, body_bytes, strict=True):
        sock = connect(server.port)
        sock.sendall(b"POST /v1 HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % length + sent)
        sockets.append(sock)
        deadline = time.monotonic() + 5
        while held_or_refused(server, loop) < len(sockets):
            assert time.monotonic() < deadline, "the server did not take the request's head"
            time.sleep(0.01)
    return sockets


def held_or_refused(server, loop) -> int:
    def count() -> int:
        held = sum(c.head is not None for c in server.connections)
        refused = error_counts(server.metrics.render().splitlines()).get("memory_budget", 0)
        return held + int(refused)

    return on_loop(loop, count)


def assert_lookups_answered(server, loop) -> None:
    config = ClientConfig(timeout_ms=5000, retries=0)
    client = LookupClient(f"http://127.0.0.1:{server.port}", config)
    try:
        for _ in range(3):
            assert client.lookup(["k"]) == [None]
        assert client.stats.degraded_lookups == 0 and client.stats.refused == 0
    finally:
        client.close()
    held = on_loop(loop, lambda: server.buffered_bytes)
    assert held <= server.config.large_body_budget, held


def test_heads_alone_cannot_take_the_share_kept_for_lookups():
    """Eight heads announcing bodies and sending none reserved 1,048,464 bytes of a
    1 MiB budget, as bodies of 64 KiB or less could take its last eighth: every lookup
    was refused 503 (`memory_budget`) until the body timeout, then again."""
    with server_on_a_thread(body_timeout_s=60, **SETTINGS) as (server, loop):
        sockets = hold_half_sent_requests(server, loop, [b""] * len(ANNOUNCED))
        try:
            assert_lookups_answered(server, loop)
        finally:
            for sock in sockets:
                sock.close()


def test_half_sent_small_bodies_cannot_take_the_share_kept_for_lookups():
    """Sending most of each small body (bytes that arrived, not only announced ones) does
    not let the unfinished requests hold the last eighth either."""
    sent = [b""] * 4 + [b"\x80" * (length - 100) for length in ANNOUNCED[4:]]
    with server_on_a_thread(body_timeout_s=60, **SETTINGS) as (server, loop):
        sockets = hold_half_sent_requests(server, loop, sent)
        try:
            assert_lookups_answered(server, loop)
        finally:
            for sock in sockets:
                sock.close()
