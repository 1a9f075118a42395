"""The runtime's lookup client: an unreachable or slow server costs milliseconds, never a request."""

import socket
import threading
import time

import msgpack
import pytest

from holeblend_runtime.lookup_server.client import (
    ClientConfig,
    Location,
    LookupClient,
    LookupConnection,
    parse_lookup_url,
)
from holeblend_runtime.lookup_server.processes import LookupProcess, free_port
from holeblend_runtime.lookup_server.wire import Entry
from tests.contention import run_contended

ENTRY = Entry("k", 4, "m", "float32", None, 64, True).to_wire()


class SilentServer:
    """Accepts connections and never answers: the slowest possible lookup server."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.connections.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for connection in self.connections:
            connection.close()


class CannedServer:
    """Answers every request with the same bytes, then closes: what a live server (or
    whatever stands at its address) may send."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection = self.sock.accept()[0]
            except OSError:
                return
            with connection:
                _read_request(connection)
                connection.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()


def _read_request(connection: socket.socket) -> None:
    """Read one request whole (the client may have closed before sending it)."""
    request = b""
    while b"\r\n\r\n" not in request:
        if not (chunk := connection.recv(65536)):
            return
        request += chunk
    head, _, body = request.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length and (chunk := connection.recv(65536)):
        body += chunk


def plain_reply(status: str, text: bytes) -> bytes:
    return (
        b"HTTP/1.1 %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (status.encode(), len(text), text)
    )


def msgpack_reply(message: dict) -> bytes:
    body = msgpack.packb(message)
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_an_unreachable_server_answers_all_miss_quickly_and_opens_the_breaker():
    client = LookupClient(f"http://127.0.0.1:{free_port()}", ClientConfig(timeout_ms=20, retries=1))
    started = time.perf_counter()
    for _ in range(10):
        assert client.lookup(["a", "b"]) == [None, None]
    assert time.perf_counter() - started < 0.5
    assert client.breaker.is_open
    assert client.stats.degraded_lookups == 10 and client.stats.skipped_by_breaker >= 7


def test_a_server_that_never_replies_costs_at_most_the_timeout_budget():
    server = SilentServer()
    try:
        config = ClientConfig(timeout_ms=30, retries=1, breaker_failures=100)
        client = LookupClient(f"http://127.0.0.1:{server.port}", config)
        started = time.perf_counter()
        assert client.lookup(["a"]) == [None]
        elapsed = time.perf_counter() - started
        assert 0.05 <= elapsed < 0.2  # two attempts of 30 ms, and nothing more
        assert client.stats.failures == 1
    finally:
        server.close()


def test_the_breaker_lets_a_trial_call_through_after_its_open_period():
    now = [0.0]
    dead = LookupClient(
        f"http://127.0.0.1:{free_port()}",
        ClientConfig(timeout_ms=20, retries=0, breaker_failures=1, breaker_open_s=5),
        clock=lambda: now[0],
    )
    dead.lookup(["a"])
    assert dead.breaker.is_open
    now[0] = 6.0
    assert not dead.breaker.is_open


@pytest.mark.parametrize("url", ["https://x:1", "http://", "lookup:8100", "http://x:1/path"])
def test_bad_lookup_urls_name_the_setting(url):
    with pytest.raises(ValueError, match="lookupServerUrl"):
        parse_lookup_url(url)


def test_a_closed_client_answers_all_miss_and_never_raises():
    """A store closes its client while requests still look up (shutdown); one that had
    to resolve the server's name again (its last connect failed) raised the stopped
    resolver's RuntimeError into them."""
    client = LookupClient(f"http://localhost:{free_port()}")
    assert client.lookup(["a"]) == [None]  # nothing listens: resolved, refused, forgotten
    client.close()
    assert client.lookup(["a", "b"]) == [None, None]
    assert client.call({"op": "stats"}) is None
    assert client.stats.degraded_lookups == 2 and client.stats.failures == 3


