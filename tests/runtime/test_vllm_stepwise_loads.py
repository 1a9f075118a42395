"""Asynchronous, stepwise loads (`blend_step_tokens`): the blend spread over vLLM's steps.

The worker runs over the reference model with plain tensors in vLLM's paged layout as the
KV cache (as in test_blend_pipeline.py); the steps are driven here as vLLM's model runner
drives them: `advance` once per step, `take_finished` with the requests vLLM finished.
"""

import dataclasses
import logging

import pytest
import torch

from holeblend_runtime.blend.blender import run_to_end
from holeblend_runtime.blend.reuse import ReusePolicy
from holeblend_runtime.vllm_connector.accounting import LoadSpec
from holeblend_runtime.vllm_connector.metadata import LoadRequest, StoreRequest
from holeblend_runtime.vllm_connector.planning import ReusePlanner
from holeblend_runtime.vllm_connector.stepwise_loads import StepwiseLoads
from holeblend_runtime.vllm_connector.worker import BlendWorker, PagedKVWriter

HOLE = 2
BLOCK = 16


class _Attention:
    """An attention module without a cache-update op: the writer scatters with torch."""


def _setup(engine, prompt, request_id="r", ratio=0.15):
    planner = ReusePlanner(
        engine.prompt_builder.separator_ids, engine.keyer, engine.store, ReusePolicy.HOLE
    )
    plan = planner.plan(prompt.token_ids)
    c = engine.config
    num_blocks = -(-prompt.num_tokens // BLOCK)
    caches = [
        torch.zeros(2, num_blocks, BLOCK, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)
    ]
    worker = BlendWorker(engine, PagedKVWriter([_Attention() for _ in caches], caches, BLOCK))
    load = LoadRequest(
        request_id, plan.prompt, plan.keys, plan.reuse.reused_segments,
        LoadSpec(0, plan.num_covered_tokens), tuple(range(num_blocks)), ratio, is_async=True,
    )  # fmt: skip
    return plan, worker, load, caches


def _loads(engine, step_tokens, on_failure=lambda load: None):
    return StepwiseLoads(step_tokens, engine.config.num_layers, on_failure)


def _failures():
    failed = []
    return failed, failed.append


def test_blend_steps_yield_once_per_layer_the_tokens_it_computed_and_end_as_blend(
    cached_engine, rag_texts
):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    plan, worker, load, _ = _setup(engine, prompt)
    reuse, entries, _ = worker._fetch(load)
    end = plan.num_covered_tokens
    whole = engine.blend_reused(prompt, reuse, entries, 0.15, end)
    steps = engine.blend_reused_steps(prompt, reuse, entries, 0.15, end)
    computed = []
    while True:
        try:
            computed.append(next(steps))
        except StopIteration as done:
            stepped = done.value
            break
    assert len(computed) == engine.config.num_layers
    check = engine.blend_config.check_layer
    active = end - whole.num_exact_prefix_tokens
    assert computed[: check + 1] == [active] * (check + 1)  # full layers and the check layer
    assert computed[check + 1 :] == [whole.recomputed.shape[0]] * (len(computed) - check - 1)
    assert torch.equal(stepped.k, whole.k) and torch.equal(stepped.v, whole.v)
    assert torch.equal(stepped.selected, whole.selected)
    again = run_to_end(engine.blend_reused_steps(prompt, reuse, entries, 0.15, end))
    assert torch.equal(again.k, whole.k)


def test_a_load_spread_over_steps_writes_what_a_synchronous_load_writes(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    _, worker, load, caches = _setup(engine, prompt)
    failed, on_failure = _failures()
    loads = _loads(engine, 5, on_failure)
    loads.start(worker, load)
    outcomes, steps = [], 0
    while not outcomes:
        steps += 1
        outcomes = loads.advance(worker)
        finished = loads.take_finished(set())
        assert finished == ({"r"} if outcomes else set())  # reported in the step it ends
    stepped = [cache.clone() for cache in caches]
    for cache in caches:
        cache.zero_()
    engine.store.remove(load.keys[HOLE])  # the load stored the hole: the same plan again
    synchronous = worker.load(load)
    assert steps > 3 and not failed and loads.num_tracked == 0
    for mine, theirs in zip(stepped, caches, strict=True):
        assert torch.equal(mine, theirs)
    (outcome,) = outcomes
    assert outcome.num_recomputed_tokens == synchronous.num_recomputed_tokens
    assert outcome.num_reused_tokens == synchronous.num_reused_tokens > 0


def test_each_step_spends_at_most_its_budget_but_always_one_layer_oldest_load_first(
    cached_engine, rag_texts
):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    _, worker, first, _ = _setup(engine, prompt, "first")
    second = dataclasses.replace(first, request_id="second")
    layers = engine.config.num_layers
    loads = _loads(engine, 1)
    loads.start(worker, first)
    loads.start(worker, second)
    pending = list(loads._pending)
    spent, order = [], []
    while loads.num_pending:
        before = [p.spent for p in pending]
        for outcome in loads.advance(worker):
            order.append(outcome.request_id)
        spent.append([p.spent - b for p, b in zip(pending, before, strict=True)])
    # A budget below one layer's tokens: exactly one layer per step, the oldest load first.
    assert len(spent) == 2 * layers
    assert all(sum(1 for s in step if s) == 1 for step in spent)
    assert all(step[1] == 0 for step in spent[:layers]) and order == ["first", "second"]

    roomy = _loads(engine, 10_000)
    roomy.start(worker, first)
    roomy.start(worker, second)
    assert [o.request_id for o in roomy.advance(worker)] == ["first", "second"]


def test_a_request_vllm_finished_first_is_dropped_and_reported_with_its_stores(
    cached_engine, rag_texts
):
    """Aborted while its blend is under way: dropped (vLLM frees its blocks once the load
    is reported), its deferred hole store dropped too (a future miss), nothing left."""
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    _, worker, load, _ = _setup(engine, prompt)
    loads = _loads(engine, 1)
    loads.start(worker, load)
    hole_store = StoreRequest("r", prompt, (HOLE,))
    other = StoreRequest("other", prompt, (1,))
    assert loads.due_stores([hole_store, other]) == [other]  # the hole waits for its load
    loads.advance(worker)
    assert loads.take_finished(set()) == set()
    assert loads.take_finished({"r", "unknown"}) == {"r"}
    assert loads.num_pending == 0 and loads.num_tracked == 0
    assert loads.due_stores([]) == []
    assert loads.advance(worker) == []


def _hole_load_done(engine, prompt):
    """Start a load whose prompt has a hole, hold the hole's store behind it, run the load
    to its end: (worker, load, the released stores, the canonical computes recorded)."""
    _, worker, load, _ = _setup(engine, prompt)
    loads = _loads(engine, 10_000)
    loads.start(worker, load)
    hole_store = StoreRequest("r", prompt, (HOLE,))
    assert loads.due_stores([hole_store]) == []
    computed = []
    worker.engine.cache_segments = lambda *args: computed.append(args) or 0
    assert [o.request_id for o in loads.advance(worker)] == ["r"]
    released = loads.due_stores([])
    assert released == [hole_store]
    return worker, load, released, computed


def test_a_hole_store_waits_for_its_load_which_stores_it_from_the_blend(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    worker, load, released, computed = _hole_load_done(engine, prompt)
    assert engine.store.contains_many([load.keys[HOLE]]) == [True]  # from the blend
    assert worker.store_many(released) == (0, 0) and computed == []  # nothing to compute


def test_a_hole_the_tier_refused_is_not_computed_again_by_its_store_step(cached_engine, rag_texts):
    """The node tier is full of segments used more often (frequency admission): the
    load's offer of the hole is refused, and the released store computes nothing."""
    from holeblend_runtime.kv.admission import FrequencyAdmission
    from holeblend_runtime.kv.store import LocalKVStore

    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    stored_keys = engine.store.keys()
    held = [engine.store.get(key) for key in stored_keys]
    full = LocalKVStore(sum(kv.num_bytes for kv in held), admission=FrequencyAdmission())
    for kv in held:
        full.put(kv)
        full.get(kv.key)  # used twice: more than the hole will be
    engine.store = full
    worker, load, released, computed = _hole_load_done(engine, prompt)
    assert full.contains_many([load.keys[HOLE]]) == [False] and full.num_refused == 1
    assert worker.store_many(released) == (0, 0)
    assert computed == []  # refused once from the blend; not computed to be refused again
    # Another request's store of the same segment (no load offered it) is still computed.
    assert worker.store_many([StoreRequest("other", prompt, (HOLE,))]) == (0, 0)
    assert len(computed) == 1


@pytest.mark.parametrize("stage", ["start", "advance"])
def test_a_load_that_fails_is_reported_finished_and_its_blocks_failed(
    cached_engine, rag_texts, monkeypatch, stage
):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    _, worker, load, _ = _setup(engine, prompt)
    failed, on_failure = _failures()
    loads = _loads(engine, 10_000, on_failure)
    hole_store = StoreRequest("r", prompt, (HOLE,))

    def broken(*args, **kwargs):
        raise OSError("tier gone")

    if stage == "start":
        monkeypatch.setattr(worker, "_fetch", broken)
    loads.start(worker, load)
    if stage == "advance":
        assert loads.due_stores([hole_store]) == []
        monkeypatch.setattr(worker, "finish", broken)
    assert loads.advance(worker) == []
    assert failed == [load] and loads.take_finished(set()) == {"r"}
    # The hole was not stored by the failed load: its store is released, to be computed.
    assert loads.due_stores([]) == ([hole_store] if stage == "advance" else [])
    assert loads.num_tracked == 0


def test_slots_past_the_block_table_are_refused_naming_the_range_and_the_blocks():
    writer = PagedKVWriter([], [], 16)
    assert writer.slots([3, 1], 15, 17).tolist() == [63, 16]
    assert writer.slots([], 5, 5).tolist() == []
    with pytest.raises(ValueError, match=r"\[30, 33\) need 3 blocks of 16 tokens, .* has 2"):
        writer.slots([3, 1], 30, 33)


def test_a_load_whose_blocks_end_before_its_range_fails_saying_so(cached_engine, rag_texts, caplog):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    _, worker, load, _ = _setup(engine, prompt)
    assert load.load.end > BLOCK
    short = dataclasses.replace(load, block_ids=load.block_ids[:1])
    failed, on_failure = _failures()
    loads = _loads(engine, 10_000, on_failure)
    loads.start(worker, short)
    with caplog.at_level(logging.ERROR):
        assert loads.advance(worker) == []
    assert failed == [short] and loads.take_finished(set()) == {"r"}
    needed = -(-load.load.end // BLOCK)
    says = (
        f"positions [0, {load.load.end}) need {needed} blocks of {BLOCK} tokens, the request has 1"
    )
    assert says in caplog.text


def test_step_tokens_must_be_positive():
    with pytest.raises(ValueError, match="step_tokens"):
        StepwiseLoads(step_tokens=0, num_layers=30, on_failure=print)


def test_the_step_budget_defaults_to_an_eighth_of_vllm_s_and_zero_means_whole_blends():
    from holeblend_runtime.vllm_connector.settings import load_settings, step_tokens

    assert step_tokens(load_settings({}), max_num_batched_tokens=2048) == 256
    assert step_tokens(load_settings({}), max_num_batched_tokens=4) == 1
    assert step_tokens(load_settings({"blend_step_tokens": 64}), 2048) == 64
    assert step_tokens(load_settings({"blend_step_tokens": 0}), 2048) is None
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ValueError, match="blend_step_tokens"):
            load_settings({"blend_step_tokens": bad})


def test_a_missing_segment_past_the_covered_range_is_still_computed_by_its_own_store(
    cached_engine, rag_texts
):
    """The last document is missing: the covered range ends before it and the load's blend
    never computes it. When vLLM's forward could not be captured storing it (a chunked
    prefill split it: a plain store), that store computes it; the load offered it nothing."""
    last = len(rag_texts[1])  # segment index of the last document
    engine, prompt = cached_engine(rag_texts, hole=last)
    plan, worker, load, _ = _setup(engine, prompt)
    assert plan.missing_segments == (last,)
    assert prompt.segments[last].start >= plan.num_covered_tokens > 0
    worker.load(dataclasses.replace(load, is_async=False))
    assert engine.store.contains_many([load.keys[last]]) == [False]  # not in the blend
    split = StoreRequest("r", prompt, (last,))  # a later step's, without the capture
    assert worker.store_many([split]) == (1, 0)
    assert engine.store.contains_many([load.keys[last]]) == [True]
