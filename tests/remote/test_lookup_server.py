"""The lookup server as a real process: operations, limits, probes, metrics, restarts."""

import socket
import threading
import time
import urllib.error
import urllib.request

import msgpack
import pytest

from holeblend_runtime.lookup_server.client import (
    Announcer,
    AnnouncerConfig,
    ClientConfig,
    LookupClient,
)
from holeblend_runtime.lookup_server.processes import LookupProcess
from holeblend_runtime.lookup_server.server import LookupServer
from holeblend_runtime.lookup_server.wire import Entry


def entry(key: str, shared: bool = True) -> Entry:
    return Entry(key, 12, "model", "float32", None, 1000, shared)


def raw_post(port: int, body: bytes, version: str = "HTTP/1.1") -> tuple[int, dict | bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        head = f"POST /v1 {version}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        sock.sendall(head.encode() + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    try:
        return status, msgpack.unpackb(payload)
    except Exception:
        return status, payload


def test_batch_lookup_of_hundreds_of_keys_returns_flags_and_locations(lookup_server):
    client = LookupClient(lookup_server.url)
    admitted = [entry(f"key-{i}").to_wire() for i in range(300)]
    assert client.call({"op": "admit", "pod": "pod-a", "entries": admitted})["admitted"] == 300
    keys = [f"key-{i}" for i in range(0, 600, 2)]
    hits = client.lookup(keys)
    assert [hit is not None for hit in hits] == [i < 300 for i in range(0, 600, 2)]
    assert hits[0].pods == ("pod-a",) and hits[0].in_shared_tier and hits[0].num_tokens == 12


def test_evict_heartbeat_and_stats_round_trip(lookup_server):
    client = LookupClient(lookup_server.url)
    assert client.call({"op": "heartbeat", "pod": "p"})["resync"] is True
    client.call({"op": "admit", "pod": "p", "entries": [entry("a", shared=False).to_wire()]})
    assert client.call({"op": "evict", "pod": "p", "keys": ["a"]})["evicted"] == 1
    stats = client.call({"op": "stats"})["stats"]
    assert stats["entries"] == 0 and stats["pods"] == 1 and stats["admits"] == 1


def test_probes_and_metrics_answer(lookup_server):
    client = LookupClient(lookup_server.url)
    client.call({"op": "admit", "pod": "p", "entries": [entry("a").to_wire()]})
    client.lookup(["a", "b"])
    for path in ("/healthz", "/ready"):
        assert urllib.request.urlopen(lookup_server.url + path).status == 200
    metrics = urllib.request.urlopen(lookup_server.url + "/metrics").read().decode()
    assert "holeblend_lookup_index_entries 1.0" in metrics
    assert "holeblend_lookup_lookups_total 2.0" in metrics
    assert "holeblend_lookup_hits_total 1.0" in metrics
    assert 'holeblend_lookup_request_seconds_count{op="lookup"} 1.0' in metrics


# The codes docs/lookup-server.md names for `holeblend_lookup_errors_total`.
ERROR_CODES = (
    *("bad_request", "too_large", "too_many_keys", "too_many_entries", "unsupported_version"),
    *("unknown_op", "bad_http", "header_timeout", "body_timeout", "write_timeout"),
    *("write_budget", "memory_budget", "connection_limit", "not_found", "method_not_allowed"),
    "internal",
)


def error_counts(metrics: str) -> dict[str, float]:
    prefix = 'holeblend_lookup_errors_total{code="'
    lines = [line.removeprefix(prefix) for line in metrics.splitlines() if line.startswith(prefix)]
    return {line.split('"')[0]: float(line.split()[-1]) for line in lines}


def test_every_error_code_is_exported_at_zero_before_its_first_error(lookup_server):
    """A rate over an error code that was never counted reads "no data", not 0, and an
    alert on it cannot fire on the first error: a fresh server exports each code at 0,
    and the errors it counts are among them."""
    url = lookup_server.url
    counts = error_counts(urllib.request.urlopen(url + "/metrics").read().decode())
    assert counts == dict.fromkeys(ERROR_CODES, 0.0)
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(url + "/nowhere")
    assert raw_post(lookup_server.port, msgpack.packb({"v": 1, "op": "nope"}))[0] == 400
    counts = error_counts(urllib.request.urlopen(url + "/metrics").read().decode())
    assert counts == {**dict.fromkeys(ERROR_CODES, 0.0), "not_found": 1.0, "unknown_op": 1.0}


def test_the_request_latency_histogram_includes_encoding_the_reply():
    """`holeblend_lookup_request_seconds` is the time to answer a request: for a lookup of
    many hits most of that is encoding the reply, which it left out before (a 4 MB reply
    that took 8 ms to answer was observed as 2 ms)."""
    server = LookupServer()
    keys = [f"{i:064x}" for i in range(1024)]
    for p in range(16):  # every hit names 16 pods: a reply of about 4 MB
        server.index.admit(f"pod{p:03d}" + "x" * 240, [entry(key) for key in keys])
    body = msgpack.packb({"v": 1, "op": "lookup", "keys": keys})
    started = time.perf_counter()
    status, _, payload = server.handle("POST", "/v1", body)
    elapsed = time.perf_counter() - started
    assert status == 200 and len(payload) > 4_000_000
    metrics = server.metrics.render().decode()
    prefix = 'holeblend_lookup_request_seconds_sum{op="lookup"} '
    observed = float(
        next(line for line in metrics.splitlines() if line.startswith(prefix)).split()[-1]
    )
    assert 0.7 * elapsed < observed <= elapsed, (observed, elapsed)


def test_too_many_keys_get_a_clear_error_and_the_server_keeps_serving(lookup_server):
    status, reply = raw_post(
        lookup_server.port, msgpack.packb({"v": 1, "op": "lookup", "keys": ["k"] * 5000})
    )
    assert status in (400, 413)
    assert reply["ok"] is False and reply["error"]["code"] in ("bad_request", "too_many_keys")
    assert LookupClient(lookup_server.url).lookup(["k"]) == [None]


def test_an_oversized_body_is_refused_before_it_is_read(lookup_server):
    with socket.create_connection(("127.0.0.1", lookup_server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1 HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413")
    assert LookupClient(lookup_server.url).lookup(["k"]) == [None]


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"v": 2, "op": "lookup", "keys": []}, "unsupported_version"),
        ({"op": "lookup", "keys": []}, "unsupported_version"),
        ({"v": 1, "op": "drop-everything"}, "unknown_op"),
        ({"v": 1, "op": "lookup", "keys": "abc"}, "bad_request"),
        ({"v": 1, "op": "admit", "pod": "p", "entries": [{"key": "k"}]}, "bad_request"),
    ],
)
def test_bad_requests_name_the_problem(lookup_server, message, code):
    status, reply = raw_post(lookup_server.port, msgpack.packb(message))
    assert status == 400
    assert reply["error"]["code"] == code and reply["error"]["message"]


