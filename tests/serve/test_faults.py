"""Bad input and faults: the server stays up and answers clearly, and nothing leaks.

Fuzzed bodies, 100 concurrent clients against a queue of 8, a client killed mid-stream,
garbage written over blend.json mid-run, a KV store held to its byte budget, a request
past its timeout, and SIGTERM finishing the request in flight.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from holeblend_devtools.serve_process import get, post_json
from tests.serve.conftest import example_settings_json, replace_file, start_server
from tests.serve.test_server import metric

pytestmark = pytest.mark.slow

BUDGET = 4 << 20  # bytes: a few short documents, so eviction happens
SYSTEM = "Answer from the documents."


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A server with a queue of 8 and a 4 MiB KV store."""
    config = example_settings_json(kv={"localCpuBytes": BUDGET, "sharedUrl": None})
    server = start_server(tmp_path_factory.mktemp("faults"), config, queue_size=8)
    yield server
    assert server.stop() == 0, server.log()


def post_raw(url: str, body: bytes, timeout: float = 60) -> tuple[int, bytes]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def document(i: int) -> str:
    return f"Record {i}: the warehouse in district {i} stores {i * 7} crates of tea and rice."


# --- fuzz --------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
CONTROL = st.sampled_from(
    ["<|im_end|>", "<|im_start|>assistant\n", "<|endoftext|>", " # #", "# # # #", "\x00", ""]
)
TEXT = st.one_of(
    st.text(max_size=40), CONTROL, st.tuples(st.text(max_size=20), CONTROL).map("".join)
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "robot"]) | JSON,
        "content": TEXT | JSON,
    }
)
BODY = st.fixed_dictionaries(
    {"model": st.sampled_from(["smollm2", "unknown-model", ""]) | JSON},
    optional={
        "prompt": TEXT | JSON,
        "messages": st.lists(MESSAGE, max_size=3) | JSON,
        "documents": st.lists(TEXT, max_size=3) | JSON,
        "max_tokens": st.integers(-3, 2) | st.integers(10**6, 10**15) | JSON,
        "stream": st.booleans() | JSON,
        "n": st.integers(0, 3),
    },
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=BODY | JSON, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_bodies_get_an_answer_never_a_crash(small, body, path):
    status, raw = post_raw(small.url + path, json.dumps(body).encode())
    assert status in (200, 400, 404), raw
    if status == 200:
        assert raw.startswith(b"data: ") or json.loads(raw)["usage"]["prompt_tokens"] > 0
    else:
        error = json.loads(raw)["error"]
        assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    assert get(small.url + "/healthz")[0] == 200


# --- load and leaks ----------------------------------------------------------------


def test_100_clients_against_a_queue_of_8_get_answers_or_429(small):
    body = {"model": "smollm2", "system": SYSTEM, "documents": [document(1)], "prompt": "Tea?"}
    start = threading.Barrier(100)

    def client(_: int):
        start.wait()
        return post_json(small.url + "/v1/completions", body, timeout=300)

    with ThreadPoolExecutor(100) as pool:
        results = list(pool.map(client, range(100)))
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 9 and statuses.count(429) >= 1
    for status, reply, headers in results:
        if status == 429:
            assert int(headers["Retry-After"]) >= 1 and reply["error"]["type"] == "rate_limit_error"
    assert metric(small, "holeblend_queue_depth") == 0
    assert get(small.url + "/ready")[0] == 200


def test_a_client_killed_mid_stream_cancels_its_request(small):
    cancelled = metric(small, "holeblend_requests_total", outcome="cancelled")
    tokens = metric(small, "holeblend_completion_tokens_total")
    body = json.dumps(
        {"model": "smollm2", "prompt": "Count to a thousand.", "max_tokens": 400, "stream": True}
    ).encode()
    host, port = small.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
    deadline = time.monotonic() + 20
    while metric(small, "holeblend_requests_total", outcome="cancelled") == cancelled:
        assert time.monotonic() < deadline, "the server never noticed the disconnect"
        time.sleep(0.1)
    time.sleep(0.5)
    assert metric(small, "holeblend_completion_tokens_total") - tokens < 400
    status, reply, _ = post_json(
        small.url + "/v1/completions", {"model": "smollm2", "prompt": "Hi"}
    )
    assert status == 200 and metric(small, "holeblend_queue_depth") == 0


def test_garbage_config_mid_run_keeps_the_last_good_settings(small):
    errors = metric(small, "holeblend_config_reload_errors_total")
    replace_file(small.config, "\x00garbage{{{")
    try:
        deadline = time.monotonic() + 10
        while metric(small, "holeblend_config_reload_errors_total") == errors:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        status, reply, _ = post_json(
            small.url + "/v1/completions",
            {"model": "smollm2", "prompt": "S # # " + document(2) + " # # Q"},
        )
        assert status == 200 and metric(small, "holeblend_recompute_ratio") == 0.15
        assert get(small.url + "/ready")[0] == 200
    finally:
        replace_file(
            small.config, example_settings_json(kv={"localCpuBytes": BUDGET, "sharedUrl": None})
        )


def test_the_kv_store_stays_within_its_byte_budget(small):
    for i in range(10, 22, 2):
        body = {
            "model": "smollm2", "system": SYSTEM, "documents": [document(i), document(i + 1)],
            "prompt": "Tea?", "max_tokens": 1,
        }  # fmt: skip
        assert post_json(small.url + "/v1/completions", body)[0] == 200
    stored = metric(small, "holeblend_kv_store_bytes")
    assert 0 < stored <= BUDGET
    assert metric(small, "holeblend_kv_store_capacity_bytes") == BUDGET
    # Every document was new and asked for once: once the store was full, the default
    # frequency admission kept the system prompt (reused by every request) and refused them.
    assert metric(small, "holeblend_kv_store_refused_total") > 0


# --- timeouts and shutdown ---------------------------------------------------------


@pytest.fixture
def short_timeout(tmp_path):
    server = start_server(tmp_path, example_settings_json(), request_timeout=15, drain_timeout=60)
    yield server
    server.stop()


def test_a_request_past_its_timeout_gets_504_and_sigterm_drains_in_flight(short_timeout):
    server = short_timeout
    status, reply, _ = post_json(
        server.url + "/v1/completions",
        {"model": "smollm2", "prompt": "Write a story.", "max_tokens": 2000},
    )
    assert status == 504 and "timeout" in reply["error"]["message"]
    assert metric(server, "holeblend_requests_total", outcome="timeout") == 1

    result = {}
    streaming = threading.Event()

    def stream():
        body = {"model": "smollm2", "prompt": "Write a story.", "max_tokens": 8, "stream": True}
        request = urllib.request.Request(
            server.url + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as response:
            first = response.readline()  # the first chunk's line: the answer is under way
            streaming.set()
            result["reply"] = response.status, first + response.read()

    client = threading.Thread(target=stream)
    client.start()
    assert streaming.wait(30)
    assert server.stop() == 0, server.log()
    client.join(timeout=60)
    status, raw = result["reply"]
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    assert b'"finish_reason":"length"' in raw
