"""Shadow requests in the installed vLLM's real scheduler, driven step by step with a fake
model output. vLLM's own `Scheduler` first: at the lowest priority (the operator renders
`--scheduling-policy priority`) a waiting shadow goes after waiting user requests, but a
running shadow's chunked prefill takes each step's whole token budget until it ends;
`--long-prefill-token-threshold` bounds it to one chunk of each step a user request is in,
at the price of chunking user prompts too. Then the operator's `ShadowYieldingScheduler`:
a shadow sits out every step a user request waits or prefills in, prefills at most one
small chunk per step beside decoding user requests and alone (a user prompt that arrives
while a shadow runs on an idle engine waits for one chunk), and is preempted first when a user request needs its KV blocks or its seat; without shadows the steps are
vLLM's own."""

from __future__ import annotations

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from holeblend_devtools.hf_export import export_smollm2
from holeblend_runtime.vllm_connector import metrics
from holeblend_runtime.vllm_connector.scheduler import (
    AsyncShadowYieldingScheduler,
    ShadowYieldingScheduler,
)
from holeblend_runtime.vllm_connector.shadow import SHADOW_MARK, SHADOW_PRIORITY

BUDGET = 128  # --max-num-batched-tokens
CHUNK = 16  # shadow_chunk_tokens
THRESHOLD = 32  # --long-prefill-token-threshold
BLOCK = 16
SHADOW_PROMPT, USER_PROMPT, USER_TOKENS = 1000, 100, 4


def scheduler(
    cls=ShadowYieldingScheduler,
    *,
    num_blocks: int = 400,
    asynchronous: bool = False,
    policy: str = "priority",
    threshold: int = 0,
    max_seqs: int = 8,
    adaptive: bool = False,
):
    model = ModelConfig(
        model=str(export_smollm2()), dtype="float32", seed=0, skip_tokenizer_init=True,
        max_model_len=2048,
    )  # fmt: skip
    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_seqs, max_num_batched_tokens=BUDGET, max_model_len=2048,
            enable_chunked_prefill=True, policy=policy, is_encoder_decoder=False,
            async_scheduling=asynchronous, long_prefill_token_threshold=threshold,
        ),
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False),
    )  # fmt: skip
    config.scheduler_config.async_scheduling = asynchronous  # the platform's last word
    if adaptive:  # --long-prefill-token-threshold-adaptive (vLLM 0.32; 0.23 has no such flag)
        config.scheduler_config.long_prefill_token_threshold_adaptive = True
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    engine = cls(
        vllm_config=config, kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config), block_size=BLOCK,
    )  # fmt: skip
    if isinstance(engine, ShadowYieldingScheduler):
        engine.shadow_chunk_tokens = CHUNK
    return engine


def request(
    request_id: str, num_prompt: int, *, shadow: bool = False, idle: bool = False
) -> Request:
    marks = {"shadow": SHADOW_MARK, "idle": True} if idle else {"shadow": SHADOW_MARK}
    extra = {"kv_transfer_params": {"holeblend": marks}} if shadow or idle else None
    params = SamplingParams(max_tokens=USER_TOKENS, temperature=0.0, extra_args=extra)
    priority = SHADOW_PRIORITY if shadow else 0
    return Request(request_id, list(range(10, 10 + num_prompt)), params, None, priority=priority)


def step(engine: Scheduler) -> dict[str, int]:
    """One scheduler step and a model output for it: the tokens each request got."""
    out = engine.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for request_id in ids:
        state = engine.requests[request_id]
        prefilled = state.num_computed_tokens + out.num_scheduled_tokens[request_id]
        sampled.append([5] if prefilled >= state.num_prompt_tokens else [])
    output = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    engine.update_from_output(out, output)
    return dict(out.num_scheduled_tokens)


def user_arrives_during_a_shadow(engine: Scheduler) -> list[dict[str, int]]:
    engine.add_request(request("shadow", SHADOW_PROMPT, shadow=True))
    # Alone in vLLM's the shadow takes the step (vLLM 0.32), or its threshold's share of it
    # (0.23 cuts even a lone request at a set `long_prefill_token_threshold`).
    first = step(engine)
    threshold = engine.scheduler_config.long_prefill_token_threshold
    assert list(first) == ["shadow"] and first["shadow"] >= min(BUDGET, threshold or BUDGET)
    engine.add_request(request("user", USER_PROMPT))
    return [step(engine) for _ in range(6)]


