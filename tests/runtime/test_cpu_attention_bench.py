"""The CPU attention benchmark: both arms per case against the chunks, computing the same
attention, and bad cases named."""

import json

import pytest

from holeblend_devtools import cpu_attention


def test_rows_per_case_and_arm_against_the_chunks(tmp_path):
    out = tmp_path / "attention.json"
    argv = ["--cases", "40:3,90:22", "--rounds", "1", "--json", str(out)]
    assert cpu_attention.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["keys"], r["prefix"], r["arm"]) for r in rows} == {
        (keys, prefix, arm) for keys, prefix in ((40, 3), (90, 22)) for arm in cpu_attention.ARMS
    }
    for row in rows:
        assert row["ms_per_layer"] > 0 and row["max_difference"] < 1e-5
        if row["arm"] == "chunks":
            assert row["x_chunks"] == 1.0


@pytest.mark.parametrize(
    "cases, message",
    [("40-3", "--cases: expected"), ("40:11", "within 1..KEYS x 0.25"), ("40:0", "within 1..KEYS")],
)
def test_bad_cases_are_named(cases, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cpu_attention.main(["--cases", cases, "--json", str(tmp_path / "out.json")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
