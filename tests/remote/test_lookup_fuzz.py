"""Malformed frames against the real lookup server: a clear reply each time, and it keeps serving."""

import socket

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from holeblend_runtime.lookup_server.client import LookupClient
from holeblend_runtime.lookup_server.processes import LookupProcess

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
_messages = st.fixed_dictionaries(
    {},
    optional={
        "v": st.sampled_from([0, 1, 2, "1", None]),
        "op": st.sampled_from(
            [
                "lookup",
                "admit",
                "evict",
                "heartbeat",
                "resync",
                "stats",
                "pairs_add",
                "pairs_get",
                "x",
                7,
            ]
        ),
        "keys": st.one_of(_values, st.lists(st.text(min_size=1, max_size=300), max_size=40)),
        "pod": _values,
        "entries": _values,
        "reset": _values,
        "shared": _values,
        "model": _values,
        "scope": _values,
        "pairs": st.one_of(
            _values, st.lists(st.lists(_values, min_size=4, max_size=4), max_size=3)
        ),
        "ids": _values,
        "after": _values,
    },
)


def _frame_body(draw_kind: str, message: dict, cut: int, garbage: bytes) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if draw_kind == "truncated":
        return body[: cut % max(len(body), 1)]
    if draw_kind == "garbage":
        return garbage
    if draw_kind == "two-maps":
        return body + body
    return body


@pytest.fixture(scope="module")
def fuzz_server():
    with LookupProcess() as server:
        yield server


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kind=st.sampled_from(["valid-shape", "truncated", "garbage", "two-maps"]),
    message=_messages,
    cut=st.integers(min_value=0, max_value=1000),
    garbage=st.binary(max_size=200),
)
def test_any_frame_gets_a_reply_and_the_server_keeps_serving(
    fuzz_server, kind, message, cut, garbage
):
    body = _frame_body(kind, message, cut, garbage)
    reply = _exchange(
        fuzz_server.port, b"POST /v1 HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    status = int(reply.split(b" ")[1])
    payload = msgpack.unpackb(reply.partition(b"\r\n\r\n")[2])
    if status == 200:
        assert payload["ok"] is True
    else:
        assert status in (400, 413) and payload["ok"] is False and payload["error"]["message"]
    assert LookupClient(fuzz_server.url).lookup(["still-serving"]) == [None]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(head=st.binary(max_size=300))
def test_broken_http_framing_is_answered_or_closed_and_others_are_served(fuzz_server, head):
    reply = _exchange(fuzz_server.port, head + b"\r\n\r\n")
    assert reply == b"" or reply.startswith(b"HTTP/1.1 ")
    assert LookupClient(fuzz_server.url).lookup(["still-serving"]) == [None]


def test_a_huge_key_list_is_refused_with_the_limit_named(fuzz_server):
    body = msgpack.packb({"v": 1, "op": "lookup", "keys": [f"k{i}" for i in range(100_000)]})
    reply = _exchange(
        fuzz_server.port, b"POST /v1 HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    payload = msgpack.unpackb(reply.partition(b"\r\n\r\n")[2])
    assert payload["ok"] is False and "1024" in payload["error"]["message"]
    assert LookupClient(fuzz_server.url).lookup(["still-serving"]) == [None]


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("v", _nested(1000)),
        ("op", _nested(1000)),
        ("pairs", [[0.5, 0.1, 0.9, _nested(1000)]]),
        ("v", "x" * 100_000),
    ],
    ids=["v-nested", "op-nested", "pair-nested", "v-long"],
)
def test_a_deeply_nested_or_long_value_is_refused_naming_its_field_and_quoted_short(
    fuzz_server, field, value
):
    """msgpack nests lists up to 1,000 deep, past where Python's repr() fails: the error
    reply still names the field, and quotes a value of any size in a few dozen characters."""
    message = {"v": 1, "op": "pairs_add", "scope": "s", "pod": "p", "pairs": [[0.5, 0.1, 0.9, 1]]}
    message[field] = value
    body = msgpack.packb(message, use_bin_type=True)
    reply = _exchange(
        fuzz_server.port, b"POST /v1 HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    assert int(reply.split(b" ")[1]) == 400, reply[:200]
    error = msgpack.unpackb(reply.partition(b"\r\n\r\n")[2])["error"]
    assert error["message"].startswith(field) and len(error["message"]) < 200, error
    assert LookupClient(fuzz_server.url).lookup(["still-serving"]) == [None]
