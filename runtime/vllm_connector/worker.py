"""Worker side of the connector (torch, no vLLM import): blend and write into the paged
cache, store missing segments.

Load, for one request (inside `start_load_kv`, before vLLM's forward of the step):
1. Fetch each reused segment's KV from the tier; one that is missing, corrupt or does
   not fit the model (`ReferenceEngine.kv_problem`) becomes a hole: the blend computes it.
2. Run our blender over the covered range `[0, load.end)` with the model adapter (the
   check layer, the selected tokens and the holes are computed; the rest is reused).
3. Write the blended K/V of `[load.start, load.end)` into vLLM's paged cache at the
   request's slots, layer by layer, with the attention backend's own cache-update op
   (or the kernels package's reference scatter for backends without one).
Store: each missing segment is computed in its canonical context
(`ReferenceEngine.cache_segments`) after the step's forward, on the same thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from holeblend_kernels.paged import scatter_kv_nhd
from holeblend_runtime.blender import CachedSpan
from holeblend_runtime.engine import ReferenceEngine
from holeblend_runtime.kv_store import SegmentKV
from holeblend_runtime.vllm_connector.metadata import LoadRequest, ReusedSegment, StoreRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadOutcome:
    """What one load reused and computed (sent back to the scheduler side)."""

    request_id: str
    num_reused_tokens: int
    num_hole_tokens: int
    # Tokens computed in every layer by the blend (check-layer picks + holes + separators).
    num_recomputed_tokens: int
    # Segments the scheduler planned to reuse whose KV was missing or unusable.
    num_rejected_segments: int
    blend_seconds: float


class PagedKVWriter:
    """Writes [tokens, kv_heads, head_dim] K/V of one layer at given slots of vLLM's cache."""

    def __init__(
        self,
        attention_modules: Sequence[torch.nn.Module],
        kv_caches: Sequence[torch.Tensor],
        block_size: int,
    ) -> None:
        self.attention_modules = list(attention_modules)
        self.kv_caches = list(kv_caches)
        self.block_size = block_size

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        module, cache = self.attention_modules[layer], self.kv_caches[layer]
        capacity = cache.numel() // (2 * k.shape[1] * k.shape[2])
        if int(slots.max()) >= capacity or int(slots.min()) < 0:
            raise ValueError(f"slots: {int(slots.max())} outside the KV cache of {capacity} slots")
        slots = slots.to(cache.device)
        impl = getattr(module, "impl", None)
        if hasattr(impl, "do_kv_cache_update"):
            impl.do_kv_cache_update(module, k.contiguous(), v.contiguous(), cache, slots)
        else:
            scatter_kv_nhd(cache, slots, k, v)


class BlendWorker:
    """Loads (blend + write) for one worker; `engine` wraps the model adapter."""

    def __init__(self, engine: ReferenceEngine, writer: PagedKVWriter) -> None:
        self.engine = engine
        self.writer = writer

    @torch.inference_mode()
    def store(self, request: StoreRequest) -> int:
        """Compute the request's missing segments in canonical context; number stored."""
        return self.engine.cache_segments(request.prompt, request.segments)

    @torch.inference_mode()
    def load(self, request: LoadRequest) -> LoadOutcome:
        started = time.perf_counter()
        end = request.load.end
        spans = [s for s in map(lambda r: self._span(r, end), request.reused) if s is not None]
        num_rejected = len(request.reused) - len(spans)
        token_ids = torch.tensor(request.token_ids[:end], device=self.engine.model.device)
        k, v, num_recomputed = self._blend(token_ids, spans, request)
        slots = self.writer.slots(request.block_ids, request.load.start, end)
        for layer in range(k.shape[0]):
            layer_k = k[layer, :, request.load.start : end].transpose(0, 1)
            layer_v = v[layer, :, request.load.start : end].transpose(0, 1)
            self.writer.write(layer, layer_k, layer_v, slots)
        num_reused = sum(span.end - span.start for span in spans)
        return LoadOutcome(
            request.request_id,
            num_reused_tokens=num_reused,
            num_hole_tokens=_count(request.hole_ranges) + _count_rejected(request, spans, end),
            num_recomputed_tokens=num_recomputed,
            num_rejected_segments=num_rejected,
            blend_seconds=time.perf_counter() - started,
        )

    def _blend(
        self, token_ids: torch.Tensor, spans: list[CachedSpan], request: LoadRequest
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        model = self.engine.model
        if not spans:  # every planned segment was unusable: compute the range in full
            k, v = model.new_kv(token_ids.shape[0])
            model.forward(token_ids, k, v, start=0)
            return k, v, token_ids.shape[0]
        holes = [*request.hole_ranges, *_rejected_ranges(request, spans, token_ids.shape[0])]
        result = self.engine.blender.blend(token_ids, spans, request.ratio, sorted(holes))
        return result.k, result.v, int(result.recomputed.shape[0])

    def _span(self, reused: ReusedSegment, end: int) -> CachedSpan | None:
        entry = self.engine.store.get(reused.key)
        num_tokens = reused.end - reused.start
        problem = (
            "missing" if entry is None else self.engine.kv_problem(entry, reused.key, num_tokens)
        )
        if problem is not None:
            log.warning("segment %s: %s; computing it fresh", reused.key, problem)
            return None
        if reused.end > end:  # a full-prompt hit: vLLM computes the last token itself
            entry = _truncated(entry, end - reused.start)
        return CachedSpan(reused.start, min(reused.end, end), entry)


def _truncated(entry: SegmentKV, num_tokens: int) -> SegmentKV:
    return SegmentKV(
        entry.key, entry.k[:, :, :num_tokens], entry.v[:, :, :num_tokens],
        entry.positions[:num_tokens], entry.model_id,
    )  # fmt: skip


def _rejected_ranges(
    request: LoadRequest, spans: list[CachedSpan], end: int
) -> list[tuple[int, int]]:
    used = {span.start for span in spans}
    return [(r.start, min(r.end, end)) for r in request.reused if r.start not in used]


def _count_rejected(request: LoadRequest, spans: list[CachedSpan], end: int) -> int:
    return _count(_rejected_ranges(request, spans, end))


def _count(ranges: Sequence[tuple[int, int]]) -> int:
    return sum(end - start for start, end in ranges)
