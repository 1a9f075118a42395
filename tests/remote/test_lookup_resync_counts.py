"""A resync re-announces what pods hold already: it is counted apart from admits."""

import msgpack

from holeblend_runtime.lookup_server.index import SegmentIndex
from holeblend_runtime.lookup_server.server import LookupServer
from holeblend_runtime.lookup_server.wire import Entry


def entry(key: str) -> Entry:
    return Entry(key, 12, "model", "float32", None, 1000, False)


def test_a_resync_counts_as_resynced_not_as_admits():
    index = SegmentIndex()
    index.admit("pod-a", [entry("a"), entry("b")])
    index.resync("pod-a", [entry("a"), entry("b")], reset=True)
    index.resync("pod-a", [entry("c")], reset=False)
    stats = index.stats()
    assert stats["admits"] == 2 and stats["resynced"] == 3 and stats["entries"] == 3


def test_periodic_resyncs_leave_the_admits_metric_at_the_segments_pods_stored():
    """Dashboards read `holeblend_lookup_admits_total` as segments stored. A pod
    re-announces everything it holds every `resync_s` (60 s): counted as admits, a pod
    holding 100,000 segments read as 1,700 new stores a second with none stored."""
    server = LookupServer()

    def post(message: dict) -> dict:
        status, _, payload = server.handle("POST", "/v1", msgpack.packb({"v": 1, **message}))
        assert status == 200
        return msgpack.unpackb(payload)

    held = [entry(f"key-{i}").to_wire() for i in range(5)]
    post({"op": "admit", "pod": "pod-a", "entries": held})
    for _ in range(3):
        post({"op": "resync", "pod": "pod-a", "entries": held, "reset": True})
        post({"op": "heartbeat", "pod": "pod-a"})
    metrics = server.metrics.render().decode().splitlines()
    assert "holeblend_lookup_admits_total 5.0" in metrics
    assert "holeblend_lookup_resynced_total 15.0" in metrics
    stats = post({"op": "stats"})["stats"]
    assert stats["admits"] == 5 and stats["resynced"] == 15 and stats["entries"] == 5
