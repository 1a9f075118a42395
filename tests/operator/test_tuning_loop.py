"""The tuner's driver, its pure parts: where tuning continues from, what a decision writes
into status, and which replica is the active one."""

import asyncio
import contextlib
import copy
import dataclasses
import datetime
import time
import types
from pathlib import Path

import aiohttp.web
import pytest
import yaml

from holeblend_operator import handlers, metrics
from holeblend_operator.api import BlendDeployment, TuningSpec
from holeblend_operator.host_paths import DEFAULT_HOST_PATH_PREFIXES
from holeblend_operator.render import engine_name
from holeblend_operator.settings import OperatorSettings
from holeblend_operator.tuner import Decision, Reading, State, decide, select_signal
from holeblend_operator.tuning_loop import (
    HISTORY_LENGTH,
    TuningLoop,
    is_active,
    ratio_in_force,
    recent_seconds,
    state_from,
    status_patch,
    window_seconds,
)
from holeblend_operator.tuning_sources import ScrapeSource, Target
from tests.operator.test_tuning_sources import Clock, metrics_page, servers, vector, vllm_page

SPEC = {
    "model": {"name": "m", "source": {"hub": {"id": "org/m"}}},
    "accelerator": {"type": "cpu", "count": 0},
    "blend": {"recomputeRatio": 0.15},
}
BD = BlendDeployment.model_validate({"metadata": {"name": "r", "generation": 3}, "spec": SPEC})
SEEN = Reading(0.8, 0.9, 40, 75.0, 0.4, 2.0, (0.15,))
NOW = "2026-11-23T10:00:00Z"
ROOT = Path(__file__).resolve().parents[2]


def test_the_recent_part_is_the_last_three_intervals_of_a_longer_window():
    spec = TuningSpec(intervalSeconds=45, cooldownSeconds=45)
    assert (window_seconds(spec), recent_seconds(spec)) == (450.0, 135.0)
    # A window of a long cooldown: still the last three intervals.
    assert recent_seconds(TuningSpec(intervalSeconds=60, cooldownSeconds=3600)) == 180.0


def hold(code="InBand", ratio=0.15):
    return Decision("hold", ratio, ratio, code, "f1 0.9", True, State())


def test_tuning_continues_from_the_tuned_ratio_while_it_derives_from_the_spec_ratio():
    status = {"recomputeRatio": 0.3, "tuning": {"baseRatio": 0.15}}
    assert ratio_in_force(0.15, status) == 0.3
    assert ratio_in_force(0.2, status) == 0.2  # a person edited the spec: start over
    assert ratio_in_force(0.15, {}) == 0.15


def test_a_ratio_patched_by_hand_reaches_the_law_unclamped_so_it_can_say_so():
    assert ratio_in_force(0.15, {"recomputeRatio": 0.95, "tuning": {"baseRatio": 0.15}}) == 0.95


def test_the_cooldown_survives_a_failover_through_status():
    status = {"tuning": {"baseRatio": 0.15, "aboveTargetSince": "2026-11-23T10:00:00Z"}}
    since = state_from(status, 0.15).above_since
    assert since == datetime.datetime(2026, 11, 23, 10, tzinfo=datetime.UTC).timestamp()
    assert state_from(status, 0.2) == State()


def test_tuning_switched_off_and_on_again_starts_without_the_old_state():
    """While tuning was off the pods ran the spec's ratio and the reconcile kept the law's
    state in status; switched on again (Tuned still Disabled), a cooldown begun an hour
    earlier must not let the first reading above the band step down at once."""
    status = {
        "recomputeRatio": 0.15,
        "tuning": {
            "baseRatio": 0.15,
            "aboveTargetSince": "2026-11-23T09:00:00Z",
            "belowTargetRatio": 0.13,
            "belowTargetAt": "2026-11-23T09:00:00Z",
        },
        "conditions": [{"type": "Tuned", "status": "False", "reason": "Disabled"}],
    }
    state = state_from(status, 0.15)
    assert state == State()
    spec = BD.spec.tuning
    high = Reading(0.99, 0.99, 10 * spec.min_samples, None, None, 1.0, (0.15,))
    now = datetime.datetime(2026, 11, 23, 10, tzinfo=datetime.UTC).timestamp()
    assert decide(spec, 0.15, high, state, now).code == "AboveTargetCooling"
    # Once the tuner wrote its own condition, status carries its state as before.
    status["conditions"] = [{"type": "Tuned", "status": "True", "reason": "InBand"}]
    assert state_from(status, 0.15).floor == 0.13


def test_what_the_law_learned_survives_a_failover_through_status():
    learned = State(
        above_since=None,
        floor=0.13,
        floor_at=1795428000.0,
        good=0.21,
        good_at=1795428010.0,
        good_above=0.4,
        good_above_at=1795427990.0,
    )
    hold = Decision("hold", 0.21, 0.21, "AtLearnedFloor", "F1 proxy 1.000", True, learned)
    patch = status_patch(BD, {}, hold, SEEN, NOW)
    assert patch["tuning"]["belowTargetRatio"] == 0.13
    assert patch["tuning"]["meetsTargetAboveRatio"] == 0.4
    assert state_from(patch, BD.spec.blend.recompute_ratio) == learned
    assert BlendDeployment.model_validate(
        {"metadata": {"name": "r"}, "spec": SPEC, "status": patch}
    )
    # Patched by hand into something that is not a ratio, or half of a pair: forgotten.
    patch["tuning"]["belowTargetRatio"] = "0.13"
    del patch["tuning"]["meetsTargetAt"]
    state = state_from(patch, BD.spec.blend.recompute_ratio)
    assert (state.floor, state.good) == (None, None)
    # A rung above a known-good ratio means nothing without one: forgotten too.
    assert state.good_above is None


