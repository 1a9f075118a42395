"""Blend cached per-segment KV into one prompt's KV cache (CacheBlend, hole-aware).

1. Cached K is re-rotated from the positions it was computed at to its positions in
   this prompt; cached V needs nothing.
2. Layers up to and including the check layer run in full over every token, so their
   K/V are exact. At the check layer the fresh K of each cached token is compared with
   its cached K; the strategy picks the cached tokens whose K moved most.
3. The recompute set is those tokens plus every token without cached KV (holes,
   separators, the uncached tail). Later layers compute hidden states only for it;
   each of its tokens attends to all cache slots up to its own true position, reading
   fresh K/V where a slot was recomputed and the cached K/V elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from holeblend_runtime.attention import CausalPlan, plan_causal
from holeblend_runtime.blend_config import BlendConfig, check_ratio
from holeblend_runtime.kv_store import SegmentKV
from holeblend_runtime.llama import Llama
from holeblend_runtime.rope import RopeTable, rerotate
from holeblend_runtime.selection import SelectionStrategy, make_strategy, num_to_select


@dataclass(frozen=True)
class CachedSpan:
    """A reused segment: where it sits in the prompt and its cached KV."""

    start: int
    end: int
    kv: SegmentKV


@dataclass(frozen=True, eq=False)
class BlendResult:
    # [vocab] next-token logits at the last prompt position.
    logits: torch.Tensor
    # [layers, kv_heads, tokens, head_dim]: the prompt's blended KV cache.
    k: torch.Tensor
    v: torch.Tensor
    # Sorted positions computed in the layers after the check layer.
    recomputed: torch.Tensor
    # Sorted positions of the cached tokens the strategy chose (a subset of `recomputed`).
    selected: torch.Tensor
    # Check-layer squared K deviation of every cached token, in position order.
    deviation: torch.Tensor


class Blender:
    def __init__(self, model: Llama, config: BlendConfig) -> None:
        if config.check_layer >= model.num_layers:
            raise ValueError(
                f"check_layer: must be below the model's {model.num_layers} layers, "
                f"got {config.check_layer}"
            )
        self.model = model
        self.config = config

    def blend(
        self,
        token_ids: torch.Tensor,
        spans: Sequence[CachedSpan],
        ratio: float,
        hole_ranges: Sequence[tuple[int, int]] = (),
        strategy: SelectionStrategy | None = None,
    ) -> BlendResult:
        """Prefill `token_ids` reusing `spans`; `hole_ranges` bound per-section selection."""
        check_ratio(ratio)
        cache = self._cache(token_ids.shape[0], spans)
        h = self._full_layers(token_ids, cache)
        check = self._check_layer(h, cache, _Selection(ratio, tuple(hole_ranges), strategy))
        h = check.hidden
        rope = RopeTable(cache.rope.cos[check.recomputed], cache.rope.sin[check.recomputed])
        for layer in range(self.config.check_layer + 1, self.model.num_layers):
            h = self._sparse_layer(layer, h, rope, cache, check)
        logits = self.model.logits(h[-1:])[0]
        return BlendResult(
            logits, cache.k, cache.v, check.recomputed, check.selected, check.deviation
        )

    def assemble_cached_kv(
        self, spans: Sequence[CachedSpan], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K/V buffers holding every span's KV, K re-rotated to the span's positions, and
        which positions are cached (the other slots are uninitialized)."""
        device = self.model.device
        k_cache, v_cache = self.model.new_kv(num_tokens)
        is_cached = torch.zeros(num_tokens, dtype=torch.bool, device=device)
        for span in spans:
            self._check_span(span, num_tokens)
            to_positions = torch.arange(span.start, span.end, device=device)
            from_positions = span.kv.positions.to(device)
            k = span.kv.k.to(device)
            theta = self.model.config.rope_theta
            k_cache[:, :, span.start : span.end] = rerotate(
                k, from_positions, to_positions, theta=theta
            )
            v_cache[:, :, span.start : span.end] = span.kv.v.to(device)
            is_cached[span.start : span.end] = True
        return k_cache, v_cache, is_cached

    def _cache(self, num_tokens: int, spans: Sequence[CachedSpan]) -> _BlendCache:
        k, v, is_cached = self.assemble_cached_kv(spans, num_tokens)
        rope = self.model.rope(torch.arange(num_tokens, device=self.model.device))
        return _BlendCache(rope, k, v, is_cached)

    def _check_span(self, span: CachedSpan, num_tokens: int) -> None:
        if not 0 <= span.start < span.end <= num_tokens:
            raise ValueError(f"spans: range ({span.start}, {span.end}) is outside the prompt")
        if span.kv.num_tokens != span.end - span.start:
            raise ValueError(
                f"spans: KV of {span.kv.num_tokens} tokens for range ({span.start}, {span.end})"
            )

    def _full_layers(self, token_ids: torch.Tensor, cache: _BlendCache) -> torch.Tensor:
        """Layers below the check layer, every token, plain causal attention."""
        h = self.model.embed(token_ids)
        for layer in range(self.config.check_layer):
            q, k, v = self.model.qkv(layer, h, cache.rope)
            cache.k[layer], cache.v[layer] = k, v
            h = self.model.attend_and_mlp(layer, h, q, k, v, plan=None)
        return h

    def _check_layer(
        self, h: torch.Tensor, cache: _BlendCache, selection: _Selection
    ) -> _CheckOutcome:
        """Fresh QKV for every token; choose the recompute set; attention for it only."""
        layer = self.config.check_layer
        q, k, v = self.model.qkv(layer, h, cache.rope)
        cached_positions = cache.is_cached.nonzero().squeeze(1)
        fresh, stored = k[:, cached_positions], cache.k[layer, :, cached_positions]
        deviation = (fresh - stored).pow(2).sum((0, 2))
        selected = self._select(deviation, cached_positions, selection)
        uncached = (~cache.is_cached).nonzero().squeeze(1)
        recomputed = torch.cat([selected, uncached]).sort().values
        # The check layer's K/V stay fresh for every token: computing them was the price
        # of the deviation, and they are exact.
        cache.k[layer], cache.v[layer] = k, v
        plan = plan_causal(recomputed, h.shape[0], h.dtype)
        hidden = self.model.attend_and_mlp(layer, h[recomputed], q[:, recomputed], k, v, plan)
        return _CheckOutcome(hidden, recomputed, selected, deviation, plan)

    def _select(
        self, deviation: torch.Tensor, cached_positions: torch.Tensor, selection: _Selection
    ) -> torch.Tensor:
        """Sorted positions of the chosen cached tokens (per section if configured)."""
        strategy = selection.strategy or make_strategy(self.config)
        sections = self._sections(cached_positions, selection.hole_ranges)
        picks = []
        for members in sections:
            k = num_to_select(members.shape[0], selection.ratio)
            picks.append(cached_positions[members[strategy.select(deviation[members], k)]])
        return torch.cat(picks).sort().values

    def _sections(
        self, cached_positions: torch.Tensor, hole_ranges: tuple[tuple[int, int], ...]
    ) -> list[torch.Tensor]:
        """Indexes into cached_positions per section: all of them, or split at each hole."""
        everything = torch.arange(cached_positions.shape[0], device=cached_positions.device)
        if not self.config.per_section or not hole_ranges:
            return [everything]
        hole_starts = torch.tensor(
            sorted(s for s, _ in hole_ranges), device=cached_positions.device
        )
        section_of = torch.searchsorted(hole_starts, cached_positions)
        return [everything[section_of == section] for section in section_of.unique()]

    def _sparse_layer(
        self, layer: int, h: torch.Tensor, rope: RopeTable, cache: _BlendCache, check: _CheckOutcome
    ) -> torch.Tensor:
        """One layer for the recompute set only; reused K/V stay in the cache."""
        q, k, v = self.model.qkv(layer, h, rope)
        keys, values = cache.k[layer], cache.v[layer]
        keys[:, check.recomputed], values[:, check.recomputed] = k, v
        return self.model.attend_and_mlp(layer, h, q, keys, values, check.plan)


@dataclass(frozen=True, eq=False)
class _BlendCache:
    """One request's KV buffers (filled in place, layer by layer) and RoPE table."""

    rope: RopeTable
    k: torch.Tensor
    v: torch.Tensor
    # [tokens] bool: the slot holds reused KV.
    is_cached: torch.Tensor


@dataclass(frozen=True)
class _Selection:
    ratio: float
    hole_ranges: tuple[tuple[int, int], ...]
    # None: the strategy the config names.
    strategy: SelectionStrategy | None


@dataclass(frozen=True, eq=False)
class _CheckOutcome:
    """What the check layer decided, shared by every later layer."""

    hidden: torch.Tensor
    recomputed: torch.Tensor
    selected: torch.Tensor
    deviation: torch.Tensor
    # Attention of the recompute set; None when every token is recomputed.
    plan: CausalPlan | None
