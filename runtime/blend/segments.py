"""Split a RAG prompt into system / documents / question and key each segment.

Prompt layout: ``system SEP doc_0 SEP doc_1 ... SEP doc_{n-1} SEP question``. A prompt
built from its pieces (`prompt.PromptBuilder`) knows where every separator is and makes
its segments with `SegmentedPrompt.from_separators`; searching the joined tokens
(`SegmentSplitter`) is for prompts that arrive whole, and is ambiguous when a document
ends in the first tokens of the separator. Either way the segments are exactly the tokens
the model sees. Keys ignore positions: the same document at any place in any prompt has
the same key, which is what lets its KV be reused.
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
        """A non-empty system prompt, and documents with at least `min_segment_tokens` tokens.

        The question is unique to a request, so storing it would only waste the budget.
        The system prompt is cached whatever its length: one entry serves every prompt,
        and standard CacheBlend reuses it as the first segment of each, so a short one
        left uncached would end prefix reuse before the first document (and cost hole
        mode its exact prefix).
        """
        if self.kind is SegmentKind.QUESTION:
            return False
        min_tokens = 1 if self.kind is SegmentKind.SYSTEM else max(min_segment_tokens, 1)
        return self.num_tokens >= min_tokens


@dataclass(frozen=True)
class SegmentedPrompt:
    """A prompt's token ids and its segments: system, documents..., question."""

    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    # Token ranges [start, end) of the separators, in prompt order.
    separator_ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        # Hand-built prompts get the same checks as split or built ones: the engine
        # relies on system first, question last and one separator between each pair.
        if not self.token_ids:
            raise ValueError("token_ids: the prompt is empty")
        if not self.separator_ranges:
            raise ValueError(
                "separator_ranges: no separator in the prompt; "
                "expected system SEP documents... SEP question"
            )
        expected = _segment_bounds(self.separator_ranges, len(self.token_ids))
        actual = [(s.start, s.end) for s in self.segments]
        if actual != expected:
            raise ValueError(
                f"segments: ranges {actual} do not lie between the separators {expected}"
            )
        # Keys hash a segment's own token ids and the engine caches by kind: a segment
        # other than the prompt's would store this prompt's KV under another text's key.
        for position, segment in enumerate(self.segments):
            own = _make_segment(position, len(expected), segment.start, segment.end, self.token_ids)
            fields = (segment.kind, segment.index, tuple(segment.token_ids))
            if fields != (own.kind, own.index, tuple(own.token_ids)):
                raise ValueError(
                    f"segments[{position}]: not the prompt's {own.kind} (index {own.index}) "
                    f"with its tokens [{segment.start}, {segment.end}); make the segments "
                    "with SegmentedPrompt.from_separators"
                )

    @classmethod
    def from_separators(
        cls, token_ids: Sequence[int], separator_ranges: Sequence[tuple[int, int]]
    ) -> SegmentedPrompt:
        """The prompt whose separators are exactly at `separator_ranges` (sorted, disjoint)."""
        tokens = tuple(int(t) for t in token_ids)
        ranges = tuple((int(start), int(end)) for start, end in separator_ranges)
        previous_end = 0
        for start, end in ranges:
            if not previous_end <= start < end <= len(tokens):
                raise ValueError(
                    f"separator_ranges: ({start}, {end}) overlaps, is empty or lies outside "
                    f"the {len(tokens)} tokens"
                )
            previous_end = end
        bounds = _segment_bounds(ranges, len(tokens))
        segments = tuple(
            _make_segment(position, len(bounds), start, end, tokens)
            for position, (start, end) in enumerate(bounds)
        )
        return cls(tokens, segments, ranges)

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
    # Documents shorter than this are not cached (too little to gain, one entry each).
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
        return SegmentedPrompt.from_separators(tokens, separator_ranges)

    def find_separators(self, tokens: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """Non-overlapping occurrences, scanning left to right.

        Ambiguous when a document ends in the separator's first tokens (" ... #" before
        " # #"): the match starts inside the document. Prompts built from pieces do not
        search (see `SegmentedPrompt.from_separators`).
        """
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
