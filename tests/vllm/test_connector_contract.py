"""The connector against vLLM's real classes: loading by module path, metadata on the wire."""

import pickle
import types

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, supports_hma
from vllm.utils.func_utils import supports_kw

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.segments import SegmentSplitter
from holeblend_runtime.vllm_connector.accounting import LoadSpec
from holeblend_runtime.vllm_connector.connector import (
    HoleBlendConnector,
    HoleBlendConnectorMetadata,
    HoleBlendStats,
    HoleBlendWorkerMetadata,
    kv_layout,
    model_identity,
)
from holeblend_runtime.vllm_connector.metadata import (
    LoadRequest,
    StepPlan,
    StoreRequest,
)
from holeblend_runtime.vllm_connector.settings import ConnectorSettings
from holeblend_runtime.vllm_connector.worker import LoadOutcome


def transfer_config() -> KVTransferConfig:
    # The exact settings the operator renders (operator/render/engine.py).
    return KVTransferConfig(
        kv_connector="HoleBlendConnector",
        kv_connector_module_path="holeblend_runtime.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"holeblend_config": "/etc/holeblend/blend.json"},
    )


def test_the_factory_loads_our_class_by_module_path():
    connector_class = KVConnectorFactory.get_connector_class(transfer_config())
    assert connector_class is HoleBlendConnector
    assert issubclass(connector_class, KVConnectorBase_V1)


def test_the_class_has_the_three_argument_constructor_and_no_abstract_methods_left():
    assert supports_kw(HoleBlendConnector, "kv_cache_config")
    assert not HoleBlendConnector.__abstractmethods__


def test_hma_is_not_claimed_so_pods_must_disable_the_hybrid_manager():
    assert not supports_hma(HoleBlendConnector)


def test_step_metadata_round_trips_through_pickle():
    prompt = SegmentSplitter((9,), 1).split([1, 2, 9, 3, 4, 9, 5])
    plan = StepPlan(
        loads=(
            LoadRequest(
                "r1", prompt, ("ab12", None, None), (0,), LoadSpec(0, 5), (3, 7), 0.15
            ),
        ),
        stores=(StoreRequest("r1", prompt, (1,)),),
    )  # fmt: skip
    meta = HoleBlendConnectorMetadata(plan)
    assert pickle.loads(pickle.dumps(meta)) == meta


def test_worker_metadata_aggregates_the_outcomes_of_all_workers():
    first = HoleBlendWorkerMetadata((LoadOutcome("a", 10, 2, 4, 0, 0.1),))
    second = HoleBlendWorkerMetadata((LoadOutcome("b", 5, 0, 1, 1, 0.2),))
    merged = first.aggregate(second)
    assert [o.request_id for o in merged.outcomes] == ["a", "b"]
    assert pickle.loads(pickle.dumps(merged)) == merged
    # Every tensor-parallel rank reports a failed load: the scheduler hears of it once.
    failed = HoleBlendWorkerMetadata(failed=("c",)).aggregate(
        HoleBlendWorkerMetadata(failed=("c", "d"))
    )
    assert failed.failed == ("c", "d")


def test_a_load_at_tensor_parallel_size_two_is_counted_once():
    """Every rank blends the same load over its own heads and reports it: through vLLM's
    own aggregation of the ranks' outputs the scheduler hears of the load once, and vLLM's
    connector stats (summed over ranks) count its tokens once; each rank's failed stores
    are its own shard's, summed."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from holeblend_runtime.kv.store import LocalKVStore
    from holeblend_runtime.vllm_connector.connector import _WorkerSide

    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=16))
    outcome = LoadOutcome("r", 10, 2, 4, 1, 0.1)
    outputs = []
    for rank in (0, 1):
        side = _WorkerSide(
            config, ConnectorSettings(), LocalKVStore(1 << 20), counts_loads=rank == 0
        )
        try:
            side._finished(outcome)
            side._stats["num_failed_stores"] = 1
            output = ModelRunnerOutput.__new__(ModelRunnerOutput)
            output.kv_connector_output = KVConnectorOutput(
                kv_connector_worker_meta=HoleBlendWorkerMetadata(side.take_outcomes()),
                kv_connector_stats=side.take_stats(),
            )
            outputs.append(output)
        finally:
            side.close()
    merged = KVOutputAggregator(2).aggregate(outputs).kv_connector_output
    assert merged.kv_connector_worker_meta.outcomes == (outcome,)
    assert merged.kv_connector_stats.reduce() == {
        "num_reused_tokens": 10,
        "num_hole_tokens": 2,
        "num_recomputed_tokens": 4,
        "num_rejected_segments": 1,
        "num_failed_stores": 2,
    }


def test_connector_stats_sum_over_an_interval():
    stats = HoleBlendStats(data={"num_reused_tokens": 3})
    stats.aggregate(HoleBlendStats(data={"num_reused_tokens": 4, "num_hole_tokens": 1}))
    assert stats.reduce() == {"num_reused_tokens": 7, "num_hole_tokens": 1}
    assert HoleBlendConnector.build_kv_connector_stats({"x": 1}).data == {"x": 1}


def test_the_scheduler_keys_and_the_tiers_name_the_stored_kv_dtype():
    """kv.storeDtype: the scheduler's keys and the shared tier's expected blob header name
    the dtype the tiers hold documents in (as the worker's engine does), not the model's;
    the system prompt's blob, held in the model's dtype, is taken too."""
    model_config = types.SimpleNamespace(
        model="m", revision=None, dtype=torch.float32,
        get_num_layers=lambda parallel: 30, get_num_kv_heads=lambda parallel: 3,
        get_head_size=lambda: 64,
    )  # fmt: skip
    vllm_config = types.SimpleNamespace(model_config=model_config, parallel_config=None)
    narrow = ConnectorSettings(blend=BlendConfig(kv_store_dtype="bfloat16"))
    # No settings file: no model name, the weights' identity alone.
    assert model_identity(vllm_config, narrow) == ("m@main", "bfloat16")
    assert model_identity(vllm_config, ConnectorSettings()) == ("m@main", "float32")
    assert kv_layout(vllm_config, narrow).dtype == "bfloat16"
    assert kv_layout(vllm_config, narrow).other_dtypes == ("float32",)
    assert kv_layout(vllm_config, ConnectorSettings()).header("k", 2).dtype == "float32"
    assert kv_layout(vllm_config, ConnectorSettings()).other_dtypes == ()
