"""What the scheduler side sends the worker side each step (plain frozen dataclasses).

vLLM carries the connector metadata from the scheduler process to the workers by
pickling it; these types hold only ints, strings, tuples and a `SegmentedPrompt`.
"""

from __future__ import annotations

from dataclasses import dataclass

from holeblend_runtime.blend.segments import SegmentedPrompt
from holeblend_runtime.vllm_connector.accounting import LoadSpec


@dataclass(frozen=True)
class LoadRequest:
    """Blend the covered range of one request and write `load`'s slots of it."""

    request_id: str
    # The whole prompt, and one key per segment (None: never cached).
    prompt: SegmentedPrompt
    keys: tuple[str | None, ...]
    # Indexes into prompt.segments of the segments the scheduler planned to reuse.
    reused_segments: tuple[int, ...]
    # Slots to write: vLLM holds [0, load.start) already and computes [load.end, ...).
    load: LoadSpec
    # vLLM's block ids of the request, in order (block i holds tokens i*B..(i+1)*B-1).
    block_ids: tuple[int, ...]
    # The recompute ratio in force when the request was scheduled.
    ratio: float
    # Loaded asynchronously: the blend is spread over steps (`blend_step_tokens`) and the
    # request waits in vLLM's WAITING_FOR_REMOTE_KVS until the worker reports it done.
    is_async: bool = False


@dataclass(frozen=True)
class StoreRequest:
    """Store these missing segments of a prompt: from the K/V vLLM's forward of this step
    writes at the request's blocks (`block_ids` given: every segment is computed wholly in
    this step, store policy in-context), else computed in their canonical context."""

    request_id: str
    prompt: SegmentedPrompt
    # Indexes into prompt.segments.
    segments: tuple[int, ...]
    # vLLM's block ids of the request (block i holds tokens i*B..(i+1)*B-1), or None.
    block_ids: tuple[int, ...] | None = None
    # The request's lookup failed or missed its deadline, so its segments were named missing
    # without being looked up: the worker skips those the tier holds before writing any.
    check_stored: bool = False

    @property
    def is_from_forward(self) -> bool:
        return self.block_ids is not None


@dataclass(frozen=True)
class StepPlan:
    """The connector's work for one scheduler step."""

    loads: tuple[LoadRequest, ...] = ()
    stores: tuple[StoreRequest, ...] = ()
