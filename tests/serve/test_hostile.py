"""holeblend-serve under hostile and careless clients: huge prompts, stalled heads and
bodies, bodies that break the JSON parser, fields of the wrong type or range, unsupported
fields, `stop`, and a shutdown with stalled clients connected.

The module's server runs with `mode: off` (full prefill, so the same prompt always gives
the same greedy answer) and short timeouts.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
import urllib.request

import pytest

from holeblend_devtools.serve_process import get, post_json
from tests.serve.conftest import example_settings_json, start_server
from tests.serve.test_server import metric

pytestmark = pytest.mark.slow

TIMEOUTS = {"idle_timeout": 1.0, "body_timeout": 1.0, "shutdown_timeout": 1.0}
SYSTEM = "Answer from the documents."
DOCS = ["The Aral Sea was once the fourth largest lake in the world, fed by two rivers."]
QUESTION = "Tell me about the Aral Sea."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = example_settings_json(mode="off")
    server = start_server(tmp_path_factory.mktemp("hostile"), config, **TIMEOUTS)
    yield server
    assert server.stop() == 0, server.log()


def completions(server, timeout: float = 120, **body):
    body = {"model": "smollm2", "system": SYSTEM, "documents": DOCS, "prompt": QUESTION} | body
    return post_json(server.url + "/v1/completions", body, timeout=timeout)


def raw(server, method: str, path: str, body: bytes = b"", content_type="application/json"):
    """(status, headers, parsed JSON body) of one request on its own connection."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request(method, path, body, {"Content-Type": content_type})
        response = connection.getresponse()
        return response.status, dict(response.headers), json.loads(response.read())
    finally:
        connection.close()


class HealthWatch:
    """Polls /healthz every 20 ms on a thread and keeps the slowest answer."""

    def __init__(self, server) -> None:
        self.url, self.worst, self.failures = server.url + "/healthz", 0.0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._done.is_set():
            started = time.perf_counter()
            status, _ = get(self.url, timeout=30)
            self.worst = max(self.worst, time.perf_counter() - started)
            self.failures += status != 200
            time.sleep(0.02)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        self._thread.join()


# --- huge prompts --------------------------------------------------------------------


def test_health_answers_within_half_a_second_while_huge_prompts_are_handled(server):
    huge = "The warehouse in district seven stores crates of tea. " * 220_000  # 12 MB
    # Under the character bound (81 bytes per token at most, 8192 tokens), so it is
    # tokenized in full (on a parse thread) before it is refused as over the context.
    large = "Rivers carry silt to the delta every spring flood. " * 12_000  # 600 KB
    results = {}
    with HealthWatch(server) as watch:
        for name, text in (("huge", huge), ("large", large)):
            started = time.perf_counter()
            results[name] = completions(server, prompt=text), time.perf_counter() - started
    for name, ((status, reply, _), _) in results.items():
        assert status == 400, (name, reply)
        assert reply["error"]["param"] == "prompt" and "context" in reply["error"]["message"]
    assert "at least" in results["huge"][0][1]["error"]["message"]  # refused untokenized
    assert watch.failures == 0
    assert watch.worst <= 0.5, (watch.worst, {k: round(v[1], 2) for k, v in results.items()})


def test_a_body_over_16_mib_is_a_json_413(server):
    body = json.dumps({"model": "smollm2", "prompt": "x" * (16 << 20)}).encode()
    status, _, reply = raw(server, "POST", "/v1/completions", body)
    assert status == 413 and "limit" in reply["error"]["message"]
    assert get(server.url + "/healthz")[0] == 200


# --- every error a JSON body ---------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/v1/nothing-here", b"", 404),
        ("POST", "/healthz", b"{}", 405),
        ("GET", "/v1/completions", b"", 405),
        ("POST", "/v1/completions", b"[" * 100_000, 400),  # deeper than the parser allows
        ("POST", "/v1/completions", b'{"model": "smollm2", "prompt": "\xff\xfe"}', 400),
        ("POST", "/v1/completions", b'{"model": "smollm2", "prompt": "a\\ud800b"}', 400),
        ("POST", "/v1/chat/completions", b'{"model": "smollm2", "messages": [1e999]}', 400),
    ],
)
def test_every_error_is_an_openai_json_body(server, method, path, body, status):
    got, headers, reply = raw(server, method, path, body)
    assert got == status, reply
    assert headers["Content-Type"].startswith("application/json")
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["message"]


