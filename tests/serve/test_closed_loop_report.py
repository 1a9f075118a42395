"""`closed_loop_report`: the issue's goals read from `make closed-loop` outputs, and the
final ratio against the target with the offline sweep's own interval."""

import json
from pathlib import Path

import pytest

from holeblend_devtools import closed_loop_report
from holeblend_devtools.closed_loop_sim import GOAL_INTERVALS

REPO = Path(__file__).resolve().parents[2]
TUNING = {"target": 0.7, "band": 0.05}


def _run(**changes) -> dict:
    run = {
        "engine": "serve",
        "load": "saturated",
        "name": "from-high",
        "intervals_to_converge": 4,
        "direction_changes": 0,
        "ever_out_of_bounds": False,
        "final_ratio": 0.2,
    }
    return run | changes


def _output(scores_at_02: list[float], **runs) -> dict:
    """Scores at 0.1 and 0.3 around 0.2's: the final ratio 0.2 interpolates between them."""
    scores = {"0.1": scores_at_02, "0.3": scores_at_02}
    return {"tuning": TUNING, "workload_seeds": [3, 4], "offline_scores": scores} | runs


@pytest.mark.parametrize(
    ("changes", "failed"),
    [
        ({}, None),
        ({"intervals_to_converge": None}, "converged"),
        ({"intervals_to_converge": GOAL_INTERVALS + 1}, "converged"),
        ({"direction_changes": 3}, "direction_changes"),
        ({"ever_out_of_bounds": True}, "in_bounds"),
    ],
)
def test_each_goal_of_the_loop_fails_on_its_own(changes, failed):
    goals = closed_loop_report.loop_goals(_run(**changes))
    assert goals["met"] is (failed is None)
    assert [name for name, ok in goals.items() if not ok and name != "met"] == (
        [] if failed is None else [failed]
    )


def test_ten_intervals_still_converge():
    assert closed_loop_report.loop_goals(_run(intervals_to_converge=GOAL_INTERVALS))["met"]


@pytest.mark.parametrize(
    ("scores", "judged"),
    [
        ([1.0] * 20 + [0.0] * 4, "meets"),  # 0.83, the interval well above 0.65
        ([1.0] * 8 + [0.0] * 16, "below"),  # 0.33, well below
        ([1.0] * 15 + [0.0] * 9, "unresolved"),  # 0.625 over 24 binary scores: either way
    ],
)
def test_the_final_ratio_is_judged_against_the_sweeps_interval(scores, judged):
    row = closed_loop_report.verdict(_run(), _output(scores))
    assert row["final_vs_target"] == judged
    mean, low, high = row["offline_f1_at_final"]
    assert low <= mean <= high
    assert mean == pytest.approx(sum(scores) / len(scores), abs=1e-3)


def test_the_interval_narrows_with_more_questions_and_is_empty_without_spread():
    few = closed_loop_report.offline_interval({0.2: [1.0, 0.0] * 6}, 0.2)
    many = closed_loop_report.offline_interval({0.2: [1.0, 0.0] * 60}, 0.2)
    assert few[0] == many[0] == 0.5
    assert many[2] - many[1] < (few[2] - few[1]) / 2
    assert closed_loop_report.offline_interval({0.2: [0.75] * 10}, 0.2) == (0.75, 0.75, 0.75)


def test_questions_keep_their_scores_at_every_ratio_between_grid_points():
    # Each question scores 0 at one ratio and 1 at the other: halfway, every question is
    # 0.5, so resampling questions cannot move the mean.
    scores = {0.1: [0.0, 1.0] * 10, 0.3: [1.0, 0.0] * 10}
    assert closed_loop_report.offline_interval(scores, 0.2) == (0.5, 0.5, 0.5)


def test_the_changed_workloads_scores_judge_the_workload_change_run():
    output = _output([1.0] * 24) | {"offline_scores_changed": {"0.2": [0.0] * 24}}
    row = closed_loop_report.verdict(_run(name="workload-change"), output)
    assert row["offline_f1_at_final"] == [0.0, 0.0, 0.0]
    assert row["final_vs_target"] == "below"


def test_a_run_without_per_question_scores_or_final_ratio_is_not_judged():
    no_scores = {"tuning": TUNING, "runs": []}
    assert closed_loop_report.verdict(_run(), no_scores)["final_vs_target"] is None
    row = closed_loop_report.verdict(_run(final_ratio=None), _output([1.0] * 24))
    assert row["final_vs_target"] is None


def test_the_report_reads_every_run_of_every_file(tmp_path, capsys):
    first = tmp_path / "a.json"
    first.write_text(json.dumps(_output([1.0] * 24, runs=[_run(), _run(name="from-low")])))
    second = tmp_path / "b.json"
    second.write_text(json.dumps(_output([0.0] * 24, runs=[_run(intervals_to_converge=None)])))
    written = tmp_path / "report.json"
    assert closed_loop_report.main([str(first), str(second), "--json", str(written)]) == 0
    rows = json.loads(written.read_text())
    assert [(r["file"], r["name"], r["goals"]["met"], r["final_vs_target"]) for r in rows] == [
        ("a.json", "from-high", True, "meets"),
        ("a.json", "from-low", True, "meets"),
        ("b.json", "from-high", False, "below"),
    ]
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 + 3  # header, separator, a row per run
    assert "not settled" in out
    assert "loop goals met in 2 of 3 runs" in err


def test_a_missing_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        closed_loop_report.main([str(tmp_path / "nothing.json")])
    assert "nothing.json" in capsys.readouterr().err


def test_the_committed_runs_read_as_written():
    # Every committed output holds its per-question scores: each run is judged.
    paths = sorted((REPO / "docs/bench/closed-loop").glob("*.json"))
    rows = closed_loop_report.report(paths)
    assert len(rows) == sum(len(json.loads(p.read_text())["runs"]) for p in paths)
    assert all(row["final_vs_target"] in ("meets", "below", "unresolved") for row in rows)
