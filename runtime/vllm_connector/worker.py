"""Worker side of the connector (torch; vLLM only through compat.py's version seams): blend
and write into the paged cache, store missing segments.

Load, for one request (inside `start_load_kv`, before vLLM's forward of the step):
1. Fetch the planned segments' KV from the tier in one batch; one that is missing,
   corrupt or does not fit the model (`BlendEngine.fetch`) becomes a hole.
2. Run the engine's reuse path (`BlendEngine.blend_reused`, the same as
   holeblend-serve's prefill: exact prefix, blend, selection) over the covered range
   `[0, load.end)` with the model adapter; vLLM computes the tokens after it.
3. Write the blended K/V of `[load.start, load.end)` into vLLM's paged cache at the
   request's slots, layer by layer, with the attention backend's own cache-update op
   (or the kernels package's reference scatter for backends without one).
4. Report the blend's inline statistic (quality/inline_proxy.py) in the outcome, for the
   scheduler side's inline quality proxy.
Store (blend.json `storePolicy`): under `in-context` (the default) a load stores the missing
segments inside its range from the KV it just blended (at their positions in this prompt,
as holeblend-serve does); every missing segment still not stored after the step's forward
(one past the range, which vLLM computed, or all of them under `isolated`) is computed in
its canonical context (`BlendEngine.cache_segments`) on the same thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from holeblend_kernels.paged import scatter_kv_nhd
from holeblend_runtime.blend.config import ISOLATED
from holeblend_runtime.blend.reuse import ReusePolicy, SegmentReuse, plan_reuse
from holeblend_runtime.blend.segments import SegmentedPrompt, SegmentKind
from holeblend_runtime.engine import Blended, BlendEngine
from holeblend_runtime.kv.store import SegmentKV
from holeblend_runtime.quality.inline_proxy import residual_deviation
from holeblend_runtime.vllm_connector import compat, metrics
from holeblend_runtime.vllm_connector.metadata import LoadRequest, StoreRequest

# Requests whose offered segments are remembered until their store step (older ones are
# forgotten: a request whose holes needed no store step never asks).
MAX_OFFERED_REQUESTS = 1024

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
    # The blend's inline statistic (quality/inline_proxy.py: share of the check-layer deviation
    # left in cached tokens not recomputed); None when no cached token was compared.
    inline_statistic: float | None = None
    # The recompute ratio the blend ran with.
    ratio: float = 0.0


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
        # Each backend's own cache update, taken before `ForwardKVCapture` wraps it: the
        # blend's writes are not the forward's, and must not be captured as its K/V.
        self._updates = [compat.cache_update(module) for module in self.attention_modules]

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """The cache slots of positions [start, end) of a request whose blocks are
        `block_ids`; ValueError, naming both, when the blocks end before `end`."""
        needed = -(-end // self.block_size) if end > start else 0
        if needed > len(block_ids):
            raise ValueError(
                f"block_ids: positions [{start}, {end}) need {needed} blocks of "
                f"{self.block_size} tokens, the request has {len(block_ids)}"
            )
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        module, cache = self.attention_modules[layer], self.kv_caches[layer]
        capacity = cache.numel() // (2 * k.shape[1] * k.shape[2])
        if int(slots.max()) >= capacity or int(slots.min()) < 0:
            raise ValueError(f"slots: {int(slots.max())} outside the KV cache of {capacity} slots")
        slots = slots.to(cache.device)
        update = self._updates[layer]
        if update is not None:
            update(module, k.contiguous(), v.contiguous(), cache, slots)
        else:
            scatter_kv_nhd(cache, slots, k, v)


class ForwardKVCapture:
    """K/V rows of chosen cache slots, copied as vLLM's forward writes them, layer by layer.

    vLLM hands each attention layer's new K/V (`[tokens, kv_heads, head_dim]`, K already
    rotated) and their slots to the backend's cache update (`compat.tap_cache_writes`: its
    `do_kv_cache_update`, or the attention call of vLLM 0.23's CPU backend, which writes
    there); that is tapped once per layer, so the rows are taken before the backend packs
    them into its own cache layout (no layout to undo). Backends where the write cannot be
    seen are not supported: their segments are computed in their canonical context
    instead."""

    def __init__(self, attention_modules: Sequence[torch.nn.Module]) -> None:
        modules = list(attention_modules)
        self.num_layers = len(modules)
        self._slots: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._k: list[torch.Tensor | None] = []
        self._v: list[torch.Tensor | None] = []
        self.is_supported = bool(modules) and all(compat.can_tap(m) for m in modules)
        if self.is_supported:
            for layer, module in enumerate(modules):
                compat.tap_cache_writes(module, self._on_write(layer))

    def _on_write(self, layer: int) -> compat.OnWrite:
        def on_write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
            if self._slots is not None:
                self._take(layer, key, value, slots)

        return on_write

    def arm(self, slots: torch.Tensor) -> None:
        """Capture the rows of `slots` (host int64, in the order wanted) in the next forward."""
        self._slots, self._rows = slots, None
        self._k, self._v = [None] * self.num_layers, [None] * self.num_layers

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V `[layers, kv_heads, slots, head_dim]` of the armed slots, in their order;
        None when a slot or a layer was not written. Disarms."""
        armed, k, v = self._slots, self._k, self._v
        self._slots, self._rows, self._k, self._v = None, None, [], []
        if armed is None or not k or any(t is None for t in (*k, *v)):
            return None
        return torch.stack(k).transpose(1, 2), torch.stack(v).transpose(1, 2)

    def _take(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: Any) -> None:
        if self._rows is None:
            rows = _rows_of(torch.as_tensor(slots).cpu(), self._slots)
            if rows is None:  # a wanted slot is not written by this forward: give up
                log.warning("a segment to store is not in this step's forward; computing it")
                self._slots = None
                return
            self._rows = rows.to(key.device)
        self._k[layer] = key.index_select(0, self._rows)
        self._v[layer] = value.index_select(0, self._rows)


