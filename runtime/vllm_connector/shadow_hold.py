"""Scheduler side, without vLLM: when a shadow request may start.

vLLM's priority policy puts a waiting shadow after every waiting user request, but once
scheduled its prefill shares a step with user prompts, or makes a user prompt that
arrives meanwhile wait for that step: at saturation that was a user's time to first token.
So a shadow also waits in vLLM's queue (the connector answers vLLM's "how many tokens do
you provide" with "not known yet") while user prompts are pending (`PendingPrefills`)
and the inline proxy already gives the tuner a signal at the ratio in force: at most
`hold_s`, so that calibration and shadow scores never stop for good. Without an inline
signal (not calibrated yet, or a new ratio beyond its fit) shadows start at once: they
are then the tuner's only signal.

`PendingPrefills`: a user request is pending from its first plan (`add`, when vLLM first
asks about it while it waits) until a step schedules the rest of its prompt (`step`, from
vLLM's `SchedulerOutput`: computed before the step + scheduled in it >= its prompt), or
until it finishes or is aborted (`forget`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# Below the shadow's HTTP timeout (shadow.py), with room for its prefill and answer.
SHADOW_HOLD_S = 20.0


class PendingPrefills:
    def __init__(self) -> None:
        self._prompt_tokens: dict[str, int] = {}  # request -> its prompt's length

    def add(self, request_id: str, num_prompt_tokens: int) -> None:
        self._prompt_tokens[request_id] = num_prompt_tokens

    def forget(self, request_id: str) -> None:
        self._prompt_tokens.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._prompt_tokens)

    def step(self, scheduler_output: Any) -> None:
        """Drop the requests whose prompt the step `scheduler_output` completes."""
        scheduled = scheduler_output.num_scheduled_tokens
        before = {
            new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        before |= dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for request_id, computed in before.items():
            prompt = self._prompt_tokens.get(request_id)
            if prompt is not None and computed + scheduled.get(request_id, 0) >= prompt:
                del self._prompt_tokens[request_id]


class ShadowHold:
    """`admit(request_id)`: whether a waiting shadow request may start now."""

    def __init__(
        self,
        prefills: PendingPrefills,
        has_inline_signal: Callable[[], bool],
        hold_s: float = SHADOW_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefills, self.has_inline_signal = prefills, has_inline_signal
        self.hold_s, self.clock = hold_s, clock
        self._since: dict[str, float] = {}  # held shadow -> when it was first held
        self.num_held_too_long = 0  # admitted at `hold_s` while user prompts were pending

    def admit(self, request_id: str) -> bool:
        if not self.prefills or not self.has_inline_signal():
            self._since.pop(request_id, None)
            return True
        since = self._since.setdefault(request_id, self.clock())
        if self.clock() - since < self.hold_s:
            return False
        del self._since[request_id]
        self.num_held_too_long += 1
        return True

    def forget(self, request_id: str) -> None:
        self._since.pop(request_id, None)
