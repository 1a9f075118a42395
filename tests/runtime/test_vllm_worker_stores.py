"""The worker's stores never cost more than the segments that failed: one request's failed
store leaves the step's other requests stored, and a load whose hole store fails is still a
load (its K/V are written; the store step computes the hole).

The worker runs over the reference model with plain tensors in vLLM's paged layout as its
KV cache, and an attention backend that writes the cache apart from attention, as vLLM's
do (tests/runtime/test_blend_pipeline.py)."""

import torch

from holeblend_kernels.paged import scatter_kv_nhd
from holeblend_runtime.vllm_connector import metrics
from holeblend_runtime.vllm_connector.accounting import LoadSpec
from holeblend_runtime.vllm_connector.metadata import LoadRequest, StoreRequest
from holeblend_runtime.vllm_connector.planning import ReusePlanner
from holeblend_runtime.vllm_connector.worker import BlendWorker, ForwardKVCapture, PagedKVWriter

HOLE = 2  # segment index of the second document
BLOCK = 16


class _Impl:
    def do_kv_cache_update(self, layer, key, value, cache, slots):
        scatter_kv_nhd(cache, slots, key, value)


class _Backend:
    forward_includes_kv_cache_update = False


class _AttentionLayer:
    def __init__(self):
        self.impl, self.attn_backend = _Impl(), _Backend()


def _worker(engine, num_blocks):
    c = engine.config
    caches = [
        torch.zeros(2, num_blocks, BLOCK, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)
    ]
    modules = [_AttentionLayer() for _ in caches]
    writer = PagedKVWriter(modules, caches, BLOCK)
    return BlendWorker(engine, writer, capture=ForwardKVCapture(modules)), caches


def _tier_down(*args, **kwargs):
    raise OSError("tier down")


def test_one_request_s_failed_forward_store_leaves_the_others_stored(
    new_engine, rag_texts, monkeypatch
):
    """Two requests' segments come from one forward (one batch, each at its own blocks).
    The first one's tier check fails: its segment is counted failed; the second's is still
    stored from its own rows of the forward's K/V."""
    engine = new_engine()
    prompt = engine.build_prompt(*rag_texts)
    keys = engine.segment_keys(prompt)
    cacheable = [i for i, key in enumerate(keys) if key is not None]
    first, last = cacheable[0], cacheable[-1]
    full = engine.prefill(prompt, "full", 1.0)
    for i in cacheable:
        if engine.store.contains_many([keys[i]])[0]:
            engine.store.remove(keys[i])  # full prefill stored them: start from a miss
    per_request = -(-prompt.num_tokens // BLOCK)
    worker, _ = _worker(engine, 2 * per_request)
    blocks_a = tuple(range(per_request))
    blocks_b = tuple(range(per_request, 2 * per_request))
    checked = StoreRequest("a", prompt, (first,), blocks_a, check_stored=True)
    plain = StoreRequest("b", prompt, (last,), blocks_b)
    worker.arm_capture([checked, plain])
    slots = torch.cat(
        [
            worker.writer.slots(blocks_a, 0, prompt.num_tokens),
            worker.writer.slots(blocks_b, 0, prompt.num_tokens),
        ]
    )
    for layer, module in enumerate(worker.writer.attention_modules):
        k = full.k[layer].transpose(0, 1).repeat(2, 1, 1)
        v = full.v[layer].transpose(0, 1).repeat(2, 1, 1)
        module.impl.do_kv_cache_update(module, k, v, worker.writer.kv_caches[layer], slots)
    monkeypatch.setattr(engine.store, "contains_many", _tier_down)
    before = metrics.sample("holeblend_store_failures_total")
    assert worker.store_many([checked, plain]) == (1, 1)
    assert metrics.sample("holeblend_store_failures_total") == before + 1
    segment, stored = prompt.segments[last], engine.store.get(keys[last])
    assert stored is not None
    assert torch.equal(stored.positions, torch.arange(segment.start, segment.end))
    assert torch.equal(stored.k, full.k[:, :, segment.start : segment.end])
    assert engine.store.get(keys[first]) is None


def _hole_load(engine, prompt, num_blocks):
    """The scheduler's plan for the prompt and the load of its covered range."""
    planner = ReusePlanner(engine.prompt_builder.separator_ids, engine.keyer, engine.store)
    plan = planner.plan(prompt.token_ids)
    load = LoadSpec(0, plan.num_covered_tokens)
    blocks = tuple(range(num_blocks))
    return plan, LoadRequest(
        "r", plan.prompt, plan.keys, plan.reuse.reused_segments, load, blocks, 0.15
    )


def test_a_load_whose_hole_store_fails_is_written_and_its_store_step_computes_the_hole(
    cached_engine, rag_texts, monkeypatch
):
    """The blend's K/V are in vLLM's cache before the load stores its hole from them: a
    store that fails then does not fail the load (vLLM would recompute the request and
    count a failed load). The hole is not taken as offered: the step's store computes it."""
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    num_blocks = -(-prompt.num_tokens // BLOCK)
    plan, request = _hole_load(engine, prompt, num_blocks)
    real_put = engine.store.put
    monkeypatch.setattr(engine.store, "put", _tier_down)
    worker, caches = _worker(engine, num_blocks)
    outcome = worker.load(request)
    assert outcome.num_hole_tokens == prompt.segments[HOLE].num_tokens
    assert not engine.store.contains_many([plan.keys[HOLE]])[0]
    monkeypatch.setattr(engine.store, "put", real_put)
    expected_worker, expected = _worker(engine, num_blocks)
    expected_worker.load(request)  # the same load with a working tier
    engine.store.remove(plan.keys[HOLE])
    for cache, want in zip(caches, expected, strict=True):
        assert bool(want.any())
        torch.testing.assert_close(cache, want, atol=0, rtol=0)
    assert worker.store(StoreRequest("r", prompt, plan.missing_segments)) == 1
    assert engine.store.contains_many([plan.keys[HOLE]])[0]