def _rows_of(written: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor | None:
    """Row of each wanted slot in `written` (a forward's slot mapping), or None if any is
    missing."""
    if len(written) == 0:
        return None
    order = torch.argsort(written)
    rows = order[torch.searchsorted(written[order], wanted).clamp_max(len(written) - 1)]
    return rows if torch.equal(written[rows], wanted) else None


@dataclass
class PendingLoad:
    """A load whose blend is under way (`BlendWorker.start`, `advance`, `finish`)."""

    request: LoadRequest
    reuse: SegmentReuse
    entries: list[SegmentKV | None]
    num_unusable: int
    steps: Generator[int, None, Blended]
    # Worker time spent on it so far (fetch, blend layers, write).
    seconds: float
    # Token-layers computed so far, and model layers.
    spent: int = 0
    num_layers: int = 0
    blended: Blended | None = None


class BlendWorker:
    """Loads (blend + write) for one worker; `engine` wraps the model adapter and runs the
    same reuse path as holeblend-serve's prefill (`BlendEngine.blend_reused`)."""

    def __init__(
        self,
        engine: BlendEngine,
        writer: PagedKVWriter,
        inline_statistic: bool = True,
        capture: ForwardKVCapture | None = None,
    ) -> None:
        self.engine = engine
        self.writer = writer
        # Stores from the K/V the forward writes (store policy in-context); None: computed.
        self.capture = capture if capture is not None and capture.is_supported else None
        self._captured: tuple[StoreRequest, ...] = ()
        # Requests of this step's captured stores whose synchronous load failed: the forward
        # that follows read a covered range nobody wrote, so its K/V are not stored.
        self._failed_loads: set[str] = set()
        # Per request, the segments its load offered the store from its blend, taken in or
        # refused by the tier's admission: its store step does not compute them again.
        self._offered: OrderedDict[str, frozenset[int]] = OrderedDict()
        # Take each blend's inline statistic (blend.json's qualityProxies): on an
        # accelerator reading it waits for the blend's device work.
        self.inline_statistic = inline_statistic
        # Segments stored since `take_stored`, by where their KV came from (the sources of
        # `holeblend_stored_segments_total`): the connector's stats carry them to the
        # scheduler side, whose process exports the metrics at any tensor-parallel size.
        self._num_stored: Counter[str] = Counter()

    @torch.inference_mode()
    def store(self, request: StoreRequest) -> int:
        """Compute the request's missing segments that are still not stored (a load may
        have stored them in context) in canonical context; the number stored. Segments its
        load offered the store are left out: stored, or refused by the tier's admission
        (computing them again would be refused too), unless another tensor-parallel rank
        lacks them."""
        keys = self.engine.segment_keys(request.prompt)
        offered = self._offered.pop(request.request_id, frozenset())
        wanted = [i for i in request.segments if keys[i] is not None]
        # Computing runs collectives under tensor parallelism: every rank computes what any
        # rank lacks, so every rank agrees over the same segments (one rank's load may have
        # offered a segment another's failed to), and a lookup that raises on one rank (an
        # I/O error) fails the store on every rank in the same all-reduce.
        failure: Exception | None = None
        looked_up = [i for i in wanted if i not in offered]
        try:
            held = self.engine.store.contains_many([keys[i] for i in looked_up])
        except Exception as error:  # raised after the other ranks hear of it
            failure, held = error, [False] * len(looked_up)
        found = {i for i, is_held in zip(looked_up, held, strict=True) if is_held} | offered
        agreed = self._on_every_rank([failure is None, *(i in found for i in wanted)])
        if failure is not None:
            raise failure
        if not agreed[0]:
            raise RuntimeError(
                "looking up the segments to store failed on another tensor-parallel rank; "
                "the store fails on every rank (that rank logged why)"
            )
        missing = [i for i, is_found in zip(wanted, agreed[1:], strict=True) if not is_found]
        stored = self.engine.cache_segments(request.prompt, missing) if missing else 0
        self._num_stored["computed"] += stored
        return stored

    def take_stored(self) -> dict[str, int]:
        """Segments stored since the last call, by source (`blend`, `forward`, `computed`)."""
        stored, self._num_stored = dict(self._num_stored), Counter()
        return stored

    def arm_capture(self, requests: Sequence[StoreRequest]) -> None:
        """Before vLLM's forward: capture the K/V it writes for the segments of `requests`
        that come from the forward (`StoreRequest.block_ids`). Without a capture (backend
        not supported) they are computed in canonical context after the forward."""
        self._captured = tuple(r for r in requests if r.is_from_forward)
        self._failed_loads = set()
        if self.capture is None or not self._captured:
            return
        self.capture.arm(torch.cat([self._slots(r) for r in self._captured]))

    def _slots(self, request: StoreRequest) -> torch.Tensor:
        assert request.block_ids is not None
        segments = [request.prompt.segments[i] for i in request.segments]
        return torch.cat([self.writer.slots(request.block_ids, s.start, s.end) for s in segments])

    @torch.inference_mode()
    def store_captured(self) -> tuple[int, int, tuple[StoreRequest, ...]]:
        """After vLLM's forward: store the captured segments from the K/V it wrote (at
        their positions in the prompt, no compute); (segments stored, segments whose store
        failed, the requests left to compute: all of them when nothing was captured, else
        those whose load failed). A request whose store fails is counted and the others go
        on: the K/V of each request are its own rows. A segment several requests of the step
        computed (the same document) is stored once, from the first."""
        requests, self._captured = self._captured, ()
        failed, self._failed_loads = self._failed_loads, set()
        captured = None if self.capture is None else self.capture.take()
        if captured is None:
            return 0, 0, requests
        k, v = captured
        stored = num_failed = first = 0
        done: set[str] = set()
        # A request whose load failed in this step: computed in canonical context instead.
        untrusted = tuple(r for r in requests if r.request_id in failed)
        for request in requests:
            num_tokens = sum(request.prompt.segments[i].num_tokens for i in request.segments)
            rows = slice(first, first + num_tokens)
            first += num_tokens
            if request.request_id in failed:
                continue
            try:
                stored += self._store_rows(request, k[:, :, rows], v[:, :, rows], done)
            except Exception:
                log.exception(
                    "storing the segments of %s from the forward failed", request.request_id
                )
                metrics.STORE_FAILURES.inc(len(request.segments))
                num_failed += len(request.segments)
        self._num_stored["forward"] += stored
        return stored, num_failed, untrusted

    def _store_rows(
        self, request: StoreRequest, k: torch.Tensor, v: torch.Tensor, done: set[str]
    ) -> int:
        """Store the request's segments from `k`/`v` `[layers, kv_heads, tokens, head_dim]`,
        its segments' rows one after another, less those whose key is in `done` (stored
        already in this step), and add the keys stored to `done`; the number stored."""
        keys = self.engine.segment_keys(request.prompt)
        held = set()
        if request.check_stored:  # not looked up: written only where the tier lacks it
            found = self.engine.store.contains_many([keys[i] for i in request.segments])
            held = {i for i, is_found in zip(request.segments, found, strict=True) if is_found}
        stored = first = 0
        for i in request.segments:
            segment = request.prompt.segments[i]
            rows = slice(first, first + segment.num_tokens)
            first += segment.num_tokens
            if i in held or keys[i] in done:
                continue
            num_stored = self.engine.store_in_context(
                request.prompt, keys, [i], k[:, :, rows], v[:, :, rows], segment.start
            )
            if num_stored:
                done.add(keys[i])
            stored += num_stored
        return stored

    def store_many(self, requests: Sequence[StoreRequest]) -> tuple[int, int]:
        """`store` each request; (segments stored, segments whose store failed). A failure
        is logged and counted (`holeblend_store_failures_total`), never raised: a segment
        not stored is a future miss, not a failed request. Requests whose segments the
        forward computed are stored from the captured K/V (`arm_capture`)."""
        stored = failed = 0
        captured = self._captured
        try:
            stored, failed, uncaptured = self.store_captured()
        except Exception:
            log.exception("storing the segments this step computed failed")
            uncaptured = ()
            failed += sum(len(r.segments) for r in captured)
            metrics.STORE_FAILURES.inc(failed)
        computed = [r for r in requests if not r.is_from_forward] + list(uncaptured)
        for request in computed:
            try:
                stored += self.store(request)
            except Exception:
                log.exception("storing the segments of %s failed", request.request_id)
                metrics.STORE_FAILURES.inc(len(request.segments))
                failed += len(request.segments)
        return stored, failed

    def load(self, request: LoadRequest) -> LoadOutcome:
        """Fetch, blend and write one request's load at once (vLLM's forward follows)."""
        try:
            pending = self.start(request)
            while not self.advance(pending, budget=None):
                pass
            return self.finish(pending)
        except Exception:
            if any(r.request_id == request.request_id for r in self._captured):
                self._failed_loads.add(request.request_id)
            raise

    @torch.inference_mode()
    def start(self, request: LoadRequest) -> PendingLoad:
        """Fetch the load's KV and set its blend up; nothing is computed yet."""
        started = time.perf_counter()
        reuse, entries, num_unusable = self._fetch(request)
        steps = self.engine.blend_reused_steps(
            request.prompt, reuse, entries, request.ratio, request.load.end
        )
        return PendingLoad(
            request, reuse, entries, num_unusable, steps, time.perf_counter() - started
        )

    @torch.inference_mode()
    def advance(self, pending: PendingLoad, budget: int | None) -> bool:
        """Compute layers of the load's blend until `budget` token-layers (tokens times
        layers) are spent, at least one layer (None: to the end); whether it is done."""
        started = time.perf_counter()
        spent, num_layers = 0, self.engine.config.num_layers
        try:
            # Past the last layer only the end is left (no compute): taken in this call.
            while budget is None or spent < max(budget, 1) or pending.num_layers >= num_layers:
                spent += next(pending.steps)
                pending.num_layers += 1
        except StopIteration as done:
            pending.blended = done.value
        pending.spent += spent
        pending.seconds += time.perf_counter() - started
        return pending.blended is not None

    @torch.inference_mode()
    def finish(self, pending: PendingLoad) -> LoadOutcome:
        """Write the blended K/V into vLLM's paged cache, store the holes it computed; the
        load's outcome."""
        started = time.perf_counter()
        request, reuse, entries = pending.request, pending.reuse, pending.entries
        blended = pending.blended
        assert blended is not None, "finish() before the blend is done"
        prompt, end = request.prompt, request.load.end
        slots = self.writer.slots(request.block_ids, request.load.start, end)
        for layer in range(blended.k.shape[0]):
            layer_k = blended.k[layer, :, request.load.start : end].transpose(0, 1)
            layer_v = blended.v[layer, :, request.load.start : end].transpose(0, 1)
            self.writer.write(layer, layer_k, layer_v, slots)
        if self.engine.blend_config.store_policy != ISOLATED:
            # The holes inside the range were just computed in this prompt's context: stored
            # from the blend's KV (store policy in-context), not computed again.
            # Only segments wholly inside the blended range: one past it (vLLM computes it)
            # is not in the blend's KV, and its own store must still compute it.
            holes = [
                i
                for i, key in enumerate(request.keys)
                if key and entries[i] is None and prompt.segments[i].end <= blended.k.shape[2]
            ]
            try:
                stored = self.engine.store_in_context(
                    prompt, request.keys, holes, blended.k, blended.v
                )
            except Exception:  # written already: a store that failed never fails the load
                log.exception("storing the holes of %s from its blend failed", request.request_id)
                stored, holes = 0, []  # not offered: its store step computes them
            self._num_stored["blend"] += stored
            if holes:
                self._offered[request.request_id] = frozenset(holes)
            else:
                self._offered.pop(request.request_id, None)
            while len(self._offered) > MAX_OFFERED_REQUESTS:  # requests without a store step
                self._offered.popitem(last=False)
        return LoadOutcome(
            request.request_id,
            num_reused_tokens=_count(reuse.hit_ranges, end),
            num_hole_tokens=_count(_hole_ranges(prompt, reuse, end), end),
            num_recomputed_tokens=int(blended.recomputed.shape[0]),
            num_rejected_segments=pending.num_unusable,
            blend_seconds=pending.seconds + time.perf_counter() - started,
            inline_statistic=residual_deviation(
                prompt, reuse, blended.deviation, blended.selected, end
            )
            if self.inline_statistic
            else None,
            ratio=request.ratio,
        )

    def _on_every_rank(self, flags: list[bool]) -> list[bool]:
        """Each flag, true only where it is true on every tensor-parallel rank (a
        collective; one rank: the flags as given, without touching the device)."""
        model = self.engine.model
        if getattr(model, "num_shards", 1) == 1 or not flags:
            return flags
        missing = torch.tensor([float(not flag) for flag in flags], device=model.device)
        return (model.reduce_shards(missing) == 0).tolist()

    def _fetch(self, request: LoadRequest) -> tuple[SegmentReuse, list[SegmentKV | None], int]:
        """The planned segments' KV in one batched get, checked as the engine checks its
        own (`BlendEngine.fetch`); one that is missing or unusable becomes a hole. Under
        tensor parallelism both are agreed over the ranks: a hole on one rank is a hole on
        every rank, and a fetch that raises on one rank raises on every rank. Returns the
        lookup of what is actually reused, the entries and how many planned segments were
        not usable."""
        planned = set(request.reused_segments)
        keys = [key if i in planned else None for i, key in enumerate(request.keys)]
        failure: Exception | None = None
        try:
            entries, _ = self.engine.fetch(request.prompt, keys)
        except Exception as error:  # raised after the other ranks hear of it
            failure, entries = error, [None] * len(keys)
        # Every rank must blend the same segments, or their collectives would pair up
        # different work: one rank's unusable entry is a hole on all of them, and one
        # rank's failed fetch (an I/O error) fails the load on all of them, in the same
        # all-reduce (the other ranks would otherwise wait in the blend's collectives for a
        # rank that went on to vLLM's forward).
        agreed = self._on_every_rank([failure is None, *(entry is not None for entry in entries)])
        if failure is not None:
            raise failure
        if not agreed[0]:
            raise RuntimeError(
                "fetching the load's KV failed on another tensor-parallel rank; the load "
                "fails on every rank (that rank logged why)"
            )
        entries = [entry if ok else None for entry, ok in zip(entries, agreed[1:], strict=True)]
        unusable = [i for i in sorted(planned) if entries[i] is None]
        for i in unusable:
            log.warning("segment %s: not usable; computing it fresh", request.keys[i])
        flags = [entry is not None for entry in entries]
        return plan_reuse(request.prompt, flags, ReusePolicy.HOLE), entries, len(unusable)


def _hole_ranges(prompt: SegmentedPrompt, reuse: SegmentReuse, end: int) -> list[tuple[int, int]]:
    """Segments inside [0, end) that are computed fresh: planned holes and unusable ones.
    The question is never a hole (a selection that reads it covers it too), as the plan and
    holeblend-serve count."""
    reused = set(reuse.reused_segments)
    return [
        (segment.start, segment.end)
        for i, segment in enumerate(prompt.segments)
        if i not in reused
        and segment.num_tokens > 0
        and segment.start < end
        and segment.kind is not SegmentKind.QUESTION
    ]


def _count(ranges: Sequence[tuple[int, int]], end: int) -> int:
    return sum(max(0, min(stop, end) - start) for start, stop in ranges)
