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


def _pending_after(requests, settings=None) -> tuple[handlers.Job, float]:
    """The job pending after `requests` (request's arguments, in order), and the time just
    after they were made (the event loop's clock)."""

    async def scenario():
        operator = handlers.Operator(settings or OperatorSettings(status_debounce_s=0.5))
        for args, kwargs in requests:
            operator.request(KEY, *args, **kwargs)
        now = asyncio.get_running_loop().time()
        job = operator._pending[KEY]
        job.task.cancel()
        return job, now

    return asyncio.run(scenario())


RETRY_IN_A_MINUTE = ((handlers.FULL, "retry"), {"delay": 60, "refetch": True})


@pytest.mark.parametrize(
    "request_",
    [
        pytest.param(((None, "child-status"), {}), id="debounced-refresh"),
        pytest.param(((None, "child-status"), {"delay": 0}), id="settled-refresh"),
        pytest.param(((handlers.DRIFT, "drift"), {}), id="drift"),
        pytest.param(RETRY_IN_A_MINUTE, id="retry"),
    ],
)
def test_a_pending_retry_keeps_its_backoff_when_a_smaller_job_joins(request_):
    """A Deployment event during a retry's backoff (API server overloaded, owner blocked)
    asks for a status refresh: the retry already does that work, so it keeps its time
    instead of running half a second later and hammering the API server again."""
    job, now = _pending_after([RETRY_IN_A_MINUTE, request_])
    assert (job.options, job.trigger, job.refetch) == (handlers.FULL, "retry", True)
    assert 55 < job.due - now <= 60


def test_a_retry_joining_a_pending_refresh_keeps_its_backoff():
    """A reconcile fails while a status refresh is pending (Deployment events during it):
    the retry does the refresh's work too, at its backoff time, not at the refresh's."""
    job, now = _pending_after([((None, "child-status"), {}), RETRY_IN_A_MINUTE])
    assert (job.options, job.trigger) == (handlers.FULL, "retry")
    assert 55 < job.due - now <= 60


@pytest.mark.parametrize(
    "requests",
    [
        pytest.param([RETRY_IN_A_MINUTE, ((handlers.FULL, "update"), {"delay": 0})], id="after"),
        pytest.param([((handlers.FULL, "update"), {"delay": 0}), RETRY_IN_A_MINUTE], id="before"),
    ],
)
def test_a_spec_change_runs_a_pending_retry_at_once(requests):
    """A new spec (the fix for a blocked owner, say) is applied at once, whatever the order
    of the retry and the update, and as an update (which posts the spec's notices)."""
    job, now = _pending_after(requests)
    assert (job.options, job.trigger, job.refetch) == (handlers.FULL, "update", True)
    assert job.due - now <= 1


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
        # outside the bounds (maxRatio 0.6): the tuner clamps it and says so in status
        (tuned(0.9, 0.15), False),
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


class StatusClient:
    """Reads nothing but what it is given; records the status writes."""

    def __init__(self):
        self.statuses: list[dict] = []

    async def get(self, kind, namespace, name):
        return None

    async def list(self, kind, namespace, selector):
        return []

    async def patch_status(self, namespace, name, status):
        self.statuses.append(status)
        return {}


def available(child: dict, generation: int = 1, observed: int | None = None) -> dict:
    """A rendered Deployment as the API server returns it once its rollout of `generation`
    is complete (or, with `observed` lower, just patched to `generation`)."""
    obj = json.loads(json.dumps(child))
    replicas = obj["spec"].get("replicas", 1)
    obj["metadata"].update(uid=f"uid-{obj['metadata']['name']}", generation=generation)
    obj["status"] = {
        "observedGeneration": generation if observed is None else observed,
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": replicas,
        "availableReplicas": replicas,
    }
    return obj


def _ready(status: dict) -> tuple[int, str]:
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    return status["observedGeneration"], ready["status"]


def _refreshed(monkeypatch, steps) -> list[dict]:
    """The status writes of the operator's refreshes. `steps` is a list of ("watch", owner),
    ("reconciled", children returned) and ("refresh", None); the Deployments start as
    watched, available at generation 1 of the example owner; reconciles succeed."""
    client = StatusClient()
    returned: dict = {}

    async def reconciled(client, body, options, now, prepared):
        return returned

    monkeypatch.setattr(reconcile, "reconcile", reconciled)

    async def scenario():
        operator, children = watching_available_deployments(client)
        for step, arg in steps:
            if step == "watch":
                operator.owner_event(arg, "MODIFIED")
            elif step == "reconciled":
                returned.clear()
                returned.update(arg(children))
                await operator.run(KEY_EXAMPLE, "update", handlers.FULL)
            else:
                await operator._refresh(KEY_EXAMPLE)
            for job in list(operator._pending.values()):  # run here, step by step
                job.task.cancel()
            operator._pending.clear()
        return client.statuses

    return asyncio.run(scenario())


