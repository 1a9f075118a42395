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
after it, which attend to it. Positions inside the prefix without KV (the separator
between the system prompt and a first document cached after it) are computed with the
tokens after it, in every layer, at their true positions.

Device-clean: which positions are cached, the sections and how many tokens each picks
are host numbers known before the first layer; the deviation, the picks and the
recompute set stay on the model's device, and no layer reads a device value on the host
(a test runs the whole blend on the `meta` device, where such a read raises).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from holeblend_runtime.blend.config import BlendConfig, check_ratio
from holeblend_runtime.blend.selection import (
    NEEDS_QUERY,
    NEEDS_V,
    CheckScores,
    SelectionStrategy,
    make_strategy,
    num_to_select,
)
from holeblend_runtime.kv.store import SegmentKV
from holeblend_runtime.model.attention import AttentionPlan, plan_attention
from holeblend_runtime.model.devices import to_device_many
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.rope import RopeCache, RopeTable, apply_rope, rope_table

# On accelerators the recompute set is rounded up to a multiple of this many tokens by
# picking the next cached tokens in the strategy's order: the sparse layers' matrix
# products then meet a few dozen shapes over all traffic instead of a new one per prompt
# (each new shape costs host time in the BLAS library on its first calls). Costs at most
# 63 more recomputed tokens; their quality can only gain.
RECOMPUTE_BUCKET = 64


@dataclass(frozen=True)
class CachedSpan:
    """A reused segment: where it sits in the prompt and its cached KV."""

    start: int
    end: int
    kv: SegmentKV


@dataclass(frozen=True, eq=False)
class BlendResult:
    # [vocab] next-token logits at the last prompt position (None: not asked for).
    logits: torch.Tensor | None
    # [layers, kv_heads, tokens, head_dim]: the prompt's blended KV cache.
    k: torch.Tensor
    v: torch.Tensor
    # Sorted positions computed in the layers after the check layer (on the device).
    recomputed: torch.Tensor
    # Sorted positions of the cached tokens the strategy chose (a subset of `recomputed`).
    selected: torch.Tensor
    # Check-layer squared K deviation of every cached token, in position order.
    deviation: torch.Tensor


@dataclass(frozen=True, eq=False)
class PrefixKV:
    """K/V buffers of the whole prompt whose first `num_tokens` slots hold exact KV,
    except `fresh_positions` (inside the prefix, without KV: computed by the blend).

    The blender fills the other slots in place and returns these buffers.
    """

    # [layers, kv_heads, prompt tokens, head_dim].
    k: torch.Tensor
    v: torch.Tensor
    num_tokens: int
    fresh_positions: tuple[int, ...] = ()


