"""The vLLM pods' shadow (runtime/vllm_connector/shadow.py) without vLLM: reading vLLM's
prompt logprobs, scoring the answer's end against a fake full-prefill server, the lowest
priority and its fallback, the budget, and what happens to offers when the slot is taken
or the API server is down or answers garbage. Scoring against a real vLLM server is in
tests/vllm/test_shadow_serve.py."""

import collections
import contextlib
import http.server
import json
import logging
import socket
import threading
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from holeblend_runtime.quality.shadow import ShadowBudget, ShadowMetrics
from holeblend_runtime.vllm_connector import shadow as shadow_module
from holeblend_runtime.vllm_connector.shadow import (
    ENGINE_URL_ENV,
    SHADOW_MARK,
    SHADOW_PRIORITY,
    ShadowFailed,
    VllmShadow,
    VllmShadowRequest,
    engine_url,
    first_disagreement,
    is_replay_request,
    is_shadow_request,
    replay_request,
    stop_cut,
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
    """The mark is this process's random token: a client's own kv_transfer_params (any
    client can send them) cannot pass its requests off as shadows or replays, which are
    counted in no user figure and charged to no budget."""
    assert is_shadow_request({"holeblend": {"shadow": SHADOW_MARK}}, "holeblend")
    assert len(SHADOW_MARK) >= 32
    for params in (
        None, {}, {"holeblend": {}}, {"holeblend": {"shadow": "yes"}}, {"x": 1},
        {"holeblend": {"shadow": True}}, {"holeblend": {"shadow": True, "replay": True}},
        {"holeblend": {"shadow": SHADOW_MARK[:-1]}}, {"holeblend": {"shadow": 1}},
    ):  # fmt: skip
        assert not is_shadow_request(params, "holeblend"), params
        assert not is_replay_request(params, "holeblend"), params
    assert is_replay_request({"holeblend": {"shadow": SHADOW_MARK, "replay": True}}, "holeblend")


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


def test_offers_are_dropped_not_queued_when_the_slot_is_taken():
    server = Server(b"<html>busy</html>")
    server.release.clear()  # the first shadow's request hangs until released
    try:
        assert shadow(server.url, sample_rate=0.0).offer(REQUEST) == "not_sampled"
        scorer = shadow(server.url)
        assert scorer.offer(REQUEST) == "queued"
        assert scorer.offer(REQUEST) == "dropped_full"
        server.release.set()
        assert scorer.wait_idle(10)
        assert scorer.outcomes == {"dropped_full": 1, "failed": 1}  # HTML is no answer
    finally:
        server.close()


class BothRead(collections.Counter):
    """Counts where two threads both read a count before either writes it back, as a
    thread switch between the read and the write of `+= 1` lets them."""

    def __init__(self):
        super().__init__()
        self.both_read = threading.Barrier(2)

    def __getitem__(self, key):
        count = super().__getitem__(key)
        with contextlib.suppress(threading.BrokenBarrierError):
            self.both_read.wait(timeout=1)  # a second thread that cannot read: go on
        return count


def test_offers_counted_on_two_threads_at_once_are_both_counted():
    """The serving thread counts the offers it drops while the worker thread counts the
    shadows it ends: two updates of one count at once lost one."""
    sampler = shadow("http://127.0.0.1:9", sample_rate=0.0)
    sampler.outcomes = BothRead()
    try:
        threads = [threading.Thread(target=sampler.offer, args=(REQUEST,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert dict(sampler.outcomes) == {"not_sampled": 2}
    finally:
        sampler.close()


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


EOS = 0
FULL = (11, 12, 13, 14, 15)  # full prefill's answer after PROMPT, then EOS
PROMPT = (1, 2, 3)


class FullPrefillServer:
    """A fake vLLM API server whose model answers FULL after PROMPT whatever came before
    (its next token depends on the position only), then `end` (EOS unless told); it
    stops at the token whose text (`words`) reaches one of the body's stop strings, as
    vLLM's API server does; it records every body, and with `fcfs` refuses a priority
    other than 0 as vLLM's API documents."""

    def __init__(self, fcfs: bool = False, end: int = EOS):
        self.bodies: list[dict] = []
        self.end = end
        # What the connector returns for a replay (None: it blended nothing).
        self.replayed: dict | None = None
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.bodies.append(body)
                if fcfs and body.get("priority", 0) != 0:
                    self._send(400, {"error": {"message": "priority scheduling is not enabled"}})
                else:
                    self._send(200, owner.answer(body))

            def _send(self, status, answer):
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def next_token(self, position: int) -> int:
        index = position - len(PROMPT)
        return FULL[index] if index < len(FULL) else self.end

    def answer(self, body: dict) -> dict:
        marks = (body.get("kv_transfer_params") or {}).get("holeblend") or {}
        if not marks.get("replay"):
            return {"choices": [self.choice(body)]}
        figures = {"mode": "hole", "num_reused_tokens": 40}
        if self.replayed is not None:
            figures["replay"] = self.replayed
        replayed = (self.replayed or {}).get("answer_ids", [])
        choice = {"token_ids": [*replayed, EOS], "finish_reason": "stop"}
        return {"choices": [choice], "kv_transfer_params": {"holeblend": figures}}

    def choice(self, body: dict) -> dict:
        prompt = body["prompt"]
        logprobs = None
        if body.get("prompt_logprobs"):
            logprobs = [None]
            for position, token in enumerate(prompt[1:], start=1):
                top = self.next_token(position) if position >= len(PROMPT) else token
                entry = {str(token): {"logprob": -1.0, "rank": 1 if token == top else 2}}
                entry.setdefault(str(top), {"logprob": -0.1, "rank": 1})
                logprobs.append(entry)
        tokens, stop = [], body.get("stop") or []
        for position in range(len(prompt), len(prompt) + body["max_tokens"]):
            tokens.append(self.next_token(position))
            if tokens[-1] == self.end or any(s in words(tokens) for s in stop):
                break
        return {"prompt_logprobs": logprobs, "token_ids": tokens}

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids if i != EOS)


def scorer_for(server: FullPrefillServer, **options) -> VllmShadow:
    return VllmShadow(server.url, "m", 1.0, words, eos_token_id=EOS, **options)


def test_an_answer_that_stops_early_or_runs_on_scores_below_one():
    server = FullPrefillServer()
    try:
        scorer = scorer_for(server)
        same = scorer.score(VllmShadowRequest(PROMPT, FULL, "q", 0.1, stopped_at_eos=True))
        assert (same.f1, same.top1) == (1.0, 1.0)
        early = VllmShadowRequest(PROMPT, FULL[:2], "q", 0.1, stopped_at_eos=True, max_tokens=64)
        score = scorer.score(early)
        # Two answer positions agree, the end does not: full prefill goes on to its EOS.
        assert score.top1 == pytest.approx(2 / 3)
        assert score.f1 == pytest.approx(2 * (2 / 2) * (2 / 5) / (1 + 2 / 5))
        assert server.bodies[-1]["prompt"] == [*PROMPT, *FULL[:3]]  # continued from its pick
        # Cut by the token limit instead: nothing to say about the end; it agrees.
        limited = VllmShadowRequest(PROMPT, FULL[:2], "q", 0.1, max_tokens=2)
        assert (lambda s: (s.f1, s.top1))(scorer.score(limited)) == (1.0, 1.0)
        run_on = VllmShadowRequest(PROMPT, (*FULL, 16, 17), "q", 0.1, stopped_at_eos=True)
        score = scorer.score(run_on)
        # The five answer tokens agree; full prefill's EOS is where 16 and 17 were.
        assert score.top1 == pytest.approx(6 / 8) and score.f1 < 1.0
    finally:
        server.close()


def test_an_answer_ending_at_another_stop_token_agrees_with_full_prefill_ending_at_eos():
    """vLLM stops a request at any of its stop token ids (generation_config's other EOS
    ids among them, e.g. Gemma's `<end_of_turn>`), not only at the tokenizer's EOS. Full
    prefill ending the answer with any end token agrees with the blended end, and its own
    answer ends at the first end token it picks, so the stop token is never read as a
    word or a disagreement."""
    end_of_turn = 107
    server = FullPrefillServer(end=end_of_turn)
    try:
        scorer = scorer_for(server)
        ended = VllmShadowRequest(
            PROMPT, FULL, "q", 0.1, stopped_at_eos=True, stop_token_ids=(end_of_turn,)
        )
        assert (lambda s: (s.f1, s.top1))(scorer.score(ended)) == (1.0, 1.0)
        early = VllmShadowRequest(
            PROMPT, FULL[:2], "q", 0.1, stopped_at_eos=True, max_tokens=64,
            stop_token_ids=(end_of_turn,),
        )  # fmt: skip
        score = scorer.score(early)
        # Full prefill goes on to its own end (FULL, not FULL plus the stop token).
        assert score.top1 == pytest.approx(2 / 3)
        assert score.f1 == pytest.approx(2 * (2 / 2) * (2 / 5) / (1 + 2 / 5))
    finally:
        server.close()


def test_the_f1_skips_the_questions_words_not_the_chat_templates():
    """The connector decodes the question segment, which ends with the chat template's
    closing (ChatML's decodes to "\nassistant\n", here " w20"): its words were taken for
    the question's and dropped from both answers. Only the question's own are skipped,
    as holeblend-serve and holeblend-bench skip them."""
    server = FullPrefillServer()
    try:
        scorer = scorer_for(server, closing=" w20")
        # Full prefill's w11 w12 w13 against w11 w12 w20.
        request = VllmShadowRequest(PROMPT, (11, 12, 20), "w5 w6 w20", 0.1, max_tokens=3)
        assert scorer.score(request).f1 == pytest.approx(2 / 3)
        # A question that does not end with the closing (no template) is kept whole.
        request = VllmShadowRequest(PROMPT, (11, 12, 20), "w5 w20 w6", 0.1, max_tokens=3)
        assert scorer.score(request).f1 == pytest.approx(2 * (2 / 3) / (1 + 2 / 3))
    finally:
        server.close()


def test_the_answers_text_is_cut_where_vllm_cuts_it():
    """vLLM checks stop strings as each token's text arrives: the one completed first ends
    the answer (ties in the request's order), though another may start earlier."""
    assert stop_cut("abcd", ["bcd", "c"]) == 2
    assert stop_cut("abcd", ["bcd", "c"], include=True) == 3
    assert stop_cut("abcd", ["cd", "bcd"]) == 2 and stop_cut("abcd", ["bcd", "cd"]) == 1
    assert stop_cut("abcd", ["x"]) is None and stop_cut("abcd", []) is None


def test_an_answer_ended_by_a_stop_string_scores_one_when_full_prefill_agrees_up_to_it():
    """vLLM's API server ends a request whose text reaches one of its `stop` strings by
    aborting it in the engine, which may have decoded more tokens by then (99 here). The
    answer the client got ends at the token that reached the stop string. Unaware of the
    stop string, the shadow teacher-forced the 99 too (full prefill's 15 there, a
    disagreement), cut full prefill's answer at the blended length and compared the
    texts with the stop string and what followed it: 0.8 on both proxies."""
    server = FullPrefillServer()
    try:
        scorer = scorer_for(server)
        stopped = VllmShadowRequest(PROMPT, (*FULL[:4], 99), "q", 0.1, max_tokens=64, stop=("w14",))
        assert (lambda s: (s.f1, s.top1))(scorer.score(stopped)) == (1.0, 1.0)
        (forced,) = server.bodies  # all four agree: no continuation
        assert forced["prompt"] == [*PROMPT, *FULL[:4]]
    finally:
        server.close()


def test_an_answer_that_differs_before_its_stop_string_scores_below_one():
    """Full prefill's own answer runs on past the blended length (as after EOS) to where
    vLLM stops it at the same stop string; both texts are compared cut before it."""
    server = FullPrefillServer()
    try:
        scorer = scorer_for(server)
        differs = VllmShadowRequest(
            PROMPT, (11, 12, 77, 14, 99), "q", 0.1, max_tokens=64, stop=("w14",)
        )
        score = scorer.score(differs)
        assert score.top1 == pytest.approx(3 / 4)  # 11, 12 and 14 agree; 99 is not scored
        # w11 w12 w13 against w11 w12 w77: neither stop string nor what follows counts.
        assert score.f1 == pytest.approx(2 / 3)
        continuation = server.bodies[-1]
        assert continuation["prompt"] == [*PROMPT, 11, 12, 13]
        assert continuation["stop"] == ["w14"] and continuation["max_tokens"] == 4 + 16 - 3
    finally:
        server.close()


def test_a_stop_string_the_request_keeps_in_its_output_is_part_of_the_answer():
    """With `include_stop_str_in_output` the client's text ends after the stop string."""
    server = FullPrefillServer()
    try:
        scorer = scorer_for(server)
        answer = (11, 77, 99)  # full prefill: 11 12 13 14 15, reaching no stop string
        kept = VllmShadowRequest(
            PROMPT, answer, "q", 0.1, max_tokens=64, stop=("w77",), include_stop=True
        )
        # w11 w77 against w11 .. w15: precision 1/2, recall 1/5.
        assert scorer.score(kept).f1 == pytest.approx(2 * (1 / 2) * (1 / 5) / (1 / 2 + 1 / 5))
        cut = VllmShadowRequest(PROMPT, answer, "q", 0.1, max_tokens=64, stop=("w77",))
        assert scorer.score(cut).f1 == pytest.approx(2 * 1 * (1 / 5) / (1 + 1 / 5))
    finally:
        server.close()


def test_shadows_go_at_the_lowest_priority_and_fall_back_to_0_when_refused(caplog):
    server = FullPrefillServer()
    try:
        scorer_for(server).score(VllmShadowRequest(PROMPT, FULL, "q", 0.1))
        assert {body["priority"] for body in server.bodies} == {SHADOW_PRIORITY}
        assert SHADOW_PRIORITY == 2**63 - 1  # vLLM's priority queue serves smaller first
    finally:
        server.close()
    server = FullPrefillServer(fcfs=True)
    try:
        scorer = scorer_for(server)
        with caplog.at_level(logging.WARNING):
            score = scorer.score(VllmShadowRequest(PROMPT, FULL[:2], "q", 0.1, True, 64))
            scorer.score(VllmShadowRequest(PROMPT, FULL, "q", 0.1))
        assert score.top1 == pytest.approx(2 / 3)  # scored all the same
        assert scorer.priority == 0
        assert "priority" not in server.bodies[-1]
        refusals = [r for r in caplog.records if "--scheduling-policy priority" in r.message]
        assert len(refusals) == 1  # said once
    finally:
        server.close()


def test_the_budget_admits_shadows_while_user_requests_run_and_counts_what_they_spend():
    server = FullPrefillServer()
    budget = ShadowBudget(0.05, burst_tokens=0)
    try:
        scorer = scorer_for(server, budget=budget)
        assert scorer.offer(REQUEST) == "queued"  # nothing waits for idle
        assert scorer.wait_idle(10)
        assert scorer.offer(REQUEST) == "over_budget"
        budget.add_user_tokens(10_000)  # repays the debt (nothing banked beyond 0)
        early = VllmShadowRequest(PROMPT, FULL[:2], "q", 0.1, stopped_at_eos=True)
        assert scorer.offer(early) == "queued" and scorer.wait_idle(10)
        assert scorer.outcomes == {"scored": 2, "over_budget": 1}
        # Each shadow: the teacher-forced request (prompt + answer + 1) when admitted, then
        # its continuation (prompt + the agreed tokens + the rest of its budget):
        # REQUEST disagrees at once, 3 + 1 + 1; `early` at its end, 3 + 3 + (2 + 16 - 3).
        continuations = (3 + 1 + 1) + (3 + 3 + 15)
        assert budget.shadow_tokens == (
            REQUEST.num_shadow_tokens + early.num_shadow_tokens + continuations
        )
    finally:
        server.close()


def test_the_idle_floor_scores_past_the_budget_and_the_sample_rate_and_counts_apart():
    server = FullPrefillServer()
    budget = ShadowBudget(0.05, burst_tokens=0, idle_samples=2, idle_seconds=3600)
    metrics = ShadowMetrics(CollectorRegistry())
    try:
        scorer = VllmShadow(
            server.url, "m", 1e-9, words, eos_token_id=EOS, budget=budget, metrics=metrics
        )
        assert scorer.offer(REQUEST) == "not_sampled"  # busy: the sample rate decides
        # Idle: the floor is open, so the sample rate does not skip it; the sample rate
        # passed it over, so it is the floor's (not charged, though the account has room).
        assert scorer.offer(REQUEST, idle=True) == "queued" and scorer.wait_idle(10)
        assert budget.num_idle == 1 and budget.shadow_tokens == 0 and budget.balance == 0
        early = VllmShadowRequest(PROMPT, FULL[:2], "q", 0.1, stopped_at_eos=True)
        # Idle again: the floor admits it (2 of 2 in the window), with its continuation.
        assert scorer.offer(early, idle=True) == "queued" and scorer.wait_idle(10)
        assert budget.num_idle == 2
        assert scorer.offer(REQUEST, idle=True) == "not_sampled"  # the floor is met
        assert scorer.offer(REQUEST) == "not_sampled"
        assert scorer.outcomes == {"scored": 2, "not_sampled": 3}
        continuation = 3 + 3 + 15  # as in the budget test above
        full = REQUEST.num_shadow_tokens + (3 + 1 + 1)
        assert budget.idle_tokens == full + early.num_shadow_tokens + continuation
        assert budget.shadow_tokens == 0 and budget.balance == 0  # the floor's charge nothing
        assert metrics.idle_requests._value.get() == 2
        assert metrics.idle_tokens._value.get() == budget.idle_tokens
        assert metrics.tokens._value.get() == budget.shadow_tokens
    finally:
        server.close()


def test_the_engine_url_comes_from_blend_json_else_the_deprecated_env(monkeypatch, caplog):
    monkeypatch.setattr(shadow_module, "_warned_env", False)
    monkeypatch.delenv(ENGINE_URL_ENV, raising=False)
    assert engine_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert engine_url(None) is None
    monkeypatch.setenv(ENGINE_URL_ENV, "http://127.0.0.1:9000")
    with caplog.at_level(logging.WARNING):
        assert engine_url(None) == "http://127.0.0.1:9000"
        assert engine_url(None) == "http://127.0.0.1:9000"
        assert engine_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    deprecations = [r for r in caplog.records if "deprecated" in r.message]
    assert len(deprecations) == 1 and "engineUrl" in deprecations[0].message


def test_the_shadow_needs_the_engine_url_and_a_sample_rate(monkeypatch):
    assert VllmShadow.create(None, "m", 1.0, str) is None
    assert VllmShadow.create("http://127.0.0.1:8000", "m", 0.0, str) is None
    made = VllmShadow.create("http://127.0.0.1:8000", "m", 0.5, str)
    assert made.url == "http://127.0.0.1:8000/v1/completions" and made.sample_rate == 0.5
    monkeypatch.setattr(shadow_module, "_warned_env", True)
    monkeypatch.setenv(ENGINE_URL_ENV, "http://127.0.0.1:8000")
    assert VllmShadow.from_env("m", 0.5, str).url == made.url
    with pytest.raises(ValueError, match="shadowSampleRate"):
        VllmShadow("http://x", "m", 1.5, str)


def _given_up_in_debt(url: str) -> None:
    """An idle floor's shadow to `url`, its budget in debt: without an answer within its
    patience it is given up (expired), not taken over."""
    in_debt = ShadowBudget(0.05, burst_tokens=0, idle_samples=2)
    in_debt.admit(1)
    floor = shadow(url, sample_rate=0.0, timeout_s=30, budget=in_debt)
    assert floor.offer(REQUEST, idle=True) == "queued" and floor.wait_idle(10)
    assert floor.outcomes == {"expired": 1}


def test_the_idle_floors_shadow_is_marked_and_given_up_past_its_patience(monkeypatch):
    bodies, release = [], threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            release.wait(10)  # the pod serves others: no answer yet
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_):
            pass

    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http_server.server_address[1]}"
    monkeypatch.setattr(shadow_module, "IDLE_PATIENCE_S", 0.3)
    try:
        # The sample rate takes nothing: only the idle floor admits, and its shadow's
        # request says so; without an answer within its patience, and with the account in
        # debt (it cannot take the shadow over), it is given up.
        _given_up_in_debt(url)
        assert bodies[-1]["kv_transfer_params"] == {
            "holeblend": {"shadow": SHADOW_MARK, "idle": True}
        }
        assert is_shadow_request(bodies[-1]["kv_transfer_params"], "holeblend", idle=True)
        # Past its patience with the account able to pay, the budget takes it over: sent
        # again unmarked (here the server still does not answer: its own timeout fails it).
        account = ShadowBudget(0.05, idle_samples=1)
        floor = shadow(url, sample_rate=0.0, timeout_s=0.5, budget=account)
        sent = len(bodies)
        assert floor.offer(REQUEST, idle=True) == "queued" and floor.wait_idle(10)
        assert floor.outcomes == {"failed": 1}
        marks = [b["kv_transfer_params"]["holeblend"] for b in bodies[sent:]]
        assert marks == [{"shadow": SHADOW_MARK, "idle": True}, {"shadow": SHADOW_MARK}]
        assert account.shadow_tokens == REQUEST.num_shadow_tokens  # charged on take-over
        # The budget's shadow: not marked idle, and its own timeout fails it, as before.
        budget = shadow(url, timeout_s=0.3)
        assert budget.offer(REQUEST) == "queued" and budget.wait_idle(10)
        assert budget.outcomes == {"failed": 1}
        assert bodies[-1]["kv_transfer_params"] == {"holeblend": {"shadow": SHADOW_MARK}}
        assert not is_shadow_request(bodies[-1]["kv_transfer_params"], "holeblend", idle=True)
    finally:
        release.set()
        http_server.shutdown()
        http_server.server_close()


def full_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A listening socket that accepts nothing, its backlog filled: a connect to it waits
    until its timeout, as to an API server too busy to accept."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    waiting = []
    for _ in range(16):
        client = socket.socket()
        client.settimeout(0.2)
        waiting.append(client)
        try:
            client.connect(listener.getsockname())
        except TimeoutError:
            return listener, waiting
    pytest.skip("this system accepts connections past a full backlog")


def test_an_idle_floors_shadow_that_cannot_connect_in_its_patience_is_given_up_or_taken_over(
    monkeypatch,
):
    """A connect that times out arrives as a URLError, not a TimeoutError: it failed the
    idle floor's shadow, where a read that timed out gave it up or had the budget take
    it over."""
    monkeypatch.setattr(shadow_module, "IDLE_PATIENCE_S", 0.3)
    listener, waiting = full_listener()
    url = "http://{}:{}".format(*listener.getsockname())
    try:
        _given_up_in_debt(url)
        account = ShadowBudget(0.05, idle_samples=1)
        floor = shadow(url, sample_rate=0.0, timeout_s=0.3, budget=account)
        assert floor.offer(REQUEST, idle=True) == "queued" and floor.wait_idle(10)
        assert floor.outcomes == {"failed": 1}  # taken over; its own timeout fails it
        assert account.shadow_tokens == REQUEST.num_shadow_tokens
    finally:
        for client in waiting:
            client.close()
        listener.close()


class Pairs:
    """The inline proxy as the sampler sees it: the calibration pairs it is given."""

    def __init__(self):
        self.pairs = []

    def add_pair(self, statistic, score):
        self.pairs.append((statistic, score.ratio, score.f1, score.top1))


def test_a_sampled_requests_greedy_replay_is_scored_on_the_replays_own_blend():
    """A sampled request's answer is not full prefill's argmax even with no blending: the
    shadow replays its prompt greedily through the connector (marked, so that it is
    blended and counted as no user request) and scores what the connector returns: the
    replay's answer, its end, its ratio and inline statistic, which calibrate the inline
    proxy in place of the sampled request's."""
    server = FullPrefillServer()
    pairs = Pairs()
    try:
        scorer = scorer_for(server, inline=pairs)
        server.replayed = {
            "answer_ids": list(FULL[:2]), "stopped_at_eos": True, "ratio": 0.2,
            "inline_statistic": 0.375,
        }  # fmt: skip
        sampled = replay_request(PROMPT, "q", 0.15, max_tokens=500, stop_token_ids=())
        assert sampled.replay and sampled.answer_ids == () and sampled.max_tokens == 64
        assert scorer.offer(sampled) == "queued" and scorer.wait_idle(10)
        assert scorer.outcomes == {"scored": 1}
        replay, forced = server.bodies[0], server.bodies[1]
        assert replay["prompt"] == list(PROMPT) and replay["max_tokens"] == 64
        assert replay["temperature"] == 0.0 and replay["priority"] == SHADOW_PRIORITY
        marks = replay["kv_transfer_params"]["holeblend"]
        assert marks == {"shadow": SHADOW_MARK, "replay": True} and "prompt_logprobs" not in replay
        assert is_replay_request(replay["kv_transfer_params"], "holeblend")
        assert is_shadow_request(replay["kv_transfer_params"], "holeblend")
        # Then as any greedy answer: the replay's two tokens agree, its early end does not.
        assert forced["prompt"] == [*PROMPT, *FULL[:2]] and forced["prompt_logprobs"] == 1
        assert not is_replay_request(forced["kv_transfer_params"], "holeblend")
        score = scorer.scores[-1]
        assert score.top1 == pytest.approx(2 / 3) and score.ratio == 0.2
        assert pairs.pairs == [(0.375, 0.2, score.f1, score.top1)]

        # The documents were evicted meanwhile: the replay blended nothing; not scored.
        server.replayed = None
        assert scorer.offer(replay_request(PROMPT, "q", 0.15, None)) == "queued"
        assert scorer.wait_idle(10)
        assert scorer.outcomes == {"scored": 1, "replay_not_blended": 1}
        assert len(pairs.pairs) == 1
        # The token limit is the request's own when smaller.
        assert replay_request(PROMPT, "q", 0.15, max_tokens=5).max_tokens == 5
    finally:
        server.close()


def test_a_replay_is_scored_up_to_the_sampled_requests_stop_string():
    """The replay goes without the stop strings: vLLM would end it at one by aborting it in
    the engine, and the connector's figures of an aborted request never reach the
    answer (it would count as `replay_not_blended`). Its answer is cut where its text
    reaches one instead, and full prefill's own answer stops there as the client's
    would."""
    server = FullPrefillServer()
    try:
        scorer = scorer_for(server)
        server.replayed = {
            "answer_ids": [*FULL[:4], 15], "stopped_at_eos": True, "ratio": 0.2,
            "inline_statistic": None,
        }  # fmt: skip
        sampled = replay_request(PROMPT, "q", 0.15, max_tokens=500, stop=("w13",))
        assert scorer.offer(sampled) == "queued" and scorer.wait_idle(10)
        assert scorer.outcomes == {"scored": 1}
        replay, forced = server.bodies
        assert "stop" not in replay
        assert forced["prompt"] == [*PROMPT, *FULL[:3]]  # its EOS came after the stop
        assert (scorer.scores[-1].f1, scorer.scores[-1].top1) == (1.0, 1.0)
    finally:
        server.close()


def test_a_replay_is_charged_for_its_own_blend_and_answer_too():
    greedy = VllmShadowRequest(PROMPT * 10, (), "q", 0.5, max_tokens=8)
    replay = replay_request(PROMPT * 10, "q", 0.5, max_tokens=8)
    # The teacher-forced request with an answer as long as the limit, plus the replay's
    # recomputed half of the prompt and its answer.
    assert replay.num_shadow_tokens == (30 + 8 + 1) + (15 + 8)
    assert greedy.num_shadow_tokens == 30 + 0 + 1


def test_shadows_reach_the_pods_own_server_with_a_proxy_in_the_environment(monkeypatch):
    """Pods behind a corporate proxy carry http_proxy, and no_proxy rarely lists the pod's
    own address: a shadow sent through the proxy never reached the engine (here: a proxy
    that is down), and the pod scored nothing."""
    server = FullPrefillServer()
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("no_proxy", "")
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's, built from the env
    try:
        score = scorer_for(server).score(
            VllmShadowRequest(PROMPT, FULL, "q", 0.1, stopped_at_eos=True)
        )
    finally:
        server.close()
    assert (score.f1, score.top1) == (1.0, 1.0)
