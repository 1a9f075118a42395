"""The connector's scheduler-side accounting under chunked prefill, preemption and aborts.

No vLLM here: `SimulatedScheduler` makes the calls vLLM's V1 scheduler makes, in its order
(get_num_new_matched_tokens -> allocate -> update_state_after_alloc -> build_connector_meta),
and the tests check the loads the ledger hands to the worker.
"""

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from holeblend_runtime.vllm_connector.accounting import (
    LoadLedger,
    LoadSpec,
    covered_tokens,
    derive_load,
)

BLOCK = 16


@dataclass
class SimulatedRequest:
    request_id: str
    num_prompt_tokens: int
    num_covered_tokens: int
    num_computed_tokens: int = 0
    is_running: bool = False


class SimulatedScheduler:
    """The connector calls of vLLM's scheduler for one request at a time."""

    def __init__(self, ledger: LoadLedger) -> None:
        self.ledger = ledger
        self.loads: list[tuple[str, int, LoadSpec]] = []

    def schedule_waiting(
        self, request: SimulatedRequest, num_local: int, can_allocate: bool, chunk: int
    ) -> None:
        """One pass over a waiting request with `num_local` tokens in vLLM's own cache."""
        if not self.ledger.has_plan(request.request_id):
            self.ledger.set_plan(request.request_id, request.num_covered_tokens)
        num_external = self.ledger.matched(request.request_id, num_local)
        if not can_allocate:
            return  # no free blocks: vLLM skips the request this pass, no alloc call
        self.ledger.allocated(request.request_id, num_external)
        request.num_computed_tokens = num_local + num_external
        request.is_running = True
        self._take_loads(num_local)
        self.compute(request, chunk)

    def compute(self, request: SimulatedRequest, chunk: int) -> None:
        remaining = request.num_prompt_tokens - request.num_computed_tokens
        request.num_computed_tokens += min(chunk, remaining)

    def preempt(self, request: SimulatedRequest, num_kept: int) -> None:
        """vLLM frees the blocks; `num_kept` tokens stay findable in its prefix cache."""
        request.is_running = False
        request.num_computed_tokens = num_kept

    def _take_loads(self, num_local: int) -> None:
        for request_id, load in self.ledger.take_loads().items():
            self.loads.append((request_id, num_local, load))


def test_preempted_chunked_request_rederives_its_load_after_several_rounds():
    """LMCache's failure: 256 tokens cached by the connector, 336 computed by vLLM when the
    request was preempted; the next allocation must not compare against the old lookup."""
    ledger = LoadLedger()
    scheduler = SimulatedScheduler(ledger)
    request = SimulatedRequest("r", num_prompt_tokens=1000, num_covered_tokens=256)
    scheduler.schedule_waiting(request, num_local=0, can_allocate=True, chunk=80)
    assert scheduler.loads == [("r", 0, LoadSpec(0, 256))]
    assert request.num_computed_tokens == 336
    scheduler.preempt(request, num_kept=336)
    for _ in range(3):  # no free blocks for a few passes: asked, never allocated
        scheduler.schedule_waiting(request, num_local=336, can_allocate=False, chunk=80)
    scheduler.schedule_waiting(request, num_local=336, can_allocate=True, chunk=80)
    assert scheduler.loads == [("r", 0, LoadSpec(0, 256))]  # nothing more to load
    assert request.num_computed_tokens == 416


def test_preempted_request_loads_only_what_vllm_no_longer_holds():
    ledger = LoadLedger()
    scheduler = SimulatedScheduler(ledger)
    request = SimulatedRequest("r", num_prompt_tokens=1000, num_covered_tokens=512)
    scheduler.schedule_waiting(request, num_local=0, can_allocate=True, chunk=64)
    scheduler.preempt(request, num_kept=336)
    for _ in range(3):
        scheduler.schedule_waiting(request, num_local=336, can_allocate=False, chunk=64)
    scheduler.schedule_waiting(request, num_local=336, can_allocate=True, chunk=64)
    assert scheduler.loads[-1] == ("r", 336, LoadSpec(336, 512))


