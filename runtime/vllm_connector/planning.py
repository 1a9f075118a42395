"""Scheduler side of the connector, without vLLM: hole-aware lookup of a prompt.

1. Split the prompt's token ids on the separator's ids (`SegmentSplitter`).
2. Key every cacheable segment (`keys.SegmentKeyer`, the engine's own keyer).
3. Ask the segment index which keys are cached; an index that fails counts as all-miss,
   so serving never fails because of it.
4. `plan_reuse` turns the hit flags into hit and hole ranges; the connector offers the
   covered range `[0, tail_start)`, less the last prompt token (vLLM must compute one).
The plan also names the cacheable segments that were missing, which the worker stores.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from holeblend_runtime.keys import SegmentKeyer
from holeblend_runtime.lookup import LookupMode, LookupResult, ReusePolicy, plan_reuse
from holeblend_runtime.segments import SegmentedPrompt, SegmentSplitter
from holeblend_runtime.vllm_connector.accounting import covered_tokens

log = logging.getLogger(__name__)


class SegmentIndex(Protocol):
    """Which segment keys are cached (a KV tier, or the fleet's lookup server)."""

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One flag per key, in one round trip for a remote index."""
        ...


@dataclass(frozen=True)
class ReusePlan:
    """One request's lookup: what is reused, what is a hole, what the worker stores."""

    prompt: SegmentedPrompt
    lookup: LookupResult
    # One key per segment; None for segments never cached.
    keys: tuple[str | None, ...]
    # Tokens the connector provides: [0, num_covered_tokens).
    num_covered_tokens: int
    # Indexes into prompt.segments of cacheable segments that were not cached.
    missing_segments: tuple[int, ...]
    # The segment index failed; the request runs as a full miss.
    is_lookup_failed: bool = False


class ReusePlanner:
    """Prompt token ids -> `ReusePlan` (None: the prompt has no separator)."""

    def __init__(
        self,
        separator_ids: Sequence[int],
        keyer: SegmentKeyer,
        index: SegmentIndex,
        policy: ReusePolicy = ReusePolicy.HOLE,
    ) -> None:
        self.splitter = SegmentSplitter(tuple(separator_ids), keyer.blend.min_segment_tokens)
        self.keyer = keyer
        self.index = index
        self.policy = policy

    def plan(self, token_ids: Sequence[int]) -> ReusePlan | None:
        try:
            prompt = self.splitter.split(token_ids)
        except ValueError:
            return None  # not a segmented RAG prompt: vLLM computes it as usual
        keys = tuple(self.keyer.keys(prompt))
        flags, is_failed = self._hit_flags(keys)
        lookup = plan_reuse(prompt, flags, self.policy)
        missing = tuple(i for i, key in enumerate(keys) if key is not None and not flags[i])
        num_covered = 0
        if lookup.mode is not LookupMode.FULL_MISS:
            num_covered = covered_tokens(lookup.tail_start, prompt.num_tokens)
        return ReusePlan(prompt, lookup, keys, num_covered, missing, is_failed)

    def _hit_flags(self, keys: Sequence[str | None]) -> tuple[list[bool], bool]:
        try:
            known = [key for key in keys if key is not None]
            found = iter(self.index.contains_many(known))
            return [key is not None and next(found) for key in keys], False
        except Exception as error:  # an unreachable index is a miss, never a failure
            log.warning("segment lookup failed, computing the prompt in full: %s", error)
            return [False] * len(keys), True