def test_a_hanging_dns_lookup_costs_at_most_the_budget(monkeypatch):
    real_getaddrinfo = socket.getaddrinfo

    def slow_getaddrinfo(host, *args, **kwargs):
        if host == "lookup.example.svc":
            time.sleep(1.0)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    client = LookupClient("http://lookup.example.svc:8100", ClientConfig(timeout_ms=30, retries=1))
    started = time.perf_counter()
    assert client.lookup(["a"]) == [None]
    assert time.perf_counter() - started < 0.3
    assert client.stats.degraded_lookups == 1
    client.close()


def test_slow_dns_then_a_hanging_connect_cost_one_budget_not_two(monkeypatch):
    """Resolution, connect, send and reply share one attempt's budget: a DNS answer that
    took most of it left the connect a whole budget of its own (a dropped SYN then cost
    about twice the budget, against "never slower than the budget")."""
    from holeblend_runtime.lookup_server import client as client_module

    budget_s = 0.4
    real_getaddrinfo = socket.getaddrinfo
    connect_timeouts: list[float] = []

    def slow_getaddrinfo(host, *args, **kwargs):
        if host == "lookup.example.svc":
            time.sleep(0.6 * budget_s)
            host = "127.0.0.1"
        return real_getaddrinfo(host, *args, **kwargs)

    class Unanswered(socket.socket):
        def connect(self, address):  # as a SYN nobody answers: waits out its timeout
            connect_timeouts.append(self.gettimeout())
            time.sleep(self.gettimeout())
            raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    monkeypatch.setattr(client_module.socket, "socket", Unanswered)
    client = LookupClient(
        "http://lookup.example.svc:8100", ClientConfig(timeout_ms=budget_s * 1000, retries=0)
    )
    started = time.perf_counter()
    assert client.lookup(["a"]) == [None]
    elapsed = time.perf_counter() - started
    assert len(connect_timeouts) == 1 and connect_timeouts[0] <= 0.45 * budget_s
    assert elapsed < 1.25 * budget_s, elapsed
    assert client.stats.degraded_lookups == 1
    client.close()


def test_a_lookup_of_more_keys_than_the_server_takes_goes_in_several_requests(lookup_server):
    # The server refuses a lookup of over --max-keys (1024) keys whole: every key was a
    # miss, and three such prompts opened the breaker for every other lookup too.
    client = LookupClient(lookup_server.url, ClientConfig(timeout_ms=500, breaker_failures=3))
    entry = {"tokens": 4, "model": "m", "dtype": "float32", "context": None, "bytes": 64}
    entries = [{"key": key, **entry, "shared": True} for key in ("k3", "k1030")]
    assert client.call({"op": "admit", "pod": "pod-a", "entries": entries}) is not None
    keys = [f"k{i}" for i in range(1100)]
    for _ in range(3):
        hits = client.lookup(keys)
        assert [i for i, hit in enumerate(hits) if hit is not None] == [3, 1030]
        assert hits[1030].in_shared_tier and hits[1030].pods == ("pod-a",)
    assert not client.breaker.is_open and client.stats.failures == 0
    assert client.lookup(["k3"])[0] is not None
    assert client.stats.degraded_lookups == 0 and client.stats.keys_hit == 7
    assert client.stats.keys_looked_up == 3 * 1100 + 1
    client.close()


def test_lookup_counters_lose_nothing_under_concurrent_lookups():
    class Answering:
        def call(self, message: dict, deadline: float | None = None) -> dict:
            return {"hits": [[4, True, ["p"]] if k == "hit" else None for k in message["keys"]]}

        def shutdown(self) -> None:
            pass

    # A budget no wait for the connection outlasts, however the threads are scheduled: a
    # lookup that waited longer would answer all miss, and this test counts, not times.
    config = ClientConfig(timeout_ms=60_000)
    client = LookupClient(f"http://127.0.0.1:{free_port()}", config)
    client._connection = Answering()
    threads, rounds, keys = 8, 3000, ["hit", "miss"] * 4
    run_contended(lambda: client.lookup(keys), threads, rounds)
    assert client.stats.keys_looked_up == 8 * threads * rounds
    assert client.stats.keys_hit == 4 * threads * rounds
    assert client.stats.calls == threads * rounds and client.stats.failures == 0


