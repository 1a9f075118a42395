"""spec.tuning.qualityProxies and shadowBudget: on by default, rendered into blend.json and
vLLM's args, switched off and on again, and the upgrade from the HOLEBLEND_ENGINE_URL
opt-in (still honoured, with a notice that says to remove it)."""

import json

import pytest
import yaml

from holeblend_contract.blend_settings import DEFAULT_SHADOW_CHUNK_TOKENS, SHADOW_SCHEDULER_CLS
from holeblend_operator.api import BlendDeployment, spec_notices
from holeblend_operator.cli import main
from holeblend_operator.render import config_hash, render_children
from holeblend_operator.render.runtime_config import runtime_config
from holeblend_operator.tuner import Reading, State, decide
from holeblend_operator.tuning_loop import no_proxies, status_patch
from holeblend_runtime.bench.shadow_load import RENDERED_IDLE_FLOOR
from holeblend_runtime.vllm_connector.settings import shadow_chunk_tokens
from tests.operator.crd_validation import api_server_errors
from tests.operator.test_render import MINIMAL, engine_container, env_of, find

NVIDIA = {"type": "nvidia", "count": 1}
LEGACY = {"name": "HOLEBLEND_ENGINE_URL", "value": "http://127.0.0.1:8000/v2"}
SEEN = Reading(0.95, 0.97, 40, 80.0, 0.3, 1.0, (0.15,))
NOW = "2026-11-26T08:00:00Z"


def manifest(**spec) -> dict:
    return {**MINIMAL, "spec": {**MINIMAL["spec"], **spec}}


def bd_of(**spec) -> BlendDeployment:
    return BlendDeployment.model_validate(manifest(**spec))


def vllm(tuning: dict | None = None, **spec) -> BlendDeployment:
    return bd_of(accelerator=NVIDIA, **({"tuning": tuning} if tuning is not None else {}), **spec)


def args_of(bd: BlendDeployment) -> list[str]:
    return engine_container(bd)["args"]


def has_priority_scheduling(bd: BlendDeployment) -> bool:
    args = args_of(bd)
    return any(
        a == "--scheduling-policy" and b == "priority" for a, b in zip(args, args[1:], strict=False)
    )


def rendered_settings(bd: BlendDeployment) -> dict:
    configmap = find(render_children(bd), "ConfigMap", "runtime-config")
    return json.loads(configmap["data"]["blend.json"])


def tuned_code(bd: BlendDeployment) -> str:
    seen = Reading(0.95, 0.97, 40, 80.0, 0.3, 1.0, (0.15,), no_proxies=no_proxies(bd))
    return decide(bd.spec.tuning, 0.15, seen, State(), 1000.0).code


def test_the_default_vllm_deployment_scores_the_proxies_and_tunes_on_them():
    bd = vllm()
    settings = rendered_settings(bd)
    assert settings["qualityProxies"] is True
    assert settings["shadowBudget"] == 0.05
    assert settings["engineUrl"] == "http://127.0.0.1:8000"
    assert has_priority_scheduling(bd)
    assert no_proxies(bd) is None
    assert tuned_code(bd) != "NoQualityProxies"
    assert spec_notices(manifest(accelerator=NVIDIA)["spec"]) == []


def test_the_idle_floor_is_the_tuners_min_samples_per_interval_while_it_tunes():
    settings = rendered_settings(vllm())
    floor = (settings["shadowIdleSamples"], settings["shadowIdleSeconds"])
    assert floor == (20, 60.0) == RENDERED_IDLE_FLOOR  # what the benchmarks render
    tuned = rendered_settings(vllm({"minSamples": 4, "intervalSeconds": 45}))
    assert (tuned["shadowIdleSamples"], tuned["shadowIdleSeconds"]) == (4, 45.0)
    serve = rendered_settings(bd_of(tuning={"minSamples": 6}))  # holeblend-serve pods too
    assert serve["shadowIdleSamples"] == 6
    # Nothing waits for the samples: the budget alone bounds the shadows.
    assert rendered_settings(vllm({"enabled": False}))["shadowIdleSamples"] == 0
    assert rendered_settings(vllm({"qualityProxies": False}))["shadowIdleSamples"] == 0
    # Live keys, as the ratio: tuning the tuner does not restart the engine pods.
    assert config_hash(vllm({"minSamples": 4, "intervalSeconds": 30})) == config_hash(vllm())


def test_the_engine_url_follows_the_engine_port():
    bd = vllm(engine={"port": 8080, "metricsPort": 9464})
    assert rendered_settings(bd)["engineUrl"] == "http://127.0.0.1:8080"


