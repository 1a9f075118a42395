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


def test_a_segment_larger_than_the_byte_capacity_is_not_indexed_and_drops_no_other():
    """Making room for a segment over `max_bytes` dropped every indexed segment, then the
    segment itself: one such admit emptied the index for all pods."""
    index = SegmentIndex(IndexLimits(max_bytes=100))
    index.admit("p", [entry("a"), entry("b")])
    assert index.admit("q", [entry("huge", num_bytes=101), entry("c")]) == 1
    assert [hit is not None for hit in index.lookup(["a", "b", "huge", "c"])] == [
        True,
        True,
        False,
        True,
    ]
    assert index.num_bytes == 30 and index.stats()["capacity_evictions"] == 1


def test_a_segment_goes_when_its_last_holder_evicts_it_unless_the_shared_tier_has_it():
    index = SegmentIndex()
    index.admit("p", [entry("local"), entry("shared", shared=True)])
    assert index.evict("p", ["local", "shared"]) == 2
    assert index.lookup(["local", "shared"]) == [None, [5, True, []]]
    index.evict("p", ["shared"], shared=True)
    assert index.lookup(["shared"]) == [None]


def test_an_unknown_pod_is_told_to_resync_until_its_full_resync_arrives():
    """A pod is told to resync on every heartbeat until the first chunk of its full
    announcement (`reset`) arrives, so a lost heartbeat reply or a failed resync does not
    leave the index without its holdings; after that, heartbeats ask for nothing."""
    index = SegmentIndex()
    assert index.heartbeat("p") is True
    assert index.heartbeat("p") is True
    index.resync("p", [entry("a")], reset=True)
    assert index.heartbeat("p") is False
    index.forget_pod("p")  # dropped as silent: unknown again
    assert index.heartbeat("p") is True


def test_a_pod_whose_first_message_is_an_admit_is_still_told_to_resync():
    """After a server restart a serving pod's first message is usually an admit of a segment
    it just stored (queued admits go before the heartbeat). The admit is indexed, but it does
    not stand for the pod's full announcement: the next heartbeat still asks for a resync, or
    the pod's earlier holdings would stay unindexed until its unasked resync (60 s)."""
    for first in ("admit", "evict", "resync without reset"):
        index = SegmentIndex()
        if first == "admit":
            index.admit("p", [entry("new", shared=True)])
            assert index.lookup(["new"]) == [[5, True, ["p"]]]
        elif first == "evict":
            index.evict("p", ["old"])
        else:
            index.resync("p", [entry("later-chunk")], reset=False)
        assert index.heartbeat("p") is True, first
        index.resync("p", [entry("old"), entry("new", shared=True)], reset=True)
        assert index.heartbeat("p") is False, first


def test_a_resync_does_not_advertise_again_a_shared_copy_reported_gone():
    """A pod that fails to load an advertised shared copy reports it gone; the writer still
    remembers writing it and lists it as shared in its periodic resync. The index keeps the
    copy unadvertised (the pod's location stays), whether or not the resync resets, until a
    pod admits the key as shared again, which it does only after writing or loading it."""
    index = SegmentIndex()
    index.resync("writer", [entry("k", shared=True)], reset=True)
    index.evict("reader", ["k", "never-indexed"], shared=True)
    assert index.lookup(["k"]) == [[5, False, ["writer"]]]
    for reset in (True, False):
        index.resync(
            "writer", [entry("k", shared=True), entry("never-indexed", shared=True)], reset
        )
        assert index.lookup(["k", "never-indexed"]) == [
            [5, False, ["writer"]],
            [5, False, ["writer"]],
        ]
        assert index.stats()["shared_entries"] == 0
    index.admit("writer", [entry("k", shared=True)])  # written again
    assert index.lookup(["k"]) == [[5, True, ["writer"]]]
    index.resync("writer", [entry("k", shared=True)], reset=True)
    assert index.lookup(["k"]) == [[5, True, ["writer"]]]


def test_keys_of_shared_copies_reported_gone_are_remembered_up_to_a_limit():
    """The memory of gone copies is bounded (`max_shared_gone`, oldest forgotten first); a
    forgotten key is advertised again by a resync, and costs one more failed load."""
    index = SegmentIndex(IndexLimits(max_shared_gone=2))
    index.evict("reader", ["a", "b", "c"], shared=True)
    index.resync("writer", [entry(key, shared=True) for key in "abc"], reset=True)
    assert [hit[1] for hit in index.lookup(["a", "b", "c"])] == [True, False, False]


def test_resync_with_reset_replaces_what_the_pod_held_once_the_announcement_ends():
    """What the pod held and no chunk lists again goes with the pod's next message of
    another kind (the announcer sends all chunks first); shared copies stay."""
    index = SegmentIndex()
    index.admit("p", [entry("old"), entry("kept"), entry("copy", shared=True)])
    index.resync("p", [entry("kept")], reset=True)
    index.resync("p", [entry("new")], reset=False)
    index.heartbeat("p")
    keys = ["old", "kept", "new", "copy"]
    assert index.lookup(keys) == [None, [5, False, ["p"]], [5, False, ["p"]], [5, True, []]]


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


def test_a_resync_is_no_use_so_capacity_still_drops_the_least_recently_used():
    """A pod re-announces everything it holds every minute: that is no use of its
    segments. Taken for one, it made them all newer than the segments just looked up (and
    those only the pod held were dropped and indexed anew, last), so the next capacity
    eviction dropped the segment in use."""
    index = SegmentIndex(IndexLimits(max_entries=3))
    index.admit("a", [entry("a-local"), entry("a-shared", shared=True)])
    index.admit("b", [entry("b-used")])
    index.lookup(["b-used"])
    index.resync("a", [entry("a-local")], reset=True)
    index.resync("a", [entry("a-shared", shared=True)], reset=False)
    index.heartbeat("a")
    index.admit("b", [entry("b-new"), entry("b-newer")])
    keys = ["a-local", "a-shared", "b-used", "b-new", "b-newer"]
    assert [hit is not None for hit in index.lookup(keys)] == [False, False, True, True, True]


def test_a_resync_brings_back_segments_capacity_dropped_as_the_least_recently_used():
    """A pod holding more than the index takes lists, in every periodic resync, segments
    that capacity dropped. Indexed anew as the newest, they pushed out one after another
    the segments looked up since, while nobody used theirs."""
    index = SegmentIndex(IndexLimits(max_entries=3))
    held = [entry(f"a-{i}") for i in range(3)]
    index.admit("a", held)
    index.admit("b", [entry("b-used")])  # drops a-0
    index.lookup(["b-used"])
    for _ in range(3):
        index.resync("a", held, reset=True)
        index.heartbeat("a")
    assert index.lookup(["b-used"])[0] is not None
    assert len(index) == 3 and index.counters["capacity_evictions"] == 4
