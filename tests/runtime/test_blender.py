"""Blending on the real model: exactness at ratio 1, re-rotation, the recompute set."""

import dataclasses

import pytest
import torch

from holeblend_runtime.blend import blender as blender_module
from holeblend_runtime.blend.blender import Blender, CachedSpan
from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.kv.store import SegmentKV
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import preset_config, random_weights
from holeblend_runtime.model.rope import apply_rope, rerotate, rope_table

HOLE = 2  # segment index of the second document


def _with_question(texts, question):
    system, documents, _ = texts
    return system, documents, question


def _positions(ranges):
    return {p for start, end in ranges for p in range(start, end)}


@pytest.mark.parametrize("mode", ["hole", "prefix"])
@pytest.mark.parametrize("check_layer", [1, 3])
def test_ratio_one_reproduces_full_prefill(cached_engine, rag_texts, mode, check_layer):
    engine, prompt = cached_engine(rag_texts, hole=HOLE, check_layer=check_layer)
    full = engine.prefill(prompt, "full")
    blended = engine.prefill(prompt, mode, ratio=1.0)
    assert blended.num_reused_tokens > 0
    torch.testing.assert_close(blended.logits, full.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(blended.k, full.k, atol=1e-4, rtol=0)
    torch.testing.assert_close(blended.v, full.v, atol=1e-4, rtol=0)


def test_ratio_one_reproduces_full_prefill_on_a_pure_hit(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=None)
    blended = engine.prefill(prompt, "hole", ratio=1.0)
    assert blended.reuse.mode == "pure-hit"
    full = engine.prefill(prompt, "full")
    torch.testing.assert_close(blended.logits, full.logits, atol=1e-4, rtol=0)


def test_low_ratio_changes_logits_but_keeps_them_close(cached_engine, rag_texts):
    """The reuse is real: at ratio 0.15 the answer differs a little from full prefill."""
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    full = engine.prefill(prompt, "full")
    blended = engine.prefill(prompt, "hole", ratio=0.15)
    difference = (blended.logits - full.logits).abs().max().item()
    assert 1e-3 < difference < 0.5 * full.logits.abs().max().item()


def test_rerotation_composes_rotations_exactly():
    k = torch.randn(2, 3, 7, 64)
    start, end = torch.arange(5, 12), torch.arange(300, 307)
    at_start = apply_rope(k, rope_table(start, head_dim=64, theta=1e5, dtype=torch.float32))
    at_end = apply_rope(k, rope_table(end, head_dim=64, theta=1e5, dtype=torch.float32))
    torch.testing.assert_close(rerotate(at_start, start, end, theta=1e5), at_end, atol=2e-5, rtol=0)


def test_rerotated_cached_k_equals_first_layer_k_of_full_prefill(cached_engine, rag_texts):
    """Documents cached alone from position 0, moved to their prompt positions."""
    engine, prompt = cached_engine(rag_texts, hole=None, cache_after_system=False)
    keys = engine.segment_keys(prompt)
    spans = [
        CachedSpan(segment.start, segment.end, engine.store.get(keys[i]))
        for i, segment in enumerate(prompt.segments)
        if keys[i] is not None
    ]
    assert all(span.kv.positions[0] == 0 for span in spans)
    k, v, is_cached = engine.blender.assemble_cached_kv(spans, prompt.num_tokens)
    full = engine.prefill(prompt, "full")
    for span in spans[1:]:
        assert span.start > 0
        torch.testing.assert_close(
            k[0, :, span.start : span.end], full.k[0, :, span.start : span.end], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            v[0, :, span.start : span.end], full.v[0, :, span.start : span.end]
        )
    assert int(is_cached.sum()) == sum(span.end - span.start for span in spans)


def test_a_scaled_rope_moves_cached_k_with_the_models_own_frequencies(reference_engine, rag_texts):
    """A model with Llama 3's RoPE scaling (per-dimension divisors of the inverse
    frequencies, read from GGUF's rope_freqs): cached K moved to its prompt position equals
    full prefill's, so the blender rotates with the scaled frequencies too."""
    from holeblend_runtime.engine import BlendEngine
    from holeblend_runtime.kv.store import LocalKVStore
    from holeblend_runtime.model.rope import RopeCache

    base = reference_engine.model
    half = base.config.head_dim // 2
    factors = tuple(1.0 + 7.0 * i / (half - 1) for i in range(half))  # 1 .. 8, low to high
    config = dataclasses.replace(base.config, rope_freq_factors=factors)
    model = Llama.__new__(Llama)
    model.__dict__.update(base.__dict__)
    model.config = config
    model.rope_cache = RopeCache(
        head_dim=config.head_dim, theta=config.rope_theta, dtype=base.dtype, device=base.device,
        max_positions=config.context_length, divisors=config.rope_divisors,
    )  # fmt: skip
    blend = BlendConfig(cache_after_system=False)
    engine = BlendEngine(model, reference_engine.tokenizer, blend, LocalKVStore(1 << 30))
    prompt = engine.build_prompt(*rag_texts)
    keys = engine.segment_keys(prompt)
    engine.cache_segments(prompt, [i for i, key in enumerate(keys) if key is not None])
    spans = [
        CachedSpan(segment.start, segment.end, engine.store.get(keys[i]))
        for i, segment in enumerate(prompt.segments)
        if keys[i] is not None
    ]
    k, _, _ = engine.blender.assemble_cached_kv(spans, prompt.num_tokens)
    full = engine.prefill(prompt, "full")
    for span in spans[1:]:
        torch.testing.assert_close(
            k[0, :, span.start : span.end], full.k[0, :, span.start : span.end], atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_hole_tokens_separators_and_tail_are_always_recomputed(cached_engine, rag_texts, ratio):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    prefill = engine.prefill(prompt, "hole", ratio=ratio)
    recomputed = set(prefill.recomputed_positions.tolist())
    reuse = prefill.reuse
    assert _positions(reuse.hole_ranges) <= recomputed
    assert _positions(prompt.separator_ranges) <= recomputed
    assert set(range(reuse.tail_start, prompt.num_tokens)) <= recomputed
    uncached = set(range(prompt.num_tokens)) - _positions(reuse.hit_ranges)
    if ratio == 0.0:
        assert recomputed == uncached


def test_top_k_is_chosen_among_cached_tokens_only(cached_engine, rag_texts):
    # K deviation alone: the reported deviation is K's, so the picks are its top k.
    engine, prompt = cached_engine(rag_texts, hole=HOLE, selection="kDeviation")
    prefill = engine.prefill(prompt, "hole", ratio=0.3)
    # The system prompt and the first document are the exact prefix, never blended.
    prefix_end = prompt.segments[1].end
    cached = sorted(p for p in _positions(prefill.reuse.hit_ranges) if p >= prefix_end)
    selected = prefill.selected_positions.tolist()
    assert set(selected) <= set(cached)
    assert len(selected) == round(0.3 * len(cached))
    is_selected = torch.tensor([p in set(selected) for p in cached])
    deviation = prefill.deviation
    assert deviation.shape == (len(cached),)
    assert deviation[is_selected].min() >= deviation[~is_selected].max()


def test_recomputed_tokens_never_attend_to_later_positions(cached_engine, rag_texts):
    """Changing only the question must not change any KV before it."""
    engine_a, prompt_a = cached_engine(
        _with_question(rag_texts, "Who built the bridge?"), hole=HOLE
    )
    engine_b, prompt_b = cached_engine(
        _with_question(rag_texts, "When did the museum open?"), hole=HOLE
    )
    a = engine_a.prefill(prompt_a, "hole", ratio=0.3)
    b = engine_b.prefill(prompt_b, "hole", ratio=0.3)
    start = prompt_a.question.start
    assert start == prompt_b.question.start
    assert torch.equal(a.selected_positions, b.selected_positions)
    torch.testing.assert_close(a.k[:, :, :start], b.k[:, :, :start], atol=1e-5, rtol=0)
    torch.testing.assert_close(a.v[:, :, :start], b.v[:, :, :start], atol=1e-5, rtol=0)
    assert not torch.allclose(a.logits, b.logits, atol=1e-2)


def test_per_section_selection_takes_the_ratio_in_every_section(cached_engine, rag_texts):
    hole = 3  # segments 0 and 1 are the exact prefix; sections: 2 | hole | 4
    engine, prompt = cached_engine(rag_texts, hole=hole, per_section=True)
    prefill = engine.prefill(prompt, "hole", ratio=0.2)
    hole_start = prompt.segments[hole].start
    selected = prefill.selected_positions
    before, after = (selected < hole_start).sum().item(), (selected > hole_start).sum().item()
    num_before, num_after = prompt.segments[2].num_tokens, prompt.segments[4].num_tokens
    assert (before, after) == (round(0.2 * num_before), round(0.2 * num_after))


def test_random_selection_is_reproducible_and_not_top_k(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE, selection="random", seed=7)
    first = engine.prefill(prompt, "hole", ratio=0.2).selected_positions
    engine.store.remove(engine.segment_keys(prompt)[HOLE])  # the prefill stored the hole
    again = engine.prefill(prompt, "hole", ratio=0.2).selected_positions
    top_k_engine, _ = cached_engine(rag_texts, hole=HOLE)
    top_k = top_k_engine.prefill(prompt, "hole", ratio=0.2).selected_positions
    assert torch.equal(first, again)
    assert first.shape == top_k.shape and not torch.equal(first, top_k)


def test_cpu_load_rotates_evenly_moved_spans_on_the_copy_bit_for_bit(monkeypatch):
    """A span stored at consecutive positions moves by one offset: on the CPU its K is
    re-rotated while it is copied. The buffers equal a copy followed by `apply_rope` of
    each moved slot by its offset, bit for bit, next to spans that did not move and one
    stored at scattered positions (re-rotated slot by slot as before)."""
    config = dataclasses.replace(
        preset_config("smollm2-135m"), num_layers=4, vocab_size=100, context_length=256
    )
    blender = Blender(Llama(config, random_weights(config)), BlendConfig(check_layer=1))
    generator = torch.Generator().manual_seed(5)

    def entry(positions: list[int]) -> SegmentKV:
        shape = (4, config.num_kv_heads, len(positions), config.head_dim)
        k, v = (torch.randn(shape, generator=generator) for _ in range(2))
        return SegmentKV("key", k, v, torch.tensor(positions), config.model_id)

    spans = [
        CachedSpan(10, 40, entry(list(range(0, 30)))),  # moved by +10
        CachedSpan(40, 60, entry(list(range(40, 60)))),  # in place
        CachedSpan(70, 90, entry(list(range(150, 170)))),  # moved by -80
        CachedSpan(95, 99, entry([3, 9, 4, 30])),  # scattered: one offset per slot
    ]
    rotated_on_copy = []
    original = blender_module._copy_span_rotated
    monkeypatch.setattr(
        blender_module, "_copy_span_rotated",
        lambda k, v, span, *rest: (rotated_on_copy.append(span.start), original(k, v, span, *rest)),
    )  # fmt: skip
    k, v, _ = blender.assemble_cached_kv(spans, 120, first_layer=1)
    assert rotated_on_copy == [10, 70]
    for span in spans:
        offsets = torch.arange(span.start, span.end) - span.kv.positions
        table = rope_table(offsets, head_dim=config.head_dim, theta=config.rope_theta,
                           dtype=torch.float32)  # fmt: skip
        expected = span.kv.k[1:] if not offsets.any() else apply_rope(span.kv.k[1:], table)
        assert torch.equal(k[1:, :, span.start : span.end], expected), span.start
        assert torch.equal(v[1:, :, span.start : span.end], span.kv.v[1:]), span.start
