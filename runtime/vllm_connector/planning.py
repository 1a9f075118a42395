"""Scheduler side of the connector, without vLLM: a prompt's hole-aware reuse plan.

1. Split the prompt's token ids on the separator's ids (`SegmentSplitter`).
2. Key every cacheable segment (`keys.SegmentKeyer`, the engine's own keyer).
3. Ask the segment index which keys are cached; an index that fails counts as all-miss,
   so serving never fails because of it. `AsyncReusePlanner` runs this off vLLM's
   scheduler thread with a deadline (a late index plans a full miss), one lookup for all
   the requests queued meanwhile.
4. `plan_reuse` turns the hit flags into hit and hole ranges; the connector offers the
   covered range `[0, tail_start)`, less the last prompt token (vLLM must compute one);
   with a selection that reads the question (`query`), the whole prompt less its last
   token, so the blend sees the question as holeblend-serve's does.
The plan also names the cacheable segments that were missing, which the worker stores.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from holeblend_runtime.blend.keys import SegmentKeyer
from holeblend_runtime.blend.reuse import ReuseMode, ReusePolicy, SegmentReuse, plan_reuse
from holeblend_runtime.blend.segments import SegmentedPrompt, SegmentSplitter
from holeblend_runtime.blend.selection import NEEDS_QUERY
from holeblend_runtime.blend.selection import needs as selection_needs
from holeblend_runtime.vllm_connector.accounting import covered_tokens

log = logging.getLogger(__name__)


class CachedKeys(Protocol):
    """Which segment keys are cached (a KV tier, or the fleet's lookup server)."""

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One flag per key, in one round trip for a remote index."""
        ...


@dataclass(frozen=True)
class ReusePlan:
    """One request's lookup: what is reused, what is a hole, what the worker stores."""

    prompt: SegmentedPrompt
    reuse: SegmentReuse
    # One key per segment; None for segments never cached.
    keys: tuple[str | None, ...]
    # Tokens the connector provides: [0, num_covered_tokens).
    num_covered_tokens: int
    # Indexes into prompt.segments of cacheable segments that were not cached.
    missing_segments: tuple[int, ...]
    # The segment index failed; the request runs as a full miss.
    is_lookup_failed: bool = False
    # The index did not answer by the deadline; the request runs as a full miss.
    is_lookup_late: bool = False

    @property
    def is_unchecked(self) -> bool:
        """Its missing segments were named without the index's answer (it failed or was
        late): the tier may hold them, so the worker's stores check first
        (`StoreRequest.check_stored`)."""
        return self.is_lookup_failed or self.is_lookup_late

    def is_blended(self, num_reused_tokens: int) -> bool:
        """Whether a reused document's KV was blended in (`num_reused_tokens` of it
        loaded): only then can the answer differ from full prefill's. A full miss is
        exact, and so is the system prompt alone at position 0 (held in the model's own
        dtype whatever `kv.storeDtype` says, so never rounded)."""
        if not self.num_covered_tokens or not num_reused_tokens:
            return False
        return any(self.prompt.segments[i].index is not None for i in self.reuse.reused_segments)


class ReusePlanner:
    """Prompt token ids -> `ReusePlan` (None: the prompt has no separator)."""

    def __init__(
        self,
        separator_ids: Sequence[int],
        keyer: SegmentKeyer,
        index: CachedKeys,
        policy: ReusePolicy = ReusePolicy.HOLE,
    ) -> None:
        self.splitter = SegmentSplitter(tuple(separator_ids), keyer.blend.min_segment_tokens)
        self.keyer = keyer
        self.index = index
        self.policy = policy
        # A selection that reads the question's attention needs the question inside the
        # blend: the covered range then runs to the last prompt token.
        self._covers_question = NEEDS_QUERY in selection_needs(keyer.blend)

    def plan_late(self, token_ids: Sequence[int]) -> ReusePlan | None:
        """The plan of a request whose lookup missed its deadline: a full miss. Every
        cacheable segment is named missing; the worker's stores skip those the tier holds
        (`StoreRequest.check_stored`)."""
        if (split := self._split(token_ids)) is None:
            return None
        prompt, keys = split
        reuse = plan_reuse(prompt, [False] * len(keys), self.policy)
        missing = tuple(i for i, key in enumerate(keys) if key is not None)
        return ReusePlan(prompt, reuse, keys, 0, missing, is_lookup_late=True)

    def plan(self, token_ids: Sequence[int]) -> ReusePlan | None:
        return self.plan_many([token_ids])[0]

    def plan_many(self, prompts: Sequence[Sequence[int]]) -> list[ReusePlan | None]:
        """`plan` of each prompt, with one index lookup for all of them (a key several
        prompts share is asked once): an index that fails fails each prompt's lookup."""
        splits = [self._split(token_ids) for token_ids in prompts]
        cached, is_failed = self._cached([key for s in splits if s is not None for key in s[1]])
        return [
            None if split is None else self._planned(*split, cached, is_failed) for split in splits
        ]

    def _planned(
        self,
        prompt: SegmentedPrompt,
        keys: tuple[str | None, ...],
        cached: set[str],
        is_failed: bool,
    ) -> ReusePlan:
        flags = [key is not None and key in cached for key in keys]
        reuse = plan_reuse(prompt, flags, self.policy)
        missing = tuple(i for i, key in enumerate(keys) if key is not None and not flags[i])
        num_covered = 0
        if reuse.mode is not ReuseMode.FULL_MISS:
            tail_start = prompt.num_tokens if self._covers_question else reuse.tail_start
            num_covered = covered_tokens(tail_start, prompt.num_tokens)
        return ReusePlan(prompt, reuse, keys, num_covered, missing, is_failed)

    def _split(
        self, token_ids: Sequence[int]
    ) -> tuple[SegmentedPrompt, tuple[str | None, ...]] | None:
        """The prompt's segments and their keys; None: not a segmented RAG prompt (vLLM
        computes it as usual)."""
        try:
            prompt = self.splitter.split(token_ids)
        except ValueError:
            return None
        return prompt, tuple(self.keyer.keys(prompt))

    def _cached(self, keys: Sequence[str | None]) -> tuple[set[str], bool]:
        """The cached ones of `keys`, each asked once; (none, True) when the index failed."""
        unique = list(dict.fromkeys(key for key in keys if key is not None))
        try:
            found = self.index.contains_many(unique) if unique else []
            return {key for key, is_cached in zip(unique, found, strict=True) if is_cached}, False
        except Exception as error:  # an unreachable index is a miss, never a failure
            log.warning("segment lookup failed, computing the prompt in full: %s", error)
            return set(), True


class Pending:
    """`AsyncReusePlanner.poll`'s answer while a lookup is under way."""


PENDING = Pending()


@dataclass(eq=False)
class _Lookup:
    """One request's lookup, shared by vLLM's scheduler thread and the lookup thread."""

    token_ids: list[int]
    # When the request was first polled: its deadline runs from then.
    started: float
    # Written by the lookup thread once planned.
    plan: ReusePlan | None | Pending = PENDING
    # What planning raised (an index that fails is not this: it plans a full miss).
    error: Exception | None = None
    # Given up (past its deadline, the request gone, shut down): the lookup thread skips it.
    is_dropped: bool = False


class AsyncReusePlanner:
    """Plans off the caller's thread, with a deadline: vLLM's scheduler never waits on the
    segment index (a lookup-server round trip, a shared-tier query).

    `poll(request_id, token_ids)` queues the request's lookup on the first call and
    returns `PENDING` until it is done (the connector then answers vLLM "not yet", and
    vLLM asks again at its next step); then the plan. A lookup not done `deadline_s`
    after the first poll is given up: the request is planned as a full miss
    (`ReusePlan.is_lookup_late`) and its late answer is dropped.

    One lookup thread: the index client need not be thread-safe, and a hung index cannot
    pile up threads (its requests all meet the deadline and run as full misses, as with no
    index). It takes every request queued by then and plans them together
    (`ReusePlanner.plan_many`): one index lookup for the lot, each key once, so a burst of
    new requests waits one round trip, not one per request. An index that fails fails the
    lookup of every request of that batch."""

    def __init__(
        self,
        planner: ReusePlanner,
        deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s: must be > 0, got {deadline_s}")
        self.planner = planner
        self.deadline_s = deadline_s
        self._clock = clock
        self._pending: dict[str, _Lookup] = {}
        # Lookups for the lookup thread; None stops it.
        self._queue: queue.SimpleQueue[_Lookup | None] = queue.SimpleQueue()
        # Started by the first poll: a planner built before a fork has no thread to lose.
        self._thread: threading.Thread | None = None

    def poll(self, request_id: str, token_ids: Sequence[int]) -> ReusePlan | None | Pending:
        if (lookup := self._pending.get(request_id)) is None:
            lookup = self._pending[request_id] = _Lookup(list(token_ids), self._clock())
            self._queue.put(lookup)
            self._start()
        if lookup.error is not None:
            del self._pending[request_id]
            raise lookup.error
        if lookup.plan is not PENDING:
            del self._pending[request_id]
            return lookup.plan
        if self._clock() - lookup.started >= self.deadline_s:
            self.forget(request_id)  # skipped if not yet taken; a batch's answer is ignored
            log.warning(
                "segment lookup of %s missed its %.0f ms deadline: a full miss",
                request_id,
                self.deadline_s * 1000,
            )
            return self.planner.plan_late(token_ids)
        return PENDING

    def forget(self, request_id: str) -> None:
        """The request is gone (finished or aborted) before its lookup was polled done."""
        lookup = self._pending.pop(request_id, None)
        if lookup is not None:
            lookup.is_dropped = True

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def shutdown(self) -> None:
        for lookup in list(self._pending.values()):  # vLLM's scheduler may still poll
            lookup.is_dropped = True
        self._queue.put(None)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="holeblend-lookup", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            if batch:
                self._plan(batch)

    def _take(self) -> list[_Lookup] | None:
        """Every lookup queued by now (waiting for the first), less those given up; None
        once shut down."""
        queued = [self._queue.get()]
        while not self._queue.empty():  # this thread alone takes from the queue
            queued.append(self._queue.get_nowait())
        if any(lookup is None for lookup in queued):
            return None
        return [lookup for lookup in queued if lookup is not None and not lookup.is_dropped]

    def _plan(self, batch: list[_Lookup]) -> None:
        try:
            plans = self.planner.plan_many([lookup.token_ids for lookup in batch])
        except Exception as error:  # a bug, not the index's failure: each poll raises it
            for lookup in batch:
                lookup.error = error
            return
        for lookup, plan in zip(batch, plans, strict=True):
            lookup.plan = plan