KEY_EXAMPLE = ("default", "smollm2-demo")


def watching_available_deployments(client) -> tuple[handlers.Operator, list[dict]]:
    """An operator on `client` (its status writes debounced for a minute) that watched the
    example owner's Deployments, available at generation 1; and the owner's children."""
    operator = handlers.Operator(OperatorSettings(status_debounce_s=60))
    operator.client = client
    _, children = operator.prepared(example_owner())
    for child in children:
        if child["kind"] == "Deployment":
            operator.remember(available(child), "ADDED")
    return operator, children


def new_engine_args(owner: dict) -> dict:
    """generation 2: new engine.extraArgs, which change the engine's pod template."""
    owner["metadata"]["generation"] = 2
    owner["spec"].setdefault("engine", {})["extraArgs"] = ["--queue-size", "4"]
    return owner


def nothing_written(children) -> dict:
    return {}


def test_a_refresh_does_not_report_a_generation_whose_reconcile_has_not_run(monkeypatch):
    """The spec changed (generation 2) while a refresh waited for the owner's lock: the
    children are still those of generation 1, fully available, so the refresh must not
    write observedGeneration 2 with Ready=True. Once generation 2 is reconciled it may."""
    gen1 = example_owner()
    statuses = _refreshed(
        monkeypatch,
        [
            ("watch", gen1),
            ("reconciled", nothing_written),
            ("refresh", None),
            ("watch", new_engine_args(example_owner())),
            ("refresh", None),
        ],
    )
    assert [_ready(status) for status in statuses] == [(1, "True")]


def test_a_refresh_after_a_reconcile_judges_the_deployments_its_patches_returned(monkeypatch):
    """The refresh right after a reconcile may run before the watch delivers the reconcile's
    own Deployment patches: it reads what the PATCH returned (generation 2, not yet
    observed), not the watched generation-1 copy, so generation 2 is not Ready yet."""

    def engine_patched(children) -> dict:
        engine = next(c for c in children if c["metadata"]["name"].endswith("-engine"))
        return {("Deployment", engine["metadata"]["name"]): available(engine, 2, observed=1)}

    statuses = _refreshed(
        monkeypatch,
        [
            ("watch", new_engine_args(example_owner())),
            ("reconciled", engine_patched),
            ("refresh", None),
        ],
    )
    assert [_ready(status) for status in statuses] == [(2, "False")]


def test_a_watched_deployment_newer_than_the_patch_answer_is_kept(monkeypatch):
    """The watch delivered the controller's report on the patched generation before the
    reconcile ended: that copy is newer than the PATCH answer and stays."""

    def engine_patched_and_watched(children) -> dict:
        engine = next(c for c in children if c["metadata"]["name"].endswith("-engine"))
        return {("Deployment", engine["metadata"]["name"]): available(engine, 1, observed=0)}

    statuses = _refreshed(
        monkeypatch,
        [("watch", example_owner()), ("reconciled", engine_patched_and_watched), ("refresh", None)],
    )
    assert [_ready(status) for status in statuses] == [(1, "True")]


def test_a_refresh_does_not_clear_the_problem_a_blocked_reconcile_reported(monkeypatch):
    """A drift fix blocked after a good reconcile of the same spec (a foreign object took a
    deleted child's name) reports Degraded; the Deployment events and requeues that follow
    must not overwrite that with a status whose children were not all applied."""
    client = StatusClient()
    outcomes = [None, reconcile.Blocked("ChildConflict: Service default/x is not ours")]

    async def reconciled(client, body, options, now, prepared):
        outcome = outcomes.pop(0)
        if outcome is not None:
            await client.patch_status(*KEY_EXAMPLE, {"conditions": [{"type": "Degraded"}]})
            raise outcome
        return {}

    monkeypatch.setattr(reconcile, "reconcile", reconciled)

    async def scenario():
        operator, _ = watching_available_deployments(client)
        operator.owner_event(example_owner(), "MODIFIED")
        await operator.run(KEY_EXAMPLE, "update", handlers.FULL)
        await operator.run(KEY_EXAMPLE, "drift", handlers.DRIFT)
        await operator._refresh(KEY_EXAMPLE)
        for job in operator._pending.values():
            job.task.cancel()
        return client.statuses

    statuses = asyncio.run(scenario())
    assert statuses == [{"conditions": [{"type": "Degraded"}]}]
