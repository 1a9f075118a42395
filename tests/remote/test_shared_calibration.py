"""The inline proxy's calibration pairs shared by a deployment's pods through the lookup
server: the server's store and wire checks, and pods exchanging pairs through a real
lookup server process (down, restarted, a pod that starts late)."""

import math
import threading
import time

import msgpack
import pytest
from prometheus_client import CollectorRegistry

from holeblend_runtime.lookup_server import wire
from holeblend_runtime.lookup_server.calibration import CalibrationLimits, CalibrationPairs
from holeblend_runtime.lookup_server.client import ClientConfig, LookupClient
from holeblend_runtime.lookup_server.processes import LookupProcess
from holeblend_runtime.lookup_server.server import LookupServer, ServerConfig
from holeblend_runtime.quality.inline_proxy import MIN_PAIRS, STATISTIC_VERSION, InlineProxy
from holeblend_runtime.quality.shadow import ShadowScore
from holeblend_runtime.quality.shared_calibration import (
    MAX_PENDING,
    MAX_READS,
    SharedCalibration,
    calibration_scope,
)

SCOPE = "smollm2|float32|tp1|kvDeviation|check2|filter-"


# --- the server's store ----------------------------------------------------------------


def test_a_pod_reads_the_other_pods_pairs_after_where_it_left_off_never_its_own():
    store = CalibrationPairs()
    assert store.add(SCOPE, "a", [(0.15, 0.1, 0.9, 0.95), (0.15, 0.2, 0.8, 0.9)]) == 2
    store.add(SCOPE, "b", [(0.3, 0.05, 1.0, 1.0)])
    pairs, last, more = store.since(SCOPE, "b", 0)
    assert pairs == [[0.15, 0.1, 0.9, 0.95], [0.15, 0.2, 0.8, 0.9]] and not more
    assert last == 3  # its own pair was passed over, not answered
    store.add(SCOPE, "a", [(0.15, 0.3, 0.7, 0.8)])
    assert store.since(SCOPE, "b", last)[0] == [[0.15, 0.3, 0.7, 0.8]]
    assert store.since(SCOPE, "a", 0)[0] == [[0.3, 0.05, 1.0, 1.0]]
    assert store.since("another scope", "b", 0) == ([], 0, False)


def test_replies_are_bounded_and_continue_where_they_stopped():
    store = CalibrationPairs(CalibrationLimits(max_reply=2))
    store.add(SCOPE, "a", [(0.15, float(i), 0.5, 0.5) for i in range(5)])
    seen, after, rounds = [], 0, 0
    while True:
        pairs, after, more = store.since(SCOPE, "b", after)
        seen += [p[1] for p in pairs]
        rounds += 1
        if not more:
            break
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0] and rounds == 3


def test_the_store_keeps_the_newest_pairs_and_the_scopes_written_last():
    store = CalibrationPairs(CalibrationLimits(max_scopes=2, max_pairs=3))
    store.add("s1", "a", [(0.15, float(i), 0.5, 0.5) for i in range(5)])
    assert [p[1] for p in store.since("s1", "b", 0)[0]] == [2.0, 3.0, 4.0]
    store.add("s2", "a", [(0.15, 0.0, 0.5, 0.5)])
    store.add("s1", "a", [(0.15, 9.0, 0.5, 0.5)])  # s1 written last: s2 goes first
    store.add("s3", "a", [(0.15, 0.0, 0.5, 0.5)])
    assert store.since("s2", "b", 0)[0] == []
    assert [p[1] for p in store.since("s1", "b", 0)[0]] == [3.0, 4.0, 9.0]
    assert store.stats()["calibration_scopes"] == 2
    assert store.stats()["calibration_pairs"] == 4


# --- the wire -----------------------------------------------------------------------


def _rpc(server: LookupServer, **message) -> tuple[int, dict]:
    status, _, body = server.handle("POST", wire.RPC_PATH, wire.encode(message))
    return status, msgpack.unpackb(body, raw=False)