def test_a_lookup_waits_for_another_threads_call_only_within_its_own_budget():
    """The engine's lookups and the store worker's `contains` share one client and its
    connection: a lookup waited out another thread's whole call (up to every attempt's
    timeout) before its own began, against "never slower than the budget". It answers all
    miss once its budget is spent waiting, counted as a failed call, not against the breaker."""
    entered, release = threading.Event(), threading.Event()

    class HeldFirstCall:
        """Holds the first call until released, as a server slow to answer it."""

        def call(self, message: dict, deadline: float | None = None) -> dict:
            if message["op"] == "heartbeat":
                entered.set()
                release.wait(10)
            return {"v": 1, "ok": True, "hits": [None] * len(message.get("keys", []))}

        def shutdown(self) -> None:
            pass

    client = LookupClient(
        f"http://127.0.0.1:{free_port()}", ClientConfig(timeout_ms=20, breaker_failures=1)
    )
    client._connection = HeldFirstCall()
    holder = threading.Thread(target=client.call, args=({"op": "heartbeat", "pod": "p"},))
    holder.start()
    try:
        assert entered.wait(5)
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(client.lookup(["a", "b"])))
        waiter.start()
        waiter.join(2)  # 40 ms of budget; the held call goes on until released
        assert answers == [[None, None]]
        assert client.stats.degraded_lookups == 1 and client.stats.failures == 1
        assert not client.breaker.is_open
    finally:
        release.set()
        holder.join(5)
    assert client.lookup(["a"]) == [None] and client.stats.degraded_lookups == 1
    assert client.stats.calls == 3 and client.stats.failures == 1


def test_an_attempt_ends_by_the_calls_deadline_when_that_comes_first():
    """A call that waited for the connection has less than a whole attempt's timeout left."""
    server = SilentServer()
    connection = LookupConnection("127.0.0.1", server.port, timeout_s=10)
    errors = []

    def call() -> None:
        try:
            connection.call({"op": "stats"}, deadline=time.monotonic() + 0.03)
        except OSError as error:
            errors.append(error)

    try:
        caller = threading.Thread(target=call)
        caller.start()
        caller.join(2)  # the attempt's own timeout is 10 s
        assert len(errors) == 1 and isinstance(errors[0], TimeoutError)
    finally:
        connection.shutdown()
        server.close()


@pytest.mark.parametrize(
    "hits",
    [
        None,  # no hits at all
        [[4, True, ["p"]]],  # fewer locations than keys
        [[4, True, ["p"]], [4, True]],  # a location short of a field
        [[4, True, ["p"]], ["four", True, ["p"]]],  # a count that is not one
        [[4, True, ["p"]], [4, True, "p"]],  # pods not a list
        [[4, True, ["p"]], [float("inf"), True, ["p"]]],  # a count no integer holds
    ],
)
def test_a_reply_that_is_not_one_location_per_key_is_all_miss_not_an_exception(hits):
    """A server of another build (or a bug) answering ok with malformed hits raised
    KeyError, TypeError, ValueError or OverflowError into the request (on a vLLM pod: its
    scheduler thread); the lookup answers all-miss, counted as degraded, like a failed one."""

    class Answering:
        def call(self, message: dict, deadline: float | None = None) -> dict:
            return {"v": 1, "ok": True} if hits is None else {"v": 1, "ok": True, "hits": hits}

        def shutdown(self) -> None:
            pass

    client = LookupClient(f"http://127.0.0.1:{free_port()}")
    client._connection = Answering()
    assert client.lookup(["a", "b"]) == [None, None]
    assert client.stats.degraded_lookups == 1 and client.stats.keys_hit == 0
    client.close()


