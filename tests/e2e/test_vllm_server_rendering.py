"""The vLLM server the benchmarks and tests/vllm start (devtools/vllm_server.py) is the pod
the operator renders: with the quality proxies on, blend.json's `engineUrl` and the
priority flags; off, neither; never the deprecated $HOLEBLEND_ENGINE_URL. Checked against
the operator's own rendering of examples/nvidia.yaml, so a change there fails here."""

import json
from pathlib import Path

import pytest
import yaml

from holeblend_devtools import vllm_server
from holeblend_operator.api import BlendDeployment
from holeblend_operator.render import render_children
from holeblend_operator.render.runtime_config import CONFIG_KEY, runtime_configmap

EXAMPLE = Path(__file__).parents[2] / "examples" / "nvidia.yaml"


def rendered(quality_proxies: bool) -> tuple[dict, list[str]]:
    """The operator's blend.json and engine args for the vLLM example."""
    body = yaml.safe_load(EXAMPLE.read_text())
    body["spec"].setdefault("tuning", {})["qualityProxies"] = quality_proxies
    bd = BlendDeployment.model_validate(body)
    settings = json.loads(runtime_configmap(bd)["data"][CONFIG_KEY])
    engine = next(c for c in render_children(bd) if c["kind"] == "Deployment")
    container = engine["spec"]["template"]["spec"]["containers"][0]
    return settings, [*container.get("command", []), *container.get("args", [])]


@pytest.mark.parametrize("quality_proxies", [True, False])
def test_the_priority_flags_are_the_operators(quality_proxies):
    _, args = rendered(quality_proxies)
    flags = vllm_server.priority_flags(quality_proxies)
    named = ("--scheduling-policy", "--scheduler-cls", "--long-prefill-token-threshold")
    ours = [a for a in args if a in named]
    assert ours == flags[::2]
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        assert args[args.index(flag) + 1] == value
    assert bool(flags) is quality_proxies
    # The shadow chunk the operator renders into the connector's settings (its default) is
    # the devtools server's.
    extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    chunk = extra.get("shadow_chunk_tokens")
    assert chunk == (vllm_server.SHADOW_CHUNK_TOKENS if quality_proxies else None)


@pytest.mark.parametrize("quality_proxies", [True, False])
def test_blend_json_names_the_servers_own_url_only_with_the_proxies_on(quality_proxies):
    operator, _ = rendered(quality_proxies)
    ours = vllm_server.rendered_settings(0.15, quality_proxies, 0.2, "http://127.0.0.1:8123")
    for key in ("qualityProxies", "shadowBudget"):
        assert ours[key] == operator[key]
    assert (ours["engineUrl"] is None) is (operator["engineUrl"] is None) is not quality_proxies
    if quality_proxies:
        # The operator names the pod's own port; the devtools server its own free port.
        assert operator["engineUrl"].startswith("http://127.0.0.1:")
        assert ours["engineUrl"] == "http://127.0.0.1:8123"
    assert ours["shadowSampleRate"] == 0.2
    assert vllm_server.rendered_settings(0.15, True, 0.2, "u", 0.1)["shadowBudget"] == 0.1


def test_the_deprecated_engine_url_variable_is_not_passed_on(monkeypatch, tmp_path):
    """serve() builds the environment without HOLEBLEND_ENGINE_URL, even when inherited."""
    monkeypatch.setenv(vllm_server.DEPRECATED_ENGINE_URL_ENV, "http://elsewhere:1")
    started = {}

    class Stop(Exception):
        pass

    def popen(command, env, **_):
        started.update(command=command, env=env)
        raise Stop

    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    monkeypatch.setattr(vllm_server, "export_smollm2", lambda: tmp_path / "model")
    with pytest.raises(Stop), vllm_server.serve(tmp_path, shadow_sample_rate=0.2):
        pass
    assert vllm_server.DEPRECATED_ENGINE_URL_ENV not in started["env"]
    assert "HOLEBLEND_METRICS_PORT" in started["env"]
    command = started["command"]
    assert command[command.index("--scheduling-policy") + 1] == "priority"
    settings = json.loads((tmp_path / "blend.json").read_text())
    port = command[command.index("--port") + 1]
    assert settings["engineUrl"] == f"http://127.0.0.1:{port}"


def _started_command(monkeypatch, tmp_path, **options) -> tuple[list[str], dict]:
    started = {}

    class Stop(Exception):
        pass

    def popen(command, env, **_):
        started.update(command=command)
        raise Stop

    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    monkeypatch.setattr(vllm_server, "export_smollm2", lambda: tmp_path / "model")
    with pytest.raises(Stop), vllm_server.serve(tmp_path, **options):
        pass
    return started["command"], json.loads((tmp_path / "blend.json").read_text())


def test_the_plain_arm_is_vllm_without_holeblend(monkeypatch, tmp_path):
    """bench-vllm-load's baseline: no KV transfer, vLLM's own prefix caching, no holeblend
    flags; the same context and KV cache as the connector's arm."""
    plain, _ = _started_command(
        monkeypatch, tmp_path / "plain", connector=False, max_model_len=2560
    )
    ours, settings = _started_command(
        monkeypatch, tmp_path / "connector", max_model_len=2560, kv_tier_bytes=200 << 20
    )
    for flag in ("--kv-transfer-config", "--no-enable-prefix-caching", "--scheduling-policy"):
        assert flag not in plain and flag in ours
    for command in (plain, ours):
        assert command[command.index("--max-model-len") + 1] == "2560"
    assert settings["kv"]["localCpuBytes"] == 200 << 20


