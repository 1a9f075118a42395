"""holeblend-serve end to end: OpenAI routes, reuse reported in usage, SSE, errors, live
ratio, and the series a real Prometheus scrapes; in process, what the completion token
counter counts while the event loop lags behind the compute thread."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from functools import partial

import pytest
from aiohttp.test_utils import TestClient, TestServer

from holeblend_devtools.prometheus import ScrapeTarget, running_prometheus, vector, wait_for
from holeblend_devtools.serve_process import get, post_json
from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.settings import ServeSettings
from tests.serve.conftest import (
    example_settings_json,
    in_process_server,
    replace_file,
    start_server,
)
from tests.serve.test_batching import settles_to_zero

pytestmark = pytest.mark.slow

SYSTEM = "Answer from the documents."
DOCS = [
    "The Aral Sea was once the fourth largest lake in the world, fed by two great rivers.",
    "Lichens are partnerships of a fungus with algae, and they grow on bare rock slowly.",
    "The abacus is a counting frame with beads, used for arithmetic for many centuries.",
]
NEW_DOC = "Basalt is a dark volcanic rock that forms when lava cools quickly at the surface."


def completion(server, documents, question="Which lake shrank?", **extra):
    body = {"model": "smollm2", "system": SYSTEM, "documents": documents, "prompt": question}
    return post_json(server.url + "/v1/completions", body | extra)


def metric(server, name: str, **labels) -> float:
    """Sum of the samples of `name` (with these labels) in /metrics."""
    total = 0.0
    for line in get(server.url + "/metrics")[1].splitlines():
        is_sample = line.startswith(name + "{") or line.startswith(name + " ")
        if is_sample and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_health_ready_and_models(server):
    assert get(server.url + "/healthz")[0] == 200
    assert get(server.url + "/ready")[0] == 200
    status, body = get(server.url + "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["smollm2"]


def test_second_request_reuses_and_a_hole_is_reported(server):
    status, first, _ = completion(server, DOCS)
    assert status == 200, first
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["usage"]["holeblend"]["lookup_mode"] == "full-miss"
    status, second, _ = completion(server, DOCS)
    usage = second["usage"]
    assert usage["holeblend"]["lookup_mode"] == "pure-hit"
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["holeblend"]["reused_tokens"]
    assert usage["holeblend"]["reused_tokens"] > 0.6 * usage["prompt_tokens"]
    status, third, _ = completion(server, [DOCS[0], NEW_DOC, DOCS[2]])
    blend = third["usage"]["holeblend"]
    assert blend["mode"] == "hole" and blend["lookup_mode"] == "hole"
    assert blend["hole_tokens"] > 10 and blend["reused_tokens"] > 0
    assert blend["recomputed_tokens"] >= blend["hole_tokens"]
    assert third["choices"][0]["finish_reason"] in ("length", "stop")
    assert usage["completion_tokens"] == 2 and usage["total_tokens"] == usage["prompt_tokens"] + 2


def test_lmcache_shaped_chat_reuses_the_same_documents(server):
    completion(server, DOCS)
    user = " # # ".join(DOCS) + " # # Which lake shrank?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    body = {"model": "smollm2", "messages": messages, "max_tokens": 3}
    status, reply, _ = post_json(server.url + "/v1/chat/completions", body)
    assert status == 200, reply
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["holeblend"]["lookup_mode"] == "pure-hit"
    assert reply["usage"]["completion_tokens"] <= 3


def sse_events(url: str, body: dict) -> list:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = response.read().decode().split("\n\n")
    payloads = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def test_chat_streams_sse_chunks_with_usage_and_done(server):
    body = {
        "model": "smollm2", "stream": True, "max_tokens": 4,
        "stream_options": {"include_usage": True}, "documents": DOCS,
        "messages": [{"role": "user", "content": "Which lake shrank?"}],
    }  # fmt: skip
    events = sse_events(server.url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text.strip()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] <= 4


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        ({"model": "smollm2", "prompt": 5}, 400, "prompt"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ({"model": "smollm2", "prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
        # The field the client sent, not its older name.
        (
            {"model": "smollm2", "prompt": "hi", "max_completion_tokens": 10**9},
            400,
            "max_completion_tokens",
        ),
        ({"model": "smollm2", "prompt": "hi", "documents": ["a # # b"]}, 400, "documents[0]"),
        # A control token of SmolLM2's not shaped like ChatML's.
        (
            {"model": "smollm2", "prompt": "hi", "documents": ["a <file_sep> b"]},
            400,
            "documents[0]",
        ),
    ],
)
def test_malformed_requests_get_4xx_naming_the_field(server, body, status, param):
    got, reply, _ = post_json(server.url + "/v1/completions", body)
    assert got == status, reply
    assert reply["error"]["param"] == param and reply["error"]["message"]
    # The field named once (the engine's refusal of a document already starts with it).
    assert param is None or reply["error"]["message"].count(f"{param}: ") <= 1, reply


def test_prompt_over_the_context_is_refused_before_compute(server):
    waits_before = metric(server, "holeblend_queue_wait_seconds_count")
    long_document = "word " * 9000
    started = time.perf_counter()
    status, reply, _ = completion(server, [long_document])
    assert status == 400 and reply["error"]["param"] == "prompt"
    # The example's model.maxModelLen (4096, under SmolLM2's 8192), through blend.json.
    assert "context of 4096" in reply["error"]["message"]
    assert time.perf_counter() - started < 5
    assert metric(server, "holeblend_queue_wait_seconds_count") == waits_before


def test_live_ratio_change_applies_without_restart(server):
    replace_file(server.config, example_settings_json(recomputeRatio=0.4))
    deadline = time.monotonic() + 10
    while metric(server, "holeblend_recompute_ratio") != 0.4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "holeblend_recompute_ratio") == 0.4
    completion(server, DOCS)
    status, reply, _ = completion(server, [DOCS[0], NEW_DOC + " Again.", DOCS[2]])
    assert reply["usage"]["holeblend"]["ratio"] == 0.4
    replace_file(server.config, example_settings_json())


def test_a_real_prometheus_scrapes_the_series(server):
    ok_before = metric(server, "holeblend_requests_total", outcome="ok")
    reused = 0
    for documents in (DOCS, DOCS, [DOCS[0], NEW_DOC, DOCS[2]]):
        reused += completion(server, documents)[1]["usage"]["holeblend"]["reused_tokens"]
    target = ScrapeTarget(server.url.removeprefix("http://"), {})
    with running_prometheus([target]) as url:
        up = wait_for(url, "up", lambda r: all(v == 1 for v in r.values()))
        assert list(up.values()) == [1.0]
        ok = wait_for(url, 'sum(holeblend_requests_total{outcome="ok"})', lambda r: True)
        assert list(ok.values()) == [ok_before + 3]
        scraped = {
            name: sum(vector(url, name).values())
            for name in (
                "holeblend_reused_tokens_total", "holeblend_prompt_tokens_total",
                "holeblend_hole_tokens_total", "holeblend_recomputed_tokens_total",
                "holeblend_ttft_seconds_count", "holeblend_request_duration_seconds_count",
                "holeblend_queue_wait_seconds_count", "holeblend_lookup_seconds_count",
                "holeblend_kv_deviation_count", "holeblend_recompute_ratio",
                "holeblend_kv_store_bytes", "holeblend_kv_store_entries",
                "holeblend_config_reload_errors_total",
            )
        }  # fmt: skip
    assert scraped["holeblend_reused_tokens_total"] >= reused > 0
    assert scraped["holeblend_prompt_tokens_total"] > scraped["holeblend_reused_tokens_total"]
    assert scraped["holeblend_hole_tokens_total"] > 0
    # Every blended reused token has a deviation; an exact cached prefix (system prompt and
    # first document) is loaded like a prefix cache and has none.
    assert 0 < scraped["holeblend_kv_deviation_count"] <= scraped["holeblend_reused_tokens_total"]
    assert scraped["holeblend_ttft_seconds_count"] >= 3
    assert scraped["holeblend_recompute_ratio"] == 0.15
    assert scraped["holeblend_kv_store_entries"] >= 4
    assert 0 < scraped["holeblend_kv_store_bytes"] <= 512 << 20
    assert scraped["holeblend_config_reload_errors_total"] == 0


def shadow_offers(server) -> float:
    return metric(server, "holeblend_shadow_requests_total")


def test_only_requests_that_blended_are_offered_to_the_shadow_proxies(tmp_path):
    """A full miss or an exact cached prefix answers as full prefill would at any ratio:
    scoring it would only pull the proxies towards 1.0."""
    server = start_server(tmp_path, example_settings_json(shadowSampleRate=1.0))
    try:
        assert completion(server, DOCS)[0] == 200  # full miss
        status, body, _ = completion(server, [NEW_DOC])  # only the system prompt: exact
        assert status == 200 and body["usage"]["holeblend"]["reused_tokens"] > 0
        status, body, _ = completion(server, DOCS)  # documents reused out of context: blended
        assert status == 200 and body["usage"]["holeblend"]["lookup_mode"] == "pure-hit"
        # An offer's outcome is counted when it is decided (scored: seconds later).
        deadline = time.monotonic() + 120
        while shadow_offers(server) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        assert shadow_offers(server) == 1  # the third request's, none of the first two
    finally:
        assert server.stop() == 0, server.log()


# --- in process: a test that must hold the server's event loop -----------------------------


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> Iterator[Server]:
    with in_process_server(tmp_path_factory.mktemp("in-process")) as server:
        yield server


def completion_tokens(server: Server) -> float:
    sample = "holeblend_completion_tokens_total"
    return server.metrics.registry.get_sample_value(sample, {"mode": "full"}) or 0.0


async def finish_and_usage(response, stream: bool) -> tuple[str, int]:
    """The answer's finish_reason and usage.completion_tokens, streamed or whole."""
    if not stream:
        reply = await response.json()
        return reply["choices"][0]["finish_reason"], reply["usage"]["completion_tokens"]
    lines = (await response.text()).split("\n\n")
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-2]]
    return events[-2]["choices"][0]["finish_reason"], events[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_tokens_count_the_answer_not_the_tokens_decoded_past_its_stop(
    in_process, stream
):
    """The compute thread learns that an answer reached a stop sequence from the route, one
    hop over the event loop, and decodes on until then: with the loop busy, to the answer's
    limit. `holeblend_completion_tokens_total` counted those tokens too; it counts the
    answer's `usage.completion_tokens`."""
    server = in_process
    body = {
        "model": "smollm2", "system": SYSTEM, "documents": DOCS[:1],
        "prompt": "Which lake shrank?", "max_tokens": 12, "ignore_eos": True,
    }  # fmt: skip
    streamed = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    async with TestClient(TestServer(server.app())) as client:
        whole = await (await client.post("/v1/completions", json=body)).json()
        stop = whole["choices"][0]["text"].split()[1]  # a word early in the answer
        before = completion_tokens(server)
        stopped = body | streamed | {"stop": stop}
        # The thread starts the job once the loop is held, as a busy one would be, and
        # decodes the whole answer before the route sees any of it.
        held = threading.Event()
        server.worker.between_steps = partial(held.wait, 10)
        try:
            request = asyncio.create_task(client.post("/v1/completions", json=stopped))
            while not server.worker.num_pending:
                await asyncio.sleep(0.001)
            held.set()
            assert settles_to_zero(server.worker)
        finally:
            server.worker.between_steps = None
        finish, num_tokens = await finish_and_usage(await request, stream)
    assert finish == "stop" and num_tokens < 12
    assert completion_tokens(server) - before == num_tokens


class _Escaped(BaseException):
    """What no handler of the compute thread catches."""


async def test_a_compute_thread_that_died_fails_liveness_and_readiness(tmp_path):
    """Should something escape the compute thread, the server would answer nothing yet
    report itself alive and ready: the kubelet would never restart it. Nor does it queue
    requests any more."""
    config = tmp_path / "blend.json"
    config.write_text(example_settings_json(mode="off", qualityProxies=False, lookupServerUrl=None))
    server = Server(ServeSettings(config, torch_threads=1))
    server.load()
    server.is_ready = True
    try:
        async with TestClient(TestServer(server.app())) as client:
            assert (await client.get("/healthz")).status == 200
            assert (await client.get("/ready")).status == 200

            def escape():
                raise _Escaped

            server.worker.between_steps = escape
            body = {"model": "smollm2", "prompt": "Which lake shrank?", "max_tokens": 2}
            request = asyncio.create_task(client.post("/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while not server.worker.has_died:
                assert time.monotonic() < deadline, "the compute thread did not end"
                await asyncio.sleep(0.01)
            for path in ("/healthz", "/ready"):
                response = await client.get(path)
                assert response.status == 503
                assert (await response.json())["status"] == "the compute thread ended"
            # A request is refused at once, not queued for a thread that never takes it
            # (it waited out its timeout for a 504), so a client can go to another replica.
            response = await client.post("/v1/completions", json=body)
            assert response.status == 503
            error = (await response.json())["error"]
            assert "compute thread" in error["message"] and error["type"] == "unavailable"
            assert int(response.headers["Retry-After"]) >= 1
            # The request the thread had taken is answered the same, at once.
            taken = await asyncio.wait_for(request, 30)
            assert taken.status == 503, await taken.text()
            assert "compute thread" in (await taken.json())["error"]["message"]
    finally:
        server.engine.close()
        server.close()
