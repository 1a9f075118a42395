"""Which BlendDeployment watch events schedule which job, and how pending jobs merge."""

import asyncio
import json
import pathlib

import pytest
import yaml

from holeblend_operator import handlers, reconcile
from holeblend_operator.settings import OperatorSettings

KEY = ("default", "demo")
ROOT = pathlib.Path(__file__).parents[2]


class Recorder(handlers.Operator):
    """The operator with its scheduling seam recorded instead of run."""

    def __init__(self):
        super().__init__(OperatorSettings())
        self.requests = []

    def request(self, key, options, trigger, delay=None, refetch=False):
        self.requests.append((key, trigger, options))


def body(generation=1, labels=None, observed=None, uid="uid-1", ratio=0.15):
    status = {} if observed is None else {"observedGeneration": observed, "recomputeRatio": ratio}
    return {
        "metadata": {
            "namespace": KEY[0],
            "name": KEY[1],
            "uid": uid,
            "generation": generation,
            "labels": labels or {},
        },
        "spec": {},
        "status": status,
    }


def terminating(obj):
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    obj["metadata"]["finalizers"] = ["example.com/backup"]
    return obj


def scheduled(events):
    operator = Recorder()
    for event_type, obj in events:
        operator.owner_event(obj, event_type)
    return [(trigger, options) for _, trigger, options in operator.requests]


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        pytest.param([("ADDED", body())], [("create", handlers.FIRST_CREATE)], id="created"),
        pytest.param(
            [(None, body())], [("create", handlers.FIRST_CREATE)], id="listed-never-reconciled"
        ),
        pytest.param([(None, body(observed=1))], [("resume", handlers.FULL)], id="listed-done"),
        pytest.param(
            [(None, body(generation=3, observed=2))],
            [("update", handlers.FULL)],
            id="listed-changed-while-down",
        ),
        pytest.param(
            [("ADDED", body()), ("MODIFIED", body(observed=1)), ("MODIFIED", body(observed=1))],
            [("create", handlers.FIRST_CREATE)],
            id="own-status-writes-cost-nothing",
        ),
        pytest.param(
            [("ADDED", body()), ("MODIFIED", body(observed=1, ratio=0.3))],
            [("create", handlers.FIRST_CREATE)],
            id="tuned-ratio-in-status-only",
        ),
        pytest.param(
            [("ADDED", body()), ("MODIFIED", body(generation=2, observed=1))],
            [("create", handlers.FIRST_CREATE), ("update", handlers.FULL)],
            id="spec-changed",
        ),
        pytest.param(
            [("ADDED", body()), ("MODIFIED", body(labels={"team": "a"}, observed=1))],
            [("create", handlers.FIRST_CREATE), ("update", handlers.FULL)],
            id="labels-changed",
        ),
        pytest.param(
            [("ADDED", body()), ("DELETED", body()), ("ADDED", body(uid="uid-2"))],
            [("create", handlers.FIRST_CREATE), ("create", handlers.FIRST_CREATE)],
            id="deleted-and-created-again",
        ),
        pytest.param(
            [("ADDED", body()), ("MODIFIED", terminating(body(generation=2, observed=1)))],
            [("create", handlers.FIRST_CREATE)],
            id="terminating",
        ),
        pytest.param([(None, terminating(body()))], [], id="listed-terminating"),
    ],
)
def test_owner_events_schedule_one_job_per_change(events, expected):
    assert scheduled(events) == expected


def test_deleting_an_owner_forgets_it_and_drops_its_pending_job():
    async def scenario():
        operator = handlers.Operator(OperatorSettings())
        operator.owner_event(body(), "ADDED")
        task = operator._pending[KEY].task
        operator.owner_event(body(), "DELETED")
        await asyncio.sleep(0)
        return operator, task

    operator, task = asyncio.run(scenario())
    assert task.cancelled()
    assert KEY not in operator._pending and KEY not in operator._owners


@pytest.mark.parametrize(
    ("first", "second", "merged"),
    [
        (None, handlers.FULL, handlers.FULL),
        (handlers.DRIFT, None, handlers.DRIFT),
        (handlers.FIRST_CREATE, handlers.DRIFT, handlers.DRIFT),
        (handlers.DRIFT, handlers.FULL, handlers.FULL),
        (handlers.FIRST_CREATE, handlers.FIRST_CREATE, handlers.FIRST_CREATE),
    ],
)
def test_merged_jobs_do_the_work_of_both(first, second, merged):
    assert handlers.merge(first, second) == merged
    assert handlers.merge(second, first) == merged


def test_a_pending_job_takes_the_earlier_time_and_the_larger_work():
    async def scenario():
        operator = handlers.Operator(OperatorSettings(status_debounce_s=60))
        loop = asyncio.get_running_loop()
        operator.request(KEY, None, "child-status")  # a refresh in a minute
        refresh = operator._pending[KEY]
        operator.request(KEY, handlers.DRIFT, "drift", delay=30)  # a drift fix sooner
        job = operator._pending[KEY]
        operator.request(KEY, None, "child-status", delay=45)  # joins: nothing changes
        unchanged = operator._pending[KEY] is job
        await asyncio.sleep(0)
        for pending in list(operator._pending.values()):
            pending.task.cancel()
        return refresh, job, unchanged, loop.time()

    refresh, job, unchanged, now = asyncio.run(scenario())
    assert refresh.task.cancelled()
    assert (job.options, job.trigger) == (handlers.DRIFT, "drift")
    assert 25 < job.due - now <= 30
    assert unchanged


