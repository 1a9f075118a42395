"""Selection strategies: hand-built cases, then the blender on the real model."""

import dataclasses

import pytest
import torch

from holeblend_runtime.blend.blender import Blender, _Stages
from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.selection import CheckScores, Selector, make_strategy, needs
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import preset_config, random_weights

HOLE = 3  # segment index: segments 0 and 1 are the exact prefix, 2 and 4+ are reused
STRATEGIES = ["kDeviation", "vDeviation", "kvDeviation", "sinks", "query", "random"]
MIXES = ["sinks:0.25+kDeviation", "query:0.3+sinks:0.2+kDeviation", "kvDeviation:0.5+random"]


def _select(selection: str, scores: CheckScores, k: int) -> list[torch.Tensor]:
    selector = make_strategy(BlendConfig(selection=selection))
    counts = selector.split(k, scores.num_tokens)
    return list(selector.select(scores, counts))


def _scores(n: int = 12, **fields) -> CheckScores:
    k_deviation = fields.pop("k_deviation", torch.arange(n, dtype=torch.float32))
    return CheckScores(k_deviation, **fields)


def test_k_deviation_picks_the_largest_k_deviation():
    (picks,) = _select("kDeviation", _scores(k_deviation=torch.tensor([3.0, 9, 1, 7, 5])), 2)
    assert sorted(picks.tolist()) == [1, 3]


def test_v_and_kv_deviation_read_v():
    k = torch.tensor([10.0, 0, 0, 0])
    v = torch.tensor([0.0, 0, 5, 1])
    (by_v,) = _select("vDeviation", _scores(k_deviation=k, v_deviation=v), 1)
    (by_kv,) = _select("kvDeviation", _scores(k_deviation=k, v_deviation=v), 2)
    assert by_v.tolist() == [2]
    # Each normalized by its mean: K's 10 -> 4.0, V's 5 -> 3.33; the 1 of V -> 0.67.
    assert sorted(by_kv.tolist()) == [0, 2]
    with pytest.raises(ValueError, match="v_deviation"):
        _select("vDeviation", _scores(4), 1)


def test_sinks_pick_the_starts_of_every_reused_segment_first():
    # Three segments of 4, 3 and 5 tokens: offsets 0 at indexes 0, 4 and 7.
    offsets = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4])
    (starts,) = _select("sinks", _scores(12, segment_offset=offsets), 3)
    (more,) = _select("sinks", _scores(12, segment_offset=offsets), 6)
    assert sorted(starts.tolist()) == [0, 4, 7]
    assert sorted(more.tolist()) == [0, 1, 4, 5, 7, 8]


def test_query_picks_the_tokens_the_question_attends_to():
    attention = torch.tensor([0.01, 0.5, 0.02, 0.3, 0.0, 0.1])
    (picks,) = _select("query", _scores(6, attention=attention), 2)
    assert sorted(picks.tolist()) == [1, 3]
    # Without question tokens: K deviation.
    (fallback,) = _select("query", _scores(6), 2)
    assert sorted(fallback.tolist()) == [4, 5]


def test_a_mix_gives_each_part_its_share_and_never_picks_a_token_twice():
    n = 40
    offsets = torch.arange(n) % 10
    attention = torch.rand(n, generator=torch.Generator().manual_seed(1))
    scores = _scores(n, segment_offset=offsets, attention=attention)
    selector = make_strategy(BlendConfig(selection="query:0.3+sinks:0.2+kDeviation"))
    counts = selector.split(10, n)
    assert counts == (3, 2, 5)
    query, sinks, deviation = selector.select(scores, counts)
    assert sorted(sinks.tolist()) == [0, 10]  # offset 0 of the first segments not taken
    everything = torch.cat([query, sinks, deviation]).tolist()
    assert len(set(everything)) == 10
    # The deviation part takes the largest deviations the others left.
    rest = sorted(set(range(n)) - set(query.tolist()) - set(sinks.tolist()), reverse=True)
    assert sorted(deviation.tolist()) == sorted(rest[:5])


@pytest.mark.parametrize(
    ("shares", "k", "expected"),
    [((0.25, 0.75), 10, (3, 7)), ((0.5, 0.5), 3, (2, 1)), ((0.3, 0.7), 0, (0, 0))],
)
def test_split_counts_sum_to_k_by_largest_remainder(shares, k, expected):
    from holeblend_runtime.blend.selection import KDeviation, Sinks

    selector = Selector([(Sinks(), shares[0]), (KDeviation(), shares[1])])
    assert selector.split(k, 20) == expected
    assert sum(selector.split(k, 20)) == k


