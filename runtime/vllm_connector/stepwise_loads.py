"""Worker side of asynchronous, stepwise loads (`blend_step_tokens`; torch, no vLLM import).

A synchronous load blends the whole covered range inside `start_load_kv`, outside vLLM's
token budget: every request decoding in that step waits for it. With `blend_step_tokens`
the scheduler side answers vLLM "load asynchronously"; vLLM allocates the request's blocks
and parks it (WAITING_FOR_REMOTE_KVS) until the worker reports the load done. Here:

1. `start`: fetch the load's KV and set its blend up (`BlendWorker.start`); no compute.
2. `advance`, once per step: blend the loads under way, oldest first, one model layer at
   a time, until the step's budget is spent: `blend_step_tokens` tokens of whole-model
   compute, i.e. that many times the model's layers in token-layers (a layer over n tokens
   costs n); at least one layer per step, so every blend progresses. A load whose blend is
   done is written into the paged cache (`BlendWorker.finish`) and its outcome returned.
3. `take_finished(finished_req_ids)`: the requests whose load ended since the last call,
   for vLLM's `get_finished`: written, failed (its blocks are reported by the caller's
   `on_failure`, and vLLM recomputes them), or dropped because vLLM finished the request
   first (aborted: vLLM frees its blocks once told).
4. `due_stores`: a store of a segment inside a pending load's range waits for the load,
   which stores it from its blend; it is released when the load ends (computed then only
   if the load could not store it), dropped with an aborted request.

Every tensor-parallel rank runs the same steps: the budget counts tokens, not time.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence

from holeblend_runtime.vllm_connector.metadata import LoadRequest, StoreRequest
from holeblend_runtime.vllm_connector.worker import BlendWorker, LoadOutcome, PendingLoad

log = logging.getLogger(__name__)


class StepwiseLoads:
    def __init__(
        self,
        step_tokens: int,
        num_layers: int,
        on_failure: Callable[[LoadRequest], None],
    ) -> None:
        if step_tokens < 1:
            raise ValueError(f"step_tokens: must be >= 1, got {step_tokens}")
        self.budget = step_tokens * num_layers
        self._on_failure = on_failure
        self._pending: deque[PendingLoad] = deque()
        self._done: set[str] = set()
        self._deferred: dict[str, list[StoreRequest]] = {}
        self._released: list[StoreRequest] = []

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_tracked(self) -> int:
        """Requests with any state here (0 once every load ended and was reported)."""
        pending = {p.request.request_id for p in self._pending}
        return len(pending | self._done | self._deferred.keys())

    def start(self, worker: BlendWorker, load: LoadRequest) -> None:
        try:
            self._pending.append(worker.start(load))
        except Exception:
            self._fail(load)

    def advance(self, worker: BlendWorker) -> list[LoadOutcome]:
        """One step's share of the blends under way; the outcomes of those now written."""
        budget, outcomes = self.budget, []
        while self._pending and budget > 0:
            pending = self._pending[0]
            spent = pending.spent
            try:
                is_done = worker.advance(pending, budget)
                budget -= pending.spent - spent
                if not is_done:
                    break
                outcome = worker.finish(pending)
            except Exception:
                self._pending.popleft()
                self._fail(pending.request)
                continue
            self._pending.popleft()
            self._end(outcome.request_id)
            outcomes.append(outcome)
        return outcomes

    def take_finished(self, finished_req_ids: set[str]) -> set[str]:
        for pending in [p for p in self._pending if p.request.request_id in finished_req_ids]:
            request_id = pending.request.request_id
            self._pending.remove(pending)
            self._deferred.pop(request_id, None)  # not stored: a future miss
            self._done.add(request_id)
        done, self._done = self._done, set()
        return done

    def due_stores(self, stores: Sequence[StoreRequest]) -> list[StoreRequest]:
        """The step's stores less those waiting for a pending load, plus those released by
        loads that ended since."""
        pending = {p.request.request_id for p in self._pending}
        due, self._released = self._released, []
        for store in stores:
            if store.request_id in pending and not store.is_from_forward:
                self._deferred.setdefault(store.request_id, []).append(store)
            else:
                due.append(store)
        return due

    def _fail(self, load: LoadRequest) -> None:
        log.exception("loading %s failed; vLLM recomputes its blocks", load.request_id)
        self._on_failure(load)
        self._end(load.request_id)

    def _end(self, request_id: str) -> None:
        self._done.add(request_id)
        self._released += self._deferred.pop(request_id, [])
