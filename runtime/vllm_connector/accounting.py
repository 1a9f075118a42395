"""Scheduler-side accounting of the tokens the connector provides (pure Python, no vLLM).

vLLM asks the connector, every time it considers scheduling a request, how many prompt
tokens beyond `num_computed_tokens` it can provide; if it then allocates blocks it tells
the connector how many it accepted. LMCache's connector cached the answer of its first
call and compared later calls against it, so a request that was preempted and came back
with a different `num_computed_tokens` failed with "Mismatch in tokens to load". Here:

1. The only per-request fact kept across calls is the reuse plan's covered range
   `[0, num_covered_tokens)` (a property of the prompt and the cache, not of progress).
2. Every `matched` call derives the load from the `num_computed_tokens` it is given:
   `[num_computed_tokens, num_covered_tokens)`, or nothing when vLLM is already past it.
   It replaces whatever an earlier call derived.
3. `allocated` takes the load derived by the last `matched` call of the same scheduling
   pass, trimmed to the number of tokens vLLM accepted; zero accepted means no load.
4. `take_loads` hands the allocated loads to the step's metadata once (vLLM builds the
   metadata at the end of the same pass); `finished` (done or aborted) forgets the
   request, so nothing is loaded for a request that no longer holds its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadSpec:
    """Prompt tokens whose KV the connector writes into the paged cache in one step."""

    # First token vLLM has not computed: the connector writes KV from here on.
    start: int
    # End of the covered range (exclusive): vLLM computes the tokens from here on.
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"LoadSpec: need 0 <= start < end, got ({self.start}, {self.end})")

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def derive_load(num_covered_tokens: int, num_computed_tokens: int) -> LoadSpec | None:
    """The load for a request with `num_computed_tokens` already in vLLM's cache."""
    if num_computed_tokens < 0:
        raise ValueError(f"num_computed_tokens: must be >= 0, got {num_computed_tokens}")
    if num_computed_tokens >= num_covered_tokens:
        return None
    return LoadSpec(num_computed_tokens, num_covered_tokens)


def covered_tokens(tail_start: int, num_prompt_tokens: int) -> int:
    """Tokens the connector offers: the reused range, leaving vLLM at least one token to
    compute (vLLM needs the last prompt token's logits from its own forward)."""
    return max(0, min(tail_start, num_prompt_tokens - 1))


class LoadLedger:
    """Per-request covered ranges and the loads derived from them (one scheduler)."""

    def __init__(self) -> None:
        self._num_covered: dict[str, int] = {}
        # Derived by the last `matched` call, not yet accepted by an allocation.
        self._derived: dict[str, LoadSpec | None] = {}
        # Accepted by an allocation, not yet handed to a step's metadata.
        self._allocated: dict[str, LoadSpec] = {}

    def has_plan(self, request_id: str) -> bool:
        return request_id in self._num_covered

    def set_plan(self, request_id: str, num_covered_tokens: int) -> None:
        if num_covered_tokens < 0:
            raise ValueError(f"num_covered_tokens: must be >= 0, got {num_covered_tokens}")
        self._num_covered[request_id] = num_covered_tokens

    def matched(self, request_id: str, num_computed_tokens: int) -> int:
        """Tokens the connector can provide beyond `num_computed_tokens` (re-derived)."""
        load = derive_load(self._num_covered.get(request_id, 0), num_computed_tokens)
        self._derived[request_id] = load
        return 0 if load is None else load.num_tokens

    def allocated(self, request_id: str, num_external_tokens: int) -> LoadSpec | None:
        """Record that vLLM allocated blocks for `num_external_tokens` external tokens."""
        load = self._derived.pop(request_id, None)
        self._allocated.pop(request_id, None)
        if num_external_tokens <= 0 or load is None:
            return None
        if num_external_tokens > load.num_tokens:
            raise ValueError(
                f"num_external_tokens: vLLM accepted {num_external_tokens} tokens for request "
                f"{request_id}, the connector offered {load.num_tokens}"
            )
        accepted = LoadSpec(load.start, load.start + num_external_tokens)
        self._allocated[request_id] = accepted
        return accepted

    def take_loads(self) -> dict[str, LoadSpec]:
        """The loads allocated since the last call, for this step's metadata."""
        loads, self._allocated = self._allocated, {}
        return loads

    def finished(self, request_id: str) -> None:
        """Finished or aborted: forget everything about the request."""
        self._derived.pop(request_id, None)
        self._allocated.pop(request_id, None)
        self._num_covered.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        """Requests with any state here (0 once every request has finished)."""
        return len(self._num_covered.keys() | self._derived.keys() | self._allocated.keys())