class Blender:
    def __init__(self, model: Llama, config: BlendConfig) -> None:
        if config.check_layer >= model.num_layers:
            raise ValueError(
                f"check_layer: must be below the model's {model.num_layers} layers, "
                f"got {config.check_layer}"
            )
        if config.filter_layers and config.filter_layers[-1] >= model.num_layers:
            raise ValueError(
                f"filter_layers: must be below the model's {model.num_layers} layers, "
                f"got {list(config.filter_layers)}"
            )
        self.model = model
        self.config = config
        c = model.config
        # Moved K is re-rotated by its offset, looked up in one table kept per blender.
        self._rotations = RopeCache(
            head_dim=c.head_dim, theta=c.rope_theta, dtype=model.dtype, device=model.device,
            max_positions=c.context_length, divisors=c.rope_divisors,
        )  # fmt: skip

    def blend(
        self,
        token_ids: torch.Tensor,
        spans: Sequence[CachedSpan],
        ratio: float,
        hole_ranges: Sequence[tuple[int, int]] = (),
        strategy: SelectionStrategy | None = None,
        prefix: PrefixKV | None = None,
        needs_logits: bool = True,
        query: tuple[int, int] | None = None,
    ) -> BlendResult:
        """Prefill `token_ids` reusing `spans` (and an exact `prefix`, whose tokens are
        never computed); `hole_ranges` bound per-section selection.

        `needs_logits` False (the caller computes the next token itself, as vLLM does
        after the connector's range): the last token is not forced into the recompute
        set, so the cached tokens and the picks are those of the same prompt blended
        with its tail; `BlendResult.logits` is then None. `query`: the range of computed
        positions holding the question, whose attention the `query` strategy scores by
        (None or empty: that strategy falls back to K deviation)."""
        return run_to_end(
            self.blend_steps(
                token_ids, spans, ratio, hole_ranges, strategy, prefix, needs_logits, query
            )
        )

    def blend_steps(
        self,
        token_ids: torch.Tensor,
        spans: Sequence[CachedSpan],
        ratio: float,
        hole_ranges: Sequence[tuple[int, int]] = (),
        strategy: SelectionStrategy | None = None,
        prefix: PrefixKV | None = None,
        needs_logits: bool = True,
        query: tuple[int, int] | None = None,
    ) -> Generator[int, None, BlendResult]:
        """`blend`, one model layer at a time: yields after each layer the number of tokens
        it computed (its share of the work); returns the `BlendResult`. A caller may stop
        between layers and go on later (the vLLM connector spreads a blend over steps)."""
        check_ratio(ratio)
        selector = strategy or make_strategy(self.config)
        num_tokens = token_ids.shape[0]
        start = 0 if prefix is None else prefix.num_tokens
        if any(span.start < start for span in spans):
            raise ValueError(f"spans: a span starts inside the exact prefix of {start} tokens")
        # The layers below the check layer compute every position after the exact prefix
        # (and its fresh ones) whatever is cached: they are launched first, and the host
        # lays out the rest of the blend while the device runs the first of them.
        fresh = () if prefix is None else prefix.fresh_positions
        active = torch.cat(
            [torch.tensor(fresh, dtype=torch.int64), torch.arange(start, num_tokens)]
        )
        k, v = (prefix.k, prefix.v) if prefix is not None else self.model.new_kv(num_tokens)
        rope = self.model.rope_upto(num_tokens)

        def prepare(active_on_device: torch.Tensor) -> _BlendCache:
            is_cached, stored_at = self._slots(spans, num_tokens)
            layout = self._layout(
                is_cached, active, spans, start, ratio, tuple(hole_ranges), needs_logits,
                selector, query,
            )  # fmt: skip
            return self._cache(layout, active_on_device, spans, stored_at, k, v, rope)

        full = _FullLayers(active, token_ids, k, v, rope, needs_logits)
        h, cache = yield from self._full_layers(full, prepare, early=self._loads_early(spans))
        check = self._check_layer(h, cache, selector)
        yield active.shape[0]
        h = check.hidden
        rope = cache.rope_at(check.recomputed)
        filters = iter(enumerate(self.config.filter_layers))
        next_filter = next(filters, None)
        for layer in range(self.config.check_layer + 1, self.model.num_layers):
            if next_filter is not None and next_filter[1] == layer:
                computed = h.shape[0]
                check = self._filter_layer(layer, h, rope, cache, check, selector, next_filter[0])
                h, rope = check.hidden, cache.rope_at(check.recomputed)
                next_filter = next(filters, None)
                yield computed
                continue
            h = self._sparse_layer(layer, h, rope, cache, check)
            yield h.shape[0]
        logits = self.model.logits(h[-1:])[0] if needs_logits else None
        return BlendResult(
            logits, cache.k, cache.v, check.recomputed, check.selected, check.deviation
        )

    def warm_up(self, max_tokens: int) -> int:
        """Run one layer once at every recompute-set size up to `max_tokens` (on an
        accelerator, where sizes are bucketed); the number of sizes run.

        The sparse layers' matrix shapes are the bucketed recompute-set size; the first
        call on a new shape pays host time in the BLAS library (kernel choice, lazily
        loaded kernels: 0.1-0.2 ms per matmul measured, i.e. about 15 ms for a 2k-token
        request of the Llama-3-8B shape that lands on an unseen size). Paid here once, at
        start-up, instead of by the first requests of each size. On the CPU sizes are not
        bucketed and BLAS has no per-shape cost: nothing to do."""
        bucket = self._bucket()
        if bucket == 1 or max_tokens < bucket:
            return 0
        c, device = self.model.config, self.model.device
        sizes = range(bucket, max_tokens + 1, bucket)
        # The residual stream's width (the embedding's), which may differ from heads x
        # head_dim (Qwen3; a tensor-parallel shard).
        width = self.model.embed(torch.zeros(1, dtype=torch.int64, device=device)).shape[-1]
        # One layer's K/V: slot 0 is never a query, so the plan is the sparse kernel's
        # (queries at positions 1..m), not plain causal attention.
        shape = (c.num_kv_heads, sizes[-1] + 1, c.head_dim)
        k = torch.zeros(shape, device=device, dtype=self.model.dtype)
        v = torch.zeros_like(k)
        for size in sizes:
            positions = torch.arange(1, size + 1, device=device)
            h = torch.zeros(size, width, device=device, dtype=self.model.dtype)
            rope = self.model.rope(positions)
            q = self.model.qkv_into(0, h, rope, k, v, positions)
            plan = self._plan_for(positions, size + 1, h.dtype, ends_at_last_key=True)
            self.model.attend_and_mlp(0, h, q, k, v, plan)
        return len(sizes)

    def assemble_cached_kv(
        self,
        spans: Sequence[CachedSpan],
        num_tokens: int,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
        first_layer: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K/V buffers holding every span's KV, K re-rotated to the span's positions, and
        which positions are cached (a host bool tensor; the other slots are left as they
        were: uninitialized in new buffers). `buffers` None: new ones. Layers below
        `first_layer` are left out (the blend recomputes them for every token)."""
        is_cached, stored_at = self._slots(spans, num_tokens)
        k_cache, v_cache = buffers if buffers is not None else self.model.new_kv(num_tokens)
        load = self._start_load(k_cache, v_cache, spans, stored_at, first_layer)
        load.wait(first_layer)
        return k_cache, v_cache, is_cached

    def _slots(
        self, spans: Sequence[CachedSpan], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tensors over the prompt: which slots the spans cover, and the position
        each slot's K was rotated at (its own where no span moved it)."""
        is_cached = torch.zeros(num_tokens, dtype=torch.bool)
        stored_at = torch.arange(num_tokens)
        for span in spans:
            self._check_span(span, num_tokens)
            is_cached[span.start : span.end] = True
            stored_at[span.start : span.end] = span.kv.positions.cpu()
        return is_cached, stored_at

    @staticmethod
    def _segment_offsets(spans: Sequence[CachedSpan], num_tokens: int) -> torch.Tensor:
        """Host int64 over the prompt: each slot's offset from its span's start."""
        offset = torch.zeros(num_tokens, dtype=torch.int64)
        for span in spans:
            offset[span.start : span.end] = torch.arange(span.end - span.start)
        return offset

    def _start_load(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        spans: Sequence[CachedSpan],
        stored_at: torch.Tensor,
        first_layer: int,
    ) -> SpanLoad:
        """Start copying the spans' KV into the buffers and re-rotating it;
        `SpanLoad.wait(layer)` before a layer reads it."""
        moves = self._moves(stored_at, spans, k_cache.dtype)
        on_device = to_device_many(list(moves.host_tensors()), k_cache.device)
        return self._load(k_cache, v_cache, spans, first_layer, moves, *on_device)

    def _moves(
        self, stored_at: torch.Tensor, spans: Sequence[CachedSpan], dtype: torch.dtype
    ) -> _Moves:
        """The load's host numbers for buffers of `dtype`."""
        delta = torch.arange(stored_at.shape[0]) - stored_at
        moved = delta.nonzero().squeeze(1)
        offsets = delta[moved]
        table, lookup = None, offsets
        rotations = self._rotations
        if moved.shape[0] and dtype == rotations.dtype:
            # Offsets past the kept table (positions outside the context, which the engine
            # refuses) are rotated by a table of their own.
            found = rotations.offsets_table(offsets)
            if found is not None:
                table, lookup = found
        slots = torch.empty(0, dtype=torch.int64)
        if self._batches_copies(spans):
            slots = torch.cat([torch.arange(span.start, span.end) for span in spans])
        return _Moves(moved, lookup, table, slots)

    def _batches_copies(self, spans: Sequence[CachedSpan]) -> bool:
        """Whether the spans' KV is copied in one gather per K and V rather than one copy
        per span: on an accelerator, where each copy costs the host a launch (~25 us)
        and the device a few; on the CPU a copy is its bytes, and one per span is fewer."""
        device = self.model.device
        return (
            device.type in ("cuda", "npu")
            and len(spans) > 1
            and all(_is_on(span.kv.k, device) for span in spans)
        )

    def _load(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        spans: Sequence[CachedSpan],
        first_layer: int,
        moves: _Moves,
        moved: torch.Tensor,
        lookup: torch.Tensor,
        slots: torch.Tensor,
    ) -> SpanLoad:
        """SpanLoad of the spans; `moved`, `lookup`, `slots`: `moves`' tensors on the device."""
        rotation = None
        if moves.moved.shape[0]:
            if moves.table is not None:  # rows of the cached table
                table = RopeTable(moves.table.cos[lookup], moves.table.sin[lookup])
            else:  # the offsets themselves
                c = self.model.config
                table = rope_table(
                    lookup, head_dim=c.head_dim, theta=c.rope_theta, dtype=k_cache.dtype,
                    divisors=c.rope_divisors,
                )  # fmt: skip
            rotation = moved, table
        batched = slots if moves.batched else None
        return SpanLoad(k_cache, v_cache, spans, first_layer, rotation, batched)

    def _layout(
        self,
        is_cached: torch.Tensor,
        active: torch.Tensor,
        spans: Sequence[CachedSpan],
        start: int,
        ratio: float,
        hole_ranges: tuple[tuple[int, int], ...],
        needs_logits: bool,
        selector: SelectionStrategy,
        query: tuple[int, int] | None,
    ) -> _Layout:
        """The blend's host numbers: `is_cached` per slot (spans only), `active` the
        positions the layers below the check layer compute, `start` the exact prefix."""
        num_tokens = is_cached.shape[0]
        # The last token's hidden state gives the logits: it is always computed.
        is_cached = is_cached.clone()
        if needs_logits:
            is_cached[-1] = False
        cached = is_cached.nonzero().squeeze(1)
        sections = self._sections(cached, hole_ranges)
        picks = tuple(num_to_select(members.shape[0], ratio) for members in sections)
        num_uncached = int(active.shape[0]) - int(is_cached[active].sum())
        picks = _round_up_picks(picks, sections, num_uncached, self._bucket())
        bounds = (self.config.check_layer, *self.config.filter_layers, self.model.num_layers)
        stage_layers = tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))
        stages = _Stages.plan(selector, picks, sections, num_uncached, stage_layers, self._bucket())
        query_rows = torch.empty(0, dtype=torch.int64)
        if query is not None and NEEDS_QUERY in selector.needs:
            is_query = (active >= query[0]) & (active < query[1]) & ~is_cached[active]
            query_rows = is_query.nonzero().squeeze(1)
        offsets = self._segment_offsets(spans, num_tokens)[cached]
        return _Layout(
            num_tokens, start, active, is_cached[active], cached, sections, picks,
            needs_logits, stages, query_rows, offsets,
        )  # fmt: skip

    def _bucket(self) -> int:
        """Recompute-set sizes are rounded up to a multiple of this (more tokens picked)."""
        return RECOMPUTE_BUCKET if self.model.device.type in ("cuda", "npu") else 1

    def _cache(
        self,
        layout: _Layout,
        active: torch.Tensor,
        spans: Sequence[CachedSpan],
        stored_at: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RopeTable,
    ) -> _BlendCache:
        """The request's buffers with the reused KV on its way (`active`: the layout's
        active positions, already on the device). Every other host index of the blend
        (the layout's, the load's) moves in one copy."""
        moves = self._moves(stored_at, spans, k.dtype)
        moved = to_device_many([*_host_indexes(layout), *moves.host_tensors()], self.model.device)
        on_device = _on_device(layout, active, moved)
        # Below the check layer every computed token's K/V is written fresh.
        first_move = _NUM_LAYOUT_INDEXES + len(layout.sections)
        load = self._load(
            k, v, spans, self.config.check_layer, moves, *moved[first_move : first_move + 3]
        )
        return _BlendCache(rope, k, v, layout, on_device, load)

    def _loads_early(self, spans: Sequence[CachedSpan]) -> bool:
        """Whether the reused KV's load starts before the first layer: KV in host memory
        on a GPU is copied on a side stream that waits for the work queued before it,
        which would otherwise include the first layer."""
        device = self.model.device
        return device.type == "cuda" and not all(_is_on(s.kv.k, device) for s in spans)

    def _check_span(self, span: CachedSpan, num_tokens: int) -> None:
        if not 0 <= span.start < span.end <= num_tokens:
            raise ValueError(f"spans: range ({span.start}, {span.end}) is outside the prompt")
        if span.kv.num_tokens != span.end - span.start:
            raise ValueError(
                f"spans: KV of {span.kv.num_tokens} tokens for range ({span.start}, {span.end})"
            )

    def _full_layers(
        self,
        full: _FullLayers,
        prepare: Callable[[torch.Tensor], _BlendCache],
        early: bool,
    ) -> Generator[int, None, tuple[torch.Tensor, _BlendCache]]:
        """Layers below the check layer: every computed token (after the exact prefix and
        the prefix's fresh positions), at its true position; yields after each layer.
        `prepare(active on the device)` (the blend's layout and the reused KV's load)
        runs once these layers are launched, while the device computes them (the host's
        layout takes about as long as one such layer at 2k tokens on a GPU: after the
        first alone the device waited for it), or before them when `early`."""
        device = self.model.device
        ids_on_host = full.token_ids.device.type == "cpu"
        hosts = [full.active]
        if ids_on_host:
            hosts.append(full.token_ids[full.active].long())
        moved = to_device_many(hosts, device)
        active = moved[0]
        ids = moved[1] if ids_on_host else full.token_ids.to(device)[active]
        cache = prepare(active) if early else None
        h = self.model.embed(ids)
        rope = RopeTable(full.rope.cos[active], full.rope.sin[active])
        plan = self._plan_for(active, full.token_ids.shape[0], h.dtype, full.needs_logits)
        for layer in range(self.config.check_layer):
            keys, values = full.k[layer], full.v[layer]
            q = self.model.qkv_into(layer, h, rope, keys, values, active)
            h = self.model.attend_and_mlp(layer, h, q, keys, values, plan)
            if cache is None and layer == self.config.check_layer - 1:
                cache = prepare(active)
            yield active.shape[0]
        assert cache is not None  # check_layer >= 1 (BlendConfig): the loop ran
        return h, cache

    def _check_layer(
        self, h: torch.Tensor, cache: _BlendCache, selector: SelectionStrategy
    ) -> _CheckOutcome:
        """Fresh QKV for every computed token; choose the recompute set; attention for it."""
        layer, on_device = self.config.check_layer, cache.on_device
        q, k, v = self.model.qkv(layer, h, cache.rope_at(on_device.active))
        cache.load.wait(layer)
        # Every score is a sum over heads: under tensor parallelism each rank holds a shard
        # of the heads, and summing the shards' scores (`reduce_shards`) gives every rank
        # the whole model's scores, hence the same recompute set on every rank.
        reduce = self.model.reduce_shards
        deviation = reduce(
            _deviation(k[:, on_device.cached_rows], cache.k[layer], on_device.cached)
        )
        v_deviation = None
        if NEEDS_V in selector.needs:
            v_deviation = reduce(
                _deviation(v[:, on_device.cached_rows], cache.v[layer], on_device.cached)
            )
        # The check layer's K/V stay fresh for every computed token: computing them was
        # the price of the deviation, and they are exact.
        cache.k[layer].index_copy_(1, on_device.active, k)
        cache.v[layer].index_copy_(1, on_device.active, v)
        attention = None
        if on_device.query_rows.shape[0] > 0:
            attention = reduce(self._query_attention(q, cache, layer)[on_device.cached])
        scores = CheckScores(deviation, v_deviation, attention, on_device.offsets)
        pinned, narrowing = self._select(scores, cache, selector)
        outcome = self._outcome(h.dtype, cache, pinned, narrowing)
        # Rows of h (indexes into the active positions) of the recompute set.
        rows = torch.searchsorted(on_device.active, outcome.recomputed)
        hidden = self.model.attend_and_mlp(
            layer, h[rows], q[:, rows], cache.k[layer], cache.v[layer], outcome.plan
        )
        return dataclasses.replace(outcome, hidden=hidden, deviation=deviation)

    def _query_attention(self, q: torch.Tensor, cache: _BlendCache, layer: int) -> torch.Tensor:
        """[num_tokens]: softmax attention the question's tokens pay every position at
        this layer (summed over heads and question tokens; causal)."""
        on_device = cache.on_device
        query = q[:, on_device.query_rows]
        heads, num_queries, head_dim = query.shape
        keys = cache.k[layer]
        kv_heads, num_slots = keys.shape[0], keys.shape[1]
        group = heads // kv_heads
        # Heads sharing a K/V head are adjacent (GQA): one product per K/V head. Scaled
        # before the product, as attention itself scales: in float16 an unscaled product
        # passes 65504 at a scaled logit of about 5,800 (head_dim 128), and the softmax of
        # its infinities is NaN for every slot.
        grouped = (query * head_dim**-0.5).reshape(kv_heads, group * num_queries, head_dim)
        logits = (grouped @ keys.transpose(1, 2)).float()
        positions = on_device.active[on_device.query_rows].repeat(group)
        slots = torch.arange(num_slots, device=keys.device)
        logits.masked_fill_(slots[None, None, :] > positions[None, :, None], float("-inf"))
        return logits.softmax(-1).sum((0, 1))

    def _select(
        self, scores: CheckScores, cache: _BlendCache, selector: SelectionStrategy
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Positions the selector chose: the pinned ones (kept by filter layers) and, per
        section, those filter layers may narrow."""
        cached = cache.on_device.cached
        is_narrowing = selector.narrowing()
        pinned, narrowing = [cached[:0]], []
        for members, counts in zip(
            cache.on_device.sections, cache.layout.stages.counts, strict=True
        ):
            section = CheckScores(*(None if t is None else t[members] for t in (
                scores.k_deviation, scores.v_deviation, scores.attention, scores.segment_offset
            )))  # fmt: skip
            picks = selector.select(section, counts)
            positions = [cached[members[p]] for p in picks]
            pinned += [p for p, n in zip(positions, is_narrowing, strict=True) if not n]
            narrowing.append(torch.cat([cached[:0]] + [
                p for p, n in zip(positions, is_narrowing, strict=True) if n
            ]))  # fmt: skip
        return torch.cat(pinned), tuple(narrowing)

    def _outcome(
        self,
        dtype: torch.dtype,
        cache: _BlendCache,
        pinned: torch.Tensor,
        narrowing: tuple[torch.Tensor, ...],
        hidden: torch.Tensor | None = None,
    ) -> _CheckOutcome:
        selected = torch.cat([pinned, *narrowing]).sort().values
        recomputed = torch.cat([selected, cache.on_device.uncached]).sort().values
        plan = self._plan(recomputed, cache, dtype)
        empty = selected[:0].float()
        return _CheckOutcome(hidden, recomputed, selected, empty, plan, pinned, narrowing)

    def _filter_layer(
        self,
        layer: int,
        h: torch.Tensor,
        rope: RopeTable,
        cache: _BlendCache,
        check: _CheckOutcome,
        selector: SelectionStrategy,
        stage: int,
    ) -> _CheckOutcome:
        """Gradual filtering: fresh QKV for the current recompute set; each section keeps
        the narrowing picks whose K (V) deviates most at this layer; attention and MLP
        for what is kept. The dropped tokens' fresh K/V of this layer stay in the cache."""
        cache.load.wait(layer)
        q, k, v = self.model.qkv(layer, h, rope)
        kept, reduce = [], self.model.reduce_shards
        for group, target in zip(
            check.narrowing, cache.layout.stages.narrow_to[stage], strict=True
        ):
            if target >= group.shape[0]:
                kept.append(group)
                continue
            rows = torch.searchsorted(check.recomputed, group)
            v_deviation = None
            if NEEDS_V in selector.needs:
                v_deviation = reduce(_deviation(v[:, rows], cache.v[layer], group))
            scores = CheckScores(reduce(_deviation(k[:, rows], cache.k[layer], group)), v_deviation)
            kept.append(
                group[torch.topk(selector.narrow_score(scores), target, sorted=False).indices]
            )
        cache.k[layer].index_copy_(1, check.recomputed, k)
        cache.v[layer].index_copy_(1, check.recomputed, v)
        outcome = self._outcome(h.dtype, cache, check.pinned, tuple(kept))
        rows = torch.searchsorted(check.recomputed, outcome.recomputed)
        hidden = self.model.attend_and_mlp(
            layer, h[rows], q[:, rows], cache.k[layer], cache.v[layer], outcome.plan
        )
        return dataclasses.replace(outcome, hidden=hidden, deviation=check.deviation)

    def _plan(self, positions: torch.Tensor, cache: _BlendCache, dtype: torch.dtype):
        # With logits the last prompt token is always computed: the plan's last position.
        return self._plan_for(
            positions, cache.layout.num_tokens, dtype, ends_at_last_key=cache.layout.needs_logits
        )

    def _plan_for(
        self, positions: torch.Tensor, num_keys: int, dtype: torch.dtype, ends_at_last_key: bool
    ):
        return plan_attention(
            positions, num_keys, dtype, head_dim=self.model.config.head_dim,
            ends_at_last_key=ends_at_last_key,
        )  # fmt: skip

    def _sections(
        self, cached_positions: torch.Tensor, hole_ranges: tuple[tuple[int, int], ...]
    ) -> tuple[torch.Tensor, ...]:
        """Host indexes into cached_positions per section: all, or split at each hole."""
        everything = torch.arange(cached_positions.shape[0])
        if not self.config.per_section or not hole_ranges:
            return (everything,)
        hole_starts = torch.tensor(sorted(s for s, _ in hole_ranges))
        section_of = torch.searchsorted(hole_starts, cached_positions)
        return tuple(everything[section_of == section] for section in section_of.unique())

    def _sparse_layer(
        self, layer: int, h: torch.Tensor, rope: RopeTable, cache: _BlendCache, check: _CheckOutcome
    ) -> torch.Tensor:
        """One layer for the recompute set only; reused K/V stay in the cache."""
        # Reused KV of this layer in place before the recomputed slots are written over it.
        cache.load.wait(layer)
        keys, values = cache.k[layer], cache.v[layer]
        q = self.model.qkv_into(layer, h, rope, keys, values, check.recomputed)
        return self.model.attend_and_mlp(layer, h, q, keys, values, check.plan)


Result = TypeVar("Result")


def run_to_end(steps: Generator[Any, None, Result]) -> Result:
    """Run a stepwise computation (`Blender.blend_steps`) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _round_up_picks(
    picks: tuple[int, ...], sections: tuple[torch.Tensor, ...], num_uncached: int, bucket: int
) -> tuple[int, ...]:
    """Picks raised (section by section, within each section's cached tokens) until the
    recompute set is a multiple of `bucket`, or every cached token is picked."""
    capacities = tuple(members.shape[0] for members in sections)
    return _round_up(picks, capacities, num_uncached, bucket)


def _round_up(
    counts: tuple[int, ...], capacities: tuple[int, ...], fixed: int, bucket: int
) -> tuple[int, ...]:
    """`counts` raised one by one within `capacities` until `fixed + sum` is a multiple
    of `bucket` (or every count is at its capacity)."""
    missing = -(sum(counts) + fixed) % bucket
    raised = []
    for count, capacity in zip(counts, capacities, strict=True):
        extra = min(missing, capacity - count)
        raised.append(count + extra)
        missing -= extra
    return tuple(raised)


def _deviation(fresh: torch.Tensor, stored: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Squared distance of `fresh` [heads, n, d] and `stored` [heads, slots, d] at
    `positions`, summed over heads and dimensions: [n] float32.

    Squared in float32: in float16 a difference above 256 squares past the largest
    finite value (65504), and so does a token's sum over heads and dimensions of smaller
    ones, which makes the top-k a choice among infinities. A float32 model's tensors pass
    through unchanged (`float()` of float32 is no copy)."""
    return (fresh - stored.index_select(1, positions)).float().pow(2).sum((0, 2))


@dataclass(frozen=True)
class _Stages:
    """How many tokens each selection part picks per section at the check layer, and how
    many narrowing picks each filter layer keeps per section (host numbers)."""

    # Per section: the selector's count per part (narrowing parts widened).
    counts: tuple[tuple[int, ...], ...]
    # Per filter layer, per section: narrowing picks kept.
    narrow_to: tuple[tuple[int, ...], ...]

    @classmethod
    def plan(
        cls,
        selector: SelectionStrategy,
        picks: tuple[int, ...],
        sections: tuple[torch.Tensor, ...],
        num_uncached: int,
        stage_layers: tuple[int, ...],
        bucket: int,
    ) -> _Stages:
        """`stage_layers`: the layers whose attention and MLP (most of a layer's work) run
        at each width: from the check layer up to the first filter layer, ..., from the
        last filter layer to the model's last layer (a filter layer's run for what it
        keeps; only its Q/K/V for the wider set). Budget-neutral: the narrowing
        parts keep `factor` of their share after the last filter layer, and
        `(1 + filters left) x` that before each filter layer, so that the token-layers
        computed equal those of the budget at one width (filtering costs what K
        deviation alone costs at the same ratio), wherever the widened set fits the
        section."""
        sizes = tuple(members.shape[0] for members in sections)
        num_filters = len(stage_layers) - 1
        if num_filters == 0:
            return cls(tuple(selector.split(k, n) for k, n in zip(picks, sizes, strict=True)), ())
        narrows = selector.narrowing()
        weight = sum(n * (num_filters + 1 - s) for s, n in enumerate(stage_layers))
        factor = sum(stage_layers) / weight

        def narrowing_sum(parts: tuple[int, ...]) -> int:
            return sum(c for c, n in zip(parts, narrows, strict=True) if n)

        finals, counts = [], []
        for k, size in zip(picks, sizes, strict=True):
            parts = selector.split(k, size)
            # Where the widened set would not fit the section (high ratios), its tokens
            # are all computed up to the filter layer and the budget is kept after it:
            # ratio 1.0 stays full prefill. Decided before rounding down, which could
            # make a whole section's widened set fit and drop some of it.
            fits = (
                sum(parts)
                - narrowing_sum(parts)
                + (num_filters + 1) * narrowing_sum(parts) * factor
                <= size
            )
            final = tuple(
                int(c * factor) if n and fits else c for c, n in zip(parts, narrows, strict=True)
            )
            widened = tuple(
                c * (num_filters + 1) if n else c for c, n in zip(final, narrows, strict=True)
            )
            finals.append(narrowing_sum(final))
            counts.append(_cap(widened, narrows, size))
        fixed = num_uncached + sum(sum(parts) - narrowing_sum(parts) for parts in counts)
        # The widened check-layer set, on accelerators rounded up like the final one.
        widened_sums = _round_up(
            tuple(narrowing_sum(parts) for parts in counts),
            tuple(
                size - sum(parts) + narrowing_sum(parts)
                for parts, size in zip(counts, sizes, strict=True)
            ),
            fixed,
            bucket,
        )
        counts = [
            _widen_last_narrowing(parts, narrows, w - narrowing_sum(parts))
            for parts, w in zip(counts, widened_sums, strict=True)
        ]
        narrow_to = tuple(
            _round_up(
                tuple(
                    min(w, final * (num_filters - j))
                    for w, final in zip(widened_sums, finals, strict=True)
                ),
                widened_sums,
                fixed,
                bucket,
            )
            for j in range(num_filters)
        )
        return cls(tuple(counts), narrow_to)


def _cap(parts: tuple[int, ...], narrows: tuple[bool, ...], size: int) -> tuple[int, ...]:
    """`parts` within `size` in all: the last narrowing parts give way."""
    capped, excess = list(parts), sum(parts) - size
    for i in reversed(range(len(capped))):
        if excess <= 0:
            break
        if narrows[i]:
            cut = min(excess, capped[i])
            capped[i] -= cut
            excess -= cut
    return tuple(capped)


def _widen_last_narrowing(
    parts: tuple[int, ...], narrows: tuple[bool, ...], extra: int
) -> tuple[int, ...]:
    """`parts` with `extra` added to the last narrowing part."""
    if extra == 0:
        return parts
    last = max(i for i, n in enumerate(narrows) if n)
    return tuple(c + extra if i == last else c for i, c in enumerate(parts))


class SpanLoad:
    """Reused KV of the spans on its way into the buffers; `wait(layer)` returns once
    that layer's K/V are in place and re-rotated (on the compute stream: no host wait).

    Device-resident KV: one copy per span and one re-rotation of every moved token, in
    order on the compute stream. Host-resident KV on a GPU: one asynchronous copy per
    span (the whole span at once: per-layer copies of a span-major host layout would
    cost a launch per span and layer) on a side stream, which the layers below the
    check layer overlap; the first layer that reads reused KV waits for all of it."""

    def __init__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        spans: Sequence[CachedSpan],
        first_layer: int,
        rotation: tuple[torch.Tensor, RopeTable] | None,
        slots: torch.Tensor | None = None,
    ) -> None:
        """`slots` (on the device; device-resident KV only): every span's slots in span
        order, to copy all spans in one gather and one scatter per K and V."""
        self.device = k_cache.device
        self.event: torch.cuda.Event | None = None
        layers = slice(first_layer, None)
        is_from_host = any(span.kv.k.device != self.device for span in spans)
        if self.device.type == "cuda" and is_from_host:
            self.event = _copy_on_side_stream(k_cache, v_cache, spans, layers, rotation)
            return
        if slots is not None:
            for cache, stored in (
                (k_cache, [s.kv.k for s in spans]),
                (v_cache, [s.kv.v for s in spans]),
            ):
                gathered = torch.cat([entry[layers] for entry in stored], dim=2)
                cache[layers].index_copy_(2, slots, gathered)
        else:
            if self.device.type == "cpu" and rotation is not None:
                spans, rotation = _copy_rotating_shifted_spans(
                    k_cache, v_cache, spans, layers, rotation
                )
            for span in spans:
                copy_span(k_cache, v_cache, span, layers)
        if rotation is not None and first_layer < k_cache.shape[0]:
            _rotate(k_cache[layers], *rotation)

    def wait(self, layer: int) -> None:
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.event = None


def _copy_on_side_stream(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: Sequence[CachedSpan],
    layers: slice,
    rotation: tuple[torch.Tensor, RopeTable] | None,
) -> torch.cuda.Event:
    compute = torch.cuda.current_stream(k_cache.device)
    stream = torch.cuda.Stream(k_cache.device)
    # The buffers were allocated (the prefix written, the RoPE table built) on the
    # compute stream.
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        for span in spans:
            copy_span(k_cache, v_cache, span, layers)
        if rotation is not None:
            _rotate(k_cache[layers], *rotation)
    event = torch.cuda.Event()
    event.record(stream)
    # The compute stream frees these buffers later: keep the side stream's use known.
    k_cache.record_stream(stream)
    v_cache.record_stream(stream)
    return event


def copy_span(
    k_cache: torch.Tensor, v_cache: torch.Tensor, span: CachedSpan, layers: slice = slice(None)
) -> None:
    """The span's KV into its slots (of `layers`). From host memory in one contiguous copy to the
    device first (pinned: asynchronous DMA), then into the strided slots."""
    for cache, stored in ((k_cache, span.kv.k), (v_cache, span.kv.v)):
        staged = stored[layers].to(cache.device, non_blocking=True)
        cache[layers, :, span.start : span.end].copy_(staged)


def _copy_rotating_shifted_spans(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: Sequence[CachedSpan],
    layers: slice,
    rotation: tuple[torch.Tensor, RopeTable],
) -> tuple[list[CachedSpan], tuple[torch.Tensor, RopeTable] | None]:
    """CPU: every span whose tokens all moved by one offset (a segment stored at
    consecutive positions, the usual case) copied with its K re-rotated on the way
    (`_copy_span_rotated`); returns the spans left to copy and the rotation left for
    the others' moved slots (None when none is left)."""
    moved, table = rotation
    left, is_left = [], torch.ones(moved.shape[0], dtype=torch.bool)
    for span in spans:
        offsets = torch.arange(span.start, span.end) - span.kv.positions
        if not (
            offsets[0] != 0
            and torch.equal(offsets, offsets[:1].expand_as(offsets))
            and span.kv.k.dtype == k_cache.dtype
        ):
            left.append(span)
            continue
        # Every slot of the span moved: its rows of the table are one run from `first`.
        first = int(torch.searchsorted(moved, span.start))
        _copy_span_rotated(k_cache, v_cache, span, layers, table.cos[first], table.sin[first])
        is_left[first : first + offsets.shape[0]] = False
    if not is_left.any():
        return left, None
    return left, (moved[is_left], RopeTable(table.cos[is_left], table.sin[is_left]))


def _copy_span_rotated(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: CachedSpan,
    layers: slice,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """`copy_span` with K rotated by one angle per frequency on the way (cos, sin
    [head_dim] in RoPE's rotate-half layout): `apply_rope`'s arithmetic, bit for bit,
    written straight into the buffer. On the CPU that replaces a copy, a gather, five
    elementwise passes and a scatter over the moved tokens' K (15.6 -> 4.4 ms for five
    moved documents of 231 tokens in SmolLM2's 28 reused layers)."""
    v_cache[layers, :, span.start : span.end].copy_(span.kv.v[layers])
    source = span.kv.k[layers]
    half = source.shape[-1] // 2
    (a, b) = source.split(half, dim=-1)
    (out_a, out_b) = k_cache[layers, :, span.start : span.end].split(half, dim=-1)
    torch.mul(a, cos[:half], out=out_a).sub_(b * sin[:half])
    torch.mul(b, cos[half:], out=out_b).add_(a * sin[half:])


def _rotate(k: torch.Tensor, slots: torch.Tensor, table: RopeTable) -> None:
    """K [layers, heads, tokens, dim]: the moved slots re-rotated in place."""
    k.index_copy_(2, slots, apply_rope(k.index_select(2, slots), table))


@dataclass(frozen=True, eq=False)
class _Layout:
    """Host numbers of one blend, known before the first layer."""

    num_tokens: int
    # Tokens of the exact prefix: never computed, compared or selected.
    start: int
    # Sorted positions the layers up to the check layer compute (fresh prefix positions,
    # then every position from `start`), and which of them hold reused KV.
    active: torch.Tensor
    is_active_cached: torch.Tensor
    # Sorted positions holding reused KV (after the prefix; the last token excluded
    # when the blend needs its logits).
    cached: torch.Tensor
    # Per section: indexes into `cached`, and how many of them to recompute.
    sections: tuple[torch.Tensor, ...]
    picks: tuple[int, ...]
    # The last token is computed for its logits (else it may stay cached).
    needs_logits: bool
    # What each selection part picks, per section and filter layer.
    stages: _Stages
    # Rows of the active positions holding the question (the `query` strategy's).
    query_rows: torch.Tensor
    # Per cached position: its offset from the start of its reused segment.
    offsets: torch.Tensor


@dataclass(frozen=True, eq=False)
class _OnDevice:
    """The layout's index tensors on the model's device (moved once, non-blocking)."""

    active: torch.Tensor
    cached: torch.Tensor
    # Rows of the active positions holding reused KV, and the positions without.
    cached_rows: torch.Tensor
    uncached: torch.Tensor
    sections: tuple[torch.Tensor, ...]
    query_rows: torch.Tensor
    offsets: torch.Tensor


def _host_indexes(layout: _Layout) -> tuple[torch.Tensor, ...]:
    """The layout's host index tensors `_on_device` takes back (all but the active
    positions, moved before), in its order."""
    cached_rows = layout.is_active_cached.nonzero().squeeze(1)
    uncached = layout.active[~layout.is_active_cached]
    return (
        layout.cached, cached_rows, uncached, layout.query_rows, layout.offsets, *layout.sections
    )  # fmt: skip


# Tensors of `_host_indexes` before the sections.
_NUM_LAYOUT_INDEXES = 5


def _on_device(layout: _Layout, active: torch.Tensor, moved: Sequence[torch.Tensor]) -> _OnDevice:
    """`_OnDevice` of `_host_indexes(layout)` moved (`moved` may go on past them) and the
    active positions on the device."""
    cached, cached_rows, uncached, query_rows, offsets = moved[:_NUM_LAYOUT_INDEXES]
    sections = tuple(moved[_NUM_LAYOUT_INDEXES : _NUM_LAYOUT_INDEXES + len(layout.sections)])
    return _OnDevice(active, cached, cached_rows, uncached, sections, query_rows, offsets)


@dataclass(frozen=True, eq=False)
class _FullLayers:
    """What the layers below the check layer need, known before the blend's layout: the
    active positions (host), the prompt's token ids (host or device), the buffers and the
    prompt's RoPE table."""

    active: torch.Tensor
    token_ids: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rope: RopeTable
    needs_logits: bool


@dataclass(frozen=True, eq=False)
class _Moves:
    """Host numbers of the reused KV's load: the slots whose K moves, and for each the
    row of its offset in `table` (None: the offset itself); with copies batched, every
    span's slots in span order."""

    moved: torch.Tensor
    lookup: torch.Tensor
    table: RopeTable | None
    slots: torch.Tensor

    @property
    def batched(self) -> bool:
        return self.slots.shape[0] > 0

    def host_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.moved, self.lookup, self.slots


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` is on `device`, which may name no index (`cuda`: the current one)."""
    if tensor.device.type != device.type:
        return False
    return device.index is None or tensor.device.index == device.index


@dataclass(frozen=True, eq=False)
class _BlendCache:
    """One request's KV buffers (filled in place, layer by layer) and RoPE table."""

    rope: RopeTable
    k: torch.Tensor
    v: torch.Tensor
    layout: _Layout
    on_device: _OnDevice
    # The reused KV on its way (waited for before the first layer that reads it).
    load: SpanLoad

    def rope_at(self, positions: torch.Tensor) -> RopeTable:
        return RopeTable(self.rope.cos[positions], self.rope.sin[positions])


@dataclass(frozen=True, eq=False)
class _CheckOutcome:
    """What the check layer (or the last filter layer) decided, shared by later layers."""

    hidden: torch.Tensor | None
    recomputed: torch.Tensor
    selected: torch.Tensor
    # Check-layer K deviation of every cached token, in position order.
    deviation: torch.Tensor
    # Attention of the recompute set.
    plan: AttentionPlan
    # Picks filter layers keep, and per section those they may narrow.
    pinned: torch.Tensor
    narrowing: tuple[torch.Tensor, ...]
