"""The segment index alone: capacity, LRU, pods' locations, heartbeats and resync."""

from hypothesis import given, settings
from hypothesis import strategies as st

from holeblend_runtime.lookup_server.index import IndexLimits, SegmentIndex
from holeblend_runtime.lookup_server.wire import Entry


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(key: str, num_bytes: int = 10, shared: bool = False, model: str = "m") -> Entry:
    return Entry(key, 5, model, "float32", None, num_bytes, shared)


def test_lookup_answers_hits_with_locations_and_misses_with_none():
    index = SegmentIndex()
    index.admit("pod-a", [entry("k1", shared=True)])
    index.admit("pod-b", [entry("k1")])
    assert index.lookup(["k1", "k2"]) == [[5, True, ["pod-a", "pod-b"]], None]


def test_a_key_indexed_for_another_model_is_a_miss():
    index = SegmentIndex()
    index.admit("pod-a", [entry("k1", model="other")])
    assert index.lookup(["k1"], model="mine") == [None]
    assert index.lookup(["k1"], model="other") == [[5, False, ["pod-a"]]]


def test_capacity_in_entries_drops_the_least_recently_used():
    index = SegmentIndex(IndexLimits(max_entries=2))
    index.admit("p", [entry("a"), entry("b")])
    index.lookup(["a"])  # a hit is a use: b is now the oldest
    index.admit("p", [entry("c")])
    assert [hit is not None for hit in index.lookup(["a", "b", "c"])] == [True, False, True]
    assert index.stats()["capacity_evictions"] == 1


def test_capacity_in_bytes_is_enforced():
    index = SegmentIndex(IndexLimits(max_bytes=25))
    index.admit("p", [entry("a"), entry("b"), entry("c")])
    assert len(index) == 2 and index.num_bytes == 20


def test_a_segment_goes_when_its_last_holder_evicts_it_unless_the_shared_tier_has_it():
    index = SegmentIndex()
    index.admit("p", [entry("local"), entry("shared", shared=True)])
    assert index.evict("p", ["local", "shared"]) == 2
    assert index.lookup(["local", "shared"]) == [None, [5, True, []]]
    index.evict("p", ["shared"], shared=True)
    assert index.lookup(["shared"]) == [None]


def test_an_unknown_pod_is_told_to_resync_and_a_known_one_is_not():
    index = SegmentIndex()
    assert index.heartbeat("p") is True
    assert index.heartbeat("p") is False


def test_resync_with_reset_replaces_what_the_pod_held():
    index = SegmentIndex()
    index.admit("p", [entry("old"), entry("kept")])
    index.resync("p", [entry("kept"), entry("new")], reset=True)
    assert [hit is not None for hit in index.lookup(["old", "kept", "new"])] == [False, True, True]


def test_silent_pods_are_dropped_and_shared_copies_outlive_them():
    clock = Clock()
    index = SegmentIndex(IndexLimits(pod_timeout_s=10), clock=clock)
    index.admit("quiet", [entry("only-local"), entry("in-shared", shared=True)])
    index.admit("alive", [entry("both")])
    index.admit("quiet", [entry("both")])
    clock.now = 8
    index.heartbeat("alive")
    clock.now = 12
    assert index.drop_silent_pods() == ["quiet"]
    assert index.lookup(["only-local", "in-shared", "both"]) == [
        None,
        [5, True, []],
        [5, False, ["alive"]],
    ]
    assert index.num_pods == 1


_keys = st.sampled_from([f"k{i}" for i in range(8)])
_pods = st.sampled_from(["p0", "p1", "p2"])
_operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("admit"),
            _pods,
            st.lists(st.tuples(_keys, st.booleans(), st.integers(1, 20)), max_size=5),
        ),
        st.tuples(st.just("evict"), _pods, st.lists(_keys, max_size=4), st.booleans()),
        st.tuples(
            st.just("resync"),
            _pods,
            st.lists(st.tuples(_keys, st.booleans(), st.integers(1, 20)), max_size=5),
            st.booleans(),
        ),
        st.tuples(st.just("forget"), _pods),
        st.tuples(st.just("heartbeat"), _pods),
        st.tuples(st.just("tick"), st.floats(0, 6)),
        st.tuples(st.just("lookup"), st.lists(_keys, max_size=4)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(operations=_operations, max_entries=st.integers(1, 10), max_bytes=st.integers(1, 100))
def test_the_maintained_counts_match_a_full_count_after_any_operations(
    operations, max_entries, max_bytes
):
    clock = Clock()
    index = SegmentIndex(IndexLimits(max_entries, max_bytes, pod_timeout_s=5), clock=clock)
    for operation in operations:
        kind, *args = operation
        if kind in ("admit", "resync"):
            entries = [entry(key, num_bytes, shared) for key, shared, num_bytes in args[1]]
            if kind == "admit":
                index.admit(args[0], entries)
            else:
                index.resync(args[0], entries, args[2])
        elif kind == "evict":
            index.evict(args[0], args[1], args[2])
        elif kind == "forget":
            index.forget_pod(args[0])
        elif kind == "heartbeat":
            index.heartbeat(args[0])
        elif kind == "tick":
            clock.now += args[0]
            index.drop_silent_pods()
        else:
            index.lookup(args[0])
        stats = index.stats()
        values = list(index._entries.values())
        assert stats["shared_entries"] == sum(value.shared for value in values)
        assert stats["bytes"] == sum(value.num_bytes for value in values)
        assert stats["entries"] == len(values) <= max_entries
