"""Split a RAG prompt into system / documents / question and key each segment.

Prompt layout: ``system SEP doc_0 SEP doc_1 ... SEP doc_{n-1} SEP question``. Splitting
works on token ids (the separator string is tokenized once by the caller), so the
segments are exactly the tokens the model sees. Keys ignore positions: the same document
at any place in any prompt has the same key, which is what lets its KV be reused.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

# Bump when the key layout changes, so old cache entries can never be mistaken for new.
_KEY_VERSION = b"holeblend-segment-key-v1"


class SegmentKind(StrEnum):
    SYSTEM = "system"
    DOCUMENT = "document"
    QUESTION = "question"


@dataclass(frozen=True)
class Segment:
    """One piece of a prompt between separators (separators excluded)."""

    kind: SegmentKind
    # Document number from 0 in prompt order; None for the system prompt and the question.
    index: int | None
    # Token range [start, end) in the whole prompt.
    start: int
    end: int
    token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def is_cacheable(self, min_segment_tokens: int) -> bool:
        """System prompt and documents with at least `min_segment_tokens` tokens.

        The question is unique to a request, so storing it would only waste the budget;
        the system prompt is cached because standard CacheBlend reuses it as the first
        segment of every prompt.
        """
        is_reusable_kind = self.kind is not SegmentKind.QUESTION
        return is_reusable_kind and self.num_tokens >= max(min_segment_tokens, 1)


@dataclass(frozen=True)
class SegmentedPrompt:
    """A prompt's token ids and its segments: system, documents..., question."""

    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    # Token ranges [start, end) of the separators, in prompt order.
    separator_ranges: tuple[tuple[int, int], ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def system(self) -> Segment:
        return self.segments[0]

    @property
    def question(self) -> Segment:
        return self.segments[-1]

    @property
    def documents(self) -> tuple[Segment, ...]:
        return self.segments[1:-1]


@dataclass(frozen=True)
class SegmentSplitter:
    """Splits token ids on a separator's token ids."""

    # The separator string tokenized once, e.g. the ids of " # #".
    separator_ids: Sequence[int]
    # Segments shorter than this are not cached (too little to gain, one entry each).
    min_segment_tokens: int

    def __post_init__(self) -> None:
        # Accept any sequence (list from a tokenizer) but keep an immutable tuple.
        object.__setattr__(self, "separator_ids", tuple(int(t) for t in self.separator_ids))
        if not self.separator_ids:
            raise ValueError("separator_ids: the separator must have at least one token")
        if self.min_segment_tokens < 1:
            raise ValueError(f"min_segment_tokens: must be >= 1, got {self.min_segment_tokens}")

    def split(self, token_ids: Sequence[int]) -> SegmentedPrompt:
        """Segments in prompt order; empty segments (adjacent separators) are kept."""
        tokens = tuple(int(t) for t in token_ids)
        if not tokens:
            raise ValueError("token_ids: the prompt is empty")
        separator_ranges = self.find_separators(tokens)
        if not separator_ranges:
            raise ValueError(
                f"token_ids: no separator {list(self.separator_ids)} in the prompt; "
                "expected system SEP documents... SEP question"
            )
        bounds = _segment_bounds(separator_ranges, len(tokens))
        segments = tuple(
            _make_segment(position, len(bounds), start, end, tokens)
            for position, (start, end) in enumerate(bounds)
        )
        return SegmentedPrompt(tokens, segments, separator_ranges)

    def find_separators(self, tokens: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """Non-overlapping occurrences, scanning left to right."""
        width = len(self.separator_ids)
        ranges: list[tuple[int, int]] = []
        position = 0
        while position + width <= len(tokens):
            if tuple(tokens[position : position + width]) == self.separator_ids:
                ranges.append((position, position + width))
                position += width
            else:
                position += 1
        return tuple(ranges)

    def cacheable_segments(self, prompt: SegmentedPrompt) -> tuple[Segment, ...]:
        return tuple(s for s in prompt.segments if s.is_cacheable(self.min_segment_tokens))


def _segment_bounds(
    separator_ranges: Sequence[tuple[int, int]], num_tokens: int
) -> list[tuple[int, int]]:
    starts = [0] + [end for _, end in separator_ranges]
    ends = [start for start, _ in separator_ranges] + [num_tokens]
    return list(zip(starts, ends, strict=True))


def _make_segment(
    position: int, num_segments: int, start: int, end: int, tokens: tuple[int, ...]
) -> Segment:
    if position == 0:
        kind, index = SegmentKind.SYSTEM, None
    elif position == num_segments - 1:
        kind, index = SegmentKind.QUESTION, None
    else:
        kind, index = SegmentKind.DOCUMENT, position - 1
    return Segment(kind, index, start, end, tokens[start:end])


def segment_key(
    token_ids: Sequence[int],
    *,
    model_id: str,
    kv_dtype: str,
    context_key: str | None = None,
) -> str:
    """Position-independent key: hash of the tokens, the model and the KV dtype.

    `context_key` names what the KV was computed after (e.g. the system prompt's key);
    None means the segment was computed alone from position 0. KV computed in different
    contexts differs, so the context is part of the key.
    """
    if len(token_ids) == 0:
        raise ValueError("token_ids: cannot key an empty segment")
    if not model_id:
        raise ValueError("model_id: must not be empty")
    if not kv_dtype:
        raise ValueError("kv_dtype: must not be empty")
    digest = hashlib.sha256(_KEY_VERSION)
    digest.update(_length_prefixed(model_id) + _length_prefixed(kv_dtype))
    # A presence byte keeps "computed alone" (None) apart from an empty context name.
    digest.update(b"\x00" if context_key is None else b"\x01")
    digest.update(_length_prefixed(context_key or ""))
    digest.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    return digest.hexdigest()


def _length_prefixed(text: str) -> bytes:
    # Length prefix so ("ab", "c") and ("a", "bc") never hash the same.
    data = text.encode()
    return struct.pack("<Q", len(data)) + data