def test_a_figure_not_read_this_interval_leaves_status_metrics():
    """status_patch is a JSON merge patch: a field it omits keeps the stored value, so an
    f1Proxy or ttftSeconds of an earlier interval stood beside the new observedAt."""
    from kmock._internal.dicts import merge_patch_dict  # the emulator's merge patch

    hold = Decision("hold", 0.15, 0.15, "TooFewSamples", "no samples", False, State())
    first = status_patch(BD, {}, hold, SEEN, NOW)
    status = merge_patch_dict({}, first)
    assert status["metrics"]["f1Proxy"] == 0.8 and status["metrics"]["ttftSeconds"] == 0.4
    unread = dataclasses.replace(SEEN, f1_proxy=None, ttft_seconds=None, top1_agreement=None)
    later = "2026-11-23T10:01:00Z"
    status = merge_patch_dict(status, status_patch(BD, status, hold, unread, later))
    assert status["metrics"] == {
        "hitPercent": 75.0, "numSamples": 40, "observedAt": later
    }  # fmt: skip
    # The history's entries are list items, which a merge patch stores as written: no nulls.
    assert None not in status["tuning"]["history"][-1]["inputs"].values()
    assert BlendDeployment.model_validate(
        {"metadata": {"name": "r"}, "spec": SPEC, "status": status}
    )


def test_a_change_writes_ratio_base_history_metrics_and_a_tuned_condition():
    up = Decision("up", 0.15, 0.225, "BelowTarget", "F1 proxy 0.800", False, State())
    patch = status_patch(BD, {}, up, SEEN, NOW)
    assert patch["recomputeRatio"] == 0.225 and patch["tuning"]["baseRatio"] == 0.15
    (entry,) = patch["tuning"]["history"]
    assert entry["reason"].startswith("BelowTarget: ") and entry["inputs"]["f1Proxy"] == 0.8
    assert (entry["fromRatio"], entry["toRatio"], entry["direction"]) == (0.15, 0.225, "up")
    (tuned,) = patch["conditions"]
    assert (tuned["type"], tuned["status"], tuned["reason"]) == ("Tuned", "False", "BelowTarget")
    assert patch["metrics"]["hitPercent"] == 75.0
    seen = dataclasses.replace(SEEN, hit_percent=75.59640467662364)
    assert status_patch(BD, {}, up, seen, NOW)["metrics"]["hitPercent"] == 75.6
    assert BlendDeployment.model_validate(
        {"metadata": {"name": "r"}, "spec": SPEC, "status": patch}
    )


def test_a_run_of_holds_with_one_reason_is_one_history_entry():
    status = {}
    for minute in range(5):
        patch = status_patch(BD, status, hold(), SEEN, f"2026-11-23T10:0{minute}:00Z")
        status = patch
    (entry,) = status["tuning"]["history"]
    assert entry["time"] == "2026-11-23T10:04:00Z"
    status = status_patch(BD, status, hold("TooFewSamples"), SEEN, NOW)
    assert len(status["tuning"]["history"]) == 2


def test_the_history_is_bounded():
    status = {}
    for i in range(HISTORY_LENGTH + 5):
        ratio = round(0.1 + i * 0.01, 4)
        change = Decision("up", ratio, ratio + 0.01, "BelowTarget", "low", False, State())
        status = status_patch(BD, status, change, SEEN, NOW)
    history = status["tuning"]["history"]
    assert len(history) == HISTORY_LENGTH and history[-1]["fromRatio"] == 0.34


def test_other_conditions_are_kept_and_tuned_keeps_its_transition_time():
    ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady"}
    tuned = {"type": "Tuned", "status": "True", "reason": "InBand", "lastTransitionTime": "T0"}
    patch = status_patch(BD, {"conditions": [ready, tuned]}, hold("AboveTargetCooling"), SEEN, NOW)
    ready_out, tuned_out = patch["conditions"]
    assert ready_out == ready
    assert (tuned_out["reason"], tuned_out["lastTransitionTime"]) == ("AboveTargetCooling", "T0")


def test_nan_metrics_are_left_out_of_status():
    nan = Reading(float("nan"), None, 0, float("inf"), None, None)
    patch = status_patch(BD, {}, hold("NoSamples"), nan, NOW)
    # Left out: null in the merge patch, which removes what an earlier interval wrote.
    written = {key: value for key, value in patch["metrics"].items() if value is not None}
    assert written == {"numSamples": 0, "observedAt": NOW}
    assert patch["metrics"]["f1Proxy"] is None and patch["metrics"]["hitPercent"] is None
    assert patch["tuning"]["history"][-1]["inputs"] == written


NOW_DT = datetime.datetime(2026, 11, 23, 10, tzinfo=datetime.UTC)