def test_a_load_bench_arm_sets_the_connector_s_step_budget(monkeypatch, tmp_path):
    """`--blend-step-tokens N` arms: the budget reaches the connector through vLLM's
    kv_connector_extra_config; the default arm leaves it to the connector's default."""

    def extra(command):
        transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
        return transfer["kv_connector_extra_config"]

    default, _ = _started_command(monkeypatch, tmp_path / "default")
    whole, _ = _started_command(monkeypatch, tmp_path / "whole", blend_step_tokens=0)
    assert "blend_step_tokens" not in extra(default)
    assert extra(whole)["blend_step_tokens"] == 0


def test_a_load_bench_arm_sets_the_tiers_store_dtype(monkeypatch, tmp_path):
    """`--kv-store-dtype D` arms: blend.json's kv.storeDtype; the default arm leaves it to
    the contract's default (auto), which the connector reads back."""
    from holeblend_contract.blend_settings import parse_blend_settings

    _, default = _started_command(monkeypatch, tmp_path / "default")
    _, narrow = _started_command(monkeypatch, tmp_path / "narrow", kv_store_dtype="bfloat16")
    assert default["kv"]["storeDtype"] == "auto" and narrow["kv"]["storeDtype"] == "bfloat16"
    assert parse_blend_settings(json.dumps(narrow)).kv.store_dtype == "bfloat16"


def test_the_load_bench_rows_and_ratios():
    from holeblend_devtools import bench_vllm_load

    result = {
        "completed": 10, "request_throughput": 0.5, "output_throughput": 8.0,
        "p50_ttft_ms": 1000.0, "p99_ttft_ms": 3000.0, "mean_ttft_ms": 1200.0,
        "p50_itl_ms": 100.0, "p99_itl_ms": 400.0, "mean_tpot_ms": 120.0, "mean_e2el_ms": 3300.0,
    }  # fmt: skip
    without = bench_vllm_load.row(result, False, {})
    assert without["ttft_p50_s"] == 1.0 and without["itl_p99_s"] == 0.4
    assert without["request_s_mean"] == 3.3 and without["tpot_mean_s"] == 0.12
    faster = result | {"request_throughput": 1.0, "p50_ttft_ms": 250.0, "p99_itl_ms": 480.0}
    with_ = bench_vllm_load.row(faster, True, {"reused_share": 0.8})
    figures = bench_vllm_load.ratios([without, with_])
    assert figures["requests_per_s"] == 2.0 and figures["ttft_p50_lower_by"] == 4.0
    assert figures["itl_p99"] == pytest.approx(1.2) and with_["reused_share"] == 0.8


def test_the_load_bench_prompts_split_into_their_segments():
    from holeblend_devtools.bench_vllm_load import build_prompts
    from holeblend_devtools.vllm_probe import SEPARATOR
    from holeblend_runtime.bench.load_workload import LoadWorkloadConfig

    config = LoadWorkloadConfig(documents_per_request=8, num_warmup=0, num_requests=3)
    prompts, lengths = build_prompts(config)
    assert len(prompts) == len(lengths) == 3
    assert all(p.count(SEPARATOR) == 9 for p in prompts)  # system, 8 documents, question


def test_the_load_bench_splits_a_stream_into_windows_and_merges_their_figures(tmp_path):
    from holeblend_devtools import bench_vllm_load

    prompts = [f"prompt {i}" for i in range(7)]
    parts = bench_vllm_load.write_parts(prompts, 3, tmp_path)
    assert [size for _, size in parts] == [2, 3, 2]
    sent = [json.loads(line)["prompt"] for path, _ in parts for line in path.read_text().split("\n") if line]  # fmt: skip
    assert sent == prompts  # in order, each once

    def part(ttfts, itls, latencies, duration, errors=None):
        return {
            "ttfts": ttfts, "itls": itls, "latencies": latencies, "duration": duration,
            "output_lens": [len(i) + 1 for i in itls], "errors": errors or [""] * len(ttfts),
        }  # fmt: skip

    first = part([1.0, 3.0], [[0.1, 0.1], [0.2, 0.4]], [1.2, 3.6], 4.0)
    second = part([2.0, 9.0], [[0.3, 0.3], [0.0, 0.0]], [2.6, 9.0], 6.0, errors=["", "timeout"])
    merged = bench_vllm_load.merge([first, second])
    # The failed request is left out; figures over the three requests that completed.
    assert merged["completed"] == 3 and merged["request_throughput"] == pytest.approx(0.3)
    assert merged["p50_ttft_ms"] == pytest.approx(2000.0)
    assert merged["mean_ttft_ms"] == pytest.approx(2000.0)
    assert merged["p50_itl_ms"] == pytest.approx(250.0)
    assert merged["mean_e2el_ms"] == pytest.approx((1.2 + 3.6 + 2.6) / 3 * 1e3)
    assert merged["mean_tpot_ms"] == pytest.approx((100 + 300 + 300) / 3)
    assert bench_vllm_load.merge([first]) is first


def test_the_load_bench_window_shares_count_only_their_own_tokens():
    from holeblend_devtools import bench_vllm_load

    before = {"prompt": 1000.0, "reused": 100.0, "recomputed": 900.0, "hole": 0.0}
    after = {"prompt": 3000.0, "reused": 1700.0, "recomputed": 1500.0, "hole": 200.0}
    shares = bench_vllm_load.shares(after, before)
    assert shares == {"reused_share": 0.8, "recomputed_share": 0.3, "hole_share": 0.1}
    assert bench_vllm_load.shares(before, before)["reused_share"] == 0.0
