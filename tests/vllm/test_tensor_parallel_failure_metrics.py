"""Load and store failures counted where they are exported at any tensor-parallel size.

vLLM runs the scheduler in its engine-core process, whose registry `$HOLEBLEND_METRICS_PORT`
serves; at tensor parallel > 1 the workers run in processes of their own and what they
record there is never exported. The failures travel in the connector stats vLLM sums over
the ranks: the scheduler side counts them from there at tensor parallel > 1, and not at 1,
where the worker shares its process and has counted them already.
"""

import types

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from holeblend_runtime.blend.segments import SegmentSplitter
from holeblend_runtime.kv.store import LocalKVStore
from holeblend_runtime.vllm_connector import connector, metrics
from holeblend_runtime.vllm_connector.accounting import LoadSpec
from holeblend_runtime.vllm_connector.metadata import LoadRequest, StepPlan, StoreRequest
from holeblend_runtime.vllm_connector.settings import ConnectorSettings

BLOCK = 16
SEP = 9
FAILURES = ("holeblend_load_failures_total", "holeblend_store_failures_total")


def _failing_rank(rank: int) -> ModelRunnerOutput:
    """One rank's step output after a load that failed and a step of two stores that failed
    (no model handed over: nothing can be computed)."""
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=BLOCK))
    side = connector._WorkerSide(
        config, ConnectorSettings(), LocalKVStore(1 << 26), counts_loads=rank == 0
    )
    try:
        prompt = SegmentSplitter((SEP,), 1).split([1, 2, SEP, 3, 4, SEP, 5, 6, SEP, 7])
        keys = tuple(f"{i:064x}" for i in range(len(prompt.segments)))
        side._fail_load(LoadRequest("r", prompt, keys, (1,), LoadSpec(0, 6), (0,), 0.15))
        side.store_missing(StepPlan(stores=(StoreRequest("r", prompt, (1, 2)),)))
        output = ModelRunnerOutput.__new__(ModelRunnerOutput)
        output.kv_connector_output = KVConnectorOutput(kv_connector_stats=side.take_stats())
        return output
    finally:
        side.close()


def _failures() -> list[float]:
    return [metrics.sample(name) for name in FAILURES]


def test_failures_in_worker_processes_are_counted_by_the_scheduler_side():
    outputs = [_failing_rank(rank) for rank in (0, 1)]
    merged = KVOutputAggregator(2).aggregate(outputs).kv_connector_output
    scheduler = object.__new__(connector.HoleBlendConnector)
    scheduler.num_shards = 2
    before = _failures()
    scheduler.update_connector_output(merged)
    after = _failures()
    # The load fails on every rank and is counted by rank 0; each rank's entries of the
    # two segments failed.
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 4]


def test_failures_of_a_worker_in_the_schedulers_process_are_counted_once():
    before = _failures()
    output = _failing_rank(0)
    merged = KVOutputAggregator(1).aggregate([output]).kv_connector_output
    object.__new__(connector.HoleBlendConnector).update_connector_output(merged)
    assert [a - b for a, b in zip(_failures(), before, strict=True)] == [1, 2]
