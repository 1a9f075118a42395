"""`make bench-operator` runs and writes the JSON the issue asks for (tiny N; numbers elsewhere)."""

import json

from holeblend_devtools import bench_operator

KEYS = {
    "num_objects", "converge_s", "floor_s", "rss_mb", "cpu_s_per_object", "rss_baseline_mb",
    "rss_converged_mb", "rss_settled_mb", "rss_per_object_mb", "rss_samples_mb", "rss_flat",
}  # fmt: skip


def test_bench_operator_writes_converge_and_floor_per_count(tmp_path):
    path = tmp_path / "bench.json"
    args = ["--counts", "1,3", "--json", str(path), "--timeout", "60", "--settle", "2"]
    assert bench_operator.main(args) == 0
    results = json.loads(path.read_text())["results"]
    assert [r["num_objects"] for r in results] == [1, 3]
    for result in results:
        assert result.keys() >= KEYS
        assert result["converge_s"] > 0 and result["floor_s"] > 0
        assert 30 < result["rss_mb"] < 500 and result["cpu_s_per_object"] > 0
        assert result["rss_baseline_mb"] <= result["rss_converged_mb"] <= result["rss_mb"]
        assert len(result["rss_samples_mb"]) >= 1
        # each BlendDeployment: its create, six children and at least one status write
        assert result["num_requests"] >= 8 * result["num_objects"]
