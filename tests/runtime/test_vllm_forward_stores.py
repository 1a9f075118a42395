"""Which missing segments each vLLM step stores from its own forward (no vLLM needed)."""

from types import SimpleNamespace

from holeblend_runtime.blend.segments import SegmentSplitter
from holeblend_runtime.vllm_connector.forward_stores import ForwardStores

SEP = 9
# system 0-2 | SEP | doc 4-7 | SEP | doc 9-12 | SEP | doc 14-17 | SEP | question 19-20
PROMPT = SegmentSplitter((SEP,), 2).split([1, 2, 3, SEP, 10, 11, 12, 13, SEP, 20, 21, 22, 23,
                                           SEP, 30, 31, 32, 33, SEP, 40, 41])  # fmt: skip
DOCS = (1, 2, 3)


def _new(request_id, computed, scheduled, blocks):
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=request_id, block_ids=(list(blocks),), num_computed_tokens=computed
            )
        ],
        scheduled_cached_reqs=_cached(),
        num_scheduled_tokens={request_id: scheduled},
    )


def _cached(entries=(), resumed=()):
    return SimpleNamespace(
        req_ids=[e[0] for e in entries],
        resumed_req_ids=set(resumed),
        new_block_ids=[None if e[3] is None else (list(e[3]),) for e in entries],
        num_computed_tokens=[e[1] for e in entries],
    )


def _later(request_id, computed, scheduled, new_blocks=None, resumed=False):
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=_cached(
            [(request_id, computed, scheduled, new_blocks)], [request_id] if resumed else []
        ),
        num_scheduled_tokens={request_id: scheduled},
    )


def test_a_prompt_computed_in_one_step_stores_every_segment_from_it():
    stores = ForwardStores()
    stores.add("r", PROMPT, DOCS)
    (store,) = stores.step(_new("r", 0, 21, [5, 6]))
    assert store.segments == DOCS and store.block_ids == (5, 6) and store.is_from_forward
    assert stores.num_pending == 0


def test_segments_that_were_not_looked_up_are_stored_after_a_check_in_every_step():
    """A late lookup's segments (`check_stored`): each step's stores say so, whole or split."""
    stores = ForwardStores()
    stores.add("r", PROMPT, DOCS, check_stored=True)
    first = stores.step(_new("r", 0, 11, [5]))  # doc 1 whole, doc 2 split
    second = stores.step(_later("r", 11, 10, [6]))
    assert [(s.segments, s.check_stored) for s in first] == [((1,), True), ((2,), True)]
    assert [(s.segments, s.check_stored) for s in second] == [((3,), True)]
    stores.add("q", PROMPT, DOCS)
    assert [s.check_stored for s in stores.step(_new("q", 0, 21, [7, 8]))] == [False]


def test_the_connector_covered_part_is_before_the_step():
    stores = ForwardStores()
    stores.add("r", PROMPT, (3,))  # documents 1-2 came from the connector: computed = 13
    (store,) = stores.step(_new("r", 13, 8, [0, 1]))
    assert store.segments == (3,) and store.block_ids == (0, 1)


def test_a_chunked_prefill_stores_whole_segments_per_step_and_computes_split_ones():
    stores = ForwardStores()
    stores.add("r", PROMPT, DOCS)
    first = stores.step(_new("r", 0, 11, [7]))  # tokens 0-10: doc 1 whole, doc 2 split
    assert [(s.segments, s.block_ids) for s in first] == [((1,), (7,)), ((2,), None)]
    second = stores.step(_later("r", 11, 10, new_blocks=[8]))  # tokens 11-20: doc 3
    assert [(s.segments, s.block_ids) for s in second] == [((3,), (7, 8))]
    assert stores.num_pending == 0


def test_a_resumed_request_uses_its_new_blocks():
    stores = ForwardStores()
    stores.add("r", PROMPT, (3,))
    assert stores.step(_new("r", 0, 13, [1])) == []  # doc 3 starts at 14: not yet
    (store,) = stores.step(_later("r", 13, 8, new_blocks=[4, 5], resumed=True))
    assert store.block_ids == (4, 5)


def test_other_requests_and_finished_ones_are_left_alone():
    stores = ForwardStores()
    stores.add("r", PROMPT, DOCS)
    assert stores.step(_new("other", 0, 21, [3])) == []
    stores.forget("r")
    assert stores.step(_new("r", 0, 21, [3])) == []
    stores.add("empty", PROMPT, ())
    assert stores.num_pending == 0