@pytest.mark.parametrize(
    ("pairs", "says"),
    [
        ([[-0.1, 0.1, 0.5, 0.5]], "pairs[0]: ratio must be in [0, 1]"),
        ([[0.15, 0.1, 0.5, 0.5], [1.5, 0.1, 0.5, 0.5]], "pairs[1]: ratio must be in [0, 1]"),
        ([[0.15, math.nan, 0.5, 0.5]], "pairs[0]: statistic must be finite and >= 0"),
        ([[0.15, -1.0, 0.5, 0.5]], "pairs[0]: statistic must be finite and >= 0"),
        ([[0.15, 0.1, 1.2, 0.5]], "pairs[0]: f1 must be in [0, 1]"),
        ([[0.15, 0.1, 0.5, math.nan]], "pairs[0]: top1 must be in [0, 1]"),
        ([[0.15, 0.1, 0.5]], "pairs[0]: expected [ratio, statistic, f1, top1]"),
        ([[0.15, True, 0.5, 0.5]], "pairs[0]: expected four numbers"),
        ([[0.15, "0.1", 0.5, 0.5]], "pairs[0]: expected four numbers"),
        ({"ratio": 0.15}, "pairs: expected a list"),
    ],
)
def test_pairs_off_their_range_are_refused_naming_the_pair_and_the_field(pairs, says):
    server = LookupServer()
    status, reply = _rpc(server, op="pairs_add", scope=SCOPE, pod="a", pairs=pairs)
    assert status == 400 and reply["error"]["code"] == "bad_request"
    assert reply["error"]["message"].startswith(says)
    assert server.calibration.stats()["calibration_pairs"] == 0  # nothing of it kept


def test_pairs_over_the_limit_and_bad_names_are_refused():
    server = LookupServer(ServerConfig(limits=wire.Limits(max_entries=2)))
    status, reply = _rpc(server, op="pairs_add", scope=SCOPE, pod="a", pairs=[[0.1, 0, 0, 0]] * 3)
    assert status == 413 and reply["error"]["code"] in ("too_many_entries", "too_many_keys")
    status, reply = _rpc(server, op="pairs_add", scope="a\nforged", pod="a", pairs=[])
    assert status == 400 and reply["error"]["message"].startswith("scope: control characters")
    status, reply = _rpc(server, op="pairs_get", scope=SCOPE, pod="a", after=-1)
    assert status == 400 and "after" in reply["error"]["message"]


def test_pairs_round_trip_on_the_wire_with_the_servers_epoch_and_stats():
    server = LookupServer()
    assert _rpc(server, op="pairs_add", scope=SCOPE, pod="a", pairs=[[0.15, 0.1, 1, 0.5]]) == (
        200,
        {"v": 1, "ok": True, "added": 1},
    )
    status, reply = _rpc(server, op="pairs_get", scope=SCOPE, pod="b", after=0)
    assert status == 200
    assert reply["pairs"] == [[0.15, 0.1, 1.0, 0.5]] and reply["last"] == 1
    assert reply["more"] is False and reply["epoch"] == server.calibration.epoch
    assert LookupServer().calibration.epoch != server.calibration.epoch
    _, stats = _rpc(server, op="stats")
    assert stats["stats"]["calibration_pairs"] == 1
    assert b"holeblend_lookup_calibration_pairs 1.0" in server.metrics.render()


