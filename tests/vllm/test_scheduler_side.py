"""The connector's scheduler side on its own: what each step's metadata carries for a
request, as vLLM plans, allocates and finishes it (no engine, no tokenizer)."""

import types

import pytest
import torch

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.vllm_connector import connector
from holeblend_runtime.vllm_connector.settings import ConnectorSettings

SEP = 9
# system | doc A | doc B | doc C | question, separated by SEP
PROMPT = [1, 2, 3, SEP, 10, 11, 12, 13, SEP, 20, 21, 22, 23, SEP, 30, 31, 32, 33, SEP, 40, 41]


class Index:
    """The tiers' keys, as the planner asks for them."""

    def __init__(self):
        self.keys: set[str] = set()

    def contains_many(self, keys):
        return [key in self.keys for key in keys]


@pytest.fixture
def side(monkeypatch):
    tokenizer = types.SimpleNamespace(encode=lambda text, add_special_tokens: [SEP])
    monkeypatch.setattr(connector, "_text_tokenizer", lambda vllm_config: tokenizer)
    model_config = types.SimpleNamespace(model="m", revision=None, dtype=torch.float32)
    vllm_config = types.SimpleNamespace(
        model_config=model_config, parallel_config=types.SimpleNamespace(tensor_parallel_size=1)
    )
    settings = ConnectorSettings(blend=BlendConfig(min_segment_tokens=2), quality_proxies=False)
    side = connector._SchedulerSide(vllm_config, settings, Index(), step_tokens=16)
    keys = side.planner.plan(PROMPT).keys
    # Everything cached but doc B: a hole inside the covered range.
    side.planner.index.keys = {k for i, k in enumerate(keys) if k is not None and i != 2}
    return side


def request(request_id):
    return types.SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(PROMPT), kv_transfer_params=None
    )


def blocks(*ids):
    return types.SimpleNamespace(get_block_ids=lambda: (list(ids),))


def test_a_holes_store_goes_out_with_its_load_not_in_the_step_that_planned_it(side):
    """vLLM plans a request, then may not allocate it in that step (no free blocks): the
    hole's store waits for the step that carries the load, which stores the hole from
    its blend (a store sent alone would compute the hole once more, in canonical
    context, before the load stores it again)."""
    matched = side.matched(request("r"), 0)
    assert matched > 0
    first = side.step_plan()
    assert (first.loads, first.stores) == ((), ())
    assert side.matched(request("r"), 0) == matched  # asked again next step
    side.allocated(request("r"), blocks(0, 1), matched)
    second = side.step_plan()
    assert [load.request_id for load in second.loads] == ["r"]
    assert [(store.request_id, store.segments) for store in second.stores] == [("r", (2,))]
    assert side.step_plan().stores == ()


def test_a_hole_vllm_computes_itself_is_stored_and_one_never_loaded_is_dropped(side):
    """Allocated with no external tokens (vLLM computes the range itself): the hole's store
    goes out alone, computed by the worker. A request that finishes before any load:
    nothing is stored for it."""
    side.matched(request("a"), 0)
    side.allocated(request("a"), blocks(), 0)
    plan = side.step_plan()
    assert plan.loads == () and [(s.request_id, s.segments) for s in plan.stores] == [("a", (2,))]
    side.matched(request("b"), 0)
    side.finished("b", request("b"))
    side.allocated(request("b"), blocks(), 0)  # late: forgotten
    assert side.step_plan().stores == ()
