"""A segment larger than the index's byte capacity is counted once, when admitted."""

from holeblend_runtime.lookup_server.index import IndexLimits, SegmentIndex
from holeblend_runtime.lookup_server.wire import Entry


def test_a_segment_over_the_byte_capacity_is_not_counted_again_by_every_resync():
    """A pod lists what it holds in every periodic resync (60 s): the one segment the
    index cannot take was counted in `capacity_evictions` each time, so the counter
    grew with time on an index that evicted nothing."""
    index = SegmentIndex(IndexLimits(max_bytes=100))
    small, large = (
        Entry(key, 4, "m", "float32", None, size, False)
        for key, size in (("small", 10), ("large", 1000))
    )
    assert index.admit("pod-a", [small, large]) == 1
    for _ in range(3):
        assert index.resync("pod-a", [small, large], reset=True) == 1
        index.heartbeat("pod-a")
    assert index.counters["capacity_evictions"] == 1
    assert index.get("large") is None and index.get("small") is not None
