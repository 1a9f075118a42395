"""The load benchmark's workload, wire format and result rows (no server, no model)."""

import contextlib
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from holeblend_contract.blend_settings import parse_blend_settings
from holeblend_runtime.bench import load
from holeblend_runtime.bench.load import (
    LOAD_RESULT_KEYS,
    ShadowSeconds,
    blend_settings,
    greedy_agreement,
    summarize_load,
)
from holeblend_runtime.bench.load_client import (
    Outcome,
    complete,
    completion_body,
    drive,
    parse_sse,
)
from holeblend_runtime.bench.load_workload import (
    LoadWorkloadConfig,
    generate_load_workload,
    make_corpus,
)

CONFIG = LoadWorkloadConfig(num_corpus_documents=20, num_warmup=4, num_requests=60)


@pytest.fixture(scope="module")
def stream():
    return generate_load_workload(CONFIG)


def test_same_config_gives_the_same_stream(stream):
    assert generate_load_workload(CONFIG) == stream
    assert generate_load_workload(LoadWorkloadConfig(**{**vars(CONFIG), "seed": 1})) != stream


def test_warmup_comes_first_and_every_request_is_counted(stream):
    assert len(stream) == 64 and [r.index for r in stream] == list(range(64))
    assert [r.is_warmup for r in stream] == [True] * 4 + [False] * 60


def test_documents_are_distinct_within_a_request_and_come_from_the_corpus(stream):
    corpus = [d.text for d in make_corpus(CONFIG)]
    assert len(set(corpus)) == 20
    for request in stream:
        assert len(set(request.document_ranks)) == CONFIG.documents_per_request
        assert list(request.documents) == [corpus[r] for r in request.document_ranks]


def test_popular_documents_recur_and_the_tail_still_appears(stream):
    counts = Counter(rank for r in stream for rank in r.document_ranks)
    assert counts[0] > counts[10] and counts[0] > 0.7 * len(stream)
    assert len(counts) >= 15  # the tail brings misses


def test_popular_documents_move_between_prompt_positions(stream):
    positions = {r.document_ranks.index(0) for r in stream if 0 in r.document_ranks}
    assert len(positions) >= 3  # a hit in a new place, next to new neighbours


def test_answer_is_in_exactly_one_document_of_its_request(stream):
    for request in stream:
        assert sum(request.gold_answer in text for text in request.documents) == 1


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"documents_per_request": 50}, "documents_per_request"),
        ({"num_requests": 0}, "num_requests"),
        ({"num_warmup": -1}, "num_warmup"),
        ({"zipf_s": -1.0}, "zipf_s"),
    ],
)
def test_bad_workload_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        LoadWorkloadConfig(**changes)


def test_completion_body_is_openai_with_the_documents_extension(stream):
    body = completion_body(stream[0], "m", 8)
    assert body["prompt"] == stream[0].question and body["documents"] == list(stream[0].documents)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["max_tokens"] == 8


def test_blend_settings_pass_the_contract_with_the_crd_mode_names():
    full = parse_blend_settings(blend_settings("full", 0.15))
    assert full.mode == "off" and full.recompute_ratio == 0.15
    assert parse_blend_settings(blend_settings("hole", 0.3)).mode == "hole"


def test_sse_payloads_stop_at_done():
    lines = [b": comment\n", b'data: {"a": 1}\n', b"\n", b'data: {"a": 2}\n', b"data: [DONE]\n",
             b'data: {"a": 3}\n']  # fmt: skip
    assert list(parse_sse(lines)) == [{"a": 1}, {"a": 2}]


def test_greedy_agreement_counts_up_to_the_first_difference():
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert greedy_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert greedy_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert greedy_agreement([], []) == 1.0 and greedy_agreement([1], []) == 0.0


def _outcome(index, ttft, cached, text="a b", status=200, itls=()):
    usage = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": cached}}
    return Outcome(index, status, ttft, ttft + 0.5, text, usage, itls_s=itls)


def test_load_row_has_every_key_and_token_weighted_reuse():
    outcomes = [
        _outcome(0, 1.0, 80, itls=(0.1, 0.3)),
        _outcome(1, 3.0, 20, text="a c", itls=(0.2,)),
        _outcome(2, 9.0, 0, status=500, itls=(5.0,)),  # a failed request's gaps do not count
    ]
    row = summarize_load(
        "hole", 0.15, 4, outcomes, 2.0, {0: "a b", 1: "a b"}, str.split, {0: "q", 1: "q"}
    )
    assert set(LOAD_RESULT_KEYS) <= set(row)
    assert row["requests"] == 3 and row["num_errors"] == 1
    assert row["requests_per_s"] == pytest.approx(1.0)
    assert row["reused_share"] == pytest.approx(0.5)
    assert row["ttft_p50_s"] == pytest.approx(2.0)
    # Inter-token latency over every gap of the requests that succeeded (interpolated).
    assert row["itl_p50_s"] == pytest.approx(0.2) and row["itl_p99_s"] == pytest.approx(0.298)
    assert row["top1_vs_full"] == pytest.approx(0.75)
    no_gaps = summarize_load("hole", 0.15, 1, [_outcome(0, 1.0, 80)], 1.0, None, str.split, {})
    assert no_gaps["itl_p50_s"] is None and no_gaps["itl_p99_s"] is None