def test_a_pair_comes_back_with_who_published_it_and_its_number_there():
    """A pod numbers the pairs it publishes; the other pods read each pair with its
    publisher and that number, so that after a restart they know the pairs they had
    before by where they came from, not by their values. A client that sends no numbers
    (an older pod) is still served, its pairs numbered None."""
    server = LookupServer()
    pair = [0.15, 0.1, 1, 0.5]
    assert _rpc(server, op="pairs_add", scope=SCOPE, pod="a", pairs=[pair] * 2, ids=[7, 8]) == (
        200,
        {"v": 1, "ok": True, "added": 2},
    )
    _rpc(server, op="pairs_add", scope=SCOPE, pod="old", pairs=[pair])
    _, reply = _rpc(server, op="pairs_get", scope=SCOPE, pod="b", after=0)
    assert reply["pairs"] == [[0.15, 0.1, 1.0, 0.5]] * 3
    assert reply["ids"] == [["a", 7], ["a", 8], ["old", None]]
    for ids, says in (([1], "ids: expected a list of 2"), ([1, -1], "ids[1]")):
        status, reply = _rpc(
            server, op="pairs_add", scope=SCOPE, pod="a", pairs=[pair] * 2, ids=ids
        )
        assert status == 400 and reply["error"]["message"].startswith(says)


class InProcessClient:
    """A pod's lookup client on an in-process server, which `server` may replace (a
    restart: a new epoch, no pairs); `strip_ids` answers as a server that does not
    number pairs."""

    def __init__(self, server: LookupServer, strip_ids: bool = False):
        self.server, self.strip_ids = server, strip_ids

    def call(self, message: dict) -> dict:
        status, reply = _rpc(self.server, **message)
        assert status == 200, reply
        if self.strip_ids:
            reply.pop("ids", None)
        return reply

    def close(self) -> None:
        pass


def test_equal_pairs_of_different_requests_all_reach_the_other_pods():
    """The blend is deterministic: a repeated prompt gives the same statistic and scores,
    and a blend that recomputed every compared token leaves statistic 0 with scores 1.
    Each such pair is a request of its own and counts on every pod, as it does on the
    one that scored it; the other pods must not stay blind at that ratio."""
    server = LookupServer()
    scorer, receiver = InlineProxy(), InlineProxy()
    scoring = SharedCalibration(InProcessClient(server), SCOPE, "pod-a", scorer)
    receiving = SharedCalibration(InProcessClient(server), SCOPE, "pod-b", receiver)
    for _ in range(10):
        scorer.add_pair(0.0, _score(1.0, 1.0))
    assert scoring.exchange() and receiving.exchange()
    assert receiver.num_pairs(1.0) == scorer.num_pairs(1.0) == 10
    assert receiver.observe(1.0, 0.0) == scorer.observe(1.0, 0.0) == (1.0, 1.0)
    # From a server that does not number pairs, only the values tell them apart.
    older = InlineProxy()
    assert SharedCalibration(InProcessClient(server, strip_ids=True), SCOPE, "c", older).exchange()
    assert older.num_pairs(1.0) == 1


def test_a_restarted_server_gets_each_pair_once_and_the_other_pods_count_each_once():
    """After a restart the lookup server has no pair: a pod publishes its own again, and
    sees the restart before it publishes what it scored meanwhile, so each pair reaches
    the new server once (not the new ones twice, using up the scope's room and counted
    twice by the pods that start later). A pod that received pairs before the restart
    reads them again from the start and keeps only the new ones."""
    server = LookupServer()
    publisher, reader = InlineProxy(), InlineProxy()
    publishing = SharedCalibration(InProcessClient(server), SCOPE, "pod-a", publisher)
    reading = SharedCalibration(InProcessClient(server), SCOPE, "pod-b", reader)
    publisher.add_pair(0.5, _score(0.2, 0.9))
    assert publishing.exchange() and reading.exchange() and reader.num_pairs(0.2) == 1
    restarted = LookupServer()
    publishing.client.server = reading.client.server = restarted
    publisher.add_pair(0.7, _score(0.2, 0.8))  # scored meanwhile
    assert publishing.exchange() and reading.exchange()
    pairs = restarted.calibration.since(SCOPE, "someone-else", 0)[0]
    assert sorted(map(tuple, pairs)) == [(0.2, 0.5, 0.9, 0.9), (0.2, 0.7, 0.8, 0.8)]
    assert reader.num_pairs(0.2) == publisher.num_pairs(0.2) == 2
    late = InlineProxy()
    assert SharedCalibration(InProcessClient(restarted), SCOPE, "pod-c", late).exchange()
    assert late.num_pairs(0.2) == 2


