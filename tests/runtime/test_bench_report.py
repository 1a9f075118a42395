"""Result rows from per-request measurements; the table and the JSON file."""

import json

import pytest

from holeblend_runtime.bench.report import (
    RESULT_KEYS,
    RequestMeasure,
    format_table,
    percentile,
    summarize,
    write_json,
)


def _measure(**changes) -> RequestMeasure:
    values = dict(
        num_prompt_tokens=100,
        num_reused_tokens=60,
        num_hole_tokens=20,
        num_recomputed_tokens=40,
        ttft_s=1.0,
        request_s=1.5,
        f1_vs_full=1.0,
        top1_vs_full=1.0,
        kl_vs_full=0.0,
        gold_loss=2.0,
        f1_vs_gold=0.0,
    )
    return RequestMeasure(**(values | changes))


def test_shares_are_token_weighted_over_all_prompts():
    measures = [
        _measure(),
        _measure(
            num_prompt_tokens=300, num_reused_tokens=0, num_hole_tokens=0, num_recomputed_tokens=300
        ),
    ]
    row = summarize("hole", 0.15, 2, measures, full_ttft_mean_s=2.0, full_request_mean_s=3.0)
    assert row["reused_share"] == pytest.approx(60 / 400)
    assert row["hole_share"] == pytest.approx(20 / 400)
    assert row["recomputed_share"] == pytest.approx(340 / 400)
    assert row["num_prompts"] == 2


def test_speedup_is_full_mean_ttft_over_mode_mean_ttft():
    measures = [_measure(ttft_s=0.5), _measure(ttft_s=1.5)]
    row = summarize("hole", 0.15, 2, measures, full_ttft_mean_s=3.0, full_request_mean_s=3.0)
    assert row["ttft_mean_s"] == pytest.approx(1.0)
    assert row["speedup_vs_full"] == pytest.approx(3.0)


def test_request_speedup_is_full_mean_request_time_over_mode_mean_request_time():
    measures = [_measure(request_s=1.0), _measure(request_s=2.0)]
    row = summarize("hole", 0.15, 2, measures, full_ttft_mean_s=3.0, full_request_mean_s=3.0)
    assert row["request_s_mean"] == pytest.approx(1.5)
    assert row["speedup_request_vs_full"] == pytest.approx(2.0)


def test_background_store_time_is_spread_over_the_rows_requests():
    row = summarize(
        "hole", 0.15, 1, [_measure(), _measure()], full_ttft_mean_s=1.0,
        full_request_mean_s=1.0, store_policy="isolated", background_store_s=3.0,
    )  # fmt: skip
    assert row["store_policy"] == "isolated"
    assert row["background_store_s_mean"] == pytest.approx(1.5)


def test_quality_columns_are_means_over_prompts():
    measures = [_measure(f1_vs_full=0.0, kl_vs_full=1.0), _measure(f1_vs_full=0.5, kl_vs_full=0.0)]
    row = summarize("prefix", 0.3, 1, measures, full_ttft_mean_s=1.0, full_request_mean_s=3.0)
    assert row["f1_vs_full"] == pytest.approx(0.25)
    assert row["kl_vs_full"] == pytest.approx(0.5)


def test_row_carries_every_result_key_in_order():
    row = summarize("full", None, 1, [_measure()], full_ttft_mean_s=1.0, full_request_mean_s=3.0)
    assert list(row)[: len(RESULT_KEYS)] == list(RESULT_KEYS)
    assert row["ratio"] is None and row["pass"] == 1 and row["mode"] == "full"


def test_summarize_needs_measures():
    with pytest.raises(ValueError, match="measures"):
        summarize("hole", 0.15, 1, [], full_ttft_mean_s=1.0, full_request_mean_s=3.0)


@pytest.mark.parametrize(
    ("values", "share", "expected"),
    [
        ([3.0], 0.9, 3.0),
        ([1.0, 2.0], 0.9, 1.9),
        ([4.0, 1.0, 3.0, 2.0, 5.0], 0.5, 3.0),
        ([1.0, 2.0, 3.0], 1.0, 3.0),
    ],
)
def test_percentile_interpolates_like_numpy(values, share, expected):
    assert percentile(values, share) == pytest.approx(expected)


def test_table_has_a_header_and_one_line_per_row():
    rows = [
        summarize("full", None, 1, [_measure()], 1.0, 1.5),
        summarize("hole", 0.15, 2, [_measure(ttft_s=0.25)], 1.0, 1.5),
    ]
    lines = format_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[0].split()[:6] == ["mode", "ratio", "pass", "store", "selection", "num_prompts"]
    assert lines[2].split()[:3] == ["full", "-", "1"]
    assert "4.000" in lines[3].split()  # speedup 1.0 / 0.25


def test_write_json_creates_the_documented_layout(tmp_path):
    rows = [summarize("full", None, 1, [_measure()], 1.0, 1.5)]
    path = tmp_path / "sub" / "bench.json"
    write_json(path, "model-x", {"seed": 1}, rows)
    document = json.loads(path.read_text())
    assert document == {"model": "model-x", "config": {"seed": 1}, "results": rows}
