"""`python -m holeblend_devtools.calibration_start`: real holeblend-serve processes and a
real lookup server; a small run, checked for what its JSON says."""

import json

import pytest

from holeblend_devtools import calibration_start
from holeblend_runtime.quality.inline_proxy import MIN_PAIRS


@pytest.mark.slow
def test_a_pod_started_into_a_calibrated_deployment_estimates_and_one_alone_does_not(tmp_path):
    out = tmp_path / "result.json"
    code = calibration_start.main([
        "--saturated-questions", "6", "--history-questions", "16", "--threads", "1",
        "--json", str(out), "--work-dir", str(tmp_path / "work"),
    ])  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert result["history"]["inline_pairs"] >= MIN_PAIRS
    rows = {row["arm"]: row for row in result["rows"]}
    assert set(rows) == {"shared", "alone"}
    shared, alone = rows["shared"], rows["alone"]
    for row in (shared, alone):
        assert row["requests"] == 12 and row["failed_requests"] == 0
        assert row["blended_requests"] > 0 and row["ttft_p99_s"] > 0
    # The history's pairs reached the new pod: every blended request was estimated.
    assert shared["pairs_received"] >= MIN_PAIRS
    assert shared["inline_samples"] == shared["blended_requests"]
    assert shared["first_inline_estimate_s"] is not None
    # Alone, a saturated pod's shadows score no 8 pairs in a few seconds: no estimate.
    assert alone["pairs_received"] == 0 and alone["inline_samples"] == 0
    assert alone["first_inline_estimate_s"] is None


@pytest.mark.parametrize(
    ("option", "value"),
    [("--seed", "-7"), ("--clients", "0"), ("--saturated-questions", "0"), ("--threads", "0")],
)
def test_options_a_run_cannot_use_are_refused_by_name_before_any_server_starts(
    capsys, option, value
):
    """A negative seed draws what its positive twin draws; no client or no question
    would crash the run after its servers started."""
    with pytest.raises(SystemExit) as stopped:
        calibration_start.main([option, value])
    assert stopped.value.code == 2
    assert f"argument {option}: must be" in capsys.readouterr().err
