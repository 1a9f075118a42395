"""`holeblend_devtools.inline_statistics`: the stream it measures on (the closed loop's
hole requests, real model) and what it computes from the rows (hand-built rows)."""

import dataclasses
import json

import pytest

from holeblend_devtools import closed_loop_runs, inline_statistics
from holeblend_runtime.bench.workload import generate_workload
from holeblend_runtime.serve.worker import is_blended


def test_each_ratio_finds_the_store_as_pass_one_left_it(reference_engine):
    workload = dataclasses.replace(closed_loop_runs.WORKLOAD, num_questions=4)
    questions = generate_workload(workload)[:2]
    ratios = (0.05, 0.3, 0.05)
    seen = list(
        closed_loop_runs.hole_requests(reference_engine, workload, questions, ratios, max_tokens=2)
    )
    assert len(seen) == 2
    for prompt, answered in seen:
        assert [ratio for ratio, _, _ in answered] == list(ratios)
        reused = {prefill.num_reused_tokens for _, prefill, _ in answered}
        holes = {prefill.num_hole_tokens for _, prefill, _ in answered}
        # The hole a request stores is removed before the next ratio's request: each finds
        # the same documents (were it kept, the next request would have no hole).
        assert len(reused) == 1 and len(holes) == 1 and holes.pop() > 0
        assert all(is_blended(prefill) for _, prefill, _ in answered)
        assert all(1 <= len(answer) <= 2 for _, _, answer in answered)
        # The same ratio twice: the same blend (nothing else changed in between).
        first, again = answered[0][1], answered[2][1]
        assert first.selected_positions.tolist() == again.selected_positions.tolist()
        assert first.num_prompt_tokens == prompt.num_tokens


def _row(ratio, mean, f1, compared=10, total=None, question=0):
    left = mean * compared
    return {
        "question": question, "ratio": ratio, "compared": compared, "left": left,
        "total": left * 2 if total is None else total, "f1": f1, "top1": f1,
    }  # fmt: skip


def test_tracking_reads_the_pooled_fit_where_the_statistic_falls():
    # Calibration: a little deviation left -> F1 1, much -> F1 0 (8 pairs: the minimum).
    calibration = [_row(0.1, m, 1.0) for m in (0.1, 0.12, 0.14, 0.16)] + [
        _row(0.1, m, 0.0) for m in (0.8, 0.82, 0.84, 0.86)
    ]
    # Another stream: at 0.3 the deviation left is small and F1 high; at 0.02 the reverse;
    # one blend beyond every calibration pair has no estimate.
    evaluated = [_row(0.3, 0.13, 1.0), _row(0.3, 0.15, 0.5), _row(0.02, 0.85, 0.0)]
    evaluated.append(_row(0.02, 9.0, 0.0))
    mean = inline_statistics.CANDIDATES["mean"]
    found = inline_statistics.tracking(calibration, evaluated, mean)
    assert found["per_ratio"]["0.3"]["estimate"] == pytest.approx(1.0)
    assert found["per_ratio"]["0.3"]["shadow_f1"] == pytest.approx(0.75)
    assert found["per_ratio"]["0.02"]["estimate"] == pytest.approx(0.0)
    assert found["per_ratio"]["0.02"]["blends"] == 2
    assert found["mean_abs_error"] == pytest.approx((0.25 + 0.0) / 2)
    assert found["inside_span"] == pytest.approx(3 / 4)
    # The share of the same rows is 0.5 everywhere: one block, the calibration's mean.
    share = inline_statistics.tracking(
        calibration, evaluated[:3], inline_statistics.CANDIDATES["share"]
    )
    assert share["per_ratio"]["0.3"]["estimate"] == pytest.approx(0.5)
    assert share["per_ratio"]["0.02"]["estimate"] == pytest.approx(0.5)


def test_correlations_per_ratio_and_none_without_spread():
    rows = [_row(0.1, m, f1) for m, f1 in ((0.1, 1.0), (0.5, 0.5), (0.9, 0.0))]
    rows += [_row(0.3, m, 1.0) for m in (0.1, 0.2, 0.3)]  # F1 constant at 0.3
    found = inline_statistics.correlations(rows, inline_statistics.CANDIDATES["mean"])
    assert found["per_ratio"]["0.1"]["f1"] == pytest.approx(-1.0)
    assert found["per_ratio"]["0.3"]["f1"] is None
    assert found["all"]["f1"] < 0
    analysed = inline_statistics.analyse({"calibration": rows, "held_out": rows})
    assert set(analysed) == set(inline_statistics.CANDIDATES)
    assert set(analysed["mean"]["tracking"]) == {"held_out"}  # not itself


def test_the_error_difference_has_a_resampled_interval():
    calibration = [_row(0.1, m, 1.0) for m in (0.1, 0.12, 0.14, 0.16)] + [
        _row(0.1, m, 0.0) for m in (0.8, 0.82, 0.84, 0.86)
    ]
    # Ten questions at two ratios: F1 follows the mean deviation left; the share is 0.5
    # everywhere (total twice the deviation left), so its fit reads 0.5 at both ratios.
    evaluated = [_row(0.3, 0.12, 1.0, question=q) for q in range(10)]
    evaluated += [_row(0.02, 0.84, 0.0, question=q) for q in range(10)]
    mean, share = (inline_statistics.CANDIDATES[n] for n in ("mean", "share"))
    found = inline_statistics.error_difference(calibration, evaluated, mean, share, resamples=200)
    assert found["difference"] == pytest.approx(0.0 - 0.5)
    low, high = found["interval_95"]
    assert low <= -0.5 <= high < 0
    same = inline_statistics.error_difference(calibration, evaluated, share, share, resamples=50)
    assert same == {"difference": 0.0, "interval_95": [0.0, 0.0]}


def test_bad_arguments_name_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        inline_statistics.main(["--questions", "1"])
    assert "--questions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        inline_statistics.main(["--ratios", "0.1,x"])
    assert "--ratios" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text('{"rows": {"calibration": []}, "config": {}}')
    with pytest.raises(SystemExit, match="--rows-from .*no rows of the three streams"):
        inline_statistics.main(["--rows-from", str(other)])
    with pytest.raises(SystemExit, match="--rows-from .*not a readable JSON"):
        inline_statistics.main(["--rows-from", str(tmp_path / "missing.json")])


def test_rows_from_an_earlier_output_are_analysed_again(tmp_path):
    calibration = [_row(0.1, m, 1.0) for m in (0.1, 0.12, 0.14, 0.16)] + [
        _row(0.1, m, 0.0) for m in (0.8, 0.82, 0.84, 0.86)
    ]
    rows = {"calibration": calibration, "held_out": calibration, "changed": calibration}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"rows": rows, "config": {"questions": 8}}))
    again = tmp_path / "again.json"
    assert inline_statistics.main(["--rows-from", str(earlier), "--json", str(again)]) == 0
    result = json.loads(again.read_text())
    assert result["rows"] == rows and result["config"] == {"questions": 8}
    # On its own calibration pairs the fit's mean estimate is the pairs' mean F1.
    tracked = result["candidates"]["mean"]["tracking"]["held_out"]
    assert tracked["mean_abs_error"] == pytest.approx(0.0)