def test_a_request_to_read_afresh_is_kept_when_jobs_merge():
    async def scenario():
        operator = handlers.Operator(OperatorSettings(status_debounce_s=60))
        operator.request(KEY, None, "child-status", delay=10, refetch=True)
        operator.request(KEY, handlers.DRIFT, "drift", delay=20)  # later, larger: joins
        job = operator._pending[KEY]
        operator.request(KEY, handlers.DRIFT, "drift", delay=30, refetch=True)  # nothing new
        unchanged = operator._pending[KEY] is job
        job.task.cancel()
        return job, unchanged

    job, unchanged = asyncio.run(scenario())
    assert (job.options, job.refetch) == (handlers.DRIFT, True)
    assert unchanged


def example_owner(status: dict | None = None, ratio: float = 0.15) -> dict:
    with open(ROOT / "examples" / "cpu.yaml") as file:
        owner = yaml.safe_load(file)
    owner["metadata"].update(namespace="default", uid="uid-1", generation=1)
    owner["spec"]["blend"]["recomputeRatio"] = ratio
    owner["status"] = status or {}
    return owner


def tuned(ratio, base):
    return {"recomputeRatio": ratio, "tuning": {"baseRatio": base}}


def configured_ratio(result) -> float:
    configmap = next(c for c in result[1] if c["kind"] == "ConfigMap")
    return json.loads(next(iter(configmap["data"].values())))["recomputeRatio"]


@pytest.mark.parametrize(
    ("ratio", "statuses", "renders", "last_ratio"),
    [
        # the first status write records the spec's ratio: same render, no second one
        (0.15, [None, tuned(0.15, 0.15)], 1, 0.15),
        # a tuned ratio derived from the current spec ratio: rendered anew
        (0.15, [tuned(0.15, 0.15), tuned(0.3, 0.15)], 2, 0.3),
        # a tuned ratio left from an older spec ratio counts for nothing
        (0.15, [None, tuned(0.3, 0.1)], 1, 0.15),
        # a tuned ratio beyond the tuning bounds is clamped (maxRatio 0.6)
        (0.15, [None, tuned(0.9, 0.15)], 2, 0.6),
    ],
)
def test_renders_are_cached_per_effective_ratio(monkeypatch, ratio, statuses, renders, last_ratio):
    calls = []

    def counting_prepare(body, *args):
        calls.append(body)
        return real_prepare(body, *args)

    real_prepare = reconcile.prepare
    monkeypatch.setattr(reconcile, "prepare", counting_prepare)
    operator = handlers.Operator(OperatorSettings())
    results = [operator.prepared(example_owner(status, ratio)) for status in statuses]
    assert len(calls) == renders
    assert configured_ratio(results[-1]) == last_ratio
    # and the cache gives what an uncached render of the last owner gives
    assert results[-1][1] == real_prepare(example_owner(statuses[-1], ratio))[1]


@pytest.mark.parametrize(
    ("patched", "requested"),
    [
        # by hand, within the bounds: nothing else would apply it (the tuner would wait for
        # the pods to run it for ever)
        (tuned(0.3, 0.15), True),
        # the tuner's own write of the ratio already rendered: nothing to do
        (tuned(0.15, 0.15), False),
        # a tuned ratio of an older spec ratio counts for nothing: nothing to do
        (tuned(0.3, 0.1), False),
    ],
)
def test_a_status_write_that_moves_the_pods_ratio_is_rendered(patched, requested):
    operator = Recorder()
    owner = example_owner(tuned(0.15, 0.15))
    operator.owner_event(owner, None)
    operator.prepared(owner)  # rendered by the reconcile
    operator.requests.clear()
    operator.owner_event(example_owner(patched), "MODIFIED")
    assert [(t, o) for _, t, o in operator.requests] == (
        [("ratio", handlers.DRIFT)] if requested else []
    )


def _reconciled(monkeypatch, spec: dict, trigger: str) -> list[tuple[str, str]]:
    """The Warning events one successful reconcile of `spec` posts."""

    async def reconciled(client, body, options, now, prepared):
        return {}

    monkeypatch.setattr(reconcile, "reconcile", reconciled)
    operator = Recorder()
    owner = body()
    owner["spec"] = spec
    operator.owner_event(owner, "ADDED")
    warned = []
    operator._warn = lambda key, reason, message: warned.append((reason, message))
    asyncio.run(operator.run(KEY, trigger, handlers.FULL))
    return warned


LEGACY_ENV = {"engine": {"env": [{"name": "HOLEBLEND_ENGINE_URL", "value": "http://x:1"}]}}


@pytest.mark.parametrize("trigger", handlers.SPEC_TRIGGERS)
def test_a_spec_with_a_deprecated_setting_gets_a_warning_event_per_spec_reconcile(
    monkeypatch, trigger
):
    ((reason, message),) = _reconciled(monkeypatch, LEGACY_ENV, trigger)
    assert reason == "DeprecatedSetting"
    assert "remove HOLEBLEND_ENGINE_URL from engine.env" in message


@pytest.mark.parametrize("trigger", ["tune", "retry", "drift"])
def test_tuning_and_retries_post_no_deprecation_events(monkeypatch, trigger):
    assert _reconciled(monkeypatch, LEGACY_ENV, trigger) == []


def test_a_current_spec_gets_no_deprecation_event(monkeypatch):
    assert _reconciled(monkeypatch, {}, "update") == []