def test_load_row_says_how_many_samples_its_percentiles_are_of():
    """A p99 of three samples is interpolated between the two largest, not a measured
    tail: the row says how few there were."""
    outcomes = [
        _outcome(0, 1.0, 80, itls=(0.1, 0.3)),
        _outcome(1, 3.0, 20, itls=(0.2,)),
        _outcome(2, 9.0, 0, status=500, itls=(5.0,)),
    ]
    row = summarize_load("hole", 0.15, 1, outcomes, 1.0, None, str.split, {})
    assert (row["num_ttft_samples"], row["num_itl_samples"]) == (2, 3)
    empty = summarize_load("full", None, 1, [], 1.0, None, str.split, {})
    assert (empty["num_ttft_samples"], empty["num_itl_samples"]) == (0, 0)


def test_shadow_seconds_between_scrapes_count_every_unit_and_the_idle_ones_apart():
    def scrape(idle, serving):
        return {
            ("holeblend_shadow_unit_seconds_total", (("engine_state", "idle"),)): idle,
            ("holeblend_shadow_unit_seconds_total", (("engine_state", "serving"),)): serving,
            ("holeblend_shadow_units_total", (("engine_state", "idle"),)): 99.0,
        }

    moved = ShadowSeconds.between(scrape(1.0, 2.0), scrape(1.5, 4.0))
    assert (moved.total, moved.idle) == (pytest.approx(2.5), pytest.approx(0.5))
    assert ShadowSeconds.between({}, {}) == ShadowSeconds(0.0, 0.0)
    # A server that restarted (counters back to 0) adds nothing rather than a negative.
    assert ShadowSeconds.between(scrape(3.0, 3.0), scrape(0.0, 0.0)) == ShadowSeconds(0.0, 0.0)
    shadow = ShadowSeconds()
    shadow.add(ShadowSeconds(2.5, 0.5))
    shadow.add(ShadowSeconds(1.0, 1.0))
    row = summarize_load("hole", 0.15, 1, [_outcome(0, 1.0, 80)], 2.0, None, str.split, {}, shadow)
    assert (row["shadow_s"], row["shadow_drain_s"]) == (pytest.approx(3.5), pytest.approx(1.5))
    assert summarize_load("full", None, 1, [], 1.0, None, str.split, {})["shadow_s"] == 0.0


class _Handler(BaseHTTPRequestHandler):
    num_busy = [1]  # the first request is told to come back

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.num_busy[0]:
            self.num_busy[0] -= 1
            self.send_response(429)
            self.send_header("Retry-After", "0.05")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in ("Oskeby", " harbour"):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode())
        usage = {"prompt_tokens": 10 * len(body["documents"]),
                 "prompt_tokens_details": {"cached_tokens": 5}}  # fmt: skip
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *_):
        pass