def test_pairs_sent_again_to_a_restarted_server_are_counted_published_once():
    """`published` counts the pairs this pod scored: sending its own again to a restarted
    server must not count them a second time."""
    registry = CollectorRegistry()
    publisher = InlineProxy(registry)
    client = InProcessClient(LookupServer())
    publishing = SharedCalibration(client, SCOPE, "pod-a", publisher)
    publisher.add_pair(0.5, _score(0.2, 0.9))
    assert publishing.exchange()
    client.server = LookupServer()  # restarted
    publisher.add_pair(0.7, _score(0.2, 0.8))
    assert publishing.exchange()
    assert len(client.server.calibration.since(SCOPE, "someone-else", 0)[0]) == 2
    published = {"direction": "published"}
    assert registry.get_sample_value("holeblend_inline_proxy_shared_pairs_total", published) == 2


class Outage(InProcessClient):
    """An in-process server that answers nothing while `down`."""

    down = False

    def call(self, message: dict) -> dict | None:
        return None if self.down else super().call(message)


def _statistics(server: LookupServer) -> list[float]:
    """The statistics of every pair the server holds, oldest first."""
    found, after, more = [], 0, True
    while more:
        pairs, after, more = server.calibration.since(SCOPE, "someone-else", after)
        found += [pair[1] for pair in pairs]
    return found


def test_after_a_long_outage_and_a_restart_the_pairs_scored_last_still_go_out():
    """Pairs scored while the server is down wait, the newest `MAX_PENDING`; a restarted
    server then gets this pod's published pairs again in front of them, and what no longer
    fits is the oldest, never the pairs scored last."""
    client = Outage(LookupServer())
    sharing = SharedCalibration(client, SCOPE, "pod-a", InlineProxy())
    sharing.publish(0.2, 0.0, 1.0, 1.0)
    assert sharing.exchange()  # published: sent again to a restarted server
    client.down = True
    for i in range(1, MAX_PENDING + 1):
        sharing.publish(0.2, float(i), 0.5, 0.5)
    assert not sharing.exchange()
    client.down, client.server = False, LookupServer()  # back, restarted
    assert sharing.exchange()
    statistics = _statistics(client.server)
    assert len(statistics) == MAX_PENDING
    assert statistics[-1] == float(MAX_PENDING)  # the pair scored last


class Replies:
    """A lookup client that answers each `pairs_get` with the next of `replies`: a server
    of another version, or one that did not check what it stored."""

    def __init__(self, *replies: dict):
        self.replies = list(replies)

    def call(self, message: dict) -> dict:
        assert message["op"] == "pairs_get", message
        return self.replies.pop(0)

    def close(self) -> None:
        pass


def test_received_pairs_off_their_range_are_dropped_and_the_rest_of_the_reply_is_kept():
    """A pod checks the pairs it receives as the server checks those it stores: one off
    its range (a NaN score, a ratio off [0, 1], three numbers, a number as text) never
    reaches the calibration, and the other pairs of that reply all count."""
    good = [[0.2, 0.1 * i, 0.9, 0.8] for i in range(1, 4)]
    bad = [[0.2, 0.5, math.nan, 0.8], [7.0, 0.5, 0.9, 0.8], [0.2, 0.5, 0.9], [0.2, "1", 1, 1]]
    pairs = [good[0], *bad, *good[1:]]
    reply = {
        "pairs": pairs,
        "ids": [["pod-a", i] for i in range(1, len(pairs) + 1)],
        "last": len(pairs),
        "more": False,
        "epoch": "e1",
    }
    registry = CollectorRegistry()
    inline = InlineProxy(registry)
    again = {**reply, "pairs": [], "ids": []}
    sharing = SharedCalibration(Replies(reply, again), SCOPE, "pod-b", inline)
    assert sharing.exchange() and sharing.exchange()
    assert inline.num_pairs(0.2) == len(good) and inline.num_pairs(7.0) == 0
    received = registry.get_sample_value(
        "holeblend_inline_proxy_shared_pairs_total", {"direction": "received"}
    )
    assert received == len(good)


