"""One reuse path for both engines: holeblend-serve's prefill and the vLLM connector's worker.

The connector's scheduler side plans with `ReusePlanner` (the engine's own keyer, the
store as the index); its worker blends the covered range with `BlendWorker`. Here the
worker runs over the reference model, with a plain tensor in vLLM's paged layout
(`[2, blocks, block_size, kv_heads, head_dim]`) as the KV cache: nothing of vLLM is
needed, and the comparison is with the same weights.
"""

import pytest
import torch

from holeblend_kernels.paged import scatter_kv_nhd
from holeblend_runtime.blend.reuse import ReusePolicy
from holeblend_runtime.blend.segments import SegmentSplitter
from holeblend_runtime.vllm_connector.accounting import LoadSpec
from holeblend_runtime.vllm_connector.metadata import LoadRequest, StoreRequest
from holeblend_runtime.vllm_connector.planning import ReusePlanner
from holeblend_runtime.vllm_connector.worker import BlendWorker, ForwardKVCapture, PagedKVWriter

HOLE = 2  # segment index of the second document
BLOCK = 16


class _Attention:
    """An attention module without a cache-update op: the writer scatters with torch."""


def _worker(engine, num_tokens):
    c = engine.config
    num_blocks = -(-num_tokens // BLOCK)
    caches = [
        torch.zeros(2, num_blocks, BLOCK, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)
    ]
    writer = PagedKVWriter([_Attention() for _ in caches], caches, BLOCK)
    return BlendWorker(engine, writer), caches, tuple(range(num_blocks))


def _load(engine, prompt, ratio, policy=ReusePolicy.HOLE, start=0):
    """The scheduler's plan for the prompt and the worker's load of its covered range."""
    planner = ReusePlanner(engine.prompt_builder.separator_ids, engine.keyer, engine.store, policy)
    plan = planner.plan(prompt.token_ids)
    worker, caches, blocks = _worker(engine, prompt.num_tokens)
    load = LoadSpec(start, plan.num_covered_tokens)
    request = LoadRequest(
        "r", plan.prompt, plan.keys, plan.reuse.reused_segments, load, blocks, ratio
    )
    return plan, worker, request, caches


@pytest.mark.parametrize(
    ("ratio", "selection", "filter_layers"),
    [
        (0.0, "kDeviation", ()),
        (0.15, "kDeviation", ()),
        (0.5, "kDeviation", ()),
        (0.15, "query", ()),
        (0.2, "query:0.3+sinks:0.2+kDeviation", ()),
        (0.2, "kvDeviation", (4,)),
    ],
)
def test_the_same_ratio_recomputes_the_same_tokens_on_both_engines(
    cached_engine, rag_texts, ratio, selection, filter_layers
):
    engine, prompt = cached_engine(
        rag_texts, hole=HOLE, selection=selection, filter_layers=filter_layers
    )
    plan, worker, request, _ = _load(engine, prompt, ratio)
    reuse, entries, num_unusable = worker._fetch(request)
    covered = engine.blend_reused(prompt, reuse, entries, ratio, plan.num_covered_tokens)
    served = engine.prefill(prompt, "hole", ratio)  # stores the hole afterwards
    assert num_unusable == 0 and covered.logits is None
    assert reuse.reused_segments == served.reuse.reused_segments
    assert torch.equal(covered.selected, served.selected_positions)
    assert covered.num_exact_prefix_tokens == served.num_exact_prefix_tokens > 0
    # Everything the serve engine recomputed inside the covered range, the worker did.
    inside = served.recomputed_positions[served.recomputed_positions < plan.num_covered_tokens]
    assert torch.equal(covered.recomputed, inside)
    # ... and the KV of the range is the same.
    end = plan.num_covered_tokens
    torch.testing.assert_close(covered.k, served.k[:, :, :end], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(covered.v, served.v[:, :, :end], atol=1e-5, rtol=1e-5)


def test_the_worker_writes_the_blended_range_into_the_paged_cache(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    plan, worker, request, caches = _load(engine, prompt, 0.15, start=BLOCK)
    outcome = worker.load(request)
    end = plan.num_covered_tokens
    engine.store.remove(plan.keys[HOLE])  # the load stored it: the prefill must see the hole
    served = engine.prefill(prompt, "hole", 0.15)
    for layer, cache in enumerate(caches):
        flat = cache.view(2, -1, *cache.shape[3:])
        torch.testing.assert_close(
            flat[0, BLOCK:end], served.k[layer, :, BLOCK:end].transpose(0, 1), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            flat[1, BLOCK:end], served.v[layer, :, BLOCK:end].transpose(0, 1), atol=1e-5, rtol=1e-5
        )
        # vLLM holds [0, start) already: untouched.
        assert not bool(flat[:, :BLOCK].any())
    hole = prompt.segments[HOLE]
    assert outcome.num_reused_tokens == plan.reuse.num_reused_tokens
    assert outcome.num_hole_tokens == hole.num_tokens
    assert outcome.num_rejected_segments == 0
    in_range = int((served.recomputed_positions < end).sum())
    assert outcome.num_recomputed_tokens == in_range


def test_a_planned_segment_gone_at_load_time_becomes_a_hole(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    plan, worker, request, _ = _load(engine, prompt, 0.15)
    gone = 3  # the third document, planned as reused
    assert gone in plan.reuse.reused_segments
    engine.store.remove(plan.keys[gone])
    outcome = worker.load(request)
    assert outcome.num_rejected_segments == 1
    expected_holes = prompt.segments[HOLE].num_tokens + prompt.segments[gone].num_tokens
    assert outcome.num_hole_tokens == expected_holes
    assert (
        outcome.num_reused_tokens == plan.reuse.num_reused_tokens - prompt.segments[gone].num_tokens
    )


@pytest.mark.parametrize("separator", [" # #", " |"])
def test_a_range_that_ends_with_the_exact_prefix_computes_its_separator_causally(
    new_engine, rag_texts, separator
):
    """The connector's range ends at the first document when the documents after it are
    missing: the separator before it is the one position computed. With a one-token
    separator that is a single query, which must see the keys up to its own position, not
    the first document's after it (its K/V then equal full prefill's)."""
    from holeblend_runtime.blend.reuse import plan_reuse

    engine = new_engine(separator=separator)
    prompt = engine.build_prompt(*rag_texts)
    engine.cache_segments(prompt)
    keys = engine.segment_keys(prompt)
    entries, _ = engine.fetch(prompt, keys)
    entries[2:] = [None] * (len(entries) - 2)  # every document after the first missing
    reuse = plan_reuse(prompt, [entry is not None for entry in entries], ReusePolicy.HOLE)
    end = prompt.segments[1].end
    with torch.inference_mode():
        full = engine.prefill(prompt, "full")
        blended = engine.blend_reused(prompt, reuse, entries, 0.15, num_tokens=end)
    start, stop = prompt.separator_ranges[0]
    assert stop - start == len(engine.tokenizer.encode(separator))
    # Up to float rounding (one query against 30-odd keys vs full prefill's matmuls; a
    # query that saw the later tokens is off by about 2).
    for ours, theirs in ((blended.k, full.k), (blended.v, full.v)):
        torch.testing.assert_close(
            ours[:, :, start:stop], theirs[:, :, start:stop], atol=1e-3, rtol=1e-3
        )


def test_in_prefix_mode_the_worker_blends_what_the_prefix_plan_covers(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    plan, worker, request, _ = _load(engine, prompt, 0.15, ReusePolicy.PREFIX)
    assert plan.reuse.reused_segments == (0, 1)
    outcome = worker.load(request)
    served = engine.prefill(prompt, "prefix", 0.15)
    assert outcome.num_reused_tokens == served.num_reused_tokens
    assert outcome.num_hole_tokens == 0


def test_the_load_stores_the_hole_from_the_kv_it_blended_and_the_step_adds_nothing(
    cached_engine, rag_texts
):
    """Store policy in-context on vLLM pods: the hole inside the covered range is stored
    from the load's own KV (at its positions in this prompt), as holeblend-serve stores it;
    the step's store then finds it and computes nothing."""
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    plan, worker, request, _ = _load(engine, prompt, 0.15)
    key = plan.keys[HOLE]
    assert HOLE in plan.missing_segments and not engine.store.contains_many([key])[0]
    worker.load(request)
    stored = engine.store.get(key)
    hole = prompt.segments[HOLE]
    assert stored is not None
    assert torch.equal(stored.positions, torch.arange(hole.start, hole.end))
    assert worker.store(StoreRequest("r", prompt, plan.missing_segments)) == 0
    engine.store.remove(key)
    served = engine.prefill(prompt, "hole", 0.15)  # in-context: stores the same slices
    again = engine.store.get(key)
    torch.testing.assert_close(stored.k, again.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stored.v, again.v, atol=1e-5, rtol=1e-5)
    assert served.num_stored_segments == 1


def test_under_isolated_the_load_stores_nothing_and_the_step_computes_canonically(
    cached_engine, rag_texts
):
    engine, prompt = cached_engine(rag_texts, hole=HOLE, store_policy="isolated")
    plan, worker, request, _ = _load(engine, prompt, 0.15)
    key = plan.keys[HOLE]
    worker.load(request)
    assert not engine.store.contains_many([key])[0]
    assert worker.store(StoreRequest("r", prompt, plan.missing_segments)) == 1
    canonical = engine.store.get(key)
    # Canonical context: right after the system prompt and separator.
    start = prompt.separator_ranges[0][1]
    assert torch.equal(canonical.positions, torch.arange(start, start + canonical.num_tokens))


def test_a_failed_store_is_counted_and_the_others_go_on(cached_engine, rag_texts):
    from holeblend_runtime.vllm_connector import metrics

    engine, prompt = cached_engine(rag_texts, hole=HOLE, store_policy="isolated")
    plan, worker, _, _ = _load(engine, prompt, 0.15)
    broken = SegmentSplitter((9,), 1).split([1, 2, 9, 3, 4, 9, 5])  # not this model's prompt
    before = metrics.sample("holeblend_store_failures_total")
    requests = (StoreRequest("bad", broken, (1, 2)), StoreRequest("r", prompt, (HOLE,)))
    original = worker.store

    def store(request):
        if request.request_id == "bad":
            raise OSError("tier down")
        return original(request)

    worker.store = store
    assert worker.store_many(requests) == (1, 2)
    assert metrics.sample("holeblend_store_failures_total") == before + 2
    assert engine.store.contains_many([plan.keys[HOLE]]) == [True]


class _Impl:
    """An attention backend that writes the cache apart from attention, as vLLM's do:
    `do_kv_cache_update(layer, key [tokens, kv_heads, d], value, cache, slots)`."""

    def do_kv_cache_update(self, layer, key, value, cache, slots):
        scatter_kv_nhd(cache, slots, key, value)


class _Backend:
    forward_includes_kv_cache_update = False


class _AttentionLayer:
    def __init__(self):
        self.impl, self.attn_backend = _Impl(), _Backend()


def _forward_into(worker, full, num_tokens, blocks, start=0):
    """What vLLM's forward does for tokens [start, num_tokens): every layer's new K/V
    through its backend's cache update (here: full prefill's K/V)."""
    slots = worker.writer.slots(blocks, start, num_tokens)
    for layer, module in enumerate(worker.writer.attention_modules):
        k = full.k[layer, :, start:num_tokens].transpose(0, 1)
        v = full.v[layer, :, start:num_tokens].transpose(0, 1)
        module.impl.do_kv_cache_update(module, k, v, worker.writer.kv_caches[layer], slots)


def _capturing_worker(engine, num_tokens):
    c = engine.config
    num_blocks = -(-num_tokens // BLOCK)
    caches = [
        torch.zeros(2, num_blocks, BLOCK, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)
    ]
    modules = [_AttentionLayer() for _ in caches]
    writer = PagedKVWriter(modules, caches, BLOCK)
    return BlendWorker(engine, writer, capture=ForwardKVCapture(modules)), tuple(range(num_blocks))


def test_segments_the_forward_computes_are_stored_from_its_kv_without_compute(
    new_engine, rag_texts, monkeypatch
):
    """A full miss: vLLM's forward computes every document; the step stores them from the
    K/V the forward wrote (equal to a reference forward's, at their positions in this
    prompt), and nothing is computed again."""
    engine = new_engine()
    prompt = engine.build_prompt(*rag_texts)
    keys = engine.segment_keys(prompt)
    missing = tuple(i for i, key in enumerate(keys) if key is not None)
    worker, blocks = _capturing_worker(engine, prompt.num_tokens)
    full = engine.prefill(prompt, "full", 1.0)
    for key in keys:
        if key is not None and engine.store.contains_many([key])[0]:
            engine.store.remove(key)  # full prefill stored them: start from a miss
    monkeypatch.setattr(engine, "cache_segments", lambda *a, **k: pytest.fail("computed"))
    store = StoreRequest("r", prompt, missing, blocks)
    worker.arm_capture([store])
    _forward_into(worker, full, prompt.num_tokens, blocks)
    assert worker.store_many([store]) == (len(missing), 0)
    for i in missing:
        segment, stored = prompt.segments[i], engine.store.get(keys[i])
        assert torch.equal(stored.positions, torch.arange(segment.start, segment.end))
        assert torch.equal(stored.k, full.k[:, :, segment.start : segment.end])
        assert torch.equal(stored.v, full.v[:, :, segment.start : segment.end])


def test_a_late_lookup_s_segments_are_stored_from_the_forward_only_where_the_tier_lacks_them(
    new_engine, rag_texts, monkeypatch
):
    """A request whose lookup missed its deadline names every segment missing without
    having looked them up (`check_stored`): the forward's K/V are written only for the
    segments the tier does not hold; the others are not written again."""
    engine = new_engine()
    prompt = engine.build_prompt(*rag_texts)
    keys = engine.segment_keys(prompt)
    cacheable = tuple(i for i, key in enumerate(keys) if key is not None)
    worker, blocks = _capturing_worker(engine, prompt.num_tokens)
    full = engine.prefill(prompt, "full", 1.0)
    gone = cacheable[-1]
    assert engine.cache_segments(prompt, cacheable[:-1]) == len(cacheable) - 1
    assert engine.store.contains_many([keys[gone]]) == [False]
    written = []
    real_put = engine.store.put
    monkeypatch.setattr(engine.store, "put", lambda kv: written.append(kv.key) or real_put(kv))
    store = StoreRequest("r", prompt, cacheable, blocks, check_stored=True)
    worker.arm_capture([store])
    _forward_into(worker, full, prompt.num_tokens, blocks)
    assert worker.store_many([store]) == (1, 0)
    assert written == [keys[gone]]
    segment = prompt.segments[gone]
    assert torch.equal(engine.store.get(keys[gone]).k, full.k[:, :, segment.start : segment.end])


def _last_segment_armed(engine, rag_texts):
    """The prompt's last cacheable segment missing from the store, a capturing worker armed
    to store it from the forward, and full prefill's K/V to play that forward with."""
    prompt = engine.build_prompt(*rag_texts)
    keys = engine.segment_keys(prompt)
    last = max(i for i, key in enumerate(keys) if key is not None)
    worker, blocks = _capturing_worker(engine, prompt.num_tokens)
    full = engine.prefill(prompt, "full", 1.0)
    engine.store.remove(keys[last])
    store = StoreRequest("r", prompt, (last,), blocks)
    worker.arm_capture([store])
    return engine, prompt, keys, last, worker, blocks, full, store


def test_the_blend_s_own_writes_before_the_forward_are_not_taken_for_the_forward_s(
    new_engine, rag_texts
):
    """The capture is armed before the step's loads run (vLLM binds the metadata first):
    the blend's writes into the cache (another request's slots) go through the backend's
    update unwrapped, so the forward that follows is still captured whole."""
    engine, prompt, keys, last, worker, blocks, full, store = _last_segment_armed(
        new_engine(), rag_texts
    )
    other = worker.writer.slots(blocks, 0, BLOCK)  # a load's write, not the forward's
    for layer in range(engine.config.num_layers):
        k = torch.zeros(BLOCK, engine.config.num_kv_heads, engine.config.head_dim)
        worker.writer.write(layer, k, k, other)
    _forward_into(worker, full, prompt.num_tokens, blocks)
    assert worker.store_captured()[0] == 1
    segment = prompt.segments[last]
    assert torch.equal(engine.store.get(keys[last]).k, full.k[:, :, segment.start : segment.end])


def test_a_segment_the_forward_did_not_write_is_computed_instead(new_engine, rag_texts):
    """The capture sees only part of the prompt (the step computed less than planned):
    nothing half-captured is stored; the segments are computed in canonical context."""
    engine, prompt, keys, last, worker, blocks, full, store = _last_segment_armed(
        new_engine(), rag_texts
    )
    _forward_into(worker, full, prompt.segments[last].start + 2, blocks)  # stops inside it
    assert worker.store_many([store]) == (1, 0)
    canonical = engine.store.get(keys[last])
    start = prompt.separator_ranges[0][1]  # canonical context: after the system prompt
    assert torch.equal(canonical.positions, torch.arange(start, start + canonical.num_tokens))


def test_a_backend_that_writes_inside_attention_is_not_captured():
    class _Inside(_AttentionLayer):
        def __init__(self):
            super().__init__()
            self.attn_backend = type("B", (), {"forward_includes_kv_cache_update": True})()

    assert not ForwardKVCapture([_Inside()]).is_supported
    assert not ForwardKVCapture([object()]).is_supported
    assert ForwardKVCapture([_AttentionLayer()]).is_supported


def test_a_selection_that_reads_the_question_counts_only_the_missing_document_as_a_hole(
    cached_engine, rag_texts
):
    """With `query` the covered range runs into the question (the blend reads it); the
    question is computed, but it is no hole: the figures are the plan's and the serve
    engine's."""
    engine, prompt = cached_engine(rag_texts, hole=HOLE, selection="query")
    plan, worker, request, _ = _load(engine, prompt, 0.15)
    assert plan.num_covered_tokens > prompt.question.start  # the question is covered
    outcome = worker.load(request)
    engine.store.remove(plan.keys[HOLE])  # the load stored it: the prefill must see the hole
    served = engine.prefill(prompt, "hole", 0.15)
    assert outcome.num_hole_tokens == plan.reuse.num_hole_tokens == served.num_hole_tokens
    assert outcome.num_hole_tokens == prompt.segments[HOLE].num_tokens


def test_a_failed_load_s_segments_are_not_stored_from_the_forward_that_read_its_range(
    cached_engine, rag_texts, monkeypatch
):
    """A synchronous load fails before the forward: vLLM's forward of the tail still runs in
    that step, over a covered range nobody wrote (vLLM recomputes the request later), so the
    K/V it writes for the last document are not that document's in this prompt. They are
    not stored from it: the segment is computed in its canonical context instead."""
    engine, prompt = cached_engine(rag_texts)
    keys = engine.segment_keys(prompt)
    last = max(i for i, key in enumerate(keys) if key is not None)
    full = engine.prefill(prompt, "full", 1.0)  # the tail's K/V, to play the forward with
    engine.store.remove(keys[last])
    planner = ReusePlanner(
        engine.prompt_builder.separator_ids, engine.keyer, engine.store, ReusePolicy.HOLE
    )
    plan = planner.plan(prompt.token_ids)
    end = plan.num_covered_tokens
    assert plan.missing_segments == (last,) and prompt.segments[last].start >= end > 0
    worker, blocks = _capturing_worker(engine, prompt.num_tokens)
    load = LoadRequest(
        "r", plan.prompt, plan.keys, plan.reuse.reused_segments, LoadSpec(0, end), blocks, 0.15
    )
    store = StoreRequest("r", prompt, (last,), blocks)
    worker.arm_capture([store])  # bound before the step's load and forward

    def tier_gone(request):
        raise OSError("tier gone")

    monkeypatch.setattr(worker, "_fetch", tier_gone)
    with pytest.raises(OSError):
        worker.load(load)
    _forward_into(worker, full, prompt.num_tokens, blocks, start=end)
    assert worker.store_many([store]) == (1, 0)
    stored = engine.store.get(keys[last])
    start = prompt.separator_ranges[0][1]  # canonical context: after the system prompt
    assert torch.equal(stored.positions, torch.arange(start, start + stored.num_tokens))


def _tier_down(*args, **kwargs):
    raise OSError("tier down")


def test_one_request_s_failed_forward_store_leaves_the_others_stored(
    new_engine, rag_texts, monkeypatch
):
    """Two requests' segments come from one forward (one batch, each at its own blocks).
    The first one's tier check fails: its segment is counted failed; the second's is still
    stored from its own rows of the forward's K/V."""
    from holeblend_runtime.vllm_connector import metrics

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
    worker, _ = _capturing_worker(engine, 2 * per_request * BLOCK)
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


def test_a_load_whose_hole_store_fails_is_written_and_its_store_step_computes_the_hole(
    cached_engine, rag_texts, monkeypatch
):
    """The blend's K/V are in vLLM's cache before the load stores its hole from them: a
    store that fails then does not fail the load (vLLM would recompute the request and
    count a failed load). The hole is not taken as offered: the step's store computes it."""
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    plan, _, request, _ = _load(engine, prompt, 0.15)
    real_put = engine.store.put
    monkeypatch.setattr(engine.store, "put", _tier_down)
    worker, _ = _capturing_worker(engine, prompt.num_tokens)
    outcome = worker.load(request)
    assert outcome.num_hole_tokens == prompt.segments[HOLE].num_tokens
    assert not engine.store.contains_many([plan.keys[HOLE]])[0]
    monkeypatch.setattr(engine.store, "put", real_put)
    expected_worker, _ = _capturing_worker(engine, prompt.num_tokens)
    expected_worker.load(request)  # the same load with a working tier
    engine.store.remove(plan.keys[HOLE])
    caches, expected = worker.writer.kv_caches, expected_worker.writer.kv_caches
    for cache, want in zip(caches, expected, strict=True):
        assert bool(want.any())
        torch.testing.assert_close(cache, want, atol=0, rtol=0)
    assert worker.store(StoreRequest("r", prompt, plan.missing_segments)) == 1
    assert engine.store.contains_many([plan.keys[HOLE]])[0]


def test_a_segment_two_requests_of_one_step_computed_is_stored_and_counted_once(
    new_engine, rag_texts, monkeypatch
):
    """Two requests with the same missing document are prefilled in one step, each at its
    own blocks: the document is written to the tier once, from the first request's rows,
    and counted once (`take_stored`, which the connector's stats carry to
    `holeblend_stored_segments_total`)."""
    engine = new_engine()
    prompt = engine.build_prompt(*rag_texts)
    keys = engine.segment_keys(prompt)
    last = max(i for i, key in enumerate(keys) if key is not None)
    full = engine.prefill(prompt, "full", 1.0)
    engine.store.remove(keys[last])  # full prefill stored it: start from a miss
    per_request = -(-prompt.num_tokens // BLOCK)
    worker, blocks = _capturing_worker(engine, 2 * per_request * BLOCK)
    blocks_a, blocks_b = blocks[:per_request], blocks[per_request:]
    requests = [
        StoreRequest("a", prompt, (last,), blocks_a),
        StoreRequest("b", prompt, (last,), blocks_b),
    ]
    worker.arm_capture(requests)
    # One forward for both: each layer's cache update writes both requests' tokens.
    writer, n = worker.writer, prompt.num_tokens
    slots = torch.cat([writer.slots(b, 0, n) for b in (blocks_a, blocks_b)])
    for layer, module in enumerate(writer.attention_modules):
        k, v = (kv[layer].transpose(0, 1).repeat(2, 1, 1) for kv in (full.k, full.v))
        module.impl.do_kv_cache_update(module, k, v, writer.kv_caches[layer], slots)
    written = []
    real_put = engine.store.put
    monkeypatch.setattr(engine.store, "put", lambda kv: written.append(kv.key) or real_put(kv))
    assert worker.store_many(requests) == (1, 0)
    assert written == [keys[last]]
    assert worker.take_stored() == {"forward": 1}
    assert worker.take_stored() == {}