def test_a_lone_surrogate_names_the_field(server):
    body = b'{"model": "smollm2", "documents": ["ok", "bad \\udfff"], "prompt": "Why?"}'
    status, _, reply = raw(server, "POST", "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "documents[1]", reply


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", 2.5),
        ("top_p", 2),
        ("seed", 1.5),
        ("presence_penalty", True),
        ("logprobs", 5),
        ("logprobs", 0),  # the chosen tokens' logprobs
        ("prompt_logprobs", 0),
        ("echo", True),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
        ("logit_bias", {"50256": -100}),
        ("n", 2),
        ("n", True),
        ("stream", "yes"),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", [""]),
        ("max_token", 5),  # a typo: an unknown field
    ],
)
def test_fields_of_the_wrong_type_range_or_unsupported_are_refused(server, field, value):
    status, reply, _ = completions(server, **{field: value})
    assert status == 400, reply
    assert reply["error"]["param"] in (field, f"{field}[0]"), reply


def test_supported_values_of_the_same_fields_are_accepted(server):
    fields = {
        "temperature": 0, "top_p": 1.0, "seed": 7, "logprobs": None, "echo": False,
        "tools": [], "response_format": {"type": "text"}, "n": 1, "stream": None,
        "user": "someone", "max_tokens": 2,
    }  # fmt: skip
    status, reply, _ = completions(server, **fields)
    assert status == 200, reply


# --- stop ----------------------------------------------------------------------------


def _answer(server, **extra) -> tuple[str, dict]:
    status, reply, _ = completions(server, max_tokens=12, **extra)
    assert status == 200, reply
    return reply["choices"][0]["text"], reply