class Flapping:
    """A lookup client whose server reports a new epoch on every reply (it restarts
    between any two calls), then, once `settled`, keeps its last one."""

    def __init__(self):
        self.num_calls = 0
        self.settled = False

    def call(self, message: dict) -> dict:
        if message["op"] == "pairs_add":
            return {"added": len(message["pairs"])}
        if not self.settled:
            self.num_calls += 1
        pairs = [[0.2, 0.5, 0.9, 0.8]] if self.settled else []
        ids = [["pod-a", 1]] if self.settled else []
        epoch = "settled" if self.settled else f"e{self.num_calls}"
        return {"pairs": pairs, "ids": ids, "last": len(pairs), "more": False, "epoch": epoch}

    def close(self) -> None:
        pass


def test_a_server_that_reports_a_new_epoch_on_every_reply_costs_one_bounded_exchange():
    """Each new epoch is a restart, read again from the start: a server reporting one on
    every reply made the exchange call itself until RecursionError, every interval. It
    now makes at most MAX_READS calls, and the pod reads the server once it settles."""
    client = Flapping()
    inline = InlineProxy()
    sharing = SharedCalibration(client, SCOPE, "pod-b", inline)
    sharing.publish(0.2, 0.1, 1.0, 1.0)
    assert sharing.exchange()  # the first epoch seen
    assert sharing.exchange()
    assert client.num_calls <= 1 + MAX_READS
    client.settled = True
    assert sharing.exchange() and sharing.exchange()
    assert inline.num_pairs(0.2) == 1


# --- pods exchanging pairs through a real lookup server ------------------------------


def _score(ratio: float, f1: float) -> ShadowScore:
    return ShadowScore(f1=f1, top1=f1, ratio=ratio, seconds=1.0)


def _pod(url: str, name: str, registry=None) -> tuple[InlineProxy, SharedCalibration]:
    inline = InlineProxy(registry)
    client = LookupClient(url, ClientConfig(timeout_ms=2000, retries=0, breaker_failures=100))
    return inline, SharedCalibration(client, SCOPE, name, inline)


def _calibrate(inline: InlineProxy, ratio: float = 0.15) -> None:
    # Statistic up, F1 down: what the proxy expects.
    for i in range(MIN_PAIRS):
        inline.add_pair(0.1 * (i + 1), _score(ratio, 1.0 - 0.05 * i))


def test_a_pod_that_starts_is_calibrated_by_the_pairs_its_deployment_scored(lookup_server):
    registry = CollectorRegistry()
    first, first_sharing = _pod(lookup_server.url, "pod-a", registry)
    _calibrate(first)
    assert first_sharing.exchange()
    late, late_sharing = _pod(lookup_server.url, "pod-b")
    assert late.observe(0.15, 0.3) is None  # on its own: no pair, no estimate
    assert late_sharing.exchange()
    assert late.num_pairs(0.15) == MIN_PAIRS
    assert late.observe(0.15, 0.3) == first.observe(0.15, 0.3) is not None
    # The first pod never reads its own back; what it sent is counted.
    assert first_sharing.exchange() and first.num_pairs(0.15) == MIN_PAIRS
    sent = registry.get_sample_value(
        "holeblend_inline_proxy_shared_pairs_total", {"direction": "published"}
    )
    assert sent == MIN_PAIRS
    # The late pod's own pair goes to the first, and not back to the late one.
    late.add_pair(0.05, _score(0.15, 1.0))
    assert late_sharing.exchange() and first_sharing.exchange()
    assert first.num_pairs(0.15) == late.num_pairs(0.15) == MIN_PAIRS + 1


