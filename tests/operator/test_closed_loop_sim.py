"""The control law in simulated time against measured per-question quality
(`holeblend_devtools.closed_loop_sim`): the model, the goals, and a floor under how often
the law meets them on the closed-loop workload's real scores."""

import json
import random

import pytest

from holeblend_devtools import closed_loop_sim as sim
from holeblend_devtools.closed_loop_sim import Tuning, Workload

GRID = ("0.02", "0.2", "0.3", "0.8")


def step_workload(threshold_index: int, questions: int = 6) -> Workload:
    """Every question scores 0 below the grid ratio at `threshold_index` and 1 from it."""
    return Workload.of({r: [float(i >= threshold_index)] * questions for i, r in enumerate(GRID)})


def test_a_question_scores_its_measured_f1_linear_between_grid_ratios():
    workload = Workload.of({"0.1": [0.0, 1.0], "0.3": [1.0, 1.0], "0.02": [0.0, 0.5]})
    assert workload.grid == (0.02, 0.1, 0.3)
    assert workload.quality(0, 0.2) == pytest.approx(0.5)
    assert workload.quality(1, 0.06) == pytest.approx(0.75)
    assert workload.quality(0, 0.9) == 1.0  # the end value outside the grid
    assert workload.mean(0.3) == 1.0
    assert workload.smallest_meeting(0.7) == 0.3
    assert workload.smallest_meeting(1.1) is None


def test_every_question_comes_once_before_any_comes_again():
    questions = sim.Questions(5, random.Random(0))
    cycles = [[questions.next() for _ in range(5)] for _ in range(4)]
    assert all(sorted(cycle) == list(range(5)) for cycle in cycles)
    assert any(cycle != list(range(5)) for cycle in cycles)  # shuffled, not in order


def test_on_a_noiseless_step_the_law_meets_every_goal_in_every_run():
    # Quality 0 below 0.3, 1 from it; after the change the step is at 0.8.
    base, changed = step_workload(2), step_workload(3)
    # Doubling: x3 (the runs' default) overshoots this step (0.54, then 0.9 after the change,
    # where quality ramps from 0.3 to 0.8) and changes direction 3 times in workload-change.
    figures = sim.evaluate(Tuning(target=0.73, step_up=2.0), base, changed, runs=20)
    for name, run in figures.items():
        assert run["met_goals"] == 1.0, (name, run)
    assert figures["from-high"]["min_ratio_meeting_target"] == 0.3
    assert figures["workload-change"]["min_ratio_meeting_target"] == 0.8
    # from-low doubles 0.02 up to 0.32, the first ratio past the step, and holds it.
    assert figures["from-low"]["final_ratios"] == {"0.32": 20}


def test_a_run_that_cannot_settle_fails_the_goals():
    # No ratio meets the target: the loop climbs to maxRatio and stays pinned there.
    nothing = Workload.of({r: [0.0] * 4 for r in GRID})
    figures = sim.evaluate(Tuning(target=0.73), nothing, nothing, runs=5)
    assert all(run["met_goals"] == 0.0 for run in figures.values())
    assert figures["from-low"]["unsettled"] == 1.0
    assert figures["from-low"]["final_ratios"] == {"0.9": 5}


def test_a_from_high_run_must_end_within_one_step_of_the_smallest_ratio_meeting_the_target():
    spec = sim.TuningSpec.model_validate(Tuning(target=0.73).spec(None))
    scenario = sim.scenarios(12)[1]
    workload = step_workload(1)  # 0.2 is the smallest grid ratio meeting the target
    run = {
        "intervals_to_converge": 4,
        "direction_changes": 1,
        "ever_out_of_bounds": False,
    }
    assert sim.met_goals(spec, scenario, run | {"final_ratio": 0.4}, workload, 0.68)
    assert not sim.met_goals(spec, scenario, run | {"final_ratio": 0.6}, workload, 0.68)
    # from-low has no such bound, but its final ratio must meet the target.
    low = sim.scenarios(12)[0]
    assert sim.met_goals(spec, low, run | {"final_ratio": 0.6}, workload, 0.68)
    assert not sim.met_goals(spec, low, run | {"final_ratio": 0.1}, workload, 0.68)


def test_direction_changes_count_reversals_only():
    assert sim.direction_changes(["up", "up", "down", "down", "up"]) == 2
    assert sim.direction_changes([]) == 0


def test_on_the_measured_scores_the_law_meets_the_goals_at_least_as_often_as_it_did():
    """A floor under the share of runs that meet every goal with the closed-loop
    workload's measured per-question scores, at 5 samples per interval (half the live rate:
    1000 runs per scenario measured 0.82, 0.62 and 0.85 when the floor was set, and this
    test's 400 runs 0.80, 0.61 and 0.85): a change to the law that makes it noticeably less
    reliable fails here."""
    base, changed, found = sim.load(sim.MEASURED)
    tuning = Tuning(target=found["target"])
    figures = sim.evaluate(tuning, base, changed, runs=400, seed=7, samples_per_interval=5.0)
    assert figures["from-low"]["met_goals"] >= 0.74
    assert figures["from-high"]["met_goals"] >= 0.55
    assert figures["workload-change"]["met_goals"] >= 0.79
    assert all(run["ever_out_of_bounds"] == 0.0 for run in figures.values())


def test_an_output_without_per_question_scores_is_refused_with_the_fix(tmp_path):
    old = tmp_path / "closed-loop.json"
    old.write_text(json.dumps({"offline_sweep": {"0.1": 0.5}, "runs": []}))
    with pytest.raises(SystemExit, match="make closed-loop"):
        sim.load(old)
