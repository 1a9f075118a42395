"""The worker side's stores through vLLM's own step code, in a step that runs no forward.

vLLM's model runner runs a step that schedules no tokens (e.g. each request it schedules is
parked for its stepwise load) through `kv_connector_no_forward`: vLLM 0.32 calls
`wait_for_save` there, 0.23 does not. The scheduler side has sent that step's stores all the
same, the parked loads' holes among them, and sends them only once: they must run once on
either version, and once in a step with a forward, and what they count must go out in that
step's connector stats, which vLLM takes before it clears the step.
"""

import types

import pytest
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.forward_context import set_forward_context
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
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


def _parked_store() -> StepPlan:
    """A step whose one store, of two segments, fails without the model."""
    prompt = SegmentSplitter((SEP,), 1).split([1, 2, SEP, 3, 4, SEP, 5, 6, SEP, 7])
    return StepPlan(stores=(StoreRequest("parked", prompt, (1, 2)),))


def test_a_step_without_forward_exports_its_failed_stores_in_its_own_stats(worker):
    """The step's failed stores are in the stats of the step that ran them, not the next
    one's (never sent if the engine goes idle)."""
    out = KVConnectorModelRunnerMixin.kv_connector_no_forward(
        step_output(_parked_store()), VllmConfig()
    )
    stats = out.kv_connector_output.kv_connector_stats
    assert stats is not None and stats.data == {"num_failed_stores": 2}


def test_under_speculative_decoding_a_steps_stores_run_once_and_go_out_with_its_stats(worker):
    """With a draft model vLLM calls `wait_for_save` after the draft's forward, once it took
    the step's stats: the stores ran after the target model's forward, once."""
    before = metrics.STORE_FAILURES._value.get()
    with (
        set_forward_context(None, VllmConfig()),
        KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(
            step_output(_parked_store()), defer_finalize=True
        ) as output,
    ):
        pass  # the target model's forward
    KVConnectorModelRunnerMixin.finalize_kv_connector()  # after the draft model's forward
    assert output.kv_connector_stats.data == {"num_failed_stores": 2}
    assert metrics.STORE_FAILURES._value.get() - before == 2


def test_a_stored_segment_is_counted_once_by_the_scheduler_side_at_tensor_parallel_two(model):
    """Each rank stores its shard of the step's missing segment; vLLM sums the ranks' stats,
    and the scheduler side, whose process exports the metrics (the workers' do not at
    tensor parallel > 1), counts the segment once: not per rank, nor again in a worker
    that shares its process (tensor parallel 1)."""
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=BLOCK))
    labels = {"source": "computed"}
    before = metrics.sample("holeblend_stored_segments_total", labels)
    outputs = []
    for rank in (0, 1):
        side = connector._WorkerSide(
            config, ConnectorSettings(), LocalKVStore(1 << 26), counts_loads=rank == 0
        )
        try:
            engine = BlendEngine(model.model, model.tokenizer, BlendConfig(), side.store)
            side._worker = BlendWorker(engine, PagedKVWriter([], [], BLOCK))
            prompt = engine.build_prompt("You are a helpful assistant.", DOCUMENTS, "Who?")
            plan = StepPlan(stores=(StoreRequest("r", prompt, (2,)),))
            side.store_missing(plan)
            output = ModelRunnerOutput.__new__(ModelRunnerOutput)
            output.kv_connector_output = KVConnectorOutput(kv_connector_stats=side.take_stats())
            outputs.append(output)
        finally:
            side.close()
    merged = KVOutputAggregator(2).aggregate(outputs).kv_connector_output
    scheduler = object.__new__(connector.HoleBlendConnector)
    scheduler.update_connector_output(merged)
    assert merged.kv_connector_stats.data == {"num_stored_segments_computed": 1}
    assert metrics.sample("holeblend_stored_segments_total", labels) - before == 1