def test_pairs_wait_for_a_lookup_server_that_is_down_and_survive_its_restart():
    with LookupProcess() as server:
        registry = CollectorRegistry()
        pod, sharing = _pod(server.url, "pod-a", registry)
        server.kill()
        _calibrate(pod)  # scored while the server is down: nothing lost
        assert not sharing.exchange()
        assert registry.get_sample_value("holeblend_inline_proxy_share_failures_total") == 1
        assert pod.num_pairs(0.15) == MIN_PAIRS  # the pod calibrates on its own meanwhile
        server.start()
        assert sharing.exchange()
        other, other_sharing = _pod(server.url, "pod-b")
        assert other_sharing.exchange() and other.num_pairs(0.15) == MIN_PAIRS
        # The server restarts and loses every pair: the pods publish theirs again, and
        # a pod that starts then still finds them.
        server.kill()
        server.start()
        assert sharing.exchange() and other_sharing.exchange()
        assert other.num_pairs(0.15) == MIN_PAIRS  # not counted twice
        new, new_sharing = _pod(server.url, "pod-c")
        assert new_sharing.exchange() and new.num_pairs(0.15) == MIN_PAIRS


def test_the_thread_publishes_a_scored_pair_soon_and_its_last_ones_on_stop(lookup_server):
    pod, sharing = _pod(lookup_server.url, "pod-a")
    sharing.interval_s = 3600.0  # only a scored pair or the stop wakes it
    sharing.start()
    reader, reader_sharing = _pod(lookup_server.url, "pod-b")
    pod.add_pair(0.2, _score(0.15, 0.9))
    for _ in range(100):
        assert reader_sharing.exchange()
        if reader.num_pairs(0.15):
            break
        time.sleep(0.05)
    assert reader.num_pairs(0.15) == 1
    sharing.stop()
    pod.add_pair(0.3, _score(0.15, 0.8))  # after the stop: kept here, not sent
    assert reader_sharing.exchange() and reader.num_pairs(0.15) == 1


class SendHeldUp(InProcessClient):
    """`InProcessClient` whose first `pairs_add` waits (for `release`, at most 2 s) after
    saying `entered`: an exchange caught sending when the pod is told to stop."""

    def __init__(self, server: LookupServer):
        super().__init__(server)
        self.entered, self.release = threading.Event(), threading.Event()

    def call(self, message: dict) -> dict:
        if message["op"] == "pairs_add" and not self.entered.is_set():
            self.entered.set()
            self.release.wait(2.0)
        return super().call(message)


def test_a_pair_scored_while_the_last_exchange_sends_still_goes_out_on_stop():
    """`stop` promises a last exchange: a pair scored after the exchange in flight took
    the pending ones, with the stop asked before that exchange ends, must go out too."""
    server = LookupServer()
    pod = InlineProxy()
    client = SendHeldUp(server)
    sharing = SharedCalibration(client, SCOPE, "pod-a", pod, interval_s=3600.0).start()
    pod.add_pair(0.2, _score(0.15, 0.9))  # wakes the thread, whose send is held up
    assert client.entered.wait(2.0)
    pod.add_pair(0.3, _score(0.15, 0.8))  # pending behind the send in flight
    stopping = threading.Thread(target=sharing.stop)
    stopping.start()
    for _ in range(2000):  # until the stop was asked (it then waits for the thread)
        if sharing._stopping:
            break
        time.sleep(0.001)
    client.release.set()
    stopping.join(5.0)
    pairs = server.calibration.since(SCOPE, "pod-b", 0)[0]
    assert sorted(pair[1] for pair in pairs) == [0.2, 0.3]


