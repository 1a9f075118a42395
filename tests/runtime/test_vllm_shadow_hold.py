"""When a shadow may start on a vLLM pod: user prompts pending from their first plan until
a step computes the rest of them; shadows wait for them while the inline proxy answers,
at most a bounded time (no vLLM needed)."""

from types import SimpleNamespace

from holeblend_runtime.quality.inline_proxy import InlineProxy
from holeblend_runtime.quality.shadow import ShadowScore
from holeblend_runtime.vllm_connector.shadow_hold import PendingPrefills, ShadowHold


def step(new=(), cached=(), scheduled=None):
    """A SchedulerOutput: `new` and `cached` as (request id, tokens computed before)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached], num_computed_tokens=[c for _, c in cached]
        ),
        num_scheduled_tokens=scheduled or {},
    )


def test_a_prompt_is_pending_until_a_step_schedules_its_last_token():
    prefills = PendingPrefills()
    prefills.add("a", 500)
    prefills.add("b", 300)
    assert len(prefills) == 2
    # a: 200 reused by the connector, 256 computed (a chunk); b waits.
    prefills.step(step(new=[("a", 200)], scheduled={"a": 256}))
    assert len(prefills) == 2
    prefills.step(step(new=[("b", 0)], cached=[("a", 456)], scheduled={"a": 44, "b": 300}))
    assert len(prefills) == 0
    # Decode steps of requests no longer pending, and unknown requests, change nothing.
    prefills.add("c", 10)
    prefills.step(step(cached=[("a", 500), ("x", 3)], scheduled={"a": 1, "x": 1}))
    assert len(prefills) == 1
    prefills.forget("c")  # aborted before it ran
    assert not prefills


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_shadow_waits_for_pending_user_prompts_only_while_the_inline_proxy_answers():
    prefills, clock, signal = PendingPrefills(), Clock(), [True]
    hold = ShadowHold(prefills, lambda: signal[0], hold_s=20, clock=clock)
    assert hold.admit("s1")  # nothing pending: at once
    prefills.add("user", 400)
    assert not hold.admit("s2")
    clock.now = 5
    assert not hold.admit("s2")
    signal[0] = False  # no inline signal (e.g. a new ratio): the shadow is the only one
    assert hold.admit("s2")
    signal[0] = True
    assert not hold.admit("s3")
    prefills.step(step(new=[("user", 0)], scheduled={"user": 400}))
    assert hold.admit("s3")  # the prompt is computed: the shadow starts
    assert hold.num_held_too_long == 0


def test_a_shadow_is_never_held_longer_than_the_bound():
    prefills, clock = PendingPrefills(), Clock()
    hold = ShadowHold(prefills, lambda: True, hold_s=20, clock=clock)
    prefills.add("user", 400)
    assert not hold.admit("s")
    clock.now = 19.9
    assert not hold.admit("s")
    clock.now = 20.0
    assert hold.admit("s")
    assert hold.num_held_too_long == 1
    clock.now = 21
    assert not hold.admit("t")  # another shadow's hold starts from its own first ask
    hold.forget("t")
    clock.now = 45
    assert not hold.admit("t")  # forgotten (finished or aborted): a new first ask


def test_the_inline_proxy_answers_at_a_ratio_once_its_last_request_there_got_an_estimate():
    proxy = InlineProxy(min_pairs=3)
    assert not proxy.answers(0.15)
    assert proxy.observe(0.15, 0.4) is None
    assert not proxy.answers(0.15)
    for statistic, f1 in ((0.2, 0.9), (0.4, 0.7), (0.6, 0.5)):
        proxy.add_pair(statistic, ShadowScore(f1, f1, 0.15, 1.0))
    assert proxy.observe(0.15, 0.4) is not None
    assert proxy.answers(0.15)
    assert not proxy.answers(0.3)  # never observed there
    assert proxy.observe(0.15, float("nan")) is None  # no statistic: nothing learned
    assert proxy.answers(0.15)