def test_clients_stream_time_the_first_chunk_and_retry_a_429(stream):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        outcomes, wall_s = drive(server.server_address[1], stream[:6], "m", 3, 4, timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()
    assert [o.index for o in outcomes] == list(range(6)) and wall_s > 0
    assert all(o.is_ok and o.text == "Oskeby harbour" for o in outcomes)
    assert all(0 < o.ttft_s <= o.request_s for o in outcomes)
    # Two chunks with text (the usage chunk has none): one inter-token gap each.
    assert all(len(o.itls_s) == 1 and 0 <= o.itls_s[0] <= o.request_s for o in outcomes)
    assert outcomes[0].usage["prompt_tokens"] == 60
    assert sum(o.num_rejected for o in outcomes) == 1


class _BusyOnceHandler(_Handler):
    """Rejects the first request with a 429 and Retry-After 0.3 s, then streams."""

    def do_POST(self):
        if self.num_busy[0]:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.num_busy[0] -= 1
            self.send_response(429)
            self.send_header("Retry-After", "0.3")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_POST()


def test_a_rejected_requests_wait_counts_in_its_ttft_and_request_time(stream):
    """The user waits through the 429 and its Retry-After before the first token: the clock
    starts at the first send, not at the try the server took, or an overloaded mode's
    latencies come out flattered."""
    _BusyOnceHandler.num_busy = [1]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BusyOnceHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.perf_counter()
        outcome = complete(server.server_address[1], stream[0], "m", 4, timeout_s=10)
        waited = time.perf_counter() - started
    finally:
        server.shutdown()
        server.server_close()
    assert outcome.is_ok and outcome.num_rejected == 1
    assert 0.3 <= outcome.ttft_s <= outcome.request_s <= waited


class _NoServer:
    """Stands for a started server whose requests the test drives itself."""

    port = 1

    def wait_ready(self, timeout):
        pass

    def model_name(self):
        return "m"


@contextlib.contextmanager
def _no_server(*_):
    yield _NoServer()


def test_zero_warm_up_requests_send_only_the_measured_blocks(monkeypatch, tmp_path):
    """`--warmup 0` is a documented setting: with no warm-up block the measured blocks
    still go to every server and are counted."""
    config = load.LoadConfig(
        LoadWorkloadConfig(num_corpus_documents=20, num_warmup=0, num_requests=4),
        modes=("full",),
        num_blocks=2,
    )
    requests = generate_load_workload(config.workload)
    sent = []

    def fake_drive(port, block, *_):
        sent.append([r.index for r in block])
        return [Outcome(r.index, 200, 0.1, 0.2, "x", None) for r in block], 0.5

    monkeypatch.setattr(load, "_server", _no_server)
    monkeypatch.setattr(load, "drive", fake_drive)
    rows = load.run_load(config, requests, tmp_path, str.split)
    assert sent == [[0, 1], [2, 3]]
    assert rows[0]["requests"] == 4 and rows[0]["wall_s"] == pytest.approx(1.0)


@pytest.mark.slow
def test_load_bench_through_real_servers_writes_one_row_per_mode(tmp_path):
    """Two real holeblend-serve processes (full, hole) on a tiny stream; both stopped after."""
    from holeblend_runtime.bench.cli import main

    path = tmp_path / "load.json"
    argv = ["--load", "--load-modes", "full,hole", "--requests", "2", "--warmup", "1",
            "--blocks", "1", "--clients", "2", "--corpus", "6", "--request-documents", "2",
            "--min-doc-tokens", "30", "--max-doc-tokens", "40", "--max-new-tokens", "3",
            "--workdir", str(tmp_path), "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    rows = {row["mode"]: row for row in json.loads(path.read_text())["results"]}
    assert set(rows) == {"full", "hole"}
    for row in rows.values():
        assert set(LOAD_RESULT_KEYS) <= set(row)
        assert row["requests"] == 2 and row["num_errors"] == 0 and row["requests_per_s"] > 0
        assert 0 < row["itl_p50_s"] <= row["itl_p99_s"]  # 3-token answers: 2 gaps each
    assert rows["full"]["reused_share"] == 0.0 and rows["full"]["top1_vs_full"] == 1.0
    assert rows["hole"]["reused_share"] > 0.0
    assert rows["full"]["shadow_s"] == 0.0  # nothing blended, no shadow
    assert 0.0 <= rows["hole"]["shadow_drain_s"] <= rows["hole"]["shadow_s"]
    for mode in rows:  # SIGTERM drained and stopped each server
        assert "stopped" in (tmp_path / f"serve-{mode}.log").read_text()


class _TimeoutMidStreamHandler(BaseHTTPRequestHandler):
    """Streams one token, then the error event holeblend-serve sends when a request runs
    past its timeout after the 200 and the first chunks went out."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(f"data: {json.dumps({'choices': [{'text': 'Osk'}]})}\n\n".encode())
        error = {"message": "the request did not finish within the server's timeout of 1 s",
                 "type": "timeout", "param": None, "code": None}  # fmt: skip
        self.wfile.write(f"data: {json.dumps({'error': error})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *_):
        pass


def test_an_error_event_in_the_stream_fails_the_request(stream):
    """A request the server gave up on after it began streaming is a failure: counted in
    num_errors, not in the throughput, the TTFT percentiles or the answers compared."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TimeoutMidStreamHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        outcome = complete(server.server_address[1], stream[0], "m", 4, timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()
    assert not outcome.is_ok
    assert "timeout of 1 s" in outcome.error
    row = summarize_load("hole", 0.15, 1, [outcome], 1.0, None, str.split, {})
    assert row["num_errors"] == 1 and row["requests_per_s"] == 0.0
    assert row["ttft_p50_s"] is None


def test_the_servers_order_turns_from_block_to_block(monkeypatch, tmp_path):
    """Each mode takes every place in a round once over as many blocks as modes: a load
    that grows (or fades) on a shared machine during each round must not fall on the mode
    that always runs last."""
    config = load.LoadConfig(
        LoadWorkloadConfig(num_corpus_documents=20, num_warmup=0, num_requests=6), num_blocks=3
    )
    requests = generate_load_workload(config.workload)
    rounds: list[list[str]] = []

    def run_block(config, mode, server, model, block):
        if not rounds or len(rounds[-1]) == len(config.modes):
            rounds.append([])
        rounds[-1].append(mode)
        return [Outcome(r.index, 200, 0.1, 0.2, "x", None) for r in block], 0.5, ShadowSeconds()

    monkeypatch.setattr(load, "_server", _no_server)
    monkeypatch.setattr(load, "_run_block", run_block)
    rows = load.run_load(config, requests, tmp_path, str.split)
    assert len(rounds) == 3 and all(sorted(r) == sorted(load.LOAD_MODES) for r in rounds)
    for place in range(3):
        assert {r[place] for r in rounds} == set(load.LOAD_MODES)
    assert [row["mode"] for row in rows] == list(load.LOAD_MODES)
    assert all(row["requests"] == 6 for row in rows)


def test_a_chunk_that_is_not_a_json_object_fails_the_request_instead_of_its_client():
    """A client thread that raised would drop its request from the counts without a word."""
    from holeblend_runtime.bench.load_client import _read_stream

    lines = [b'data: {"choices": [{"text": "Osk"}]}', b'data: ["eby"]', b"data: [DONE]"]
    outcome = _read_stream(0, lines, time.perf_counter())
    assert not outcome.is_ok and "not a JSON object" in outcome.error


class _CutShortHandler(BaseHTTPRequestHandler):
    """Streams one token, then closes the connection without `data: [DONE]`, as a server
    whose process died mid-answer does (the kernel closes its sockets cleanly)."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(f"data: {json.dumps({'choices': [{'text': 'Osk'}]})}\n\n".encode())

    def log_message(self, *_):
        pass


def test_a_stream_cut_short_before_done_fails_the_request(stream):
    """A half answer is not a success: it would count in the throughput with a short
    request time, and in the answers compared with full prefill's."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CutShortHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        outcome = complete(server.server_address[1], stream[0], "m", 4, timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()
    assert not outcome.is_ok
    assert "[DONE]" in outcome.error
    row = summarize_load("hole", 0.15, 1, [outcome], 1.0, None, str.split, {})
    assert row["num_errors"] == 1 and row["requests_per_s"] == 0.0
    assert row["ttft_p50_s"] is None


class _MalformedChoicesHandler(BaseHTTPRequestHandler):
    """A 200 stream whose chunk has a `choices` entry that is not an object."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"choices": [null]}\n\ndata: [DONE]\n\n')

    def log_message(self, *_):
        pass


def test_a_request_that_breaks_its_client_is_counted_as_failed_and_the_client_goes_on(stream):
    """A client thread that raised would end there: its request gone from every count and,
    with one client, every request after it never sent."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _MalformedChoicesHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        outcomes, _ = drive(server.server_address[1], stream[:3], "m", 1, 4, timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()
    assert [o.index for o in outcomes] == [0, 1, 2]
    assert all(not o.is_ok and o.error for o in outcomes)
    row = summarize_load("hole", 0.15, 1, outcomes, 1.0, None, str.split, {})
    assert row["requests"] == row["num_errors"] == 3


def test_the_measured_requests_go_in_as_many_blocks_as_asked(monkeypatch, tmp_path):
    """4 measured requests asked for in 3 blocks go in 3 blocks (of 1, 1 and 2, in stream
    order), not in 2 blocks of 2: with fewer blocks than modes the servers' order never
    turns through every place, and the JSON's `num_blocks` would name blocks never sent."""
    config = load.LoadConfig(
        LoadWorkloadConfig(num_corpus_documents=20, num_warmup=0, num_requests=4), num_blocks=3
    )
    requests = generate_load_workload(config.workload)
    rounds: list[list[tuple[str, list[int]]]] = []

    def run_block(config, mode, server, model, block):
        if not rounds or len(rounds[-1]) == len(config.modes):
            rounds.append([])
        rounds[-1].append((mode, [r.index for r in block]))
        return [Outcome(r.index, 200, 0.1, 0.2, "x", None) for r in block], 0.5, ShadowSeconds()

    monkeypatch.setattr(load, "_server", _no_server)
    monkeypatch.setattr(load, "_run_block", run_block)
    rows = load.run_load(config, requests, tmp_path, str.split)
    assert len(rounds) == 3
    for place in range(3):
        assert {r[place][0] for r in rounds} == set(load.LOAD_MODES)
    blocks = [r[0][1] for r in rounds]
    assert sorted(len(b) for b in blocks) == [1, 1, 2] and sum(blocks, []) == [0, 1, 2, 3]
    assert all(row["requests"] == 4 for row in rows)


def test_more_blocks_than_measured_requests_are_refused():
    with pytest.raises(ValueError, match="num_blocks: 4 blocks need as many measured requests"):
        load.LoadConfig(LoadWorkloadConfig(num_requests=2), num_blocks=4)