def test_a_pair_off_its_range_is_dropped_before_sending_and_does_not_block_the_rest(
    lookup_server,
):
    pod, sharing = _pod(lookup_server.url, "pod-a")
    sharing.publish(0.15, 0.1, 1.5, 0.5)  # an F1 above 1: the server would refuse the batch
    sharing.publish(0.0, 0.2, 0.9, 0.9)  # ratio 0 is a ratio like any other
    assert sharing.exchange()
    reader, reader_sharing = _pod(lookup_server.url, "pod-b")
    assert reader_sharing.exchange()
    assert reader.num_pairs(0.0) == 1 and reader.num_pairs(0.15) == 0


def test_every_setting_that_changes_the_statistics_scale_is_in_the_scope():
    """The statistic is the check-layer deviation left unrecomputed: the segment context
    and the store policy change the cached KV it is measured against, the shortest cached
    segment which tokens it compares, and the dtype the model computes in its scale even
    where the tiers hold one stored dtype. Pods that differ in any of them must not
    calibrate on each other's pairs (a lookup server outlives a change of blend.json's
    settings, and a new pod reads the pairs from the start)."""
    from holeblend_contract.blend_settings import BlendSettings
    from holeblend_runtime.blend.config import BlendConfig

    def scope(blend=None, kv_dtype="float32", **options):
        return calibration_scope("m@main", kv_dtype, 1, blend or BlendConfig(), **options)

    scopes = {
        scope(),
        scope(BlendConfig(cache_after_system=False)),
        scope(BlendConfig(store_policy="isolated")),
        scope(BlendConfig(min_segment_tokens=64)),
        scope(BlendConfig(kv_store_dtype="bfloat16"), "bfloat16", model_dtype="float32"),
        scope(BlendConfig(kv_store_dtype="bfloat16"), "bfloat16", model_dtype="float16"),
        scope(kv_dtype="bfloat16", model_dtype="bfloat16"),  # a bfloat16 model, auto
    }
    assert len(scopes) == 7
    # Without the model's dtype, the tiers' is the model's when kv.storeDtype is auto.
    assert scope(model_dtype="float32") == scope()
    assert scope().startswith(f"stat{STATISTIC_VERSION}|m@main|")
    # blend.json's settings (holeblend-serve) and the runtime's (the vLLM connector) name
    # the same configuration with the same scope.
    settings = BlendSettings.model_validate(
        {"model": {"name": "m"}, "segmentContext": "alone", "storePolicy": "isolated",
         "minSegmentTokens": 32}
    )  # fmt: skip
    runtime = BlendConfig(cache_after_system=False, store_policy="isolated", min_segment_tokens=32)
    assert scope(settings) == scope(runtime) != scope()
    # A model id too long for the server's scope names is hashed, still one per model.
    long_ids = ("x" * 300, "y" * 300)
    long_scopes = {calibration_scope(m, "float32", 1, BlendConfig()) for m in long_ids}
    assert len(long_scopes) == 2
    assert all(len(s) <= wire.Limits().max_name_chars for s in long_scopes)


def test_pods_share_only_within_one_scope(lookup_server):
    from holeblend_runtime.blend.config import BlendConfig

    blend = BlendConfig()
    scopes = {
        calibration_scope("m@main", "float32", 1, blend),
        calibration_scope("m@main", "bfloat16", 1, blend),
        calibration_scope("m@main", "float32", 2, blend),
        calibration_scope("other@main", "float32", 1, blend),
        calibration_scope("m@main", "float32", 1, BlendConfig(check_layer=3)),
        calibration_scope("m@main", "float32", 1, BlendConfig(selection="kDeviation")),
        calibration_scope("m@main", "float32", 1, BlendConfig(filter_layers=(4,))),
    }
    assert len(scopes) == 7
    writer = InlineProxy()
    client = LookupClient(lookup_server.url)
    sharing = SharedCalibration(client, "scope-1", "pod-a", writer)
    _calibrate(writer)
    assert sharing.exchange()
    reader = InlineProxy()
    other = SharedCalibration(LookupClient(lookup_server.url), "scope-2", "pod-b", reader)
    assert other.exchange() and reader.num_pairs(0.15) == 0
