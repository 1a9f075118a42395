"""A lookup split into several requests keeps the one budget the caller asked for."""

import socket
import threading
import time

import msgpack

from holeblend_runtime.lookup_server.client import ClientConfig, Location, LookupClient

HIT = [4, True, ["pod-a"]]


class SlowServer:
    """Answers each lookup (every key a hit) `delay_s` after it arrived, on a kept-alive
    connection."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.num_requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection = self.sock.accept()[0]
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        buffer = b""
        with connection:
            while True:
                while b"\r\n\r\n" not in buffer:
                    if not (chunk := connection.recv(65536)):
                        return
                    buffer += chunk
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(buffer) < length:
                    if not (chunk := connection.recv(65536)):
                        return
                    buffer += chunk
                body, buffer = buffer[:length], buffer[length:]
                self.num_requests += 1
                time.sleep(self.delay_s)
                keys = msgpack.unpackb(body)["keys"]
                reply = msgpack.packb({"v": 1, "ok": True, "hits": [HIT] * len(keys)})
                head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(reply)
                try:
                    connection.sendall(head + reply)
                except OSError:
                    return

    def close(self) -> None:
        self.sock.close()


def test_the_requests_of_a_long_lookup_share_one_budget():
    """Each of the 1024-key requests of a 3,000-key lookup had a whole budget of its own:
    against a server answering each in 60% of the budget, the caller waited 180% of it
    for an answer. The requests share the lookup's budget: the second one runs out of it,
    and the lookup answers all miss, counted as degraded, when its budget is spent."""
    server = SlowServer(delay_s=0.12)
    client = LookupClient(server.url, ClientConfig(timeout_ms=200, retries=0, breaker_failures=5))
    try:
        assert client.lookup([f"k{i}" for i in range(3000)]) == [None] * 3000
        assert server.num_requests < 3  # the third never started: no budget was left
        assert client.stats.degraded_lookups == 1 and client.stats.failures == 1
    finally:
        client.close()
        server.close()


def test_a_long_lookup_within_its_budget_is_answered_whole():
    server = SlowServer(delay_s=0.0)
    client = LookupClient(server.url, ClientConfig(timeout_ms=5000, retries=0))
    try:
        hits = client.lookup([f"k{i}" for i in range(3000)])
        assert hits == [Location(4, True, ("pod-a",))] * 3000
        assert server.num_requests == 3 and client.stats.degraded_lookups == 0
    finally:
        client.close()
        server.close()