def peer(priority, seconds_ago=1, lifetime=60):
    seen = NOW_DT - datetime.timedelta(seconds=seconds_ago)
    return {"priority": priority, "lastseen": seen.isoformat(), "lifetime": lifetime}


def test_only_the_live_peer_of_highest_priority_is_active():
    peers = {"me": peer(10), "other": peer(5)}
    assert is_active(peers, "me", 10, NOW_DT)
    assert not is_active(peers | {"boss": peer(20)}, "me", 10, NOW_DT)
    assert not is_active(peers | {"twin": peer(10)}, "me", 10, NOW_DT)  # kopf pauses both
    assert is_active(peers | {"dead": peer(20, seconds_ago=120)}, "me", 10, NOW_DT)
    assert is_active(peers | {"junk": "not a record"}, "me", 10, NOW_DT)


def test_status_says_which_proxy_the_decision_read():
    shadow = status_patch(BD, {}, hold(), SEEN, NOW)
    assert shadow["metrics"]["proxySignal"] == "shadow"
    seen = dataclasses.replace(SEEN, num_samples=3, inline_f1_proxy=0.7, inline_num_samples=90)
    chosen = select_signal(TuningSpec(minSamples=20), seen)
    patch = status_patch(BD, {}, hold(), chosen, NOW)
    assert patch["metrics"]["proxySignal"] == "inline"
    assert (patch["metrics"]["f1Proxy"], patch["metrics"]["numSamples"]) == (0.7, 90)
    assert patch["tuning"]["history"][-1]["inputs"]["proxySignal"] == "inline"
    BlendDeployment.model_validate(  # what status takes, the CRD's schema too
        {"metadata": {"name": "r"}, "spec": SPEC, "status": patch}
    )


def test_the_inline_gauge_says_which_proxy_the_last_decision_read():
    from holeblend_operator import metrics
    from holeblend_operator.tuning_loop import TuningLoop

    loop, key = TuningLoop(operator=None), ("ns", "inline-gauge")
    seen = dataclasses.replace(SEEN, num_samples=3, inline_f1_proxy=0.7, inline_num_samples=90)
    try:
        loop._record(key, TuningSpec(), hold(), select_signal(TuningSpec(), seen))
        assert _gauge("holeblend_operator_tuning_inline_proxy", key) == 1.0
        loop._record(key, TuningSpec(), hold(), SEEN)
        assert _gauge("holeblend_operator_tuning_inline_proxy", key) == 0.0
    finally:
        metrics.TUNING.forget(key)


def _gauge(name: str, key: tuple) -> float:
    from holeblend_operator import metrics

    for family in metrics.TUNING.collect():
        for sample in family.samples:
            if sample.name == name and (sample.labels["namespace"], sample.labels["name"]) == key:
                return sample.value
    raise AssertionError(f"no {name} for {key}")


def test_a_model_on_a_host_path_the_operator_admits_is_tuned_like_any_other():
    """The tuner reads the owner with the operator's hostPathPrefixes, as the reconcile
    does: a deployment admitted only by a custom prefix was reconciled but never tuned."""
    from holeblend_operator.host_paths import DEFAULT_HOST_PATH_PREFIXES
    from holeblend_operator.tuning_loop import _parse

    body = yaml.safe_load((ROOT / "examples" / "nvidia.yaml").read_text())
    body["spec"]["model"]["source"] = {"hostPath": {"path": "/srv/models/llama"}}
    body["spec"]["blend"]["kv"].pop("sharedUrl")
    body["spec"]["blend"]["kv"].pop("sharedPasswordSecret")
    assert _parse(body) is None  # outside the default prefixes: the reconcile refuses it too
    admitted = _parse(body, (*DEFAULT_HOST_PATH_PREFIXES, "/srv/models"))
    assert admitted is not None and admitted.spec.tuning.enabled


def test_a_history_reason_quoting_a_whole_page_still_fits_the_crd():
    """A source's error quotes what it answered (an HTML page, a long URL): the history
    entry is cut to what status.tuning.history[].reason holds, or the API server would
    refuse every status write of the tuner."""
    from holeblend_operator.api import REASON_MAX_LENGTH
    from holeblend_operator.tuner import decide
    from holeblend_operator.tuning_sources import failed

    seen = failed("no engine pod answered on /metrics (not Prometheus text format: " + "x" * 3000)
    decision = decide(BD.spec.tuning, 0.15, seen, State(), 1e9)
    patch = status_patch(BD, {}, decision, seen, NOW)
    reason = patch["tuning"]["history"][-1]["reason"]
    assert len(reason) == REASON_MAX_LENGTH and reason.startswith(
        "MetricsUnavailable: no metrics: no engine"
    )
    BlendDeployment.model_validate({"metadata": {"name": "r"}, "spec": SPEC, "status": patch})


class _StatusClient:
    """A BlendDeployment whose status merge patches apply as the API server applies them."""

    def __init__(self, status: dict):
        self.body = {
            "apiVersion": "blend.holeblend.io/v1alpha1",
            "kind": "BlendDeployment",
            "metadata": {"name": "r", "namespace": "ns", "generation": 2, "uid": "u"},
            "spec": SPEC,
            "status": status,
        }

    async def get(self, kind, namespace, name):
        return copy.deepcopy(self.body)

    async def patch_status(self, namespace, name, patch):
        _merge(self.body["status"], patch)
        return copy.deepcopy(self.body)