def test_a_restarted_server_rebuilds_its_index_from_heartbeats(lookup_server):
    held = [entry(f"seg-{i}") for i in range(50)]
    config = AnnouncerConfig(heartbeat_s=0.2, resync_s=60)
    announcer = Announcer(LookupClient(lookup_server.url), "pod-a", lambda: held, config).start()
    client = LookupClient(lookup_server.url)
    try:
        _wait_for(lambda: client.lookup(["seg-0"])[0] is not None)
        lookup_server.kill()
        assert client.lookup(["seg-0"]) == [None]  # down: all miss, no exception
        lookup_server.start()
        started = time.monotonic()
        _wait_for(lambda: all(client.lookup([e.key for e in held])))
        assert time.monotonic() - started < 3  # within a few heartbeat periods
    finally:
        announcer.stop()


def test_the_announcer_outlives_a_failure_and_resyncs_after_it(lookup_server):
    """A resync reads the pod's holdings from its store; one read that raised killed the
    announcer thread, and the index then forgot the pod's segments for good (no admits, no
    heartbeats, `flush` waiting in vain). The failure is logged, the thread goes on, and
    the next heartbeat's resync announces what the pod holds."""
    held = [entry(f"seg-{i}") for i in range(5)]
    calls = []

    def holdings():
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise OSError("the store's directory vanished")
        return held

    config = AnnouncerConfig(heartbeat_s=0.1, resync_s=60)
    announcer = Announcer(LookupClient(lookup_server.url), "pod-a", holdings, config).start()
    client = LookupClient(lookup_server.url)
    try:
        _wait_for(lambda: all(client.lookup([e.key for e in held])))
        assert len(calls) >= 2 and announcer._thread.is_alive()
        announcer.admit(entry("later"))
        assert announcer.flush()
        assert client.lookup(["later"])[0] is not None
    finally:
        announcer.stop()