def test_error_replies_from_a_live_server_do_not_open_the_breaker_but_a_dead_server_does(
    lookup_server,
):
    """The server answered each refused request at once: counted as failures toward the
    breaker, a few bad requests (a bug in one caller, a name the server refuses) made the
    client skip every lookup, the good ones too, for `breaker_open_s`."""
    config = ClientConfig(timeout_ms=2000, breaker_failures=2, breaker_open_s=60)
    client = LookupClient(lookup_server.url, config)
    assert client.call({"op": "admit", "pod": "p", "entries": [ENTRY]}) is not None
    for message in (
        {"op": "heartbeat", "pod": "pod\nwith a newline"},
        {"op": "no-such-op"},
        {"op": "lookup", "keys": "not a list"},
        {"op": "lookup", "keys": ["k"] * 2000},
    ):
        assert client.call(message) is None
    assert client.lookup(["k", "other"]) == [Location(4, True, ("p",)), None]
    assert not client.breaker.is_open and client.breaker.num_opened == 0
    assert client.stats.refused == 4 and client.stats.degraded_lookups == 0
    lookup_server.kill()
    for _ in range(2):
        assert client.lookup(["k"]) == [None]
    assert client.breaker.is_open
    client.close()


def test_a_request_over_the_servers_body_limit_does_not_open_the_breaker():
    """The server refuses a body over `--max-body-bytes` in plain text (HTTP 413), which the
    client took for garbage on the socket: retried, then counted toward the breaker."""
    with LookupProcess("--max-body-bytes", "2048") as server:
        config = ClientConfig(timeout_ms=2000, breaker_failures=2, breaker_open_s=60)
        client = LookupClient(server.url, config)
        entries = [{**ENTRY, "key": f"k{i}"} for i in range(100)]
        for _ in range(3):
            assert client.call({"op": "admit", "pod": "p", "entries": entries}) is None
        assert client.call({"op": "admit", "pod": "p", "entries": [ENTRY]}) is not None
        assert not client.breaker.is_open and client.breaker.num_opened == 0
        assert client.stats.calls == 4 and client.stats.refused == 3
        client.close()


@pytest.mark.parametrize(
    ("reply", "opens_the_breaker"),
    [
        (plain_reply("503 Service Unavailable", b"server busy: retry shortly\n"), True),
        (plain_reply("502 Bad Gateway", b"no upstream\n"), True),
        (plain_reply("500 Internal Server Error", b"internal error\n"), False),
        (plain_reply("400 Bad Request", b"malformed header line\n"), False),
        (plain_reply("200 OK", b"not msgpack"), True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: twelve\r\n\r\n", True),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", True),
        (msgpack_reply({"v": 1, "ok": False, "error": "boom"}), True),
    ],
    ids=[
        "503",
        "502",
        "500",
        "400",
        "200-not-msgpack",
        "bad-content-length",
        "not-http",
        "error-not-a-map",
    ],
)
def test_only_replies_that_say_the_server_cannot_serve_open_the_breaker(reply, opens_the_breaker):
    server = CannedServer(reply)
    try:
        config = ClientConfig(timeout_ms=2000, retries=0, breaker_failures=2, breaker_open_s=60)
        client = LookupClient(server.url, config)
        for _ in range(3):
            assert client.lookup(["a"]) == [None]
        assert client.breaker.is_open is opens_the_breaker
        assert client.stats.refused == (0 if opens_the_breaker else 3)
        client.close()
    finally:
        server.close()


@pytest.mark.parametrize(
    "url", ["http://x:99999", "http://x:abc", "http://x:-1", "http://x:0", "http://[::1:8100"]
)
def test_a_lookup_url_with_a_bad_port_names_the_setting_the_value_and_the_form(url):
    """urllib's own errors ("Port out of range 0-65535") name no setting, and port 0 was
    taken for 80."""
    with pytest.raises(ValueError, match="lookupServerUrl") as caught:
        parse_lookup_url(url)
    assert repr(url) in str(caught.value) and "http://HOST:PORT" in str(caught.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [("breaker_open_s", -1.0), ("breaker_open_s", float("nan")), ("timeout_ms", float("nan"))],
)
def test_a_bad_setting_is_refused_by_the_client_config_under_its_own_name(field, value):
    """Not later by the circuit breaker (as `open_s`), nor by the socket on the first lookup."""
    with pytest.raises(ValueError, match=f"^{field}: "):
        ClientConfig(**{field: value})