def test_filter_stages_cost_what_the_budget_costs_at_one_width():
    """Budget-neutral gradual filtering: the token-layers of the narrowing parts over all
    stages equal the budget's at one width; pinned parts (sinks) are not narrowed."""
    selector = make_strategy(BlendConfig(selection="sinks:0.2+kDeviation"))
    sections = (torch.arange(400),)
    # 1 filter layer: 3 sparse layers wide (2x), then 24 at the final width.
    stages = _Stages.plan(selector, (100,), sections, 30, stage_layers=(3, 24), bucket=1)
    (sinks, wide), (final,) = stages.counts[0], stages.narrow_to[0]
    assert sinks == 20 and wide == 2 * final
    assert 3 * wide + 24 * final <= 80 * 27 < 3 * (wide + 2) + 24 * (final + 1)
    # Two filter layers: 3x, 2x, then 1x.
    two = _Stages.plan(selector, (100,), sections, 30, stage_layers=(2, 3, 22), bucket=1)
    (_, wide), (middle,), (final,) = two.counts[0], two.narrow_to[0], two.narrow_to[1]
    assert (wide, middle) == (3 * final, 2 * final)
    assert 2 * wide + 3 * middle + 22 * final <= 80 * 27
    # Widening never asks for more than the section holds.
    capped = _Stages.plan(selector, (100,), (torch.arange(110),), 0, (20, 7), bucket=1)
    assert sum(capped.counts[0]) <= 110
    # On accelerators every stage's recompute set is a multiple of the bucket.
    bucketed = _Stages.plan(selector, (100,), sections, 30, stage_layers=(3, 24), bucket=64)
    assert (bucketed.counts[0][0] + bucketed.counts[0][1] + 30) % 64 == 0
    assert (20 + bucketed.narrow_to[0][0] + 30) % 64 == 0


def test_needs_says_what_the_selection_reads():
    assert needs(BlendConfig(selection="kDeviation")) == frozenset()
    assert needs(BlendConfig()) == {"v"}  # the default, kvDeviation
    assert needs(BlendConfig(selection="query:0.5+kvDeviation")) == {"query", "v"}