def test_switching_the_proxies_off_and_on_changes_the_render_and_the_tuner():
    on = vllm()
    off = vllm({"qualityProxies": False})
    again = vllm({"qualityProxies": True})

    settings = rendered_settings(off)
    assert (settings["qualityProxies"], settings["engineUrl"]) == (False, None)
    assert not has_priority_scheduling(off)
    assert "spec.tuning.qualityProxies is false" in no_proxies(off)
    assert tuned_code(off) == "NoQualityProxies"
    # Not a live key: the pods restart with the new settings (and the new vLLM args).
    assert config_hash(off) != config_hash(on)

    assert rendered_settings(again) == rendered_settings(on)
    assert args_of(again) == args_of(on)
    assert config_hash(again) == config_hash(on)
    assert no_proxies(again) is None
    assert tuned_code(again) != "NoQualityProxies"


def test_the_shadow_budget_is_rendered():
    assert rendered_settings(vllm({"shadowBudget": 0.1}))["shadowBudget"] == 0.1
    assert rendered_settings(vllm({"shadowBudget": 0}))["shadowBudget"] == 0


def flag_value(bd: BlendDeployment, flag: str) -> str | None:
    args = args_of(bd)
    return args[args.index(flag) + 1] if flag in args else None


def transfer_extra(bd: BlendDeployment) -> dict:
    return json.loads(flag_value(bd, "--kv-transfer-config"))["kv_connector_extra_config"]


def test_shadows_yield_to_user_requests_under_the_operators_scheduler():
    """Priority orders vLLM's waiting queue only: the scheduler class makes a running
    shadow sit out the steps user requests need, and the chunk sizes its other steps."""
    assert flag_value(vllm(), "--scheduler-cls") == SHADOW_SCHEDULER_CLS
    assert flag_value(vllm(), "--scheduling-policy") == "priority"
    assert transfer_extra(vllm())["shadow_chunk_tokens"] == DEFAULT_SHADOW_CHUNK_TOKENS == 128
    chunked = vllm({"shadowChunkTokens": 256})
    assert transfer_extra(chunked)["shadow_chunk_tokens"] == 256
    assert args_of(chunked) != args_of(vllm())  # the pod template changes: pods roll
    off = vllm({"qualityProxies": False})
    assert flag_value(off, "--scheduler-cls") is None
    assert "shadow_chunk_tokens" not in transfer_extra(off)
    # vLLM's own per-request chunk cap is no longer the operator's: users may set it.
    assert "--long-prefill-token-threshold" not in args_of(vllm())
    own = vllm(engine={"extraArgs": ["--long-prefill-token-threshold", "64"]})
    assert flag_value(own, "--long-prefill-token-threshold") == "64"
    with pytest.raises(ValueError, match="shadow_chunk_tokens|shadowChunkTokens"):
        vllm({"shadowChunkTokens": 8})
    with pytest.raises(ValueError, match="tuning.qualityProxies"):
        vllm(engine={"extraArgs": ["--scheduler-cls", "my.Scheduler"]})


def test_the_rendered_chunk_reads_back_through_the_connectors_parser():
    assert shadow_chunk_tokens(transfer_extra(vllm({"shadowChunkTokens": 300}))) == 300
    assert shadow_chunk_tokens({}) == DEFAULT_SHADOW_CHUNK_TOKENS
    for bad in (0, -5, 1.5, True, "64"):
        with pytest.raises(ValueError, match="shadow_chunk_tokens: expected a whole number"):
            shadow_chunk_tokens({"shadow_chunk_tokens": bad})


def test_holeblend_serve_pods_score_in_process_without_an_engine_url_or_vllm_flags():
    bd = bd_of(accelerator={"type": "cpu", "count": 0})
    settings = rendered_settings(bd)
    assert (settings["qualityProxies"], settings["engineUrl"]) == (True, None)
    assert "--scheduling-policy" not in args_of(bd)
    assert no_proxies(bd) is None


def test_without_blending_nothing_is_scored_and_vllm_keeps_its_scheduling():
    bd = vllm(blend={"mode": "off"})
    assert rendered_settings(bd)["engineUrl"] is None
    assert "--scheduling-policy" not in args_of(bd)
    assert "blend.mode is off" in no_proxies(bd)


def test_the_scheduling_policy_is_the_operators_and_is_refused_in_extra_args():
    for args in (["--scheduling-policy", "fcfs"], ["--scheduling_policy=fcfs"], ["--schedul=x"]):
        spec = manifest(accelerator=NVIDIA, engine={"extraArgs": args})
        with pytest.raises(ValueError, match="--scheduling-policy"):
            BlendDeployment.model_validate(spec)
        assert any(e.startswith(".spec.engine.extraArgs") for e in api_server_errors(spec))


# --- the API server --------------------------------------------------------------------------


def test_the_api_server_defaults_the_fields_and_refuses_bad_values():
    assert api_server_errors(manifest(tuning={"qualityProxies": False, "shadowBudget": 0.2})) == []
    errors = api_server_errors(manifest(tuning={"shadowBudget": 1.5}))
    assert "spec.tuning.shadowBudget: 1.5 is greater than the maximum of 1" in errors
    errors = api_server_errors(manifest(tuning={"qualityProxies": "yes"}))
    assert "spec.tuning.qualityProxies: 'yes' is not of type 'boolean'" in errors
    with pytest.raises(ValueError, match="shadowBudget"):
        bd_of(tuning={"shadowBudget": -0.1})


