"""The connector's lookups off vLLM's scheduler thread, with a deadline: an index that
answers at once, late, slowly, never, or fails (no vLLM needed)."""

import threading
import time

import pytest

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.keys import SegmentKeyer
from holeblend_runtime.blend.reuse import ReuseMode
from holeblend_runtime.vllm_connector.planning import PENDING, AsyncReusePlanner, ReusePlanner
from holeblend_runtime.vllm_connector.settings import load_settings

SEP = 9
PROMPT = [1, 2, 3, SEP, 10, 11, 12, SEP, 20, 21, 22, SEP, 30, 31, 32, SEP, 40, 41]


class MemoryIndex:
    def __init__(self, keys=(), is_down=False):
        self.keys, self.is_down = set(keys), is_down

    def contains_many(self, keys) -> list[bool]:
        if self.is_down:
            raise ConnectionError("lookup server unreachable")
        return [key in self.keys for key in keys]


def planner(index) -> ReusePlanner:
    keyer = SegmentKeyer("model", "float32", BlendConfig(min_segment_tokens=2))
    return ReusePlanner([SEP], keyer, index)


class SlowIndex(MemoryIndex):
    """Answers after `delay_s`, or (delay None) once `release` is set."""

    def __init__(self, keys=(), delay_s=None):
        super().__init__(keys)
        self.delay_s, self.release, self.calls = delay_s, threading.Event(), 0

    def contains_many(self, keys):
        self.calls += 1
        if self.delay_s is None:
            self.release.wait(10)
        else:
            time.sleep(self.delay_s)
        return super().contains_many(keys)


def cached_keys():
    plan = planner(MemoryIndex()).plan(PROMPT)
    return [key for key in plan.keys if key is not None]


def poll_until_done(lookups, request_id="r", timeout_s=5.0):
    started, answers = time.monotonic(), []
    while time.monotonic() - started < timeout_s:
        answer = lookups.poll(request_id, PROMPT)
        answers.append(answer)
        if answer is not PENDING:
            return answer, answers
        time.sleep(0.005)
    raise AssertionError("the lookup never finished")


def test_the_first_poll_never_waits_and_a_prompt_answer_gives_the_plan():
    index = MemoryIndex(cached_keys())
    lookups = AsyncReusePlanner(planner(index), deadline_s=5.0)
    plan, answers = poll_until_done(lookups)
    assert plan == planner(index).plan(PROMPT)
    assert plan.reuse.mode is ReuseMode.PURE_HIT and not plan.is_lookup_late
    assert lookups.num_pending == 0


def test_a_poll_returns_before_a_slow_index_answers():
    index = SlowIndex(cached_keys(), delay_s=0.3)
    lookups = AsyncReusePlanner(planner(index), deadline_s=5.0)
    started = time.monotonic()
    assert lookups.poll("r", PROMPT) is PENDING
    assert time.monotonic() - started < 0.1  # vLLM's scheduler thread did not wait
    plan, answers = poll_until_done(lookups)
    assert answers[0] is PENDING and plan.num_covered_tokens > 0


def test_an_index_that_answers_after_the_deadline_plans_a_full_miss():
    index = SlowIndex(cached_keys(), delay_s=0.5)
    lookups = AsyncReusePlanner(planner(index), deadline_s=0.05)
    plan, _ = poll_until_done(lookups)
    assert plan.is_lookup_late and not plan.is_lookup_failed
    assert plan.num_covered_tokens == 0 and plan.reuse.mode is ReuseMode.FULL_MISS
    # Unknown: every cacheable segment is named, the worker's store skips what is held.
    assert plan.missing_segments == tuple(i for i, k in enumerate(plan.keys) if k is not None)
    assert lookups.num_pending == 0


def test_an_index_that_never_answers_meets_the_deadline_for_every_request():
    index = SlowIndex(cached_keys())  # blocks until released
    lookups = AsyncReusePlanner(planner(index), deadline_s=0.05)
    try:
        for request_id in ("a", "b", "c"):
            plan, _ = poll_until_done(lookups, request_id)
            assert plan.is_lookup_late
        # One lookup thread: the hung index holds it, and no more threads are started.
        assert index.calls == 1
    finally:
        index.release.set()
        lookups.shutdown()


def test_a_failing_index_plans_a_full_miss_as_before():
    lookups = AsyncReusePlanner(planner(MemoryIndex(is_down=True)), deadline_s=5.0)
    plan, _ = poll_until_done(lookups)
    assert plan.is_lookup_failed and plan.num_covered_tokens == 0


def test_a_request_gone_before_its_lookup_is_forgotten():
    index = SlowIndex(cached_keys(), delay_s=0.2)
    lookups = AsyncReusePlanner(planner(index), deadline_s=5.0)
    assert lookups.poll("gone", PROMPT) is PENDING
    lookups.forget("gone")
    assert lookups.num_pending == 0


def test_a_prompt_without_separator_is_not_planned():
    lookups = AsyncReusePlanner(planner(MemoryIndex()), deadline_s=5.0)
    started = time.monotonic()
    while (answer := lookups.poll("r", [1, 2, 3])) is PENDING:
        assert time.monotonic() - started < 5
        time.sleep(0.005)
    assert answer is None


def test_the_deadline_comes_from_the_connector_config_and_bad_values_are_refused():
    assert load_settings({}).lookup_deadline_s is None  # inline lookups by default
    assert load_settings({"lookup_deadline_ms": 40}).lookup_deadline_s == pytest.approx(0.04)
    for bad in (0, -5, "fast", True, 120_000):
        with pytest.raises(ValueError, match="lookup_deadline_ms"):
            load_settings({"lookup_deadline_ms": bad})
    with pytest.raises(ValueError, match="deadline_s"):
        AsyncReusePlanner(planner(MemoryIndex()), deadline_s=0)