def _question_attention(model, q, keys, positions):
    """The blender's grouped product, scale and causal mask, and the same written out as a
    per-head loop in float32."""

    class _Cache:
        k = keys

        class on_device:
            query_rows = torch.arange(len(positions))
            active = positions

    got = Blender(model, BlendConfig())._query_attention(q, _Cache, 0)
    c = model.config
    group = c.num_heads // c.num_kv_heads
    expected = torch.zeros(keys.shape[2])
    for head in range(c.num_heads):
        k = keys[0, head // group].float()
        for row, position in enumerate(positions.tolist()):
            logits = q[head, row].float() @ k[: position + 1].T / c.head_dim**0.5
            expected[: position + 1] += logits.softmax(-1)
    return got, expected


def test_query_attention_equals_attention_computed_head_by_head(reference_engine):
    model = reference_engine.model
    c = model.config
    generator = torch.Generator().manual_seed(0)
    num_slots, positions = 30, torch.tensor([20, 25, 29])
    q = torch.randn(c.num_heads, 3, c.head_dim, generator=generator)
    keys = torch.randn(1, c.num_kv_heads, num_slots, c.head_dim, generator=generator)
    got, expected = _question_attention(model, q, keys, positions)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_question_s_attention_in_float16_stays_finite_where_q_dot_k_passes_its_range():
    """A key far from the others (an attention sink: 80 in every element, queries near
    64): q . k is about 82,000, past float16's 65504, while the scaled logit (about
    20,000) is not. The question's attention goes to that key, as in float32, instead of
    the NaN a softmax of infinities gives every slot."""
    dtype = torch.float16
    c = dataclasses.replace(preset_config("smollm2-135m"), num_layers=3)
    model = Llama(c, random_weights(c, dtype=dtype), dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    num_slots, positions = 30, torch.tensor([20, 25, 29])
    q = (60 + 8 * torch.rand(c.num_heads, 3, c.head_dim, generator=generator)).to(dtype)
    keys = 2 * torch.rand(1, c.num_kv_heads, num_slots, c.head_dim, generator=generator) - 1
    keys[:, :, 9] = 80.0
    got, expected = _question_attention(model, q, keys.to(dtype), positions)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)


def _cached_positions(prefill, prompt):
    prefix_end = prompt.segments[1].end
    return sorted(p for s, e in prefill.reuse.hit_ranges for p in range(s, e) if p >= prefix_end)


@pytest.mark.parametrize("selection", STRATEGIES + MIXES)
def test_every_strategy_picks_its_budget_among_cached_tokens_only(
    cached_engine, rag_texts, selection
):
    engine, prompt = cached_engine(rag_texts, hole=HOLE, selection=selection)
    prefill = engine.prefill(prompt, "hole", ratio=0.2)
    cached = _cached_positions(prefill, prompt)
    selected = prefill.selected_positions.tolist()
    assert len(set(selected)) == len(selected) == round(0.2 * len(cached))
    assert set(selected) <= set(cached)


@pytest.mark.parametrize("selection", ["sinks", "query", "kvDeviation", "sinks:0.5+kDeviation"])
def test_ratio_zero_and_one_limits(cached_engine, rag_texts, selection):
    engine, prompt = cached_engine(rag_texts, hole=HOLE, selection=selection)
    none = engine.prefill(prompt, "hole", ratio=0.0)
    assert none.selected_positions.numel() == 0
    engine.store.remove(engine.segment_keys(prompt)[HOLE])
    every = engine.prefill(prompt, "hole", ratio=1.0)
    assert every.selected_positions.tolist() == _cached_positions(every, prompt)
    full = engine.prefill(prompt, "full", ratio=1.0)
    torch.testing.assert_close(every.logits, full.logits, atol=2e-3, rtol=0)


def test_sinks_in_the_engine_recompute_the_first_tokens_of_each_reused_document(
    cached_engine, rag_texts
):
    engine, prompt = cached_engine(rag_texts, hole=HOLE, selection="sinks")
    prefill = engine.prefill(prompt, "hole", ratio=0.05)
    starts = {s for s, _ in prefill.reuse.hit_ranges if s >= prompt.segments[1].end}
    selected = set(prefill.selected_positions.tolist())
    # Each reused document's first token is picked before any second token.
    assert len(selected) >= len(starts)
    assert starts <= selected


def test_query_selection_follows_the_question_not_the_deviation(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE, selection="query")
    by_query = engine.prefill(prompt, "hole", ratio=0.2).selected_positions
    deviation_engine, _ = cached_engine(rag_texts, hole=HOLE)
    by_deviation = deviation_engine.prefill(prompt, "hole", ratio=0.2).selected_positions
    assert by_query.shape == by_deviation.shape and not torch.equal(by_query, by_deviation)


def test_filter_layers_narrow_the_choice_within_the_budget(cached_engine, rag_texts):
    plain_engine, prompt = cached_engine(rag_texts, hole=HOLE)
    plain = plain_engine.prefill(prompt, "hole", ratio=0.15)
    engine, _ = cached_engine(rag_texts, hole=HOLE, filter_layers=(3, 6))
    filtered = engine.prefill(prompt, "hole", ratio=0.15)
    cached = _cached_positions(plain, prompt)
    # Budget-neutral: fewer kept after the last filter layer than the plain budget.
    assert 0 < filtered.selected_positions.numel() < plain.selected_positions.numel()
    assert set(filtered.selected_positions.tolist()) <= set(cached)
    assert not torch.equal(filtered.selected_positions, plain.selected_positions)
    # After the last filter layer the recompute set is the kept picks plus the tokens
    # without cached KV, as without filter layers.
    uncached = set(plain.recomputed_positions.tolist()) - set(plain.selected_positions.tolist())
    expected = sorted(uncached | set(filtered.selected_positions.tolist()))
    assert filtered.recomputed_positions.tolist() == expected


def test_filter_layers_at_ratio_one_reproduce_full_prefill(cached_engine, rag_texts):
    engine, prompt = cached_engine(
        rag_texts, hole=HOLE, selection="sinks:0.3+kDeviation", filter_layers=(4,)
    )
    blended = engine.prefill(prompt, "hole", ratio=1.0)
    full = engine.prefill(prompt, "full", ratio=1.0)
    torch.testing.assert_close(blended.logits, full.logits, atol=2e-3, rtol=0)


@pytest.mark.parametrize("shares", [(0.25, 0.25), (0.75, 0.75), (1.5, -0.5)])
def test_a_selector_whose_shares_do_not_sum_to_one_is_refused(shares):
    """Such shares would pick fewer tokens than the budget, or more, taking some twice."""
    from holeblend_runtime.blend.selection import KDeviation, Sinks

    with pytest.raises(ValueError, match=r"selection: shares must .* sum to 1"):
        Selector([(Sinks(), shares[0]), (KDeviation(), shares[1])])
