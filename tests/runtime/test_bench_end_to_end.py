"""holeblend-bench end to end on a tiny workload through the real engine and model."""

import json

import pytest

from holeblend_runtime.bench.cli import main
from holeblend_runtime.bench.report import RESULT_KEYS

pytestmark = pytest.mark.slow

ARGS = [
    "--questions", "1",
    "--documents", "4",
    "--min-doc-tokens", "40",
    "--max-doc-tokens", "60",
    "--holes", "middle",
    "--ratios", "0.15,1.0",
    "--max-new-tokens", "4",
    "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    assert main([*ARGS, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _row(bench, mode, ratio, pass_number):
    [row] = [
        r
        for r in bench["results"]
        if r["mode"] == mode and r["ratio"] == ratio and r["pass"] == pass_number
    ]
    return row


def test_json_has_model_config_and_one_result_per_mode_ratio_pass(bench):
    assert bench["model"].startswith("SmolLM2")
    assert bench["config"]["bench"]["ratios"] == [0.15, 1.0]
    points = {(r["mode"], r["ratio"], r["pass"]) for r in bench["results"]}
    expected = {("full", None, p) for p in (1, 2)}
    expected |= {(m, r, p) for m in ("prefix", "hole") for r in (0.15, 1.0) for p in (1, 2)}
    assert points == expected
    assert len(bench["results"]) == len(expected)
    for row in bench["results"]:
        assert set(RESULT_KEYS) <= set(row)
        assert row["num_prompts"] == 1


def test_full_prefill_reuses_nothing_and_is_its_own_reference(bench):
    for pass_number in (1, 2):
        row = _row(bench, "full", None, pass_number)
        assert row["reused_share"] == 0.0 and row["hole_share"] == 0.0
        assert row["recomputed_share"] == 1.0
        assert row["speedup_vs_full"] == 1.0
        assert row["f1_vs_full"] == 1.0 and row["top1_vs_full"] == 1.0
        assert row["kl_vs_full"] == pytest.approx(0.0, abs=1e-9)
        assert row["gold_loss"] > 0.0


def test_pass_one_starts_from_an_empty_cache(bench):
    for mode in ("prefix", "hole"):
        row = _row(bench, mode, 0.15, 1)
        assert row["reused_share"] == 0.0
        assert row["recomputed_share"] == 1.0


def test_hole_mode_reuses_more_than_prefix_mode_with_a_middle_hole(bench):
    prefix, hole = _row(bench, "prefix", 0.15, 2), _row(bench, "hole", 0.15, 2)
    assert hole["reused_share"] > prefix["reused_share"] > 0.0
    assert hole["hole_share"] > 0.0 and prefix["hole_share"] == 0.0
    assert hole["recomputed_share"] < prefix["recomputed_share"]


def test_ratio_one_reproduces_full_prefill(bench):
    for mode in ("prefix", "hole"):
        for pass_number in (1, 2):
            row = _row(bench, mode, 1.0, pass_number)
            # Every token is recomputed but the exact prefix (system + first document).
            assert row["recomputed_share"] + row["reused_share"] >= 1.0
            assert row["top1_vs_full"] == 1.0
            assert row["f1_vs_full"] == pytest.approx(1.0)
            assert row["kl_vs_full"] < 1e-4
            full = _row(bench, "full", None, pass_number)
            assert row["gold_loss"] == pytest.approx(full["gold_loss"], abs=1e-3)


def test_shares_are_shares(bench):
    for row in bench["results"]:
        for key in ("reused_share", "hole_share", "recomputed_share", "top1_vs_full", "f1_vs_full"):
            assert 0.0 <= row[key] <= 1.0
        assert row["reused_share"] + row["hole_share"] <= 1.0
        # One prompt per row: its p90 is its only TTFT.
        assert row["ttft_p90_s"] == pytest.approx(row["ttft_mean_s"])
        assert row["ttft_mean_s"] > 0.0
        assert row["request_s_mean"] >= row["ttft_mean_s"]
        assert row["speedup_request_vs_full"] > 0.0


def test_every_row_names_the_device_dtype_and_model_shape(bench):
    for row in bench["results"]:
        assert row["device"] == "cpu" and row["dtype"] == "float32" and row["model"] == "smollm2"
        assert row["model_shape"]["num_layers"] == 30 and row["model_shape"]["head_dim"] == 64


def test_a_preset_shape_with_pass_three_profile_and_sdpa_reference(tmp_path):
    """Random weights of a named shape write the same JSON, plus the timing extras."""
    path = tmp_path / "preset.json"
    argv = [*ARGS, "--model", "smollm2-135m", "--dtype", "bfloat16", "--ratios", "0.5",
            "--repeat", "--profile", "--sdpa-reference", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    document = json.loads(path.read_text())
    assert document["model"] == "random:smollm2-135m"
    points = {(r["mode"], r["pass"]) for r in document["results"]}
    assert points == {(m, p) for m in ("full", "prefix", "hole") for p in (1, 2, 3)}
    for row in document["results"]:
        assert set(RESULT_KEYS) <= set(row)
        assert (row["device"], row["dtype"], row["model"]) == ("cpu", "bfloat16", "smollm2-135m")
        assert row["model_shape"]["num_kv_heads"] == 3
    repeated = {r["mode"]: r for r in document["results"] if r["pass"] == 3}
    second = {r["mode"]: r for r in document["results"] if r["pass"] == 2}
    for mode in ("prefix", "hole"):
        # The same cache state again: the same tokens reused and recomputed.
        assert repeated[mode]["reused_share"] == second[mode]["reused_share"] > 0
        assert repeated[mode]["recomputed_share"] == second[mode]["recomputed_share"]
    reference = document["config"]["sdpa_reference"]
    assert reference["num_prompts"] == 1 and reference["ttft_mean_s"] > 0
    # A CPU has no separate device to keep busy.
    assert document["config"]["profile"]["hole"]["busy_share"] is None