def test_vllms_threshold_bounds_a_running_shadow_to_a_chunk_of_a_user_step():
    steps = user_arrives_during_a_shadow(scheduler(Scheduler, threshold=THRESHOLD))
    # The user request is served from the first step after it arrives, in every step
    # until its prefill is done (in chunks too), and beside it the shadow takes at most
    # one chunk.
    prefilled = 0
    for tokens in steps:
        assert "user" in tokens and tokens["user"] <= THRESHOLD
        assert tokens.get("shadow", 0) <= THRESHOLD
        prefilled += tokens["user"]
        if prefilled >= USER_PROMPT:
            break
    assert prefilled >= USER_PROMPT
    assert all(tokens.get("shadow", 0) > 0 for tokens in steps)  # and it still progresses


def test_in_vllms_scheduler_alone_a_running_shadow_starves_the_user_request():
    steps = user_arrives_during_a_shadow(scheduler(Scheduler))
    assert steps[0] == {"shadow": BUDGET}  # why the operator renders its scheduler class


@pytest.mark.parametrize("policy, first", [("priority", "user"), ("fcfs", "shadow")])
def test_a_waiting_shadow_goes_after_a_waiting_user_request_under_the_priority_policy(
    policy, first
):
    engine = scheduler(Scheduler, policy=policy, max_seqs=1)
    engine.add_request(request("shadow", 64, shadow=True))  # arrived first
    engine.add_request(request("user", 64))
    assert list(step(engine)) == [first]


def test_a_shadow_sits_out_a_user_prefill_then_takes_small_chunks_beside_its_decode():
    engine = scheduler()
    engine.add_request(request("shadow", SHADOW_PROMPT, shadow=True))
    assert step(engine) == {"shadow": CHUNK}  # alone: one chunk, the step's budget capped
    assert engine.shadow_steps["alone"] == 1
    engine.add_request(request("user", USER_PROMPT))
    steps = [step(engine) for _ in range(8)]
    # The user prompt is served from the next step, whole (not chunked on the shadow's
    # account), and the shadow gets nothing until it is done.
    assert steps[0] == {"user": USER_PROMPT}
    assert engine.shadow_steps["paused"] == 1
    # Then the user request decodes one token a step and the shadow prefills one chunk
    # beside it; once the user request finished, the shadow runs alone, a chunk a step.
    decoding = steps[1:USER_TOKENS]
    assert decoding == [{"user": 1, "shadow": CHUNK}] * (USER_TOKENS - 1)
    assert engine.requests.get("user") is None  # finished after USER_TOKENS tokens
    assert steps[USER_TOKENS:] == [{"shadow": CHUNK}] * (8 - USER_TOKENS)
    assert engine.shadow_steps["chunked"] == USER_TOKENS - 1
    assert engine.shadow_steps["alone"] == 1 + 8 - USER_TOKENS
    # It kept its progress while paused: nothing was recomputed.
    shadow = engine.requests["shadow"]
    assert shadow.num_preemptions == 0
    assert shadow.num_computed_tokens == sum(s.get("shadow", 0) for s in steps) + CHUNK


