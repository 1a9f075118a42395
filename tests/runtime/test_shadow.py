"""Shadow full prefill on the real model: the proxies agree with the engine's own full
prefill, score where and whether the answer ends, the work stays within its token budget
and yields to serving a slice at a time yet progresses under sustained load, and the
metrics carry the ratio."""

import threading
import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from holeblend_runtime.quality.scores import answer_f1, answer_words
from holeblend_runtime.quality.shadow import (
    BLIND_TIME_SHARE,
    RUN_ON_TOKENS,
    SHADOW_CATCH_UP_S,
    SHADOW_TIME_SHARE,
    ShadowBudget,
    ShadowExpired,
    ShadowGate,
    ShadowMetrics,
    ShadowRequest,
    ShadowScorer,
    answer_budget,
    serving_catch_up_s,
    serving_time_share,
)

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
    question = answer_words(QUESTION)  # as written, as holeblend-bench skips it
    expected_f1 = answer_f1(
        answer_words(engine.tokenizer.decode(full_answer)),
        answer_words(engine.tokenizer.decode(request.answer_ids)),
        question,
    )
    assert score.f1 == pytest.approx(expected_f1)


def test_the_f1_skips_the_questions_words_not_the_chat_templates(engine):
    """The question segment ends with ChatML's closing, which decodes to "\nassistant\n":
    "assistant" was taken for a question word and dropped from both answers. Only the
    words of the question as written are skipped, as holeblend-bench skips them."""
    prompt = engine.build_prompt(SYSTEM, DOCS, QUESTION)
    full = engine.generate(engine.prefill(prompt, mode="full"), ANSWER_TOKENS)
    answer = (*full, *engine.tokenizer.encode(" the lab assistant"))
    request = ShadowRequest(prompt, answer, 0.1, max_tokens=len(answer))
    score = scorer(engine).score(request)
    full_answer = engine.generate(engine.prefill(prompt, mode="full"), len(answer))
    expected = answer_f1(
        answer_words(engine.tokenizer.decode(full_answer)),
        answer_words(engine.tokenizer.decode(answer)),
        answer_words(QUESTION),
    )
    assert "assistant" not in answer_words(engine.tokenizer.decode(full_answer))
    assert score.f1 == pytest.approx(expected)


def test_an_answer_unrelated_to_the_prompt_scores_low(engine):
    prompt = engine.build_prompt(SYSTEM, DOCS, QUESTION)
    nonsense = tuple(engine.tokenizer.encode(" purple giraffes sing loudly at dawn today"))
    score = scorer(engine).score(ShadowRequest(prompt, nonsense, 0.05))
    assert score.top1 <= 0.3 and score.f1 <= 0.3


def test_offers_are_dropped_not_queued_when_the_slot_is_taken_or_over_budget(engine):
    request = blended_request(engine)
    busy = threading.Event()
    busy.set()  # serving does not stop sampling: only the slot and the budget do
    shadow = scorer(engine, is_busy=busy.is_set, slots=1)
    try:
        outcomes = [shadow.offer(request) for _ in range(3)]
        assert outcomes[0] == "queued" and "dropped_full" in outcomes[1:]
        busy.clear()
        assert shadow.wait_idle(60)
        assert scorer(engine, sample_rate=0.0).offer(request) == "not_sampled"
    finally:
        shadow.close()
    budget = ShadowBudget(0.05, burst_tokens=0)  # no credit banked: a shadow's worth
    metrics = ShadowMetrics(CollectorRegistry())
    shadow = scorer(engine, budget=budget, metrics=metrics)
    try:
        budget.add_user_tokens(100)
        assert shadow.offer(request) == "queued"  # the balance was not negative
        assert shadow.wait_idle(60)
        assert shadow.offer(request) == "over_budget"  # in debt by about one shadow
        assert budget.shadow_tokens == request.num_shadow_tokens
        assert metrics.tokens._value.get() == request.num_shadow_tokens
    finally:
        shadow.close()