def test_a_later_call_replaces_an_earlier_derivation():
    ledger = LoadLedger()
    ledger.set_plan("r", 300)
    assert ledger.matched("r", 0) == 300
    assert ledger.matched("r", 128) == 172
    assert ledger.allocated("r", 172) == LoadSpec(128, 300)


def test_accepting_more_tokens_than_offered_is_an_error_naming_the_field():
    ledger = LoadLedger()
    ledger.set_plan("r", 100)
    ledger.matched("r", 0)
    with pytest.raises(ValueError, match="num_external_tokens"):
        ledger.allocated("r", 101)


def test_zero_accepted_tokens_load_nothing():
    ledger = LoadLedger()
    ledger.set_plan("r", 100)
    ledger.matched("r", 0)
    assert ledger.allocated("r", 0) is None
    assert ledger.take_loads() == {}


def test_a_full_prompt_hit_leaves_one_token_to_compute():
    assert covered_tokens(tail_start=50, num_prompt_tokens=50) == 49
    assert covered_tokens(tail_start=30, num_prompt_tokens=50) == 30
    assert covered_tokens(tail_start=0, num_prompt_tokens=1) == 0


def test_nothing_is_loaded_once_vllm_is_past_the_covered_range():
    assert derive_load(100, 100) is None
    assert derive_load(100, 140) is None
    assert derive_load(100, 96) == LoadSpec(96, 100)


def test_finished_requests_leave_nothing_behind():
    ledger = LoadLedger()
    ledger.set_plan("r", 100)
    ledger.matched("r", 0)
    ledger.allocated("r", 100)
    ledger.finished("r")
    assert ledger.num_tracked == 0
    assert ledger.take_loads() == {}


# --- property tests over random schedules --------------------------------------------

_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["step", "preempt", "stall", "abort"]),
        st.integers(min_value=1, max_value=600),  # chunk size or kept tokens
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    num_prompt_tokens=st.integers(min_value=1, max_value=2000),
    tail_start=st.integers(min_value=0, max_value=2000),
    events=_EVENTS,
)
def test_random_schedules_load_exactly_the_uncomputed_covered_tokens(
    num_prompt_tokens, tail_start, events
):
    ledger = LoadLedger()
    scheduler = SimulatedScheduler(ledger)
    num_covered = covered_tokens(min(tail_start, num_prompt_tokens), num_prompt_tokens)
    request = SimulatedRequest("r", num_prompt_tokens, num_covered)
    is_aborted = False
    for kind, amount in events:
        if request.num_computed_tokens >= num_prompt_tokens or is_aborted:
            break
        if kind == "abort":
            ledger.finished("r")
            is_aborted = True
        elif kind == "preempt" and request.is_running:
            kept = min(amount, request.num_computed_tokens) // BLOCK * BLOCK
            scheduler.preempt(request, kept)
        elif request.is_running:
            scheduler.compute(request, amount)
        else:
            num_before = len(scheduler.loads)
            local = request.num_computed_tokens
            scheduler.schedule_waiting(request, local, kind != "stall", amount)
            _check_new_loads(scheduler.loads[num_before:], local, num_covered, num_prompt_tokens)
    ledger.finished("r")
    assert ledger.num_tracked == 0


def _check_new_loads(loads, num_local, num_covered, num_prompt_tokens):
    assert len(loads) <= 1
    for _, local, load in loads:
        assert load.start == local == num_local  # from the current count, never a stale one
        assert load.end == num_covered < num_prompt_tokens


@settings(max_examples=200, deadline=None)
@given(
    covered=st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=6),
    order=st.randoms(use_true_random=False),
)
def test_interleaved_requests_never_see_each_others_loads(covered, order):
    ledger = LoadLedger()
    for i, num_covered in enumerate(covered):
        ledger.set_plan(f"r{i}", num_covered)
    ids = [f"r{i}" for i in range(len(covered))]
    order.shuffle(ids)
    for request_id in ids:
        ledger.allocated(request_id, ledger.matched(request_id, 0))
    loads = ledger.take_loads()
    expected = {f"r{i}": LoadSpec(0, n) for i, n in enumerate(covered) if n > 0}
    assert loads == expected
    for request_id in ids:
        ledger.finished(request_id)
    assert ledger.num_tracked == 0
