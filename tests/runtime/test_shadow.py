"""Shadow full prefill on the real model: the proxies agree with the engine's own full
prefill, the work is bounded and yields to serving, and the metrics carry the ratio."""

import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from holeblend_runtime.bench.quality import answer_f1, answer_words
from holeblend_runtime.shadow import ShadowMetrics, ShadowRequest, ShadowScorer

SYSTEM = "Answer the question from the documents in a few words."
DOCS = [
    " Alice Moreau was born in Lyon in 1980 and studied chemistry in Grenoble.",
    " Bob Lindqvist lives in Oslo, where he repairs old sailing boats for a living.",
    " Carol Zhang works at Zeta Corp as the head of its battery research lab.",
    " The Brakenvas Observatory was founded in 1874 by Talia Mirvok in the town of Oskpel.",
]
QUESTION = " Who founded the Brakenvas Observatory?"
ANSWER_TOKENS = 8


@pytest.fixture
def engine(new_engine):
    return new_engine(ratio=0.0)


def blended_request(engine, ratio=0.0):
    """Pass 1 caches documents 0 and 2; pass 2 blends with holes at 1 and 3."""
    engine.prefill(engine.build_prompt(SYSTEM, [DOCS[0], DOCS[2]], QUESTION), mode="hole")
    prompt = engine.build_prompt(SYSTEM, DOCS, QUESTION)
    prefill = engine.prefill(prompt, mode="hole", ratio=ratio)
    return ShadowRequest(prompt, tuple(engine.generate(prefill, ANSWER_TOKENS)), ratio)


def scorer(engine, **options):
    return ShadowScorer(engine.model, engine.tokenizer, options.pop("sample_rate", 1.0), **options)


def test_an_answer_full_prefill_gave_scores_one_on_both_proxies(engine):
    prompt = engine.build_prompt(SYSTEM, DOCS, QUESTION)
    answer = tuple(engine.generate(engine.prefill(prompt, mode="full"), ANSWER_TOKENS))
    score = scorer(engine, chunk_tokens=16).score(ShadowRequest(prompt, answer, 1.0))
    assert (score.f1, score.top1) == (1.0, 1.0)


def test_the_proxies_match_the_engines_own_full_prefill(engine):
    request = blended_request(engine)
    score = scorer(engine).score(request)
    full = engine.prefill(request.prompt, mode="full")
    expected_top1 = (
        engine.score(full, list(request.answer_ids)).argmax(dim=-1).tolist()
    )  # teacher-forced on the blended answer
    agree = [a == b for a, b in zip(expected_top1, request.answer_ids, strict=True)]
    assert score.top1 == pytest.approx(sum(agree) / len(agree))
    full_answer = engine.generate(full, len(request.answer_ids))
    question = answer_words(engine.tokenizer.decode(request.prompt.question.token_ids))
    expected_f1 = answer_f1(
        answer_words(engine.tokenizer.decode(full_answer)),
        answer_words(engine.tokenizer.decode(request.answer_ids)),
        question,
    )
    assert score.f1 == pytest.approx(expected_f1)


def test_an_answer_unrelated_to_the_prompt_scores_low(engine):
    prompt = engine.build_prompt(SYSTEM, DOCS, QUESTION)
    nonsense = tuple(engine.tokenizer.encode(" purple giraffes sing loudly at dawn today"))
    score = scorer(engine).score(ShadowRequest(prompt, nonsense, 0.05))
    assert score.top1 <= 0.3 and score.f1 <= 0.3


def test_offers_are_dropped_not_queued_when_busy_or_full(engine):
    request = blended_request(engine)
    busy = threading.Event()
    shadow = scorer(engine, is_busy=busy.is_set, slots=1)
    try:
        busy.set()
        assert shadow.offer(request) == "dropped_busy"
        busy.clear()
        outcomes = [shadow.offer(request) for _ in range(3)]
        assert outcomes[0] == "queued" and "dropped_full" in outcomes[1:]
        assert shadow.wait_idle(60)
        assert scorer(engine, sample_rate=0.0).offer(request) == "not_sampled"
    finally:
        shadow.close()


def test_the_shadow_pauses_while_the_engine_serves_and_gives_up_after_a_while(engine):
    request = blended_request(engine)
    busy = threading.Event()
    metrics = ShadowMetrics(CollectorRegistry())
    shadow = scorer(engine, is_busy=busy.is_set, metrics=metrics, max_pause_s=0.3)
    try:
        assert shadow.offer(request) == "queued"
        busy.set()  # a request arrives before the first chunk
        time.sleep(0.6)
        busy.clear()
        assert shadow.wait_idle(60)
        assert metrics.offers.labels(outcome="preempted")._value.get() >= 1
    finally:
        shadow.close()


def test_the_shadow_checks_for_waiting_requests_before_every_layer(engine):
    # A request waits for at most one layer's work, not for a whole chunk of the prompt.
    request = blended_request(engine)
    checks = []
    shadow = scorer(engine, is_busy=lambda: checks.append(1) and False)
    assert len(request.prompt.token_ids) <= shadow.chunk_tokens  # one chunk
    shadow.score(request)
    assert len(checks) >= engine.model.num_layers


def test_scores_are_observed_by_the_ratio_the_request_ran_with(engine):
    registry = CollectorRegistry()
    shadow = scorer(engine, metrics=ShadowMetrics(registry))
    try:
        assert shadow.offer(blended_request(engine, ratio=0.15)) == "queued"
        assert shadow.wait_idle(60)
    finally:
        shadow.close()
    count = registry.get_sample_value("holeblend_f1_proxy_count", {"ratio": "0.15"})
    top1_sum = registry.get_sample_value("holeblend_top1_agreement_sum", {"ratio": "0.15"})
    assert count == 1 and 0 <= top1_sum <= 1
    assert registry.get_sample_value("holeblend_shadow_requests_total", {"outcome": "scored"}) == 1


def test_a_cached_prompt_scores_as_a_fresh_prefill_and_is_prefilled_once(engine):
    """cache_prompt (the offline sweep): several answers to one prompt, one full prefill."""
    low, high = blended_request(engine, ratio=0.0), blended_request(engine, ratio=0.5)
    assert low.prompt.token_ids == high.prompt.token_ids
    fresh = [scorer(engine).score(r) for r in (low, high)]
    cached = scorer(engine, cache_prompt=True, chunk_tokens=16)
    forwarded: list[int] = []
    cached.model = _CountingModel(cached.model, forwarded)
    scores = [cached.score(low)]
    num_first = len(forwarded)
    scores.append(cached.score(high))
    assert [(s.f1, s.top1) for s in scores] == [(s.f1, s.top1) for s in fresh]
    num_prompt = len(low.prompt.token_ids)
    # The first score prefills the prompt; the second runs only answer tokens.
    assert sum(forwarded[:num_first]) >= num_prompt
    assert 0 < sum(forwarded[num_first:]) < 2 * ANSWER_TOKENS


class _CountingModel:
    """The model, counting the tokens of each forward call."""

    def __init__(self, model, counts: list[int]):
        self._model, self._counts = model, counts

    def forward(self, token_ids, *args, **kwargs):
        self._counts.append(int(token_ids.shape[0]))
        return self._model.forward(token_ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_bad_settings_are_refused_with_the_field_named(engine):
    with pytest.raises(ValueError, match="sample_rate"):
        scorer(engine, sample_rate=1.5)
    with pytest.raises(ValueError, match="chunk_tokens"):
        scorer(engine, chunk_tokens=0)
    with pytest.raises(ValueError, match="slots"):
        scorer(engine, slots=0)