def test_the_budget_keeps_shadow_tokens_within_their_share_plus_a_burst():
    budget = ShadowBudget(0.05, burst_tokens=1000)
    spent = 0
    for _ in range(2000):  # user requests of 500 prompt tokens, a shadow offered after each
        budget.add_user_tokens(500)
        if budget.try_spend(520):
            spent += 520
    assert spent == budget.shadow_tokens
    assert spent <= 0.05 * budget.user_tokens + 1000 + 520
    assert spent >= 0.05 * budget.user_tokens - 520  # and it does use its share
    # Credit banks up to the burst only: a long stretch without offers buys one burst.
    idle = ShadowBudget(0.05, burst_tokens=1000)
    idle.add_user_tokens(10**7)
    assert idle.balance == 1000
    assert ShadowBudget(0.05, burst_tokens=300).try_spend(200)  # starts with the burst
    assert not ShadowBudget(0.0).try_spend(1)  # share 0: no shadow at all
    with pytest.raises(ValueError, match="shadowBudget"):
        ShadowBudget(1.5)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_idle_floors_window_forgets_admissions_while_the_engine_never_idles():
    """At saturation no offer is idle, so the floor's window is never consulted: the
    admissions it remembers must still be only those of the last `idle_seconds`, not one
    more per shadow for the pod's whole life."""
    clock = Clock()
    budget = ShadowBudget(1.0, idle_samples=2, idle_seconds=10, clock=clock)
    for _ in range(1000):
        clock.now += 1.0
        budget.add_user_tokens(1000)
        assert budget.admit(100) == "budget"
    assert len(budget._admitted) <= 10
    # The window still counts what it should: 10 admissions in the last 10 s, floor shut.
    assert not budget.floor_open()
    clock.now += 10.0
    assert budget.floor_open()


def test_the_idle_floor_admits_past_the_budget_only_while_idle_and_within_its_window():
    clock = Clock()
    budget = ShadowBudget(0.05, burst_tokens=0, idle_samples=2, idle_seconds=60, clock=clock)
    assert budget.admit(500) == "budget"  # balance 0: admitted, now in debt
    assert budget.admit(500) is None  # busy: the account alone decides
    clock.now = 10.0
    assert budget.admit(500, idle=True) == "idle"  # 1 admitted in the window, floor 2
    assert budget.admit(500, idle=True) is None  # 2 in the window: the floor is met
    assert not budget.floor_open()
    # Idle shadows are counted apart and never charged to the account.
    assert (budget.balance, budget.shadow_tokens, budget.idle_tokens) == (-500, 500, 500)
    budget.charge(40, idle=True)
    budget.charge(10)
    assert (budget.balance, budget.shadow_tokens, budget.idle_tokens) == (-510, 510, 540)
    assert budget.num_idle == 1
    clock.now = 59.9
    assert budget.admit(500, idle=True) is None  # both admissions still in the window
    clock.now = 60.0  # the first admission (t=0) left the window: one place free
    assert budget.floor_open() and budget.admit(500, idle=True) == "idle"
    assert budget.admit(500, idle=True) is None
    clock.now = 200.0  # a fresh window: the floor's whole count again, never more
    assert [budget.admit(1, idle=True) for _ in range(3)] == ["idle", "idle", None]
    # Users repay the account's debt, and the budget admits as before.
    budget.add_user_tokens(20_000)
    assert budget.admit(500) == "budget"
    # A request the sample rate passed over is the floor's alone: never charged, even
    # where the account has room (here a fresh one).
    fresh = ShadowBudget(0.05, burst_tokens=1000, idle_samples=1, idle_seconds=60, clock=clock)
    assert fresh.admit(500, idle=True, sampled=False) == "idle"
    assert (fresh.balance, fresh.shadow_tokens, fresh.idle_tokens) == (1000, 0, 500)
    assert fresh.admit(500, idle=True, sampled=False) is None  # the floor is met
    assert fresh.admit(500, sampled=False) is None  # busy: nothing admits it
    assert fresh.admit(500, idle=True) == "budget"  # sampled: the account, with room
    # No floor (the default), or no shadow at all (share 0): idle changes nothing.
    assert ShadowBudget(0.05, burst_tokens=0).admit(1) == "budget"
    assert ShadowBudget(0.05, burst_tokens=0, clock=clock).admit(1, idle=True) == "budget"
    none = ShadowBudget(0.05, burst_tokens=0, clock=clock)
    none.admit(1)
    assert none.admit(1, idle=True) is None
    assert ShadowBudget(0.0, idle_samples=5).admit(1, idle=True) is None
    with pytest.raises(ValueError, match="shadowIdleSamples"):
        ShadowBudget(0.05, idle_samples=-1)
    with pytest.raises(ValueError, match="shadowIdleSeconds"):
        ShadowBudget(0.05, idle_seconds=0)


