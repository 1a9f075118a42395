"""Shadow requests in vLLM's own scheduler (the real `Scheduler` of the installed vLLM,
driven step by step with a fake model output): at the connector's lowest priority a
shadow waits behind user requests (the operator renders `--scheduling-policy priority`),
but a running shadow's chunked prefill takes each step's whole token budget until its
prefill ends, which is why the operator also renders its own scheduler class
(test_shadow_scheduler.py). vLLM's `--long-prefill-token-threshold` bounds the shadow to
one chunk of each step a user request is in, at the price of chunking user prompts too
(the operator rendered it before the scheduler class)."""

from __future__ import annotations

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from holeblend_devtools.hf_export import export_smollm2
from holeblend_runtime.vllm_connector.shadow import SHADOW_PRIORITY

BUDGET = 128  # --max-num-batched-tokens
CHUNK = 32  # --long-prefill-token-threshold
SHADOW_PROMPT, USER_PROMPT = 1000, 100


def scheduler(policy: str = "priority", threshold: int = CHUNK, max_seqs: int = 8) -> Scheduler:
    model = ModelConfig(
        model=str(export_smollm2()), dtype="float32", seed=0, skip_tokenizer_init=True,
        max_model_len=2048,
    )  # fmt: skip
    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_seqs, max_num_batched_tokens=BUDGET, max_model_len=2048,
            enable_chunked_prefill=True, policy=policy, is_encoder_decoder=False,
            long_prefill_token_threshold=threshold,
        ),
        model_config=model,
        cache_config=CacheConfig(block_size=16, cache_dtype="auto", enable_prefix_caching=False),
    )  # fmt: skip
    config.cache_config.num_gpu_blocks = 400
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=400, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    return Scheduler(
        vllm_config=config, kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config), block_size=16,
    )  # fmt: skip


def request(request_id: str, num_prompt: int, priority: int) -> Request:
    params = SamplingParams(max_tokens=4, temperature=0.0)
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
    engine.add_request(request("shadow", SHADOW_PROMPT, SHADOW_PRIORITY))
    assert step(engine) == {"shadow": BUDGET}  # alone: the shadow takes the whole step
    engine.add_request(request("user", USER_PROMPT, 0))
    return [step(engine) for _ in range(6)]


def test_a_running_shadow_takes_at_most_one_chunk_of_a_step_a_user_request_is_in():
    steps = user_arrives_during_a_shadow(scheduler())
    # The user request is served from the first step after it arrives, in every step
    # until its prefill is done, and beside it the shadow takes at most one chunk.
    prefilled = 0
    for tokens in steps:
        assert "user" in tokens
        assert tokens.get("shadow", 0) <= CHUNK
        prefilled += tokens["user"]
        if prefilled >= USER_PROMPT:
            break
    assert prefilled >= USER_PROMPT
    assert all(tokens.get("shadow", 0) > 0 for tokens in steps)  # and it still progresses


def test_without_the_threshold_a_running_shadow_starves_the_user_request():
    steps = user_arrives_during_a_shadow(scheduler(threshold=0))
    assert steps[0] == {"shadow": BUDGET}  # the reason the operator renders the threshold


@pytest.mark.parametrize("policy, first", [("priority", "user"), ("fcfs", "shadow")])
def test_a_waiting_shadow_goes_after_a_waiting_user_request_under_the_priority_policy(
    policy, first
):
    engine = scheduler(policy, max_seqs=1)
    engine.add_request(request("shadow", 64, SHADOW_PRIORITY))  # arrived first
    engine.add_request(request("user", 64, 0))
    assert list(step(engine)) == [first]
