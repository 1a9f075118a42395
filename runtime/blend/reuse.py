"""Turn per-segment cache hits into a reuse plan.

Standard CacheBlend (policy `prefix`) reuses segments only up to the first one that is
not cached and recomputes everything after it. Hole mode (policy `hole`) reuses every
cached segment; the missing ones ("holes") are computed fresh between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from holeblend_runtime.blend.segments import Segment, SegmentedPrompt, SegmentKind


class ReuseMode(StrEnum):
    FULL_MISS = "full-miss"
    PURE_HIT = "pure-hit"
    HOLE = "hole"


class ReusePolicy(StrEnum):
    PREFIX = "prefix"
    HOLE = "hole"


@dataclass(frozen=True)
class SegmentReuse:
    """Which tokens of a prompt come from the cache and which are computed fresh.

    Every token is in exactly one of: a hit range, a hole range, a separator before
    `tail_start`, or the tail `[tail_start, num_prompt_tokens)`. Empty segments are in
    none of the ranges.
    """

    mode: ReuseMode
    num_prompt_tokens: int
    # Indexes into `SegmentedPrompt.segments` of the reused segments, in prompt order.
    reused_segments: tuple[int, ...]
    # Token ranges [start, end) of the reused segments.
    hit_ranges: tuple[tuple[int, int], ...]
    # Token ranges [start, end) of missing segments before the tail (computed fresh).
    hole_ranges: tuple[tuple[int, int], ...]
    # First token of the uncached tail: the end of the last reused segment (0 when
    # nothing is reused); everything from here on is computed fresh.
    tail_start: int

    @property
    def num_reused_tokens(self) -> int:
        """Tokens whose KV comes from the cache (the sum of the hit ranges)."""
        return sum(end - start for start, end in self.hit_ranges)

    @property
    def num_hole_tokens(self) -> int:
        return sum(end - start for start, end in self.hole_ranges)

    @property
    def num_tail_tokens(self) -> int:
        return self.num_prompt_tokens - self.tail_start


def plan_reuse(
    prompt: SegmentedPrompt, hit_flags: Sequence[bool], policy: ReusePolicy | str
) -> SegmentReuse:
    """`hit_flags[i]` says whether `prompt.segments[i]` is in the cache."""
    _check_hit_flags(prompt, hit_flags)
    reused = _reused_segment_indexes(prompt.segments, hit_flags, _parse_policy(policy))
    tail_start = prompt.segments[reused[-1]].end if reused else 0
    hit_ranges = tuple(_range(prompt.segments[i]) for i in reused)
    hole_ranges = tuple(
        _range(segment)
        for i, segment in enumerate(prompt.segments)
        if i not in reused and segment.num_tokens > 0 and segment.end <= tail_start
    )
    return SegmentReuse(
        mode=_mode(hit_ranges, hole_ranges),
        num_prompt_tokens=prompt.num_tokens,
        reused_segments=reused,
        hit_ranges=hit_ranges,
        hole_ranges=hole_ranges,
        tail_start=tail_start,
    )


def _parse_policy(policy: ReusePolicy | str) -> ReusePolicy:
    try:
        return ReusePolicy(policy)
    except ValueError:
        choices = ", ".join(p.value for p in ReusePolicy)
        raise ValueError(f"policy: expected one of {choices}, got {policy!r}") from None


def _check_hit_flags(prompt: SegmentedPrompt, hit_flags: Sequence[bool]) -> None:
    if len(hit_flags) != len(prompt.segments):
        raise ValueError(
            f"hit_flags: expected one flag per segment ({len(prompt.segments)}), "
            f"got {len(hit_flags)}"
        )
    for i, (segment, is_hit) in enumerate(zip(prompt.segments, hit_flags, strict=True)):
        if is_hit and segment.kind is SegmentKind.QUESTION:
            raise ValueError(f"hit_flags[{i}]: the question is never reused")
        if is_hit and segment.num_tokens == 0:
            raise ValueError(f"hit_flags[{i}]: an empty segment cannot be a cache hit")


def _reused_segment_indexes(
    segments: Sequence[Segment], hit_flags: Sequence[bool], policy: ReusePolicy
) -> tuple[int, ...]:
    reused: list[int] = []
    for i, (segment, is_hit) in enumerate(zip(segments, hit_flags, strict=True)):
        if is_hit:
            reused.append(i)
        elif policy is ReusePolicy.PREFIX and segment.num_tokens > 0:
            # Standard CacheBlend: a miss ends reuse; an empty segment costs nothing.
            break
    return tuple(reused)


def _mode(
    hit_ranges: tuple[tuple[int, int], ...], hole_ranges: tuple[tuple[int, int], ...]
) -> ReuseMode:
    if not hit_ranges:
        return ReuseMode.FULL_MISS
    return ReuseMode.HOLE if hole_ranges else ReuseMode.PURE_HIT


def _range(segment: Segment) -> tuple[int, int]:
    return (segment.start, segment.end)