def _merge(target: dict, patch: dict) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class _Operator:
    def __init__(self, client):
        self.client, self.kept, self.requested = client, None, []
        self.owners = {}
        self.settings = types.SimpleNamespace(
            peering=None, host_path_prefixes=DEFAULT_HOST_PATH_PREFIXES
        )

    @contextlib.asynccontextmanager
    async def lock(self, key):
        yield

    def keep_owner(self, key, body):
        self.kept = body

    def request_tuned(self, key):
        self.requested.append(key)


class _Loop(TuningLoop):
    """The metrics read takes a while; `meanwhile` runs during it (another writer)."""

    def __init__(self, operator, meanwhile, seen=SEEN):
        super().__init__(operator)
        self.meanwhile, self.seen = meanwhile, seen

    async def read(self, bd, ratio):
        await self.meanwhile(self.operator.client)
        return self.seen


def _condition(status: dict, kind: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_a_status_refresh_during_the_metrics_read_is_not_put_back():
    """The reconcile's refresh writes Ready=True while the tuner reads the metrics (it
    takes the owner's lock only to write): the tuner's patch keeps it."""
    not_ready = {"type": "Ready", "status": "False", "reason": "EngineNotReady"}
    client = _StatusClient({"phase": "Progressing", "conditions": [not_ready]})

    async def refresh(client):
        ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady"}
        await client.patch_status("ns", "r", {"phase": "Ready", "conditions": [ready]})

    decision = asyncio.run(_Loop(_Operator(client), refresh).tune(("ns", "r")))
    status = client.body["status"]
    assert decision is not None and _condition(status, "Tuned")["reason"] == decision.code
    assert _condition(status, "Ready")["status"] == "True" and status["phase"] == "Ready"


def test_a_ratio_that_moves_during_the_metrics_read_is_decided_again_next_interval():
    client = _StatusClient({})
    low = dataclasses.replace(SEEN, f1_proxy=0.2)  # below target: the law would raise 0.15

    async def hand_patch(client):
        await client.patch_status("ns", "r", {"recomputeRatio": 0.3, "tuning": {"baseRatio": 0.15}})

    operator = _Operator(client)
    assert asyncio.run(_Loop(operator, hand_patch, low).tune(("ns", "r"))) is None
    assert client.body["status"]["recomputeRatio"] == 0.3 and operator.requested == []


def test_tuning_bounds_changed_during_the_metrics_read_void_the_decision():
    """maxRatio lowered to 0.2 while the metrics were read: the raise of 0.15 decided on the
    old bounds (x1.5 to 0.225) must not reach status, where it would stand above the new
    maxRatio while the pods run the clamped 0.2 (and the next interval would clamp it and
    forget what the law had learned)."""
    client = _StatusClient({})
    low = dataclasses.replace(SEEN, f1_proxy=0.2)  # below target: the law would raise 0.15

    async def narrow(client):
        client.body["spec"] = SPEC | {"tuning": {"maxRatio": 0.2}}
        client.body["metadata"]["generation"] += 1

    operator = _Operator(client)
    try:
        assert asyncio.run(_Loop(operator, narrow, low).tune(KEY)) is None
        assert "recomputeRatio" not in client.body["status"] and operator.requested == []
        # The next interval decides on the new bounds.
        decision = asyncio.run(_Loop(operator, _nothing, low).tune(KEY))
    finally:
        metrics.TUNING.forget(KEY)
    assert (decision.direction, decision.to_ratio) == ("up", 0.2)
    assert client.body["status"]["recomputeRatio"] == 0.2


def test_a_namesake_created_during_the_metrics_read_gets_nothing_of_the_deleted_one():
    """Deleted and created again (`kubectl delete` + `apply`) while the metrics were read:
    the reading and the law's state were the old object's, and the new one, at the same
    spec ratio, must not start with its decision (a raise, its cooldown, its history)."""
    client = _StatusClient({})
    low = dataclasses.replace(SEEN, f1_proxy=0.2)  # below target: the law would raise 0.15

    async def recreate(client):
        client.body["metadata"]["uid"] = "u-new"
        client.body["status"] = {}

    operator = _Operator(client)
    assert asyncio.run(_Loop(operator, recreate, low).tune(KEY)) is None
    assert client.body["status"] == {} and operator.requested == []


class _Watched(handlers.Operator):
    """The operator with the owners as its watch left them; its jobs are not run."""

    def __init__(self, client):
        super().__init__(OperatorSettings())
        self.client = client

    def request(self, key, options, trigger, delay=None, refetch=False):
        pass


class _DeletedClient(_StatusClient):
    """A BlendDeployment the API server deletes after its first read; `meanwhile` runs
    while the read that finds it gone is under way."""

    def __init__(self, meanwhile=None):
        super().__init__({})
        self.reads, self.meanwhile = 0, meanwhile

    async def get(self, kind, namespace, name):
        self.reads += 1
        if self.reads <= 2:  # the first evaluation: its read and its read under the lock
            return await super().get(kind, namespace, name)
        if self.meanwhile is not None:
            self.meanwhile()
        return None  # 404: kube.Client.get's None


async def _nothing(client):
    pass


def test_an_owner_deleted_while_the_watch_was_down_is_forgotten_by_the_tuner():
    """After a watch gap (410 Gone) kopf lists the BlendDeployments again and sends no
    DELETED event for one deleted meanwhile. The tuner, which reads it every interval,
    finds it gone: it is forgotten, and its gauges are no longer exported (a pinned-at-
    a-bound alert would otherwise fire for it for the life of the process)."""
    client = _DeletedClient()
    operator = _Watched(client)
    operator.owner_event(copy.deepcopy(client.body), None)  # as kopf's listing yields it
    loop = _Loop(operator, _nothing)

    async def evaluate_twice():
        decision = await loop.tune(KEY)
        assert _gauge("holeblend_operator_tuned_ratio", KEY) == decision.to_ratio
        assert await loop.tune(KEY) is None

    try:
        asyncio.run(evaluate_twice())
        assert KEY not in operator.owners
        with pytest.raises(AssertionError, match="no holeblend_operator_tuned_ratio"):
            _gauge("holeblend_operator_tuned_ratio", KEY)
    finally:
        metrics.TUNING.forget(KEY)


def test_an_owner_deleted_while_its_metrics_are_read_leaves_no_scrape_history():
    """The DELETED event forgets the owner (its scrape history too) while the tuner's
    direct scrape is under way; that scrape then keeps its snapshots. Without a second
    forget they stayed for the life of the process."""
    client = _StatusClient({})
    operator = _Watched(client)
    operator.owner_event(copy.deepcopy(client.body), None)
    service = (KEY[0], engine_name(KEY[1]))

    class Deleting(_Loop):
        async def read(self, bd, ratio):
            operator.owner_event(copy.deepcopy(client.body), "DELETED")
            self._scrape = ScrapeSource(None)
            self._scrape._history[(*service, "pod-0")] = []  # what the scrape kept
            return SEEN

    loop = Deleting(operator, _nothing)
    try:
        assert asyncio.run(loop.tune(KEY)) is None
        assert not [k for k in loop._scrape._history if k[:2] == service]
    finally:
        metrics.TUNING.forget(KEY)


def test_a_namesake_watched_during_the_read_that_found_the_owner_gone_is_kept():
    created = {}

    def create_anew():  # its ADDED event arrives while the 404 is on its way
        body = copy.deepcopy(client.body)
        body["metadata"]["uid"] = "u-new"
        operator.owner_event(body, "ADDED")
        created["kept"] = operator.owners[KEY]

    client = _DeletedClient(create_anew)
    operator = _Watched(client)
    operator.owner_event(copy.deepcopy(client.body), None)
    loop = _Loop(operator, _nothing)

    async def evaluate_twice():
        await loop.tune(KEY)
        await loop.tune(KEY)

    try:
        asyncio.run(evaluate_twice())
        assert operator.owners[KEY] is created["kept"]
    finally:
        metrics.TUNING.forget(KEY)


class _SpecChangedClient(_StatusClient):
    """A person changes the spec right after the tuner's status write, and the watch
    delivers that change while the write's answer (the object before it) is on its way."""

    def __init__(self):
        super().__init__({})
        self.watch = None  # the operator's owner_event

    async def patch_status(self, namespace, name, patch):
        answer = await super().patch_status(namespace, name, patch)
        self.body["metadata"]["generation"] += 1
        self.body["spec"] = SPEC | {"replicas": 2}
        self.watch(copy.deepcopy(self.body), "MODIFIED")
        return answer


def test_the_tuners_status_write_does_not_hide_a_spec_change_seen_meanwhile():
    """The answer to the tuner's status patch predates a spec change the watch already
    delivered: kept as the owner's latest copy, the reconcile that change asked for would
    apply the spec from before it, and the next status write's watch event (same inputs
    as the change) would ask for none again."""
    client = _SpecChangedClient()
    requested = []

    class Operator(_Watched):
        def request(self, key, options, trigger, delay=None, refetch=False):
            requested.append(trigger)

    operator = Operator(client)
    client.watch = operator.owner_event
    operator.owner_event(copy.deepcopy(client.body), None)
    try:
        asyncio.run(_Loop(operator, _nothing).tune(KEY))
    finally:
        metrics.TUNING.forget(KEY)
    assert "update" in requested
    assert operator.owner(KEY)["metadata"]["generation"] == 3
    assert operator.owner(KEY)["spec"]["replicas"] == 2


def test_a_shorter_interval_applies_from_the_last_evaluation(monkeypatch):
    """intervalSeconds 3600 lowered to 60: the next evaluation is due 60 s after the last
    one, not at the hour the old interval had scheduled."""
    import holeblend_operator.tuning_loop as tuning_loop

    clock = [0.0]
    monkeypatch.setattr(tuning_loop.time, "monotonic", lambda: clock[0])
    key = ("ns", "r")
    owners = {key: types.SimpleNamespace(interval=3600.0)}
    evaluated = []

    class Loop(TuningLoop):
        async def tune(self, key):
            evaluated.append(clock[0])

    loop = Loop(types.SimpleNamespace(owners=owners))
    for now, interval in ((0, 3600), (3599, 3600), (3600, 3600), (3610, 60), (3660, 60)):
        clock[0] = float(now)
        owners[key] = types.SimpleNamespace(interval=float(interval))
        asyncio.run(loop.tick())
    assert evaluated == [3600.0, 3660.0]


async def test_a_deployment_tuned_again_after_a_pause_does_not_count_the_pause():
    """Tuning switched off for an hour and on again: the scrape history kept from before
    would be the new window's baseline, and the first reading would count the hour's
    samples as if they were the window's."""
    async with servers(1) as ((pod,), session):
        clock = Clock()
        owners = {KEY: types.SimpleNamespace(interval=60.0)}
        loop = TuningLoop(types.SimpleNamespace(owners=owners))
        loop._scrape = ScrapeSource(session, clock=clock)
        pods = Target(KEY[0], engine_name(KEY[1]), {"r-engine-0": f"{pod.url}/metrics"})
        pod.answer = (200, metrics_page(18, 20), "text/plain")
        await loop.tick()  # seen tuned: its first interval starts
        await loop._scrape.read(pods, 0.15, window_s=600)
        owners[KEY] = types.SimpleNamespace(interval=None)  # switched off
        await loop.tick()
        clock.now += 3600
        owners[KEY] = types.SimpleNamespace(interval=60.0)  # and on again an hour later
        pod.answer = (200, metrics_page(990, 1100), "text/plain")
        seen = await loop._scrape.read(pods, 0.15, window_s=600)
    assert seen.num_samples == 0  # its first sight since the pause is the baseline


async def test_a_raise_back_to_a_ratio_run_earlier_counts_only_samples_since_the_raise():
    """40 samples at 0.3 came in before a step down; the tuner raised back to 0.3 50 s ago,
    and 5 samples came in since. Those 40 were taken before the change: counted, a ratio
    that no longer meets the target reads as it did (and is remembered as meeting it
    again) until the window (600 s) fills with new samples."""
    async with servers(1) as ((pod,), session):
        client = _PodsClient(SPEC | {"engine": {"port": pod.port}})
        raised = {
            "time": datetime.datetime.fromtimestamp(time.time() - 50, datetime.UTC).isoformat(),
            "direction": "up",
            "fromRatio": 0.28,
            "toRatio": 0.3,
            "reason": "BelowTarget: raised back to 0.3",
        }
        client.body["status"] = {
            "recomputeRatio": 0.3,
            "tuning": {"baseRatio": 0.15, "history": [raised]},
        }
        bd = BlendDeployment.model_validate(client.body)
        clock = Clock()
        loop = TuningLoop(_Operator(client))
        loop._scrape = ScrapeSource(session, clock=clock)
        for f1_sum, count in ((10, 10), (50, 50), (50.5, 55)):  # 60 s apart; the raise at 50
            pod.answer = (200, metrics_page(f1_sum, count, ratio=0.3), "text/plain")
            seen = await loop.read(bd, 0.3)
            clock.now += 60
    assert (seen.num_samples, seen.f1_proxy) == (5, pytest.approx(0.1))


# The engine pods' /metrics, as the tuner reads them in status.metrics (HTTP servers on
# 127.0.0.1 standing in for the pods and for Prometheus).
VLLM_SPEC = SPEC | {"accelerator": {"type": "nvidia", "count": 1}}
KEY = ("ns", "r")


class _PodsClient(_StatusClient):
    """One ready engine pod at 127.0.0.1, the ports the spec gives it."""

    def __init__(self, spec: dict):
        super().__init__({})
        self.body["spec"] = spec

    async def list(self, kind, namespace, selector):
        ready = [{"type": "Ready", "status": "True"}]
        return [
            {
                "metadata": {"name": "r-engine-0"},
                "status": {"podIP": "127.0.0.1", "conditions": ready},
            }
        ]


async def _tune(client, times: int, pages) -> tuple[dict, TuningLoop]:
    """Tunes `times` times, `pages(n)` setting the servers' answers before the n-th; the
    status metrics written last."""
    loop = TuningLoop(_Operator(client))
    try:
        for n in range(1, times + 1):
            pages(n)
            await loop.tune(KEY)
    finally:
        metrics.TUNING.forget(KEY)
        if loop._session is not None:
            await loop._session.close()
    return client.body["status"]["metrics"], loop


def _connector_page(n: int) -> tuple:
    page = metrics_page(18 * n, 20 * n, prompt=1000 * n, reused=800 * n, ttft=None)
    return (200, page, "text/plain")


def _vllm_pod(connector, engine, failing_at: int | None = None):
    """A vLLM pod's client and pages(n): the connector's metrics on one server, vLLM's TTFT
    on the engine's (answering 503 at the `failing_at`-th read)."""
    ports = {"port": engine.port, "metricsPort": connector.port}

    def pages(n):
        connector.answer = _connector_page(n)
        engine.answer = (200, vllm_page(3 * n, 10 * n), "text/plain")
        if n == failing_at:
            engine.answer = (503, "overloaded", "text/plain")

    return _PodsClient(VLLM_SPEC | {"engine": ports}), pages


async def test_a_vllm_pods_status_ttft_is_the_mean_of_vllms_own_histogram():
    """vLLM pods: the connector's metrics port has no TTFT; vLLM's API server exports
    vllm:time_to_first_token_seconds on the engine's port, and status shows its mean."""
    async with servers(2) as ((connector, engine), _):
        client, pages = _vllm_pod(connector, engine)
        seen, _ = await _tune(client, 2, pages)
    assert seen["ttftSeconds"] == pytest.approx(0.3)
    assert (seen["f1Proxy"], seen["numSamples"], seen["hitPercent"]) == (0.9, 20, 80.0)


async def test_a_vllm_deployment_read_through_prometheus_shows_vllms_ttft():
    async with servers(1) as ((prometheus,), _):
        asked = []

        async def handle(request):
            query = request.query["query"]
            asked.append(query)
            values = {
                "vllm:time_to_first_token_seconds_sum": 12.0,
                "vllm:time_to_first_token_seconds_count": 30.0,
                "holeblend_f1_proxy_sum{": 36.0,
                "holeblend_f1_proxy_count{": 40.0,
                "timestamp": 4.0,
            }
            found = [v for series, v in values.items() if series in query]
            if found or query.startswith("holeblend_recompute_ratio"):
                value = found[0] if found else 0.15
                return aiohttp.web.Response(
                    text=vector(({"ratio": "0.15"}, value)), content_type="application/json"
                )
            return aiohttp.web.Response(text=vector(), content_type="application/json")

        prometheus.respond = handle
        tuning = {"prometheusUrl": prometheus.url}
        client = _PodsClient(VLLM_SPEC | {"tuning": tuning})
        seen, _ = await _tune(client, 1, lambda n: None)
    assert (seen["ttftSeconds"], seen["f1Proxy"], seen["numSamples"]) == (0.4, 0.9, 40)
    (ttft_sum,) = [q for q in asked if "first_token_seconds_sum" in q]
    assert 'namespace="ns",service="r-engine"' in ttft_sum


async def test_a_failed_ttft_read_on_a_vllm_pod_keeps_the_other_figures():
    async with servers(2) as ((connector, engine), _):
        client, pages = _vllm_pod(connector, engine, failing_at=3)
        seen, _ = await _tune(client, 2, pages)
        assert seen["ttftSeconds"] == pytest.approx(0.3)
        seen, _ = await _tune(client, 3, pages)
    # The reading had no TTFT (status.metrics is merge-patched: it keeps the last one).
    (inputs,) = [e["inputs"] for e in client.body["status"]["tuning"]["history"][-1:]]
    assert "ttftSeconds" not in inputs and inputs["numSamples"] == 40
    assert (seen["f1Proxy"], seen["numSamples"], seen["hitPercent"]) == (0.9, 40, 80.0)
    tuned = _condition(client.body["status"], "Tuned")
    assert tuned["reason"] != "MetricsUnavailable", tuned


async def test_holeblend_serve_pods_keep_holeblend_ttft_on_one_port():
    async with servers(1) as ((pod,), _):
        client = _PodsClient(SPEC | {"engine": {"port": pod.port}})
        asked = []

        async def respond(request):
            n = len(asked) + 1
            asked.append(request.url.port)
            page = metrics_page(18 * n, 20 * n, ttft=(5 * n, 10 * n)) + vllm_page(100 * n, n)
            return aiohttp.web.Response(text=page, content_type="text/plain")

        pod.respond = respond
        seen, loop = await _tune(client, 2, lambda n: None)
        target = await loop.target(BlendDeployment.model_validate(client.body))
    assert seen["ttftSeconds"] == pytest.approx(0.5)  # not vLLM's 100 s
    assert asked == [pod.port, pod.port]  # one scrape per pod and read, no second port
    assert (target.ttft, target.ttft_urls) == ("holeblend_ttft_seconds", {})


def _learned_status(**learned) -> dict:
    """Status at the tuned ratio 0.13 (spec ratio 0.15) with what the law learned `ago`
    seconds back (within its memory of 20 cooldowns of 60 s)."""
    ago = learned.pop("ago", 0)
    at = datetime.datetime.fromtimestamp(time.time() - ago, datetime.UTC)
    stamp = at.strftime("%Y-%m-%dT%H:%M:%SZ")
    tuning = {"baseRatio": 0.15} | {
        key: stamp if value is None else value for key, value in learned.items()
    }
    return {"recomputeRatio": 0.13, "tuning": tuning}


def _retargeted(client, target: float) -> None:
    client.body["spec"] = SPEC | {"tuning": {"targetF1Proxy": target, "cooldownSeconds": 60}}
    client.body["metadata"]["generation"] += 1


def test_a_lowered_target_does_not_hold_the_ratio_at_a_floor_measured_against_the_old_one():
    """0.13 read below 0.87 (target 0.9 - band) and 0.15 above 0.93: held at the floor.
    The target lowered to 0.7, 0.15 reads far above 0.73 for longer than a cooldown: the
    step down to 0.13, never measured against 0.7, is taken rather than held for 20
    cooldowns on a floor that belonged to the old target."""
    client = _StatusClient(
        _learned_status(belowTargetRatio=0.13, belowTargetAt=None, aboveTargetSince=None, ago=120)
        | {"recomputeRatio": 0.15}
    )
    _retargeted(client, 0.9)
    above = dataclasses.replace(SEEN, f1_proxy=0.99)  # 40 samples at 0.15
    loop = _Loop(_Operator(client), _nothing, above)
    try:
        held = asyncio.run(loop.tune(KEY))
        _retargeted(client, 0.7)
        lowered = asyncio.run(loop.tune(KEY))
    finally:
        metrics.TUNING.forget(KEY)
    assert held.code == "AtLearnedFloor"
    assert (lowered.direction, lowered.to_ratio) == ("down", 0.13)
    assert "forgot ratio 0.13, measured below the old target" in lowered.reason
    assert "belowTargetRatio" not in client.body["status"]["tuning"]


def test_a_raised_target_does_not_wait_on_a_ratio_measured_meeting_the_old_one():
    """0.15 met target 0.7 and the ratio was stepped down to 0.13. The target raised to
    0.9, 0.13 reads 0.85, below 0.87: nothing is known to meet 0.9, so the ratio is
    raised a whole step at once, neither held (`ConfirmingBelowTarget`, a wait justified
    only by a ratio above meeting the target) nor sent back to 0.15 as "measured meeting
    the target"."""
    client = _StatusClient(_learned_status(meetsTargetRatio=0.15, meetsTargetAt=None))
    _retargeted(client, 0.7)
    few = dataclasses.replace(SEEN, f1_proxy=0.85, num_samples=5, ratios_in_force=(0.13,))
    loop = _Loop(_Operator(client), _nothing, few)
    try:
        assert asyncio.run(loop.tune(KEY)).code == "TooFewSamples"
        _retargeted(client, 0.9)
        loop.seen = dataclasses.replace(few, num_samples=40)
        raised = asyncio.run(loop.tune(KEY))
    finally:
        metrics.TUNING.forget(KEY)
    assert (raised.direction, raised.to_ratio, raised.code) == ("up", 0.195, "BelowTarget")
    assert "forgot ratio 0.15, measured meeting the old target" in raised.reason
    assert "meetsTargetRatio" not in client.body["status"]["tuning"]


def test_a_restarted_operator_knows_the_target_its_ratios_were_learned_against():
    """Status records the target and band with the learned ratios, so a new process (a
    restart, a failover to another replica) forgets what a changed target makes unknown;
    a status from before it recorded them keeps its ratios (nothing says they are stale)."""
    client = _StatusClient(_learned_status(meetsTargetRatio=0.15, meetsTargetAt=None))
    _retargeted(client, 0.7)
    few = dataclasses.replace(SEEN, f1_proxy=0.85, num_samples=5, ratios_in_force=(0.13,))
    try:
        asyncio.run(_Loop(_Operator(client), _nothing, few).tune(KEY))
        tuning = client.body["status"]["tuning"]
        assert (tuning["learnedTargetF1Proxy"], tuning["learnedBand"]) == (0.7, 0.03)
        legacy = copy.deepcopy(client.body)
        _retargeted(client, 0.9)
        restarted = _Loop(_Operator(client), _nothing, dataclasses.replace(few, num_samples=40))
        raised = asyncio.run(restarted.tune(KEY))
        for name in ("learnedTargetF1Proxy", "learnedBand"):
            del legacy["status"]["tuning"][name]
        client.body = legacy
        _retargeted(client, 0.9)
        kept = asyncio.run(restarted.tune(KEY))
    finally:
        metrics.TUNING.forget(KEY)
    assert "forgot ratio 0.15, measured meeting the old target" in raised.reason
    assert "forgot" not in kept.reason
    assert client.body["status"]["tuning"]["meetsTargetRatio"] == 0.15


class _PeeringClient(_StatusClient):
    """The owner, and a peering object whose peers are `peers` (kopf's status of it)."""

    def __init__(self, status: dict, peers: dict):
        super().__init__(status)
        self.peers = peers

    async def get(self, kind, namespace, name):
        if kind.group == "kopf.dev":
            if self.peers is None:
                raise OSError("the API server is down")
            return {"status": copy.deepcopy(self.peers)}
        return await super().get(kind, namespace, name)


def test_a_replica_that_became_a_standby_stops_exporting_the_owners_gauges():
    """Both replicas' metrics are scraped and the alerts take the max per owner: the gauges
    a standby kept from when it was active (a pinned-at-a-bound ratio) would stand beside
    the active replica's for good. An unreadable peering object says nothing: kept."""
    client = _PeeringClient({}, None)
    operator = _Operator(client)
    operator.settings.peering, operator.settings.namespaces = "holeblend", ["ns"]
    operator.identity, operator.priority = "me", 5
    loop = _Loop(operator, _nothing)
    try:
        client.peers = {"me": peer(5)}
        decision = asyncio.run(loop.tune(KEY))
        assert _gauge("holeblend_operator_tuned_ratio", KEY) == decision.to_ratio
        client.peers = None
        assert asyncio.run(loop.tune(KEY)) is None
        assert _gauge("holeblend_operator_tuned_ratio", KEY) == decision.to_ratio
        ago = (NOW_DT - datetime.datetime.now(datetime.UTC)).total_seconds()  # seen now
        client.peers = {"me": peer(5, ago), "newer": peer(9, ago)}
        assert asyncio.run(loop.tune(KEY)) is None
        with pytest.raises(AssertionError, match="no holeblend_operator_tuned_ratio"):
            _gauge("holeblend_operator_tuned_ratio", KEY)
    finally:
        metrics.TUNING.forget(KEY)
