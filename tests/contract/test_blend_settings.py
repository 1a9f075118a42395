"""blend.json: one contract, rendered by the operator and parsed by the runtime."""

import json
from pathlib import Path

import pytest
import yaml

from holeblend_contract import blend_settings as contract
from holeblend_contract.blend_settings import BlendSettingsError, parse_blend_settings
from holeblend_operator.api import BlendDeployment, BlendSpec, KVTiers, TuningSpec
from holeblend_operator.quantity import quantity_bytes
from holeblend_operator.render import render_children
from holeblend_runtime.blend.config import BlendConfig, from_settings

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def rendered_blend_json(path: Path) -> str:
    bd = BlendDeployment.model_validate(yaml.safe_load(path.read_text()))
    configmaps = [c for c in render_children(bd) if c["kind"] == "ConfigMap"]
    [data] = [c["data"] for c in configmaps if contract.CONFIG_KEY in c["data"]]
    return data[contract.CONFIG_KEY]


def minimal_file(**extra) -> str:
    return json.dumps({"formatVersion": 1, "model": {"name": "m"}, **extra})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_rendered_example_loads_with_the_runtime_parser(path):
    text = rendered_blend_json(path)
    settings = parse_blend_settings(text)
    config = from_settings(settings)
    assert settings.to_json() == text
    assert config.ratio == settings.recompute_ratio
    assert config.separator == settings.separator
    assert config.min_segment_tokens == settings.min_segment_tokens


def test_rendered_file_carries_every_contract_key():
    text = rendered_blend_json(EXAMPLES[0])
    keys = set(json.loads(text))
    assert keys == {field.alias for field in contract.BlendSettings.model_fields.values()}


def test_api_defaults_are_the_contract_defaults():
    blend = BlendSpec()
    assert blend.separator == contract.DEFAULT_SEPARATOR
    assert blend.check_layer == contract.DEFAULT_CHECK_LAYER
    assert blend.recompute_ratio == contract.DEFAULT_RECOMPUTE_RATIO
    assert blend.min_segment_tokens == contract.DEFAULT_MIN_SEGMENT_TOKENS
    assert quantity_bytes(KVTiers().local_cpu_bytes) == contract.DEFAULT_LOCAL_CPU_BYTES
    assert TuningSpec().shadow_sample_rate == contract.DEFAULT_SHADOW_SAMPLE_RATE


def test_runtime_defaults_are_the_contract_defaults():
    from_file = from_settings(parse_blend_settings(minimal_file()))
    assert from_file == BlendConfig()


@pytest.mark.parametrize(
    ("wire", "field", "value"),
    [
        ({"segmentContext": "alone"}, "cache_after_system", False),
        ({"segmentContext": "afterSystem"}, "cache_after_system", True),
        ({"selection": "random"}, "selection", "random"),
        ({"checkLayer": 3}, "check_layer", 3),
        ({"recomputeRatio": 0.4}, "ratio", 0.4),
    ],
)
def test_wire_names_map_onto_the_runtime_config(wire, field, value):
    config = from_settings(parse_blend_settings(minimal_file(**wire)))
    assert getattr(config, field) == value


def test_newer_format_version_is_refused_with_the_fix():
    with pytest.raises(BlendSettingsError, match="formatVersion: 2 is newer .*upgrade the runtime"):
        parse_blend_settings(minimal_file(formatVersion=2, someFutureKey=1))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kDeviation": 1}, "kDeviation: unknown key"),
        ({"kv": {"localCpuByte": 1}}, "kv.localCpuByte: unknown key"),
        ({"checkLayers": [1]}, "checkLayers: unknown key"),
        ({"checkLayer": 0}, "checkLayer: Input should be greater than or equal to 1"),
        ({"recomputeRatio": "high"}, "recomputeRatio: Input should be a valid number"),
        ({"selection": "k-deviation"}, "selection: unknown strategy 'k-deviation'"),
        ({"selection": "sinks:0.5+query:0.6"}, "selection: shares sum to 1.1"),
        ({"filterLayers": [2]}, "filterLayers: must be strictly increasing and above checkLayer 2"),
        (
            {"lookupServerUrl": "http://lookup:99999"},
            r"^blend.json: lookupServerUrl: expected http://HOST:PORT with a port in 1-65535",
        ),
        ({"lookupServerUrl": "redis://lookup:7000"}, "lookupServerUrl: expected http://HOST:PORT"),
    ],
)
def test_bad_keys_and_values_name_the_key(extra, message):
    with pytest.raises(BlendSettingsError, match=message):
        parse_blend_settings(minimal_file(**extra))


@pytest.mark.parametrize("text", ["", "{", "[]", "null", b"\xff\xfe"])
def test_garbage_is_a_settings_error_not_a_crash(text):
    with pytest.raises(BlendSettingsError):
        parse_blend_settings(text)


def test_restart_settings_leave_out_the_live_keys():
    settings = parse_blend_settings(minimal_file(recomputeRatio=0.3))
    assert "recomputeRatio" not in settings.restart_settings()
    assert {"recomputeRatio", "shadowIdleSamples", "shadowIdleSeconds"} == contract.LIVE_KEYS
    assert not contract.LIVE_KEYS & settings.restart_settings().keys()


def test_a_retired_key_from_an_older_operator_is_read_and_dropped():
    """`chunkSize` was written by older operators and read by nothing: their files still
    load (contract 2), and a file written now never carries it."""
    old = parse_blend_settings(minimal_file(chunkSize=256))
    assert old == parse_blend_settings(minimal_file())
    assert "chunkSize" not in old.to_wire()


def test_the_api_refuses_the_retired_key_naming_it():
    with pytest.raises(ValueError, match="chunkSize"):
        BlendSpec.model_validate({"chunkSize": 256})
