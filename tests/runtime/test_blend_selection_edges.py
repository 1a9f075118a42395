"""The blender's selection at its edges (on a small random-weight model): deviations and
the question's attention in half precision, and gradual filtering against the budget at
one width and at ratio 1.0."""

import dataclasses

import pytest
import torch

from holeblend_runtime.blend.blender import Blender, CachedSpan
from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.kv.store import SegmentKV
from holeblend_runtime.model.config import ModelConfig
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import random_weights

CONFIG = ModelConfig(
    model_id="tiny", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=96, rope_theta=10000.0, rms_norm_eps=1e-5, vocab_size=100,
    context_length=512, bos_token_id=1, eos_token_id=2, add_bos_token=False,
    tie_word_embeddings=True,
)  # fmt: skip


def _span(start: int, k: torch.Tensor, v: torch.Tensor) -> CachedSpan:
    """A span cached at its own positions (no re-rotation)."""
    end = start + k.shape[2]
    return CachedSpan(start, end, SegmentKV("k", k, v, torch.arange(start, end), "tiny"))


@pytest.mark.parametrize("selection", ["kDeviation", "kvDeviation"])
def test_float16_deviations_past_the_float16_range_still_rank_the_tokens(selection):
    """Cached K far from the fresh K (by 40, 80, ... 1200 in every element): every token's
    squared distance summed over heads and dimensions but the first one's is past
    float16's 65504, yet the tokens that moved most are the ones recomputed."""
    dtype = torch.float16
    model = Llama(CONFIG, random_weights(CONFIG, dtype=dtype), dtype=dtype)
    shape = (CONFIG.num_layers, CONFIG.num_kv_heads, 30, CONFIG.head_dim)
    moved_by = 40.0 * torch.arange(1, 31)
    k = (torch.ones(shape) * moved_by[None, None, :, None]).to(dtype)
    v = torch.zeros(shape, dtype=dtype)
    token_ids = torch.randint(3, 100, (40,), generator=torch.Generator().manual_seed(0))
    blender = Blender(model, BlendConfig(check_layer=1, selection=selection))
    result = blender.blend(token_ids, [_span(5, k, v)], 0.2)
    assert torch.isfinite(result.deviation).all()
    assert result.deviation.argsort().tolist() == list(range(30))
    assert result.selected.tolist() == list(range(29, 35))


def _sparse_rows(model: Llama, blender: Blender, token_ids, spans, ratio: float) -> int:
    """Rows that attention and the MLP compute in the check layer and every later layer
    (the bulk of a layer's work), counted as the blend calls them."""
    rows, attend_and_mlp = [], model.attend_and_mlp

    def counted(layer, h, *args):
        if layer >= blender.config.check_layer:
            rows.append(h.shape[0])
        return attend_and_mlp(layer, h, *args)

    model.attend_and_mlp = counted
    try:
        blender.blend(token_ids, spans, ratio, needs_logits=False)
    finally:
        model.attend_and_mlp = attend_and_mlp
    return sum(rows)


@pytest.mark.parametrize("filter_layers", [(4,), (3, 6), (11,)])
def test_filter_layers_compute_the_budget_at_one_width_up_to_one_token(filter_layers):
    """Budget-neutral gradual filtering, counted where the work is: the wider set's rows
    in the layers before each filter layer and the narrower one's from it on (a filter
    layer's attention and MLP run for what it keeps, the last layer's too) add up to at
    most what the budget costs without filter layers, and one more kept token would
    pass it."""
    config = dataclasses.replace(CONFIG, num_layers=12, context_length=1024)
    model = Llama(config, random_weights(config))
    generator = torch.Generator().manual_seed(0)
    shape = (config.num_layers, config.num_kv_heads, 600, config.head_dim)
    spans = [_span(20, torch.randn(shape, generator=generator), torch.randn(shape))]
    token_ids = torch.randint(3, 100, (640,), generator=generator)
    check_layer, ratio = 2, 0.3
    plain = Blender(model, BlendConfig(check_layer=check_layer, selection="kDeviation"))
    budget = _sparse_rows(model, plain, token_ids, spans, ratio)
    filtering = Blender(
        model,
        BlendConfig(check_layer=check_layer, selection="kDeviation", filter_layers=filter_layers),
    )
    spent = _sparse_rows(model, filtering, token_ids, spans, ratio)
    # One more kept token is one more row in every layer, and one more per filter layer
    # still ahead in the layers before each filter layer.
    bounds = (check_layer, *filter_layers, config.num_layers)
    per_token = sum(
        (len(filter_layers) + 1 - stage) * (end - start)
        for stage, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False))
    )
    assert spent <= budget < spent + per_token


@pytest.mark.parametrize("num_cached", [1, 4, 40])
def test_ratio_one_recomputes_every_cached_token_whatever_the_filter_layers(num_cached):
    """Ratio 1.0 is full prefill, also with a filter layer at the last layer (where the
    wider set is barely wider) and over a few cached tokens (where a share of them rounds
    down): no filter layer drops a cached token."""
    model = Llama(CONFIG, random_weights(CONFIG))
    generator = torch.Generator().manual_seed(0)
    shape = (CONFIG.num_layers, CONFIG.num_kv_heads, num_cached, CONFIG.head_dim)
    spans = [_span(3, torch.randn(shape, generator=generator), torch.randn(shape))]
    token_ids = torch.randint(3, 100, (num_cached + 8,), generator=generator)
    config = BlendConfig(check_layer=1, selection="kDeviation", filter_layers=(3,))
    filtered = Blender(model, config).blend(token_ids, spans, 1.0)
    plain = Blender(model, BlendConfig(check_layer=1, selection="kDeviation")).blend(
        token_ids, spans, 1.0
    )
    assert filtered.selected.tolist() == list(range(3, 3 + num_cached))
    assert filtered.recomputed.tolist() == list(range(num_cached + 8))
    torch.testing.assert_close(filtered.logits, plain.logits, atol=1e-5, rtol=0)
