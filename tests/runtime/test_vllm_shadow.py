"""The vLLM pods' shadow (runtime/vllm_connector/shadow.py) without vLLM: reading vLLM's
prompt logprobs, and what happens to offers when the engine is busy, the slot is taken,
or the API server is down or answers garbage. Scoring against a real vLLM server is in
tests/vllm/test_shadow_serve.py."""

import http.server
import threading

import pytest

from holeblend_runtime.vllm_connector.shadow import (
    ENGINE_URL_ENV,
    ShadowFailed,
    VllmShadow,
    VllmShadowRequest,
    first_disagreement,
    is_shadow_request,
    teacher_forced_top1,
)

REQUEST = VllmShadowRequest((1, 2, 3), (7, 8), "who?", 0.15)


def entry(actual: int, rank: int, top: int | None = None) -> dict:
    """One position of vLLM's prompt_logprobs with prompt_logprobs=1."""
    found = {str(actual): {"logprob": -0.1, "rank": rank, "decoded_token": "x"}}
    if top is not None:
        found[str(top)] = {"logprob": -0.01, "rank": 1, "decoded_token": "y"}
    return found


def test_the_top1_picks_come_from_the_ranks_of_the_answer_positions():
    logprobs = [None, entry(2, 5, 9), entry(3, 1), entry(7, 1), entry(8, 3, 4)]
    assert teacher_forced_top1(logprobs, 3, [7, 8]) == [7, 4]
    assert first_disagreement([7, 8], [7, 4]) == 1
    assert first_disagreement([7, 8], [7, 8]) == 2
    with pytest.raises(ShadowFailed, match="4 positions, expected 5"):
        teacher_forced_top1(logprobs[:4], 3, [7, 8])
    with pytest.raises(ShadowFailed, match=r"prompt_logprobs\[3\]"):
        teacher_forced_top1([None, {}, {}, None, entry(8, 1)], 3, [7, 8])


def test_only_requests_marked_shadow_are_shadow_requests():
    assert is_shadow_request({"holeblend": {"shadow": True}}, "holeblend")
    for params in (None, {}, {"holeblend": {}}, {"holeblend": {"shadow": "yes"}}, {"x": 1}):
        assert not is_shadow_request(params, "holeblend")


class Server:
    """A local HTTP server answering POSTs with `body`, after `release` is set."""

    def __init__(self, body: bytes, status: int = 200):
        self.release = threading.Event()
        self.release.set()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                owner.release.wait(10)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def close(self):
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


def shadow(url: str, **options) -> VllmShadow:
    return VllmShadow(url, "m", options.pop("sample_rate", 1.0), lambda ids: "", **options)


def test_offers_are_dropped_not_queued_when_busy_or_the_slot_is_taken():
    server = Server(b"<html>busy</html>")
    server.release.clear()  # the first shadow's request hangs until released
    try:
        assert shadow(server.url, sample_rate=0.0).offer(REQUEST) == "not_sampled"
        assert shadow(server.url, is_busy=lambda: True).offer(REQUEST) == "dropped_busy"
        scorer = shadow(server.url)
        assert scorer.offer(REQUEST) == "queued"
        assert scorer.offer(REQUEST) == "dropped_full"
        server.release.set()
        assert scorer.wait_idle(10)
        assert scorer.outcomes == {"dropped_full": 1, "failed": 1}  # HTML is no answer
    finally:
        server.close()


@pytest.mark.parametrize(
    "body, status",
    [(b"<html>oops</html>", 200), (b'{"choices": []}', 200), (b'{"error": "x"}', 500)],
)
def test_a_garbage_answer_fails_the_sample_and_nothing_else(body, status):
    server = Server(body, status)
    try:
        scorer = shadow(server.url)
        with pytest.raises(ShadowFailed):
            scorer.score(REQUEST)
        assert scorer.offer(REQUEST) == "queued" and scorer.wait_idle(10)
        assert scorer.outcomes == {"failed": 1} and scorer.scores == []
    finally:
        server.close()


def test_a_server_that_is_down_fails_the_sample():
    server = Server(b"")
    url = server.url
    server.close()  # nothing listens there now
    scorer = shadow(url, timeout_s=2)
    assert scorer.offer(REQUEST) == "queued" and scorer.wait_idle(10)
    assert scorer.outcomes == {"failed": 1}


def test_a_shadow_that_waits_too_long_for_the_engine_is_given_up():
    # Idle when offered; then user requests keep arriving before the shadow's request.
    answers = iter([False])
    scorer = shadow("http://127.0.0.1:9", is_busy=lambda: next(answers, True), max_pause_s=0.2)
    assert scorer.offer(REQUEST) == "queued" and scorer.wait_idle(10)
    assert scorer.outcomes == {"preempted": 1}


def test_the_shadow_needs_the_engine_url_and_a_sample_rate(monkeypatch):
    monkeypatch.delenv(ENGINE_URL_ENV, raising=False)
    assert VllmShadow.from_env("m", 1.0, str) is None
    monkeypatch.setenv(ENGINE_URL_ENV, "http://127.0.0.1:8000")
    assert VllmShadow.from_env("m", 0.0, str) is None
    made = VllmShadow.from_env("m", 0.5, str)
    assert made.url == "http://127.0.0.1:8000/v1/completions" and made.sample_rate == 0.5
    with pytest.raises(ValueError, match="shadowSampleRate"):
        VllmShadow("http://x", "m", 1.5, str)