def _streamed(server, **extra) -> tuple[str, str]:
    body = {"model": "smollm2", "system": SYSTEM, "documents": DOCS, "prompt": QUESTION}
    body |= {"max_tokens": 12, "stream": True} | extra
    request = urllib.request.Request(
        server.url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        lines = response.read().decode().split("\n\n")
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"]


def test_stop_ends_the_answer_before_the_sequence_streaming_or_not(server):
    full, _ = _answer(server)
    assert len(full.strip()) > 8, full
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # from the middle, several characters
    expected = full[: full.index(stop)]
    for value in (stop, ["never-in-this-answer", stop]):
        text, reply = _answer(server, stop=value)
        assert text == expected and reply["choices"][0]["finish_reason"] == "stop", (text, full)
        assert reply["usage"]["completion_tokens"] < 12
        assert _streamed(server, stop=value) == (expected, "stop")
    # A stop sequence that never comes changes nothing.
    assert _answer(server, stop="never-in-this-answer")[0] == full
    assert _streamed(server, stop="never-in-this-answer")[0] == full


# --- stalled clients -----------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `seconds`, and what it sent first."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return False, received
    return True, received


def test_a_stalled_head_or_idle_connection_is_closed_after_the_idle_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        assert _closed_within(idle, 5)[0]
    with socket.create_connection(("127.0.0.1", server.port)) as half:
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        assert _closed_within(half, 5)[0]


def test_a_stalled_body_gets_a_json_408_and_the_connection_closes(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        sock.sendall(head + b'{"model": ')
        started = time.perf_counter()
        closed, received = _closed_within(sock, 10)
    assert closed and time.perf_counter() - started < 5
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["message"]


def test_a_server_with_stalled_clients_stops_within_a_bounded_time(tmp_path):
    flags = {"idle_timeout": 60.0, "body_timeout": 60.0, "shutdown_timeout": 1.0}
    server = start_server(tmp_path, example_settings_json(mode="off"), **flags)
    sockets = []
    try:
        for payload in (
            b"",  # idle
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # half a head
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99\r\n\r\n{",
        ):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(payload)
            sockets.append(sock)
        time.sleep(0.5)
        started = time.perf_counter()
        server.process.terminate()
        status = server.process.wait(30)
        took = time.perf_counter() - started
    finally:
        server.stop()
        for sock in sockets:
            sock.close()
    assert status == 0, server.log()
    assert took < 5, took  # the pods' grace period is 120 s by default, 30 s at least


def _stalled_stream(port: int, model: str) -> socket.socket:
    """A connection that asks for a long streamed answer and never reads: a small receive
    buffer and small segments keep both ends' socket buffers small, so they fill soon."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", port))
    body = {"model": model, "prompt": QUESTION, "max_tokens": 2000, "ignore_eos": True}
    data = json.dumps(body | {"stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
    sock.sendall(head.encode() + b"Content-Type: application/json\r\n\r\n" + data)
    return sock


def test_a_streaming_client_that_stops_reading_is_cut_off_after_the_deadline(tmp_path):
    """Once the socket buffers are full the server's next write waits for the client: a
    client that never reads held the handler and its pending place (what a drain waits
    for) until it left. Each SSE chunk repeats the model name, so a served name of 64 KiB
    fills the buffers within three tokens, well inside the request's deadline."""
    model = "m" * (64 << 10)
    wire = json.loads(example_settings_json(mode="off"))
    config = json.dumps(wire | {"model": wire["model"] | {"servedName": model}})
    flags = {"request_timeout": 3.0, "drain_timeout": 20.0, "shutdown_timeout": 1.0}
    server = start_server(tmp_path, config, **flags)
    try:
        with _stalled_stream(server.port, model) as sock:
            waited_until = time.monotonic() + 30
            while metric(server, "holeblend_requests_total", outcome="timeout") < 1:
                assert time.monotonic() < waited_until, "the stalled request never ended"
                time.sleep(0.2)
            closed, received = _read_until_closed(sock, 10)
            started = time.perf_counter()
            server.process.terminate()
            status = server.process.wait(15)
            took = time.perf_counter() - started
    finally:
        server.stop()
    assert closed and b"data: [DONE]" not in received  # the server cut the connection
    assert status == 0, server.log()[-2000:]
    assert took < flags["drain_timeout"] / 2  # nothing left pending for the drain


def _read_until_closed(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """`_closed_within`, a reset counting as closed."""
    try:
        return _closed_within(sock, seconds)
    except ConnectionResetError:
        return True, b""


# --- Retry-After ---------------------------------------------------------------------


def test_retry_after_is_when_the_running_request_should_end(tmp_path):
    # One request decoding at a time, so that 8 clients fill a queue of 4 (with a batch of
    # 8 they might all be admitted; the estimate with a batch: tests/serve/test_responses.py).
    flags = {"queue_size": 4, "max_batch": 1}
    server = start_server(tmp_path, example_settings_json(mode="off"), **flags)
    body = {"model": "smollm2", "prompt": "Count to a hundred.", "max_tokens": 32}
    try:
        durations, results = [], []

        def client() -> None:
            started = time.perf_counter()
            results.append(post_json(server.url + "/v1/completions", body))
            durations.append(time.perf_counter() - started)

        for _ in range(2):  # two requests alone: what one takes
            client()
        threads = [threading.Thread(target=client) for _ in range(8)]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
        for thread in threads:
            thread.join()
    finally:
        assert server.stop() == 0, server.log()
    one = max(durations[:2])
    refused = [int(headers["Retry-After"]) for status, _, headers in results if status == 429]
    assert refused, [status for status, _, _ in results]
    # A place frees when the running request ends: at most one request's time, not the
    # queue's length times the mean request time.
    assert max(refused) <= math.ceil(one) + 1, (refused, durations)


def test_ignore_eos_decodes_to_max_tokens(server):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    body = {"model": "smollm2", "messages": messages, "max_tokens": 40}
    status, short, _ = post_json(server.url + "/v1/chat/completions", body)
    assert status == 200 and short["usage"]["completion_tokens"] < 40, short  # it ended at EOS
    status, long, _ = post_json(server.url + "/v1/chat/completions", body | {"ignore_eos": True})
    assert status == 200, long
    assert long["usage"]["completion_tokens"] == 40
    assert long["choices"][0]["finish_reason"] == "length"
