"""What the server holds for a client between its turns, replies the client has not read
and pipelined requests still to answer, counts against the request-memory budget, and may
not take the budget's last eighth: that is room for the lookups that arrive whole."""

import socket
import threading
import time

from holeblend_runtime.lookup_server.client import ClientConfig, LookupClient
from holeblend_runtime.lookup_server.server import WRITE_HIGH_WATER
from holeblend_runtime.lookup_server.wire import Entry, Limits

from .test_lookup_hostile import (
    connect,
    error_counts,
    lookup_request,
    on_loop,
    read_until_closed,
    server_on_a_thread,
    statuses_of,
)

# A 1 MiB budget: bodies of 64 KiB at most, so that it is a valid one.
SMALL_BUDGET = {"max_buffer_bytes": 1 << 20, "limits": Limits(max_body_bytes=64 << 10)}


def indexed_keys(server, loop, num_keys: int) -> list[str]:
    """Keys indexed under a long pod name: a lookup of them is answered with about
    260 bytes per key."""
    keys = [f"k{i}" for i in range(num_keys)]
    entries = [Entry(key, 1, "m", "d", None, 1, True) for key in keys]
    on_loop(loop, lambda: server.index.admit("pod-" + "x" * 250, entries))
    return keys


def never_reading_connection(server, loop) -> socket.socket:
    """A client socket whose replies the kernel's buffers, small on both ends, barely hold:
    the server queues the rest of a reply of a few dozen KB."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    port = sock.getsockname()[1]

    def shrink_send_buffer() -> bool:
        for connection in server.connections:
            if connection.transport.get_extra_info("peername")[1] == port:
                sock_info = connection.transport.get_extra_info("socket")
                sock_info.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                return True
        return False

    wait_for(lambda: on_loop(loop, shrink_send_buffer), "the server did not accept the client")
    return sock


def wait_for(condition, failure: str, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, failure
        time.sleep(0.005)
    return value


def queued_and_charged(server) -> tuple[int, int]:
    """Reply bytes queued for all clients, and the budget's bytes in use."""
    queued = sum(c.transport.get_write_buffer_size() for c in server.connections if c.transport)
    return queued, server.buffered_bytes


def num_holding_replies(server) -> int:
    return sum(bool(c.transport.get_write_buffer_size()) for c in server.connections)


def errors(server, loop) -> dict[str, float]:
    return error_counts(on_loop(loop, server.metrics.render).splitlines())


def test_a_small_reply_left_unread_counts_against_the_memory_budget():
    """A reply queued below the write high-water mark was charged nowhere: thousands of
    connections that never read could hold up to 64 KiB each outside the budget."""
    with server_on_a_thread() as (server, loop):
        keys = indexed_keys(server, loop, 100)
        sock = never_reading_connection(server, loop)
        with sock:
            sock.sendall(lookup_request(keys))
            queued, charged = wait_for(
                lambda: (state := on_loop(loop, lambda: queued_and_charged(server)))[0] and state,
                "no reply was queued",
            )
            assert 0 < queued < WRITE_HIGH_WATER
            assert charged >= queued


def test_connections_that_never_read_small_replies_are_dropped_at_the_budget_share():
    """Many connections, each leaving one reply of about 50 KB unread: once their replies
    reach the seven-eighths share, the next one is dropped (`write_budget`), so what they
    hold stays bounded and the lookups of the others are answered."""
    with server_on_a_thread(**SMALL_BUDGET) as (server, loop):
        keys = indexed_keys(server, loop, 200)
        hostile = []
        try:
            for _ in range(60):  # 60 x 50 KB: far over the 1 MiB budget
                sock = never_reading_connection(server, loop)
                hostile.append(sock)
                sock.sendall(lookup_request(keys))
                wait_for(
                    lambda: (
                        on_loop(
                            loop,
                            lambda: num_holding_replies(server) == len(hostile),
                        )
                        or errors(server, loop).get("write_budget")
                    ),
                    "the reply was neither queued nor dropped",
                )
                if errors(server, loop).get("write_budget"):
                    break
            assert errors(server, loop).get("write_budget") == 1
            queued, charged = on_loop(loop, lambda: queued_and_charged(server))
            assert queued <= charged <= server.config.large_body_budget
            client = LookupClient(
                f"http://127.0.0.1:{server.port}", ClientConfig(timeout_ms=5000, retries=0)
            )
            try:
                assert all(hit is not None for hit in client.lookup(keys[:4]))
                assert client.stats.degraded_lookups == 0 and client.stats.refused == 0
            finally:
                client.close()
        finally:
            for sock in hostile:
                sock.close()


def test_pipelined_requests_waiting_for_their_turn_cannot_hold_the_last_eighth():
    """2,400 pipelined requests (62,400 bytes) arrive in one read against a 64 KiB budget
    whose seven-eighths share is 57,344 bytes. Before, answering them over 150 turns held
    the budget's last eighth all along; now the turn that leaves them over the share
    answers 503 (`memory_budget`) and closes, as for a request still waiting for its bytes."""
    settings = {"max_buffer_bytes": 64 << 10, "limits": Limits(max_body_bytes=16 << 10)}
    with server_on_a_thread(idle_timeout_s=1.0, **settings) as (server, loop):
        sock = connect(server.port)
        with sock:
            wait_for(lambda: on_loop(loop, lambda: len(server.connections)), "not accepted")
            requests = b"GET /healthz HTTP/1.1\r\n\r\n" * 2400
            assert server.config.large_body_budget < len(requests) <= server.config.max_buffer_bytes
            loop_held = threading.Event()

            def hold_loop() -> None:  # so that the requests arrive in one read
                loop_held.set()
                time.sleep(0.3)

            loop.call_soon_threadsafe(hold_loop)
            assert loop_held.wait(5)
            sock.sendall(requests)
            replies, _ = read_until_closed(sock)
        statuses = statuses_of(replies)
        assert statuses[-1] == 503 and b"memory budget" in replies
        assert set(statuses[:-1]) == {200} and len(statuses) < 2400
        assert errors(server, loop) == {"memory_budget": 1.0}