def test_a_user_request_arriving_while_a_shadow_runs_alone_waits_one_chunk():
    # The idle floor's case: the shadow started on an idle engine and is mid-prefill when
    # a user prompt arrives. The step in flight was one chunk; the next is the user's.
    engine = scheduler()
    engine.add_request(request("shadow", SHADOW_PROMPT, shadow=True))
    assert [step(engine) for _ in range(3)] == [{"shadow": CHUNK}] * 3
    engine.add_request(request("user", USER_PROMPT))
    assert step(engine) == {"user": USER_PROMPT}
    # Alone again, the shadow runs to its end, a chunk a step, and finishes.
    seen = [step(engine) for _ in range(SHADOW_PROMPT // CHUNK + USER_TOKENS + 2)]
    assert all(s.get("shadow", 0) <= CHUNK for s in seen)
    assert engine.requests.get("shadow") is None


def test_an_idle_floor_shadow_runs_only_in_steps_no_user_request_is_in():
    engine = scheduler()
    engine.add_request(request("decoder", 40))
    engine.add_request(request("floor", SHADOW_PROMPT, idle=True))
    engine.add_request(request("budget", SHADOW_PROMPT, shadow=True))
    assert step(engine) == {"decoder": 40}  # both shadows wait behind the user's prefill
    # While the user request decodes, the budget's shadow takes a chunk beside it; the
    # floor's does not (paid for by idle time, it shares no step with a user request).
    decoding = [step(engine) for _ in range(USER_TOKENS - 1)]
    assert decoding == [{"decoder": 1, "budget": CHUNK}] * (USER_TOKENS - 1)
    assert engine.requests.get("decoder") is None
    # Alone, the shadows run within the lone step's capped budget, the floor's too.
    alone = [step(engine) for _ in range(2 * SHADOW_PROMPT // CHUNK)]
    assert all(sum(tokens.values()) <= CHUNK for tokens in alone)
    assert any(tokens.get("floor", 0) > 0 for tokens in alone)
    # A floor shadow alone beside a decoding user request: vLLM's own step without it.
    engine = scheduler()
    engine.add_request(request("floor", SHADOW_PROMPT, idle=True))
    assert step(engine) == {"floor": CHUNK}  # idle: it runs, a chunk
    engine.add_request(request("user", USER_PROMPT))
    assert step(engine) == {"user": USER_PROMPT}
    paused = engine.shadow_steps["paused"]
    assert [step(engine) for _ in range(USER_TOKENS - 1)] == [{"user": 1}] * (USER_TOKENS - 1)
    assert engine.shadow_steps["paused"] == paused + USER_TOKENS - 1
    assert engine.shadow_steps["chunked"] == 0
    assert step(engine) == {"floor": CHUNK}  # the user request ended: alone again
    assert engine.requests["floor"].num_preemptions == 0


def test_a_step_beside_a_decode_is_counted_once_under_the_rule_that_ran_it():
    """The floor's shadow sits out the steps the budget's chunks beside a decode: each such
    step counts as chunked (a shadow prefilled beside decoding user requests), not as
    paused too (with no budget shadow beside it, as paused: the test above)."""
    engine = scheduler()
    engine.add_request(request("decoder", 40))
    engine.add_request(request("floor", SHADOW_PROMPT, idle=True))
    engine.add_request(request("budget", SHADOW_PROMPT, shadow=True))
    assert step(engine) == {"decoder": 40}
    before, exported = dict(engine.shadow_steps), exported_steps()
    decoding = [step(engine) for _ in range(USER_TOKENS - 1)]
    assert decoding == [{"decoder": 1, "budget": CHUNK}] * (USER_TOKENS - 1)
    counted = {action: engine.shadow_steps[action] - before[action] for action in before}
    assert counted == {"paused": 0, "chunked": USER_TOKENS - 1, "alone": 0, "preempted": 0}
    assert {a: n - exported[a] for a, n in exported_steps().items()} == counted


def exported_steps() -> dict[str, float]:
    """`holeblend_shadow_steps_total` by action."""
    actions = ("paused", "chunked", "alone", "preempted")
    return {a: metrics.sample("holeblend_shadow_steps_total", {"action": a}) for a in actions}


def test_without_chunked_prefill_a_lone_shadow_keeps_whole_steps():
    # vLLM cannot split a prompt without chunked prefill: a capped budget would starve it.
    engine = scheduler()
    engine.scheduler_config.enable_chunked_prefill = False
    engine.add_request(request("shadow", 100, shadow=True))
    assert step(engine) == {"shadow": 100}


def test_a_user_request_arriving_beside_a_chunked_shadow_waits_one_step_at_most():
    engine = scheduler()
    engine.add_request(request("decoder", 40))
    engine.add_request(request("shadow", SHADOW_PROMPT, shadow=True))
    first = step(engine)
    assert first == {"decoder": 40}  # the shadow waits behind the user's prefill
    assert step(engine) == {"decoder": 1, "shadow": CHUNK}
    engine.add_request(request("late", USER_PROMPT))
    assert step(engine) == {"decoder": 1, "late": USER_PROMPT}  # the shadow sits out


def test_a_waiting_shadow_is_not_admitted_while_a_user_request_prefills():
    engine = scheduler()
    engine.add_request(request("user", 500))  # takes 4 steps of the 128-token budget
    engine.add_request(request("shadow", 64, shadow=True))
    steps = [step(engine) for _ in range(4)]
    assert [list(s) for s in steps] == [["user"]] * 4  # vLLM's arithmetic, no shadow
    assert sum(s["user"] for s in steps) >= 500
    assert step(engine) == {"user": 1, "shadow": CHUNK}


def test_a_user_request_that_needs_the_shadows_blocks_preempts_it():
    # 80 blocks of 16 tokens: after 48 steps of one chunk the shadow holds 48, leaving 32,
    # too few for a 600-token user prompt (38 blocks).
    engine = scheduler(num_blocks=80)
    engine.add_request(request("shadow", SHADOW_PROMPT, shadow=True))
    assert [step(engine) for _ in range(48)] == [{"shadow": CHUNK}] * 48
    engine.add_request(request("user", 600))
    assert step(engine) == {"user": BUDGET}
    shadow = engine.requests["shadow"]
    assert shadow.status == RequestStatus.PREEMPTED and shadow.num_computed_tokens == 0
    assert engine.shadow_steps["preempted"] == 1
    # It comes back once the user request no longer needs the steps, and runs to the end.
    seen = [step(engine) for _ in range(8 + SHADOW_PROMPT // CHUNK + 2)]
    assert engine.requests.get("user") is None
    assert sum(s.get("shadow", 0) for s in seen) >= SHADOW_PROMPT


def test_user_prompts_prefilling_together_preempt_the_shadow_not_each_other():
    # 80 blocks of 16 tokens, 32 free beside the shadow's 48. Chunked at the threshold, two
    # user prompts prefill side by side; each fits the free blocks, both do not (25 and 19
    # blocks). vLLM cannot take a shadow set aside's blocks: once the prefills ran out of
    # free ones it preempted a user request, losing its prefill, and kept the shadow.
    engine = scheduler(num_blocks=80, threshold=THRESHOLD)
    engine.add_request(request("shadow", SHADOW_PROMPT, shadow=True))
    for _ in range(48):
        step(engine)
    assert engine.requests["shadow"].num_computed_tokens == 48 * CHUNK
    users, seen = {"a": 400, "b": 300}, []
    for user, num_prompt in users.items():
        engine.add_request(request(user, num_prompt))
        seen.append(step(engine))
    seen += [step(engine) for _ in range(sum(users.values()) // THRESHOLD + 2 * USER_TOKENS)]
    assert all(engine.requests.get(user) is None for user in users)  # both finished
    for user, num_prompt in users.items():  # each prompt computed once, then its decodes
        assert sum(tokens.get(user, 0) for tokens in seen) == num_prompt + USER_TOKENS - 1
    assert engine.requests["shadow"].num_preemptions == engine.shadow_steps["preempted"] == 1


def test_a_user_request_with_room_beside_the_shadow_leaves_it_its_blocks():
    engine = scheduler(num_blocks=80)
    engine.add_request(request("shadow", SHADOW_PROMPT, shadow=True))
    assert [step(engine) for _ in range(48)] == [{"shadow": CHUNK}] * 48
    engine.add_request(request("user", 300))  # 19 blocks of the 32 free
    assert step(engine) == {"user": BUDGET}
    assert engine.requests["shadow"].num_computed_tokens == 48 * CHUNK
    assert engine.shadow_steps["preempted"] == 0


def test_without_shadows_the_steps_are_vllms_own():
    ours, theirs = scheduler(), scheduler(Scheduler)
    for engine in (ours, theirs):
        engine.add_request(request("a", 300))
        engine.add_request(request("b", 50))
    for _ in range(8):
        assert step(ours) == step(theirs)
    assert ours.shadow_steps == {"paused": 0, "chunked": 0, "alone": 0, "preempted": 0}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_it_follows_vllms_choice_of_asynchronous_scheduling(asynchronous):
    engine = scheduler(asynchronous=asynchronous)
    assert isinstance(engine, ShadowYieldingScheduler)
    assert isinstance(engine, AsyncScheduler) is asynchronous
    assert isinstance(engine, AsyncShadowYieldingScheduler) is asynchronous


def test_a_user_request_that_needs_the_shadows_seat_preempts_it():
    # --max-num-seqs 2: a decoding user request and a shadow fill the seats. A shadow set
    # aside keeps its seat, so the arriving user request takes it only by preempting it
    # (vLLM refuses a step with more running requests than seats).
    engine = scheduler(max_seqs=2)
    engine.add_request(request("decoder", 40))
    engine.add_request(request("shadow", SHADOW_PROMPT, shadow=True))
    assert step(engine) == {"decoder": 40}
    assert step(engine) == {"decoder": 1, "shadow": CHUNK}
    engine.add_request(request("late", USER_PROMPT))
    assert step(engine) == {"decoder": 1, "late": USER_PROMPT}
    assert engine.requests["shadow"].status == RequestStatus.PREEMPTED
    assert engine.shadow_steps["preempted"] == 1
    seen = [step(engine) for _ in range(SHADOW_PROMPT // CHUNK + USER_TOKENS + 2)]
    assert all(len(tokens) <= 2 for tokens in seen)
    assert engine.requests.get("shadow") is None  # it came back and ran to its end


def test_a_shadow_set_aside_keeps_its_seat_from_the_other_shadows():
    # --max-num-seqs 2: a decoding user request and the idle floor's shadow fill the seats;
    # the budget's shadow, which may take a chunk beside the decode, must wait for a seat.
    engine = scheduler(max_seqs=2)
    engine.add_request(request("floor", SHADOW_PROMPT, idle=True))
    assert step(engine) == {"floor": CHUNK}
    engine.add_request(request("decoder", 40))
    assert step(engine) == {"decoder": 40}
    engine.add_request(request("budget", SHADOW_PROMPT, shadow=True))
    steps = [step(engine) for _ in range(USER_TOKENS - 1)]
    assert steps == [{"decoder": 1}] * (USER_TOKENS - 1)
    assert engine.requests.get("decoder") is None
    assert len(engine.running) <= 2


@pytest.mark.parametrize("threshold", [0, THRESHOLD])
def test_vllms_adaptive_threshold_does_not_widen_a_shadows_chunk_beside_a_decode(threshold):
    # vLLM 0.32's adaptive threshold raises each prompt's cap to a fair share of the token
    # budget (half of it with two requests): the shadow's chunk stays its own. (vLLM 0.23
    # has no adaptive threshold: the same steps must hold there too.)
    engine = scheduler(threshold=threshold, adaptive=True)
    engine.add_request(request("decoder", 40))
    engine.add_request(request("shadow", SHADOW_PROMPT, shadow=True))
    steps = [step(engine)]  # the user's prompt first (in two steps on 0.23 at a threshold)
    while "shadow" not in steps[-1] and len(steps) < 4:
        steps.append(step(engine))
    assert all(list(tokens) == ["decoder"] for tokens in steps[:-1])
    assert steps[-1] == {"decoder": 1, "shadow": CHUNK}


def loaded_shadow(engine: Scheduler, num_prompt: int, num_loaded: int) -> Request:
    """A shadow (a replay: blended like a user request) whose asynchronous load is done,
    as vLLM leaves one: its loaded tokens computed, in their blocks, waiting with them
    (vLLM 0.32 in `kv_holding_waiting`, drained before `waiting`; 0.23 in `waiting`)."""
    shadow = request("shadow", num_prompt, shadow=True)
    engine.add_request(shadow)
    engine.waiting.remove_request(shadow)
    assert engine.kv_cache_manager.allocate_slots(shadow, num_loaded) is not None
    shadow.num_computed_tokens = num_loaded
    enqueue = getattr(engine, "_enqueue_waiting_request", engine.waiting.add_request)
    enqueue(shadow)
    return shadow


def test_a_shadow_waiting_with_its_loaded_kv_yields_to_a_user_request_and_keeps_its_load():
    engine = scheduler()
    shadow = loaded_shadow(engine, 400, num_loaded=256)
    engine.add_request(request("user", USER_PROMPT))
    assert step(engine) == {"user": USER_PROMPT}  # the shadow sits the user prefill out
    assert shadow.num_computed_tokens == 256
    seen = [step(engine) for _ in range(USER_TOKENS + (400 - 256) // CHUNK + 2)]
    assert seen[0] == {"user": 1, "shadow": CHUNK}  # then one chunk beside the decode
    assert engine.requests.get("shadow") is None  # finished
    # Its load is not computed again: the rest of its prompt, then its decodes.
    assert sum(s.get("shadow", 0) for s in seen) == 400 - 256 + USER_TOKENS - 1