class RecordingGate(ShadowGate):
    """The gate, recording each unit of shadow work (start, end) as the shadow runs it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.units: list[list[float]] = []

    def enter(self):
        if self.units and len(self.units[-1]) == 1:
            self.units[-1].append(time.monotonic())
        super().enter()
        self.units.append([time.monotonic()])

    def leave(self):
        if self.units and len(self.units[-1]) == 1:
            self.units[-1].append(time.monotonic())
        super().leave()


def run_engine_steps(
    gate: ShadowGate, stop: threading.Event, step_s: float
) -> list[tuple[float, float]]:
    """A scheduler that is never idle: before each of its steps it passes the gate, as
    holeblend-serve's compute thread does; when each step's wait began and ended."""
    waits = []
    while not stop.is_set():
        started = time.monotonic()
        gate.between_steps()
        waits.append((started, time.monotonic()))
        time.sleep(step_s)  # the step's own work
    return waits


def score_beside(shadow, request, serve: Callable[[threading.Event], object]) -> None:
    """Offer `request` to `shadow` while `serve(stop)` plays the engine on another thread;
    returns once the shadow is done (fails if it made no progress), the shadow closed."""
    stop = threading.Event()
    serving = threading.Thread(target=serve, args=(stop,), daemon=True)
    serving.start()
    try:
        assert shadow.offer(request) == "queued"
        assert shadow.wait_idle(120), "the shadow made no progress beside the engine"
    finally:
        stop.set()
        serving.join()
        shadow.close()


def test_under_sustained_load_the_shadow_progresses_and_delays_a_step_by_a_slice_at_most(
    engine,
):
    request = blended_request(engine)
    # Busy from the start: the budget's shadow waits out its patience for idle time,
    # then takes its time share.
    gate = RecordingGate(lambda: True, cooperative=True, time_share=0.5, idle_patience_s=0.2)
    shadow = scorer(engine, gate=gate, chunk_tokens=64)
    waits = []
    score_beside(shadow, request, lambda stop: waits.extend(run_engine_steps(gate, stop, 0.002)))
    assert shadow.outcomes == {"scored": 1}
    assert gate.num_granted == gate.num_units >= engine.model.num_layers
    # While a step waits, the shadow's units started in it start within the catch-up
    # slice, and the wait ends within the slice plus the unit that crosses it.
    longest_unit = max(end - start for start, end in gate.units)
    for began, ended in waits:
        inside = [start for start, _ in gate.units if began <= start <= ended]
        if inside:
            assert inside[-1] - began <= gate.max_catch_up_s + 0.25
    assert max(ended - began for began, ended in waits) <= (
        gate.max_catch_up_s + longest_unit + 0.25
    )
    granted = sum(end - start for start, end in gate.units)
    elapsed = gate.units[-1][1] - gate.units[0][0]
    # The time share holds (the account starts with at most one slice in it).
    assert granted <= 0.5 * elapsed + gate.max_catch_up_s + longest_unit


def _share_beside_long_steps(max_catch_up_s: float) -> tuple[float, list[float]]:
    """A shadow of 5 ms units beside an engine of 100 ms steps at a 20 % time share, for
    about 1.5 s: the shadow's share of the time and each step's wait."""
    gate = ShadowGate(lambda: True, cooperative=True, time_share=0.2, max_catch_up_s=max_catch_up_s)
    stop, units = threading.Event(), []

    def shadow_units():
        while not stop.is_set():
            gate.enter()
            started = time.monotonic()
            time.sleep(0.005)
            units.append(time.monotonic() - started)
        gate.leave()

    worker = threading.Thread(target=shadow_units, daemon=True)
    worker.start()
    began = time.monotonic()
    waits = []
    while time.monotonic() - began < 1.5:
        waits.append(-time.monotonic())
        gate.between_steps()
        waits[-1] += time.monotonic()
        time.sleep(0.1)  # a long step: a prefill
    elapsed = time.monotonic() - began
    stop.set()
    gate.between_steps()  # let the last unit finish
    worker.join(2)
    return sum(units) / elapsed, waits


def test_between_long_steps_the_shadow_catches_up_its_time_share():
    """One unit per step left most of the share unused where the engine's steps are long
    (prefills at saturation); the catch-up slice takes what each step earned."""
    share, waits = _share_beside_long_steps(max_catch_up_s=0.05)
    # Each 100 ms step earns 25 ms at a 20 % share: about five 5 ms units per wait.
    assert 0.1 <= share <= 0.2 + 0.05
    assert max(waits) <= 0.05 + 0.03  # the slice, plus the unit crossing it (and noise)
    one_unit, _ = _share_beside_long_steps(max_catch_up_s=0.0)  # one unit per step
    assert one_unit < 0.08 and one_unit < share / 2


def test_the_time_share_account_on_a_clock():
    now = [0.0]
    busy = threading.Event()
    gate = ShadowGate(busy.is_set, cooperative=True, time_share=0.1, clock=lambda: now[0])
    for _ in range(3):  # three idle units of 1 s each
        gate.enter()
        now[0] += 1.0
    gate.leave()
    busy.set()
    # They owe the last unit's second only: 9 s at a 10 % share (three would owe 27 s).
    now[0] += 8.9
    assert not gate._allowed()
    now[0] += 0.2
    assert gate._allowed()
    # A long serving stretch earns at most the catch-up slice.
    now[0] += 100.0
    assert gate._allowed() and gate._credit == pytest.approx(gate.max_catch_up_s)


def test_bad_catch_up_is_refused():
    with pytest.raises(ValueError, match="max_catch_up_s"):
        ShadowGate(lambda: True, max_catch_up_s=-0.1)


def test_under_paced_load_a_budget_shadow_runs_in_idle_time_only(engine):
    """Requests that leave the engine idle between them: the budget's shadow takes no
    serving time (a time share of 1 would grant it every unit it waits for)."""
    request = blended_request(engine)
    busy = threading.Event()
    gate = RecordingGate(busy.is_set, cooperative=True, time_share=1.0, idle_patience_s=30)
    shadow = scorer(engine, gate=gate, chunk_tokens=64)

    def paced_engine(stop: threading.Event) -> None:
        while not stop.is_set():
            busy.set()  # a request is served for 50 ms, its steps passing the gate
            until = time.monotonic() + 0.05
            while time.monotonic() < until:
                gate.between_steps()
                time.sleep(0.002)
            busy.clear()
            time.sleep(0.05)  # then the engine is idle until the next one

    score_beside(shadow, request, paced_engine)
    assert shadow.outcomes == {"scored": 1}
    assert gate.num_units >= engine.model.num_layers and gate.num_granted == 0


def test_a_unit_running_when_a_request_arrives_is_the_only_one_it_waits_for():
    busy = threading.Event()
    gate = ShadowGate(busy.is_set, cooperative=True, time_share=0.1)
    gate.enter()  # the engine was idle: a unit runs
    busy.set()  # a request arrives

    def finish_unit():
        time.sleep(0.1)
        gate.enter()  # the unit ends; the next one waits (engine busy, paced)

    worker = threading.Thread(target=finish_unit, daemon=True)
    worker.start()
    started = time.monotonic()
    gate.between_steps()  # waits for the running unit only
    waited = time.monotonic() - started
    assert 0.05 <= waited < 0.6
    started = time.monotonic()
    gate.between_steps()  # pacing: the next unit only after ~0.9 s (share 0.1)
    assert time.monotonic() - started < 0.05 and worker.is_alive()
    busy.clear()  # idle again: the shadow runs on at once
    worker.join(2)
    assert not worker.is_alive()
    gate.leave()


def test_an_idle_only_unit_waits_for_idle_and_is_never_granted_while_the_engine_serves():
    busy = threading.Event()
    gate = ShadowGate(busy.is_set, cooperative=True, time_share=1.0, idle_patience_s=30)
    gate.begin(idle_only=True)
    gate.enter()  # idle: the first unit runs at once
    busy.set()  # a request arrives while it runs
    entered = threading.Event()

    def next_unit():
        time.sleep(0.05)
        gate.enter()  # the unit ends; the next one waits for the engine to be idle
        entered.set()

    worker = threading.Thread(target=next_unit, daemon=True)
    worker.start()
    started = time.monotonic()
    gate.between_steps()  # the running unit is finished first (as for any shadow)
    assert time.monotonic() - started < 0.6
    # A time share of 1 would grant the next unit at once; idle-only gets none.
    for _ in range(20):
        started = time.monotonic()
        gate.between_steps()
        assert time.monotonic() - started < 0.05
        time.sleep(0.01)
    assert not entered.is_set() and gate.num_granted == 0
    busy.clear()
    assert entered.wait(2)  # idle again: the shadow goes on
    gate.leave()
    assert not gate.idle_only  # the next shadow starts as a budget one
    gate.enter()  # ... and a budget shadow is paced, not held, while the engine serves
    busy.set()
    worker = threading.Thread(target=gate.enter, daemon=True)
    worker.start()
    time.sleep(0.05)
    gate.between_steps()  # grants the waiting unit (share 1: no pause)
    worker.join(2)
    assert not worker.is_alive() and gate.num_granted == 1
    gate.leave()


def test_an_idle_only_shadow_under_sustained_load_is_taken_over_or_expires(engine):
    request = blended_request(engine)
    tokens = request.num_shadow_tokens
    busy = threading.Event()
    gate = ShadowGate(busy.is_set, time_share=1.0, idle_patience_s=0.3)
    budget = ShadowBudget(0.05, burst_tokens=0, idle_samples=5, idle_seconds=60)
    budget.admit(tokens)  # the account in debt: it cannot take a shadow over
    metrics = ShadowMetrics(CollectorRegistry())
    # The sample rate takes nothing: every shadow here is the idle floor's.
    shadow = scorer(engine, sample_rate=0.0, gate=gate, budget=budget, metrics=metrics)
    try:
        assert shadow.offer(request, idle=True) == "queued"
        busy.set()  # sustained load from now on
        started = time.monotonic()
        assert shadow.wait_idle(30), "the floor's shadow held its slot under load"
        assert 0.3 <= time.monotonic() - started < 10
        assert shadow.outcomes == {"expired": 1} and gate.num_granted == 0
        assert budget.idle_tokens == tokens and budget.shadow_tokens == tokens
        # Users repaid the debt: the next floor shadow caught by load goes on as the
        # account's, charged, paced as any shadow (units granted while the engine serves).
        budget.add_user_tokens(10 * tokens / 0.05)
        assert shadow.offer(request, idle=True) == "queued"
        assert shadow.wait_idle(120), "the taken-over shadow made no progress"
        assert shadow.outcomes == {"expired": 1, "scored": 1} and gate.num_granted > 0
        # (A continuation past the blended answer is charged as it runs: >=.)
        assert budget.idle_tokens == tokens and budget.shadow_tokens >= 2 * tokens
        assert metrics.taken_over._value.get() == 1
        assert metrics.tokens._value.get() >= tokens
        # And one the engine gives idle time to is scored as the floor's alone.
        busy.clear()
        granted = gate.num_granted
        assert shadow.offer(request, idle=True) == "queued" and shadow.wait_idle(60)
        assert shadow.outcomes["scored"] == 2 and gate.num_granted == granted
        assert budget.idle_tokens >= 2 * tokens and metrics.taken_over._value.get() == 1
    finally:
        shadow.close()
    with pytest.raises(ValueError, match="idle_patience_s"):
        ShadowGate(busy.is_set, idle_patience_s=0)


def test_the_shadow_checks_for_waiting_requests_before_every_layer(engine):
    # A request waits for at most one layer's work, not for a whole chunk of the prompt.
    request = blended_request(engine)
    checks = []
    shadow = scorer(engine, is_busy=lambda: checks.append(1) and False)
    assert len(request.prompt.token_ids) <= shadow.chunk_tokens  # one chunk
    shadow.score(request)
    assert len(checks) >= engine.model.num_layers


def test_an_answer_full_prefill_gave_that_ended_at_eos_scores_one(engine):
    prompt = engine.build_prompt(SYSTEM, DOCS, QUESTION)
    answer = tuple(engine.generate(engine.prefill(prompt, mode="full"), 64))
    assert len(answer) < 64, "full prefill's answer should end with EOS for this test"
    score = scorer(engine).score(ShadowRequest(prompt, answer, 1.0, stopped_at_eos=True))
    assert (score.f1, score.top1) == (1.0, 1.0)


def test_an_answer_that_stops_early_or_runs_on_scores_below_one(engine):
    """The blended answer ended with EOS before full prefill would have (or after): the
    end position and the answer length are scored, so neither passes as 1.0."""
    prompt = engine.build_prompt(SYSTEM, DOCS, QUESTION)
    full = tuple(engine.generate(engine.prefill(prompt, mode="full"), 64))
    words = engine.tokenizer.decode(full).split()
    assert len(words) >= 3 and len(full) < 64
    cut = len(engine.tokenizer.encode(" " + words[0]))  # about one word, then EOS
    early = ShadowRequest(prompt, full[:cut], 0.1, stopped_at_eos=True, max_tokens=64)
    score = scorer(engine).score(early)
    assert score.top1 < 1.0 and score.f1 < 1.0
    # The same prefix cut by the token limit is not an early stop: it agrees.
    limited = ShadowRequest(prompt, full[:cut], 0.1, stopped_at_eos=False, max_tokens=cut)
    assert (lambda s: (s.f1, s.top1))(scorer(engine).score(limited)) == (1.0, 1.0)
    # Running on where full prefill stops (its EOS position) loses too.
    extra = tuple(engine.tokenizer.encode(" and more words follow here"))
    run_on = ShadowRequest(prompt, full + extra, 0.1, stopped_at_eos=True, max_tokens=64)
    score = scorer(engine).score(run_on)
    assert score.top1 < 1.0 and score.f1 < 1.0


def _stop_in_the_middle(engine, answer) -> tuple[str, int]:
    """A stop sequence from the middle of the answer's text, and how many of its tokens
    the text needs to reach it."""
    text = engine.tokenizer.decode(answer)
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    reached = next(n for n in range(1, len(answer)) if stop in engine.tokenizer.decode(answer[:n]))
    return stop, reached


def test_an_answer_ended_at_a_stop_sequence_scores_one_when_full_prefill_agrees_up_to_it(engine):
    """The answer ends before its stop sequence (OpenAI's `stop`), so full prefill, which
    would go on past it, is cut there too; tokens decoded after the stop sequence (before
    the thread saw it was reached) are not part of the answer the client got."""
    prompt = engine.build_prompt(SYSTEM, DOCS, QUESTION)
    full = tuple(engine.generate(engine.prefill(prompt, mode="full"), 64))
    stop, reached = _stop_in_the_middle(engine, full)
    assert reached + 4 < len(full), "full prefill should go on past the stop sequence"
    late = tuple(engine.tokenizer.encode(" purple giraffes"))
    for answer in (full[:reached], full[:reached] + late):
        request = ShadowRequest(prompt, answer, 0.1, max_tokens=64, stop=(stop,))
        score = scorer(engine).score(request)
        assert (score.f1, score.top1) == (1.0, 1.0), engine.tokenizer.decode(answer)


def test_an_answer_that_differs_before_its_stop_sequence_scores_below_one(engine):
    """Full prefill's own answer then runs on to where its text reaches the stop sequence
    (as after EOS), and both answers are compared without it."""
    prompt = engine.build_prompt(SYSTEM, DOCS, QUESTION)
    full = tuple(engine.generate(engine.prefill(prompt, mode="full"), 64))
    stop, reached = _stop_in_the_middle(engine, full)
    answer = (*full[:2], *engine.tokenizer.encode(" purple giraffes sing"))
    answer_text = engine.tokenizer.decode(answer)
    answer += tuple(engine.tokenizer.encode(stop))
    assert stop not in answer_text and reached <= len(answer) + RUN_ON_TOKENS
    request = ShadowRequest(prompt, answer, 0.1, max_tokens=64, stop=(stop,))
    score = scorer(engine).score(request)
    assert score.top1 < 1.0 and score.f1 < 1.0
    full_text = engine.tokenizer.decode(full)
    question = answer_words(QUESTION)
    expected = answer_f1(
        answer_words(full_text[: full_text.index(stop)]), answer_words(answer_text), question
    )
    assert score.f1 == pytest.approx(expected)


def test_full_prefills_own_answer_may_run_past_the_blended_length_only_after_eos():
    assert answer_budget(5, stopped_at_eos=False, max_tokens=None) == 5
    assert answer_budget(5, stopped_at_eos=False, max_tokens=100) == 5
    assert answer_budget(5, stopped_at_eos=True, max_tokens=None) == 5 + RUN_ON_TOKENS
    assert answer_budget(5, stopped_at_eos=True, max_tokens=9) == 9


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


def _units_beside_blips(on_patience) -> tuple[RecordingGate, list[str]]:
    """An idle-only shadow of 10 ms units beside an engine that serves 150 ms, then is
    idle for 2 ms (a closed loop of clients), for 1.5 s; 0.3 s of patience, 50 % share."""
    busy = threading.Event()
    busy.set()
    gate = RecordingGate(busy.is_set, time_share=0.5, idle_patience_s=0.3)
    stop, ended = threading.Event(), []

    def shadow_units():
        gate.begin(idle_only=True, on_patience=on_patience)
        try:
            while not stop.is_set():
                gate.enter()
                time.sleep(0.01)
            ended.append("stopped")
        except ShadowExpired:
            ended.append("expired")
        finally:
            gate.leave()

    worker = threading.Thread(target=shadow_units, daemon=True)
    worker.start()
    until = time.monotonic() + 1.5
    while time.monotonic() < until and not ended:
        time.sleep(0.15)
        busy.clear()
        time.sleep(0.002)
        busy.set()
    stop.set()
    busy.clear()
    worker.join(2)
    return gate, ended


def test_an_idle_only_shadow_that_idle_gaps_starve_goes_on_or_expires():
    """Idle only in brief gaps between requests: no wait lasts a whole patience, yet the
    gaps give the shadow a unit each, far below its share; past its patience it goes on
    as any shadow (a budget one) or gives its slot up (a floor one)."""
    gate, ended = _units_beside_blips(lambda: True)
    assert ended == ["stopped"]
    assert gate.num_granted >= 10  # units beside the serving engine once patience ran out
    assert gate.num_units > 25  # one unit per gap alone: about 10 in 1.5 s
    gate, ended = _units_beside_blips(lambda: False)
    assert ended == ["expired"] and gate.num_granted == 0


def test_each_unit_is_reported_with_its_duration_and_the_engines_state():
    now, seen = [0.0], []
    busy = threading.Event()
    gate = ShadowGate(
        busy.is_set, time_share=1.0, clock=lambda: now[0],
        on_unit=lambda seconds, serving: seen.append((seconds, serving)),
    )  # fmt: skip
    gate.enter()  # idle
    now[0] += 0.25
    busy.set()
    gate.enter()  # the first ends; the next is paced beside the serving engine
    now[0] += 0.5
    gate.leave()
    assert seen == [(0.25, False), (0.5, True)]
    metrics = ShadowMetrics(CollectorRegistry())
    for seconds, serving in seen:
        metrics.observe_unit(seconds, serving)
    assert metrics.unit_seconds.labels(engine_state="serving")._value.get() == 0.5
    assert metrics.units.labels(engine_state="idle")._value.get() == 1


def test_the_shadow_takes_its_budget_of_a_serving_engines_time_at_most_a_tenth():
    """The token budget is also the time share while the engine serves (a shadow's full
    prefill costs several times a blend per token), capped at SHADOW_TIME_SHARE."""
    assert serving_time_share(0.05) == 0.05
    assert serving_time_share(0.5) == SHADOW_TIME_SHARE == 0.1
    for bad in (0.0, -0.1, 1.5):
        for blind in (False, True):
            with pytest.raises(ValueError, match="shadowBudget"):
                serving_time_share(bad, blind=blind)


def test_while_the_inline_proxy_is_blind_the_share_is_four_times_the_budget_at_most_a_fifth():
    assert serving_time_share(0.05, blind=True) == pytest.approx(0.2) == BLIND_TIME_SHARE
    assert serving_time_share(0.01, blind=True) == pytest.approx(0.04)
    assert serving_time_share(1.0, blind=True) == BLIND_TIME_SHARE
    for budget in (0.01, 0.05, 0.5):
        assert serving_time_share(budget, blind=True) > serving_time_share(budget)


def test_a_new_time_share_paces_the_units_from_then_on():
    now = [0.0]
    gate = ShadowGate(lambda: True, time_share=0.1, clock=lambda: now[0])
    gate.enter()  # serving: the account (0) allows one unit
    now[0] += 1.0
    gate.leave()  # it owes 1 s: 9 s at a 10 % share
    now[0] += 1.0
    assert not gate._allowed()
    gate.set_time_share(0.5)  # from now on 1 s per second (the 1 s before: 0.11 s)
    now[0] += 0.8
    assert not gate._allowed()
    now[0] += 0.2
    assert gate._allowed()
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="time_share"):
            gate.set_time_share(bad)
    with pytest.raises(ValueError, match="max_catch_up_s"):
        gate.set_time_share(0.5, -1.0)


def test_the_catch_up_slice_is_granted_only_while_the_inline_proxy_is_blind():
    assert serving_catch_up_s(blind=True) == SHADOW_CATCH_UP_S > 0
    assert serving_catch_up_s(blind=False) == 0.0
    now = [0.0]
    gate = ShadowGate(lambda: True, time_share=0.2, clock=lambda: now[0])
    now[0] += 10.0  # a long serving stretch earns the slice
    assert gate._allowed() and gate._credit == pytest.approx(SHADOW_CATCH_UP_S)
    gate.set_time_share(0.05, serving_catch_up_s(blind=False))
    assert gate._credit == 0.0 and gate.max_catch_up_s == 0.0  # what it had is dropped
    now[0] += 10.0
    assert gate._allowed() and gate._credit == 0.0  # one unit at a time from now on
    gate.set_time_share(0.2, serving_catch_up_s(blind=True))  # blind again
    now[0] += 10.0
    assert gate._allowed() and gate._credit == pytest.approx(SHADOW_CATCH_UP_S)


def _enter_in_thread(gate: ShadowGate) -> tuple[threading.Thread, list]:
    ended: list = []

    def run():
        try:
            gate.enter()
            ended.append("entered")
        except ShadowExpired:
            ended.append("expired")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, ended


def test_a_shadow_right_after_one_that_went_on_under_load_starts_with_its_patience_spent():
    now, calls = [0.0], []
    busy = threading.Event()
    busy.set()
    gate = ShadowGate(busy.is_set, time_share=1.0, idle_patience_s=10, clock=lambda: now[0])

    def goes_on():
        calls.append(now[0])
        return True

    # The first waits its patience out (10 s of sustained load), then goes on.
    gate.begin(idle_only=True, on_patience=goes_on)
    now[0] = 10.5
    gate.enter()
    assert calls == [10.5] and not gate.idle_only
    now[0] = 11.0
    gate.leave()
    # The next begins 4 s later under the same load: it goes on at its first unit.
    now[0] = 15.0
    gate.begin(idle_only=True, on_patience=goes_on)
    gate.enter()
    assert calls == [10.5, 15.0] and gate.num_granted == 2
    now[0] = 16.0
    gate.leave()
    # One that begins more than the patience after: it waits for idle time again.
    now[0] = 30.0
    gate.begin(idle_only=True, on_patience=goes_on)
    thread, ended = _enter_in_thread(gate)
    thread.join(0.2)
    assert ended == [] and calls == [10.5, 15.0]
    busy.clear()  # idle: the unit runs as an idle one
    thread.join(2)
    assert ended == ["entered"] and gate.num_granted == 2
    gate.leave()
    # A floor shadow the budget does not take over, right after one that went on, gives
    # its slot up at once; it passes nothing on.
    gate.begin(idle_only=True, on_patience=goes_on)
    busy.set()
    now[0] = 45.0  # 15 s of sustained load: patience out, it goes on
    gate.enter()
    gate.leave()
    gate.begin(idle_only=True, on_patience=lambda: False)
    with pytest.raises(ShadowExpired, match="sustained load"):
        gate.enter()
    gate.leave()
    gate.begin(idle_only=True, on_patience=goes_on)
    thread, ended = _enter_in_thread(gate)
    thread.join(0.2)
    assert ended == []  # waiting for idle time again
    busy.clear()
    thread.join(2)
    gate.leave()
