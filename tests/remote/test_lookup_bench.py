"""`holeblend-lookup bench` runs end to end and writes the documented JSON (numbers not judged)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from holeblend_runtime.lookup_server.bench import parse_args

LOOKUP = str(Path(sys.executable).parent / "holeblend-lookup")


def test_bench_writes_lookup_rows_and_shared_tier_rows(tmp_path):
    out = tmp_path / "bench.json"
    command = [LOOKUP, "bench", "--json", str(out), "--duration", "0.3", "--repeats", "1"]
    subprocess.run([*command, "--entries", "500"], check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    assert [row["clients"] for row in report["results"]] == [1, 8, 1]
    for row in report["results"]:
        assert row["lookups_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["degraded"] == 0
    assert [row["blob_mb"] for row in report["shared_tier"]] == [1, 8, 32]
    for row in report["shared_tier"]:
        assert row["tier_get_gb_s"] > 0 and row["raw_get_gb_s"] > 0 and row["put_vs_raw"] > 0


@pytest.mark.parametrize("flag", ["--duration", "--entries", "--repeats"])
def test_a_bench_flag_of_zero_exits_2_naming_it_before_anything_starts(flag, capsys):
    """Zero was taken, and the bench started a server and Redis before it crashed with a
    ZeroDivisionError or StatisticsError traceback."""
    with pytest.raises(SystemExit) as caught:
        parse_args([flag, "0"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: '0': expected" in err and "Traceback" not in err
