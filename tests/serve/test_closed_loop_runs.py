"""`make closed-loop`'s runner before it starts anything: held-out workload seeds, and
sweeps reused only for the workloads they measured."""

import json

import pytest

from holeblend_devtools import closed_loop_runs


def test_held_out_seeds_change_only_the_generator_seed():
    base, changed = closed_loop_runs.workloads_of((5, 6))
    assert (base.seed, changed.seed) == (5, 6)
    assert base.num_documents == closed_loop_runs.WORKLOAD.num_documents
    assert changed.num_documents == closed_loop_runs.CHANGED.num_documents
    assert closed_loop_runs.workloads_of((3, 4)) == (
        closed_loop_runs.WORKLOAD,
        closed_loop_runs.CHANGED,
    )


@pytest.mark.parametrize("written", [None, [3, 4]])
def test_a_sweep_of_other_workloads_is_refused_before_any_run(tmp_path, monkeypatch, written):
    monkeypatch.setattr(closed_loop_runs.signal, "signal", lambda *_: None)  # pytest's own
    earlier = {"offline_sweep": {"0.2": 0.7}, "offline_sweep_changed": {"0.2": 0.6}}
    if written is not None:
        earlier["workload_seeds"] = written  # outputs older than the key swept seeds 3 and 4
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(earlier))
    with pytest.raises(SystemExit, match=r"swept workload seeds \[3, 4\], not \[5, 6\]"):
        closed_loop_runs.main(["--sweep-from", str(sweep), "--seeds", "5", "6"])