@pytest.mark.parametrize("asked_by", ["request_resync", "queue_overflow"])
def test_a_resync_asked_for_during_a_resync_is_not_lost(lookup_server, asked_by):
    """A resync cleared the flag when it ended: a request raised while it ran (a dropped
    announcement, `request_resync`) was forgotten until the periodic resync a minute later."""
    entered, release = threading.Event(), threading.Event()
    calls = []

    def holdings():
        calls.append(time.monotonic())
        if len(calls) == 1:
            entered.set()
            release.wait(5)
        return [entry("seg-0")]

    config = AnnouncerConfig(heartbeat_s=0.05, resync_s=60, max_pending=2)
    announcer = Announcer(LookupClient(lookup_server.url), "pod-a", holdings, config).start()
    try:
        assert entered.wait(5)
        if asked_by == "request_resync":
            announcer.request_resync()
        else:
            for i in range(3):  # one more than the queue holds: the oldest is dropped
                announcer.admit(entry(f"new-{i}"))
        release.set()
        _wait_for(lambda: len(calls) >= 2, timeout_s=2)
    finally:
        release.set()
        announcer.stop()


def test_after_a_restart_a_pod_whose_first_message_is_an_admit_is_told_to_resync():
    """A serving pod stores segments all the time, so after a server restart its first
    message is usually an admit (the Announcer sends queued admits before the heartbeat).
    That admit must not pass for the pod's full announcement: the heartbeat that follows
    answers `resync`, and the pod's earlier holdings are indexed again within a heartbeat
    period, not at the unasked resync a minute later."""
    with LookupProcess() as server:  # the default pod timeout: no pod is dropped as silent
        client = LookupClient(server.url, ClientConfig(timeout_ms=500))
        client.call(
            {"op": "resync", "pod": "pod-a", "entries": [entry("old").to_wire()], "reset": True}
        )
        assert client.call({"op": "heartbeat", "pod": "pod-a"})["resync"] is False
        server.kill()
        server.start()  # empty, on the same port
        client.call({"op": "admit", "pod": "pod-a", "entries": [entry("new").to_wire()]})
        assert client.call({"op": "heartbeat", "pod": "pod-a"})["resync"] is True
        assert client.call({"op": "heartbeat", "pod": "pod-a"})["resync"] is True
        client.call(
            {"op": "resync", "pod": "pod-a", "entries": [entry("old").to_wire()], "reset": True}
        )
        assert client.call({"op": "heartbeat", "pod": "pod-a"})["resync"] is False

        held = [entry(f"seg-{i}") for i in range(5)]
        config = AnnouncerConfig(heartbeat_s=1.0, resync_s=60)
        announcer = Announcer(LookupClient(server.url), "pod-b", lambda: held, config).start()
        try:
            _wait_for(lambda: all(client.lookup([e.key for e in held])))
            server.kill()
            server.start()
            held.append(entry("seg-new"))
            announcer.admit(held[-1])  # sent at once, before the next heartbeat
            started = time.monotonic()
            _wait_for(lambda: all(client.lookup([e.key for e in held])), timeout_s=5)
            assert time.monotonic() - started < 3  # within a few heartbeat periods
        finally:
            announcer.stop()


def test_a_pod_that_stops_heartbeating_loses_its_locations(lookup_server):
    client = LookupClient(lookup_server.url)
    client.call({"op": "admit", "pod": "gone", "entries": [entry("x", shared=False).to_wire()]})
    assert client.lookup(["x"])[0] is not None
    _wait_for(lambda: client.lookup(["x"]) == [None], timeout_s=5)


def _wait_for(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_http_errors_for_wrong_paths_and_methods(lookup_server):
    with pytest.raises(urllib.error.HTTPError) as not_found:
        urllib.request.urlopen(lookup_server.url + "/nope")
    assert not_found.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as wrong_method:
        urllib.request.urlopen(lookup_server.url + "/v1")
    assert wrong_method.value.code == 405


def test_a_count_out_of_range_is_refused_naming_the_field_the_range_and_the_value():
    """A huge or negative count is refused as such: "expected a non-negative integer" was
    false for 2**63, which is one, and named neither the limit nor what came."""
    server = LookupServer()
    for field, value in (("tokens", 1 << 63), ("bytes", -1), ("bytes", float("nan"))):
        item = {**entry("k").to_wire(), field: value}
        body = msgpack.packb({"v": 1, "op": "admit", "pod": "p", "entries": [item]})
        status, _, payload = server.handle("POST", "/v1", body)
        message = msgpack.unpackb(payload)["error"]["message"]
        assert status == 400
        assert (
            message == f"entries[0].{field}: expected an integer from 0 to 2**48 - 1, got {value!r}"
        )
