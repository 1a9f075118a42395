"""`holeblend-lookup bench` runs end to end and writes the documented JSON (numbers not judged)."""

import json
import subprocess
import sys
from pathlib import Path

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
