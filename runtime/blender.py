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

An exact prefix (`PrefixKV`: e.g. the system prompt, cached alone from position 0, whose
KV is what full prefill would compute) is taken as it is, like a prefix cache: its
tokens are never computed, compared or selected; every step above runs on the tokens
after it, which attend to it.
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


@dataclass(frozen=True, eq=False)
class PrefixKV:
    """K/V buffers of the whole prompt whose first `num_tokens` slots hold exact KV.

    The blender fills the other slots in place and returns these buffers.
    """

    # [layers, kv_heads, prompt tokens, head_dim].
    k: torch.Tensor
    v: torch.Tensor
    num_tokens: int


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
        prefix: PrefixKV | None = None,
    ) -> BlendResult:
        """Prefill `token_ids` reusing `spans` (and an exact `prefix`, whose tokens are
        never computed); `hole_ranges` bound per-section selection."""
        check_ratio(ratio)
        cache = self._cache(token_ids.shape[0], spans, prefix)
        h = self._full_layers(token_ids[cache.start :], cache)
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
        self,
        spans: Sequence[CachedSpan],
        num_tokens: int,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K/V buffers holding every span's KV, K re-rotated to the span's positions, and
        which positions are cached (the other slots are left as they were: uninitialized
        in new buffers). `buffers` None: new ones."""
        device = self.model.device
        k_cache, v_cache = buffers if buffers is not None else self.model.new_kv(num_tokens)
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

    def _cache(
        self, num_tokens: int, spans: Sequence[CachedSpan], prefix: PrefixKV | None
    ) -> _BlendCache:
        start = 0 if prefix is None else prefix.num_tokens
        if any(span.start < start for span in spans):
            raise ValueError(f"spans: a span starts inside the exact prefix of {start} tokens")
        buffers = None if prefix is None else (prefix.k, prefix.v)
        k, v, is_cached = self.assemble_cached_kv(spans, num_tokens, buffers)
        rope = self.model.rope(torch.arange(num_tokens, device=self.model.device))
        return _BlendCache(rope, k, v, is_cached, start)

    def _check_span(self, span: CachedSpan, num_tokens: int) -> None:
        if not 0 <= span.start < span.end <= num_tokens:
            raise ValueError(f"spans: range ({span.start}, {span.end}) is outside the prompt")
        if span.kv.num_tokens != span.end - span.start:
            raise ValueError(
                f"spans: KV of {span.kv.num_tokens} tokens for range ({span.start}, {span.end})"
            )

    def _full_layers(self, token_ids: torch.Tensor, cache: _BlendCache) -> torch.Tensor:
        """Layers below the check layer, every token after the exact prefix, causal."""
        h = self.model.embed(token_ids)
        rope, plan = cache.rope_after_prefix(), cache.plan_after_prefix(h.dtype)
        for layer in range(self.config.check_layer):
            q, k, v = self.model.qkv(layer, h, rope)
            cache.k[layer, :, cache.start :], cache.v[layer, :, cache.start :] = k, v
            h = self.model.attend_and_mlp(layer, h, q, cache.k[layer], cache.v[layer], plan)
        return h

    def _check_layer(
        self, h: torch.Tensor, cache: _BlendCache, selection: _Selection
    ) -> _CheckOutcome:
        """Fresh QKV for every token; choose the recompute set; attention for it only."""
        layer, start = self.config.check_layer, cache.start
        q, k, v = self.model.qkv(layer, h, cache.rope_after_prefix())
        is_cached = cache.is_cached[start:]
        cached_positions = is_cached.nonzero().squeeze(1) + start
        fresh, stored = k[:, cached_positions - start], cache.k[layer, :, cached_positions]
        deviation = (fresh - stored).pow(2).sum((0, 2))
        selected = self._select(deviation, cached_positions, selection)
        uncached = (~is_cached).nonzero().squeeze(1) + start
        recomputed = torch.cat([selected, uncached]).sort().values
        # The check layer's K/V stay fresh for every token: computing them was the price
        # of the deviation, and they are exact.
        cache.k[layer, :, start:], cache.v[layer, :, start:] = k, v
        plan = plan_causal(recomputed, cache.num_tokens, h.dtype)
        rows = recomputed - start
        hidden = self.model.attend_and_mlp(
            layer, h[rows], q[:, rows], cache.k[layer], cache.v[layer], plan
        )
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
    # Tokens of the exact prefix: never computed, compared or selected.
    start: int

    @property
    def num_tokens(self) -> int:
        return self.is_cached.shape[0]

    def rope_after_prefix(self) -> RopeTable:
        return RopeTable(self.rope.cos[self.start :], self.rope.sin[self.start :])

    def plan_after_prefix(self, dtype: torch.dtype) -> CausalPlan | None:
        positions = torch.arange(self.start, self.num_tokens, device=self.is_cached.device)
        return plan_causal(positions, self.num_tokens, dtype)


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