def test_the_crd_defaults_match_the_models():
    from holeblend_operator.crd import build_crd

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    tuning = schema["properties"]["spec"]["properties"]["tuning"]
    assert tuning["properties"]["qualityProxies"]["default"] is True
    assert tuning["properties"]["shadowBudget"]["default"] == 0.05
    assert tuning["default"]["qualityProxies"] is True


# --- the upgrade from HOLEBLEND_ENGINE_URL -----------------------------------------------------


def test_a_spec_with_the_old_opt_in_keeps_working_and_is_told_to_remove_it():
    spec = manifest(accelerator=NVIDIA, engine={"env": [LEGACY]})
    assert api_server_errors(spec) == []
    bd = BlendDeployment.model_validate(spec)
    # Honoured: its value (here with a root path) is the URL the shadow requests go to.
    assert rendered_settings(bd)["engineUrl"] == "http://127.0.0.1:8000/v2"
    assert env_of(engine_container(bd))["HOLEBLEND_ENGINE_URL"] == LEGACY["value"]
    assert has_priority_scheduling(bd)
    assert no_proxies(bd) is None
    (notice,) = spec_notices(spec["spec"])
    assert "spec.tuning.qualityProxies replaces it" in notice
    assert "remove HOLEBLEND_ENGINE_URL from engine.env" in notice


def test_the_old_opt_in_does_not_turn_on_proxies_the_user_turned_off():
    spec = manifest(accelerator=NVIDIA, engine={"env": [LEGACY]}, tuning={"qualityProxies": False})
    bd = BlendDeployment.model_validate(spec)
    assert (rendered_settings(bd)["qualityProxies"], rendered_settings(bd)["engineUrl"]) == (
        False,
        None,
    )
    assert tuned_code(bd) == "NoQualityProxies"
    (notice,) = spec_notices(spec["spec"])
    assert "the variable is ignored" in notice


def test_the_tuned_condition_carries_the_notice():
    spec = manifest(accelerator=NVIDIA, engine={"env": [LEGACY]})
    bd = BlendDeployment.model_validate(spec)
    decision = decide(bd.spec.tuning, 0.15, SEEN, State(), 1000.0)
    patch = status_patch(bd, {}, decision, SEEN, NOW, spec_notices(spec["spec"]))
    (tuned,) = [c for c in patch["conditions"] if c["type"] == "Tuned"]
    assert tuned["message"].startswith(decision.reason)
    assert "Note: engine.env sets HOLEBLEND_ENGINE_URL" in tuned["message"]
    plain = status_patch(bd, {}, decision, SEEN, NOW)
    assert [c["message"] for c in plain["conditions"]] == [decision.reason]


def test_render_warns_about_the_old_opt_in_on_stderr(tmp_path, capsys):
    path = tmp_path / "bd.yaml"
    path.write_text(yaml.safe_dump(manifest(accelerator=NVIDIA, engine={"env": [LEGACY]})))
    assert main(["render", "-f", str(path)]) == 0
    captured = capsys.readouterr()
    assert "warning:" in captured.err and "remove HOLEBLEND_ENGINE_URL" in captured.err
    assert "kind: Deployment" in captured.out


def test_spec_notices_tolerate_anything():
    for spec in (None, [], {"engine": None}, {"engine": {"env": "x"}}, {"engine": {"env": [1]}}):
        assert spec_notices(spec) == []


def test_runtime_config_is_what_the_contract_reads():
    from holeblend_contract.blend_settings import BlendSettings

    settings = BlendSettings.model_validate(runtime_config(vllm({"shadowBudget": 0.03})))
    assert (settings.quality_proxies, settings.shadow_budget) == (True, 0.03)
    assert settings.engine_url == "http://127.0.0.1:8000"


def test_a_stored_object_from_before_the_fields_is_defaulted_on_by_the_api_server():
    from holeblend_devtools import schemas
    from holeblend_operator.crd import open_api_schema
    from tests.operator.crd_validation import pruned

    schema = open_api_schema()
    old = manifest(accelerator=NVIDIA, tuning={"enabled": True, "shadowSampleRate": 0.02})
    stored = schemas.with_defaults(pruned(old, schema), schema)
    assert stored["spec"]["tuning"]["qualityProxies"] is True
    assert stored["spec"]["tuning"]["shadowBudget"] == 0.05
    # The operator reads the defaulted object as it reads the one without the fields.
    as_stored = BlendDeployment.model_validate(stored)
    assert rendered_settings(as_stored) == rendered_settings(BlendDeployment.model_validate(old))
