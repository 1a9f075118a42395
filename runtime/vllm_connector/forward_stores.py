"""Scheduler side of storing segments from vLLM's own forward (store policy in-context).

A cacheable segment that was missing and lies past the connector's covered range is
computed by vLLM's forward, in this prompt's context: its K/V are what the in-context
policy stores. The worker copies them as the forward writes them (`ForwardKVCapture`), so
storing costs no compute; it needs to know, before the forward, which segments the step
computes wholly and where the request's blocks are. Per step (`step`, from vLLM's
`SchedulerOutput`):

1. A pending segment inside `[num_computed_tokens, num_computed_tokens + scheduled)` of its
   request is stored from this step's forward: a `StoreRequest` with the block ids.
2. One this step only starts, or one an earlier step computed without a capture (a
   chunked prefill that split it), cannot be captured whole: a plain `StoreRequest`
   (computed in its canonical context after the forward).
3. The rest waits for the steps that compute it; a request that finishes or is aborted
   first takes its pending segments with it (a future miss, never a wrong entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from holeblend_runtime.blend.segments import SegmentedPrompt
from holeblend_runtime.vllm_connector.metadata import StoreRequest


class ForwardStores:
    def __init__(self) -> None:
        # request -> (prompt, segments still to store, whether to check the tier first)
        self._pending: dict[str, tuple[SegmentedPrompt, tuple[int, ...], bool]] = {}
        self._blocks: dict[str, list[int]] = {}

    def add(
        self,
        request_id: str,
        prompt: SegmentedPrompt,
        segments: Sequence[int],
        check_stored: bool = False,
    ) -> None:
        """`check_stored`: the segments were not looked up (`StoreRequest.check_stored`)."""
        if segments:
            self._pending[request_id] = (prompt, tuple(segments), check_stored)

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._blocks.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def step(self, scheduler_output: Any) -> list[StoreRequest]:
        """The stores of the step `scheduler_output` describes."""
        computed_before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._pending:
                self._blocks[new.req_id] = list(new.block_ids[0])
                computed_before[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            if request_id not in self._pending:
                continue
            new_ids = cached.new_block_ids[i]
            if request_id in cached.resumed_req_ids:
                self._blocks[request_id] = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                self._blocks.setdefault(request_id, []).extend(new_ids[0])
            computed_before[request_id] = cached.num_computed_tokens[i]
        stores = []
        for request_id, before in computed_before.items():
            after = before + scheduler_output.num_scheduled_tokens.get(request_id, 0)
            stores += self._due(request_id, before, after)
        return stores

    def _due(self, request_id: str, before: int, after: int) -> list[StoreRequest]:
        prompt, segments, check = self._pending[request_id]
        spans = {i: (prompt.segments[i].start, prompt.segments[i].end) for i in segments}
        whole = tuple(i for i in segments if before <= spans[i][0] and spans[i][1] <= after)
        split = tuple(i for i in segments if i not in whole and spans[i][0] < after)
        later = tuple(i for i in segments if spans[i][0] >= after)
        stores = []
        if whole:
            blocks = tuple(self._blocks.get(request_id, ()))
            stores.append(StoreRequest(request_id, prompt, whole, blocks, check_stored=check))
        if split:
            stores.append(StoreRequest(request_id, prompt, split, check_stored=check))
        if later:
            self._pending[request_id] = (prompt, later, check)
        else:
            self.forget(request_id)
        return stores
