"""Segment keys name the RoPE a deployment runs the model with (`--hf-overrides`), on vLLM's
own ModelConfig of the exported SmolLM2 (no engine)."""

import types

import pytest
from vllm.config import ModelConfig, ParallelConfig

from holeblend_devtools.hf_export import export_smollm2
from holeblend_runtime.vllm_connector.connector import kv_layout, model_identity, rope_settings
from holeblend_runtime.vllm_connector.settings import ConnectorSettings

LINEAR_2X = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}


def model_id(hf_overrides: dict | None = None) -> str:
    config = ModelConfig(
        model=str(export_smollm2()), dtype="float32", skip_tokenizer_init=True,
        hf_overrides=hf_overrides or {},
    )  # fmt: skip
    vllm_config = types.SimpleNamespace(model_config=config)
    return model_identity(vllm_config, ConnectorSettings())[0]


@pytest.fixture(scope="module")
def plain_id() -> str:
    return model_id()


def test_a_deployment_without_overrides_keeps_its_keys(plain_id):
    assert plain_id == f"{export_smollm2()}@main"


def test_a_rope_override_names_other_kv(plain_id):
    scaled = model_id(LINEAR_2X)
    assert scaled.startswith(f"{plain_id}+rope-")
    assert model_id({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}) != scaled
    # Another base, the override the blend runs (it takes plain RoPE only: model_adapter).
    based = model_id({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert based.startswith(f"{plain_id}+rope-")
    assert based != scaled


def test_the_scheduler_and_the_tiers_take_the_same_id():
    config = ModelConfig(
        model=str(export_smollm2()), dtype="float32", skip_tokenizer_init=True,
        hf_overrides=LINEAR_2X,
    )  # fmt: skip
    vllm_config = types.SimpleNamespace(model_config=config, parallel_config=ParallelConfig())
    layout = kv_layout(vllm_config, ConnectorSettings())
    assert layout.model_id == model_identity(vllm_config, ConnectorSettings())[0]
    assert "+rope-" in layout.model_id


def test_overrides_that_keep_the_checkpoints_rope_keep_its_keys(plain_id):
    config = ModelConfig(model=str(export_smollm2()), skip_tokenizer_init=True)
    own = dict(config.hf_text_config.rope_parameters)
    own["rope_theta"] = int(own["rope_theta"])  # as a JSON flag writes it
    assert model_id({"rope_parameters": own}) == plain_id
    assert model_id({"max_position_embeddings": 4096}) == plain_id


def test_the_same_rope_written_another_way_names_the_same_kv():
    as_integers = {"rope_scaling": {"rope_type": "linear", "factor": 2}}
    assert model_id(as_integers) == model_id(LINEAR_2X)


def test_transformers_4_fields_read_as_transformers_5_parameters():
    """transformers 4 keeps RoPE in `rope_theta` and `rope_scaling` (legacy `type`);
    transformers 5 in `rope_parameters`: the same RoPE reads the same."""
    v4 = types.SimpleNamespace(rope_theta=10000, rope_scaling={"type": "linear", "factor": 2})
    v5 = types.SimpleNamespace(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    )
    assert rope_settings(v4) == rope_settings(v5)
    plain_v4 = types.SimpleNamespace(rope_theta=10000.0, rope_scaling=None)
    plain_v5 = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert rope_settings(plain_v4) == rope_settings(plain_v5)
    assert rope_settings(plain_v4) != rope_settings(v4)


def test_overrides_whose_checkpoint_cannot_be_read_again_name_the_served_rope(tmp_path):
    """Where the checkpoint's own RoPE cannot be read (its config is gone), the keys name
    the served RoPE: a needless miss, never KV computed under another RoPE."""
    served = ModelConfig(
        model=str(export_smollm2()), skip_tokenizer_init=True, hf_overrides={"num_labels": 3}
    )
    served.model = str(tmp_path)
    served.hf_config_path = None
    vllm_config = types.SimpleNamespace(model_config=served)
    assert "+rope-" in model_identity(vllm_config, ConnectorSettings())[0]
