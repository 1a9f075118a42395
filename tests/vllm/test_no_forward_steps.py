"""The worker side's stores through vLLM's own step code, in a step that runs no forward.

vLLM's model runner runs a step that schedules no tokens (e.g. each request it schedules is
parked for its stepwise load) through `kv_connector_no_forward`: vLLM 0.32 calls
`wait_for_save` there, 0.23 does not. The scheduler side has sent that step's stores all the
same, the parked loads' holes among them, and sends them only once: they must run once on
either version, and once in a step with a forward.
"""

import types

import pytest
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.forward_context import set_forward_context
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.segments import SegmentSplitter
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.kv.store import LocalKVStore
from holeblend_runtime.vllm_connector import connector, metrics
from holeblend_runtime.vllm_connector.metadata import StepPlan, StoreRequest
from holeblend_runtime.vllm_connector.settings import ConnectorSettings
from holeblend_runtime.vllm_connector.worker import BlendWorker, PagedKVWriter

BLOCK = 16
SEP = 9
DOCUMENTS = (
    "The Varn river bridge was built in 1871 by the engineer Ilse Marten.",
    "Oskeby museum opened in 1923 in a former grain store.",
)


@pytest.fixture
def worker(monkeypatch):
    """A worker-side connector without the model, installed as vLLM's connector; its
    worker side as `.side`, its tier as `.tier`."""
    tier = LocalKVStore(1 << 26)
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=BLOCK))
    side = connector._WorkerSide(config, ConnectorSettings(), tier)
    hole_blend = object.__new__(connector.HoleBlendConnector)
    hole_blend._scheduler, hole_blend._worker, hole_blend.store = None, side, tier
    hole_blend._connector_metadata = None
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", hole_blend)
    try:
        yield types.SimpleNamespace(side=side, tier=tier)
    finally:
        side.close()


@pytest.fixture(scope="module")
def model() -> BlendEngine:
    """The reference model (SmolLM2-135M-Instruct), whose forward computes the stores."""
    return BlendEngine.load(num_threads=1)


def step_output(plan: StepPlan) -> types.SimpleNamespace:
    """What the model runner reads of vLLM's `SchedulerOutput` for the connector."""
    return types.SimpleNamespace(
        kv_connector_metadata=connector.HoleBlendConnectorMetadata(plan),
        finished_req_ids=set(),
        has_sync_kv_loads=False,
    )


def run_step_without_forward(plan: StepPlan) -> None:
    KVConnectorModelRunnerMixin.kv_connector_no_forward(step_output(plan), VllmConfig())


def run_step_with_forward(plan: StepPlan) -> None:
    with (
        set_forward_context(None, VllmConfig()),
        KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(step_output(plan)),
    ):
        pass  # the forward


def test_a_steps_stores_run_once_whether_or_not_vllm_runs_a_forward(worker):
    """Without the model every store the worker attempts fails and is counted: the count
    says how often the step's stores ran."""
    prompt = SegmentSplitter((SEP,), 1).split([1, 2, SEP, 3, 4, SEP, 5, 6, SEP, 7])
    plan = StepPlan(stores=(StoreRequest("parked", prompt, (1, 2)),))
    for run_step in (run_step_without_forward, run_step_with_forward):
        before = metrics.STORE_FAILURES._value.get()
        run_step(plan)
        assert metrics.STORE_FAILURES._value.get() - before == 2, run_step.__name__


def test_a_segment_sent_in_a_step_without_forward_is_stored(worker, model):
    """The step's missing segment is computed in its canonical context and reaches the
    tier, though no forward ran."""
    engine = BlendEngine(model.model, model.tokenizer, BlendConfig(), worker.side.store)
    worker.side._worker = BlendWorker(engine, PagedKVWriter([], [], BLOCK))
    prompt = engine.build_prompt("You are a helpful assistant.", DOCUMENTS, "Who built it?")
    key = engine.segment_keys(prompt)[2]
    assert key is not None and worker.tier.contains_many([key]) == [False]
    run_step_without_forward(StepPlan(stores=(StoreRequest("parked", prompt, (2,)),)))
    assert worker.side.flush_stores(30)
    assert worker.tier.contains_many([key]) == [True]
