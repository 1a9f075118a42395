"""The tuner's driver: reads the metrics, asks the control law, writes the result.

Every second the loop looks for BlendDeployments (as last watched) whose tuning interval is
up, and evaluates each in a task of its own, up to MAX_TUNING at once: an owner whose API
requests are throttled (Retry-After) or whose Prometheus is slow holds up only itself. One
owner's evaluations stay one at a time: the next is due only after the last has ended, so a
namesake created after a delete is never tuned beside the old object. Each evaluation:

1. Only the active replica tunes. Standalone, that is this process. With `--peering`, it
   is the live peer of highest priority in kopf's peering object, by kopf's own rule (an
   equal priority pauses everyone), so a standby replica never writes a ratio.
2. The BlendDeployment is read afresh (the watched copy may be a write behind). Tuning
   starts from the spec's ratio whenever status.tuning.baseRatio is not the spec's ratio
   (first run, or a person edited spec.blend.recomputeRatio).
3. The metrics come from Prometheus (spec.tuning.prometheusUrl) or, without one, from the
   ready engine pods' /metrics (`tuning_sources`; on vLLM pods, the connector's metrics
   port, and for TTFT, which vLLM measures, vLLM's own /metrics on the engine's port:
   `vllm:time_to_first_token_seconds`); `tuner.decide` picks the ratio, on the shadow
   samples when enough came in, else on the inline proxy. With blend.mode off nothing is
   blended, and with spec.tuning.qualityProxies false nothing is scored: the law holds
   with `NoQualityProxies`.
4. The decision goes into status under the owner's lock: recomputeRatio, tuning.baseRatio,
   the bounded history (a run of holds with the same reason is one entry, its time and
   numbers the latest), tuning.aboveTargetSince, the metrics, and the Tuned condition.
   A changed ratio then gets a reconcile, which re-renders the runtime ConfigMap; the pods
   re-read the mounted file without a restart.
5. Operator metrics count the decisions by direction and reason and show the tuned ratio
   next to its bounds (for the dashboard and the pinned-at-a-bound alert).

A plain asyncio task rather than a kopf timer: kopf timers put a finalizer on every object,
and this operator writes nothing to a BlendDeployment but its status (see `handlers`).
Switching tuning off needs nothing here: render and status fall back to the spec's ratio.
"""

import asyncio
import dataclasses
import datetime
import logging
import math
import time

import aiohttp

from holeblend_contract.dual_stack import host_port
from holeblend_operator import kube, metrics
from holeblend_operator.api import (
    REASON_MAX_LENGTH,
    BlendDeployment,
    BlendDeploymentStatus,
    ConditionType,
    ObservedMetrics,
    TuningSpec,
    spec_notices,
)
from holeblend_operator.host_paths import DEFAULT_HOST_PATH_PREFIXES, validation_context
from holeblend_operator.render import engine_name, selector_string
from holeblend_operator.render.engine import exports_connector_metrics
from holeblend_operator.render.serve import runs_holeblend_serve
from holeblend_operator.status import DISABLED, stamp_transitions
from holeblend_operator.tuner import (
    INLINE,
    RECENT_INTERVALS,
    Decision,
    Reading,
    State,
    decide,
    select_signal,
)
from holeblend_operator.tuning_sources import (
    TTFT,
    VLLM_TTFT,
    PrometheusSource,
    ScrapeSource,
    Target,
    failed,
)

LOG = logging.getLogger(__name__)
TICK_S = 1.0
WINDOW_INTERVALS = 10
HISTORY_LENGTH = 20  # TuningStatus.history's bound
# Owners evaluated at once: each holds a few API requests in flight (kube.Client allows 16
# by default), and the reconcile needs some of them too.
MAX_TUNING = 8
PEERING_KINDS = {k.kind: k for k in kube.FRAMEWORK_KINDS if k.group == "kopf.dev"}


def no_proxies(bd: BlendDeployment) -> str | None:
    """Why the engine pods score no quality proxies at all, or None: only when the user
    turned them off (spec.tuning.qualityProxies false) or blends nothing (blend.mode off).
    holeblend-serve scores them in-process, vLLM's connector through the pod's own API
    server (the operator renders its URL and vLLM's priority scheduling)."""
    if str(bd.spec.blend.mode) == "off":
        return "blend.mode is off: the engine blends nothing, so it scores no quality proxies"
    if not bd.spec.tuning.quality_proxies:
        return (
            "spec.tuning.qualityProxies is false: the engine pods score no quality proxies; "
            "set it to true (the default) to tune on them"
        )
    return None


def metrics_port(bd: BlendDeployment) -> int:
    """Where an engine pod serves the holeblend_* series: holeblend-serve on its HTTP port,
    vLLM with the connector on the connector's metrics port (vLLM's own /metrics has none)."""
    engine = bd.spec.engine
    return engine.metrics_port if exports_connector_metrics(bd) else engine.port


def ttft_histogram(bd: BlendDeployment) -> str:
    """The TTFT histogram an engine pod exports: holeblend-serve's own, or on vLLM pods
    (with the connector or not) the one vLLM's API server exports on the engine's port."""
    return TTFT if runs_holeblend_serve(bd) else VLLM_TTFT


def window_seconds(spec: TuningSpec) -> float:
    """How far back a reading looks at most: a cooldown, and at least ten intervals (`read`
    looks back no further than the last change, `since_last_change`). Only samples taken
    at the ratio in force count, so after a change the window fills from zero; a long
    window lets a lightly loaded engine (few shadow samples) reach minSamples."""
    return float(max(spec.cooldown_seconds, WINDOW_INTERVALS * spec.interval_seconds))


def since_last_change(status: BlendDeploymentStatus, now: float) -> float | None:
    """Seconds since the tuner last changed the ratio (status.tuning.history), or None when
    the history shows no change. A window that reaches back past it counts samples taken
    at the ratio now in force before the change (a raise back to a ratio run earlier):
    they tell nothing of it since. History times are whole seconds, rounded down: the
    change is taken as at the end of its second."""
    for entry in reversed(status.tuning.history):
        if entry.direction != "hold":
            at = _epoch(entry.time)
            return None if at is None else now - (at + 1)
    return None


def recent_seconds(spec: TuningSpec) -> float:
    """The recent part of the window (its last tuner.RECENT_INTERVALS intervals; the window
    is at least WINDOW_INTERVALS long) that the law compares with the older part."""
    return float(RECENT_INTERVALS * spec.interval_seconds)


def ratio_in_force(spec_ratio: float, status: dict) -> object:
    """The ratio tuning continues from: the tuned one (raw, maybe out of bounds or not a
    number: `decide` clamps it) while it derives from the spec's ratio, else the spec's."""
    tuning = status.get("tuning") or {}
    tuned = status.get("recomputeRatio")
    if tuned is None or tuning.get("baseRatio") != spec_ratio:
        return spec_ratio
    return tuned


def state_from(status: dict, spec_ratio: float) -> State:
    """The law's state as status keeps it; none (a fresh start) when the spec's ratio
    changed, or when tuning was off until now (the Tuned condition still says Disabled):
    the pods ran the spec's ratio meanwhile, so a cooldown begun before (aboveTargetSince)
    would let the first reading above the band step down at once, and what was learned
    describes the workload as it was."""
    tuning = status.get("tuning") or {}
    if tuning.get("baseRatio") != spec_ratio or _was_disabled(status):
        return State()
    floor, floor_at = _learned(tuning, "belowTarget")
    good, good_at = _learned(tuning, "meetsTarget")
    above, above_at = _learned(tuning, "meetsTargetAbove")
    if good is None or above is None or above <= good:
        above, above_at = None, None  # only meaningful above a known-good ratio
    return State(
        _epoch(tuning.get("aboveTargetSince")), floor, floor_at, good, good_at, above, above_at
    )


def retargeted(status: dict, spec: TuningSpec, state: State) -> tuple[State, str]:
    """`state` without what was learned against a target or band that spec.tuning no
    longer has (`State.retargeted`, from the target and band status says the state was
    learned against), and a phrase for the reason. A status written before it recorded
    them says nothing of the target: its state is kept."""
    tuning = status.get("tuning") or {}
    target, band = tuning.get("learnedTargetF1Proxy"), tuning.get("learnedBand")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in (target, band)):
        return state, ""
    return state.retargeted(float(target), float(band), spec)


def _was_disabled(status: dict) -> bool:
    """Whether the Tuned condition is the one the reconcile writes while tuning is off
    (status._tuned): the tuner has not decided since it was switched on again."""
    return any(
        isinstance(c, dict) and c.get("type") == ConditionType.TUNED and c.get("reason") == DISABLED
        for c in status.get("conditions") or []
    )


def _learned(tuning: dict, name: str) -> tuple[float | None, float | None]:
    """A remembered ratio and when it was measured; anything incomplete or not a ratio
    (patched by hand) is forgotten."""
    value, at = tuning.get(f"{name}Ratio"), _epoch(tuning.get(f"{name}At"))
    if isinstance(value, bool) or not isinstance(value, int | float) or at is None:
        return None, None
    return (float(value), at) if 0 < value <= 1 else (None, None)


def is_active(peers: dict, identity: str, priority: int, now: datetime.datetime) -> bool:
    """kopf's rule: pause while a live peer has a higher or equal priority than ours."""
    for peer_id, info in (peers or {}).items():
        if peer_id == identity or not isinstance(info, dict):
            continue
        seen = _parse_time(info.get("lastseen"))
        lifetime = datetime.timedelta(seconds=_number(info.get("lifetime"), 60))
        if seen is not None and seen + lifetime <= now:
            continue  # dead: its record outlived its lifetime
        if _number(info.get("priority"), 0) >= priority:
            return False
    return True


def status_patch(
    bd: BlendDeployment,
    status: dict,
    decision: Decision,
    seen: Reading,
    now: str,
    notices: list[str] = (),
) -> dict:
    """The merge patch that records a decision (step 4 of the module doc); `notices`
    (api.spec_notices: settings to change) are added to the Tuned condition's message."""
    entry = {
        "time": now,
        "direction": decision.direction,
        "fromRatio": decision.from_ratio if decision.from_ratio is not None else decision.to_ratio,
        "toRatio": decision.to_ratio,
        "reason": _shortened(f"{decision.code}: {decision.reason}", REASON_MAX_LENGTH),
        "inputs": observed_metrics(seen, now),
    }
    history = list((status.get("tuning") or {}).get("history") or [])
    if history and _is_same_hold(history[-1], entry):
        history[-1] = entry
    else:
        history.append(entry)
    state = decision.state
    return {
        "recomputeRatio": decision.to_ratio,
        "tuning": {
            "baseRatio": bd.spec.blend.recompute_ratio,
            "history": history[-HISTORY_LENGTH:],
            "aboveTargetSince": _rfc3339_or_none(state.above_since),
            "belowTargetRatio": state.floor,
            "belowTargetAt": _rfc3339_or_none(state.floor_at),
            "meetsTargetRatio": state.good,
            "meetsTargetAt": _rfc3339_or_none(state.good_at),
            "meetsTargetAboveRatio": state.good_above,
            "meetsTargetAboveAt": _rfc3339_or_none(state.good_above_at),
            "learnedTargetF1Proxy": bd.spec.tuning.target_f1_proxy,
            "learnedBand": bd.spec.tuning.band,
        },
        # Every field, null when not read now: a merge patch leaves out what it omits, so
        # a figure of an earlier interval would stand beside this one's observedAt.
        "metrics": dict.fromkeys(METRICS_FIELDS) | observed_metrics(seen, now),
        "conditions": _with_tuned(
            status.get("conditions") or [], decision, now, bd.metadata.generation, notices
        ),
    }


# status.metrics' fields as the API names them.
METRICS_FIELDS = tuple(field.alias for field in ObservedMetrics.model_fields.values())


def observed_metrics(seen: Reading, now: str) -> dict:
    """status.metrics (ObservedMetrics) from a reading; NaN and out-of-range values dropped."""
    f1 = _within(seen.f1_proxy, 0, 1)
    values = {
        # One decimal: the HIT% column of `kubectl get bd` shows it as written.
        "hitPercent": _rounded(_within(seen.hit_percent, 0, 100), 1),
        "f1Proxy": f1,
        "top1Agreement": _within(seen.top1_agreement, 0, 1),
        "ttftSeconds": _within(seen.ttft_seconds, 0, math.inf),
        "numSamples": seen.num_samples,
        # Which proxy f1Proxy, top1Agreement and numSamples are (tuner.select_signal).
        "proxySignal": seen.signal if f1 is not None else None,
        "observedAt": now,
    }
    return {key: value for key, value in values.items() if value is not None}


def _with_tuned(
    conditions: list[dict], decision: Decision, now: str, generation, notices=()
) -> list[dict]:
    message = decision.reason[:1000] + "".join(f". Note: {notice}" for notice in notices)
    tuned = {
        "type": ConditionType.TUNED.value,
        "status": "True" if decision.is_tuned else "False",
        "reason": decision.code,
        "message": message,
    }
    others = [c for c in conditions if c.get("type") != ConditionType.TUNED]
    return others + stamp_transitions([tuned], conditions, now, generation)


def _shortened(text: str, limit: int) -> str:
    """`text`, or its first characters and an ellipsis within `limit` (a reason quotes
    what a source answered, which can be a whole page)."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _is_same_hold(last: dict, entry: dict) -> bool:
    code = entry["reason"].partition(":")[0]
    return (
        last.get("direction") == entry["direction"] == "hold"
        and str(last.get("reason", "")).partition(":")[0] == code
        and last.get("toRatio") == entry["toRatio"]
    )


class TuningLoop:
    """Runs the tuner for every tuned BlendDeployment the operator watches."""

    def __init__(self, operator):
        self.operator = operator  # handlers.Operator: owners, client, locks, reconcile requests
        # owner -> monotonic time of its last evaluation (or of its first sight): the next
        # is due one interval later, the interval as the spec says now (a shorter one
        # takes effect at once, not after one more wait of the old length).
        self._last: dict[tuple, float] = {}
        self._session: aiohttp.ClientSession | None = None
        self._scrape: ScrapeSource | None = None
        self._running: dict[tuple, asyncio.Task] = {}  # owner -> its evaluation under way
        self._deleted: set[tuple] = set()  # owners deleted while their evaluation runs
        self._slots = asyncio.Semaphore(MAX_TUNING)

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(TICK_S)
                await self.tick()
        finally:
            running = list(self._running.values())
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            if self._session is not None:
                await self._session.close()

    async def tick(self) -> None:
        """Starts the evaluations that are due and waits for them a tick at most: one that
        takes longer goes on by itself, and its owner is not due again until it has ended."""
        now = time.monotonic()
        started = []
        for key, kept in list(self.operator.owners.items()):
            if key in self._running:  # what it changes (scrape history, gauges) waits too
                continue
            interval = kept.interval  # interval_of(the owner), kept next to it
            if interval is None:  # not tuned (any more): no gauges, and nothing due
                if self._last.pop(key, None) is not None:
                    self._forget_scrape(key)
                metrics.TUNING.forget(key, decisions=False)
                continue
            last = self._last.setdefault(key, now)  # the first window needs filling
            if now < last + interval:
                continue
            self._last[key] = now
            started.append(self._start(key))
        if started:
            await asyncio.wait(started, timeout=TICK_S)

    def _start(self, key: tuple) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._evaluate(key))
        self._running[key] = task
        task.add_done_callback(lambda _: self._ended(key))
        return task

    def _ended(self, key: tuple) -> None:
        self._running.pop(key, None)
        self._deleted.discard(key)

    async def _evaluate(self, key: tuple) -> None:
        async with self._slots:
            try:
                await self.tune(key)
            except Exception:  # never let one owner stop the loop: log and try next interval
                LOG.exception("tuning %s/%s failed", *key)

    def forget(self, key: tuple) -> None:
        """A BlendDeployment deleted: nothing due, and its series and scrape history go. An
        evaluation of it under way does not record its decision in them when it ends: its
        status write may have been answered before the deletion, and the series would be
        exported again for good (or counted as a namesake's, created meanwhile)."""
        self._last.pop(key, None)
        metrics.TUNING.forget(key)
        self._forget_scrape(key)
        if key in self._running:
            self._deleted.add(key)

    def _forget_scrape(self, key: tuple) -> None:
        """Drop the owner's scrape history: kept while it is not tuned, its snapshots would
        be the baseline when tuning is switched on again, a window as long as the pause."""
        if self._scrape is not None:
            self._scrape.forget(key[0], engine_name(key[1]))

    async def tune(self, key: tuple) -> Decision | None:
        """One evaluation of one BlendDeployment; the decision, or None if not tuned now."""
        client = self.operator.client
        leader = await self.is_leader(key[0])
        if not leader:
            if leader is False:  # a standby: the active replica exports the owner's gauges
                metrics.TUNING.forget(key, decisions=False)
            return None
        watched = self.operator.owners.get(key)
        body = await client.get(kube.BLEND_DEPLOYMENT, *key)
        if body is None:
            self.operator.gone(key, watched)
            return None
        bd = _parse(body, self.operator.settings.host_path_prefixes)
        if bd is None or not bd.spec.tuning.enabled:
            return None
        uid = bd.metadata.uid
        status = body.get("status") or {}
        spec, spec_ratio = bd.spec.tuning, bd.spec.blend.recompute_ratio
        ratio = ratio_in_force(spec_ratio, status)
        seen = await self.read(bd, ratio)
        if watched is not None and key not in self.operator.owners:
            # Deleted while its metrics were read: its DELETED event forgot it before the
            # read kept this interval's scrape history, which would otherwise stay for good.
            self.forget(key)
            return None
        if (why := no_proxies(bd)) is not None:
            seen = dataclasses.replace(seen, no_proxies=why)
        seen = select_signal(spec, seen)  # the proxy the law acts on, for status too
        state, forgot = retargeted(status, spec, state_from(status, spec_ratio))
        decision = decide(spec, ratio, seen, state, time.time())
        if forgot:
            decision = dataclasses.replace(decision, reason=f"{decision.reason}; {forgot}")
        async with self.operator.lock(key):
            # The status as it is now: the reconcile's refresh may have written it (under
            # this lock) while the metrics were read, and a patch built on the earlier
            # read would put its conditions back. A ratio that moved meanwhile (a hand
            # patch, a spec change) makes this decision moot: the next interval decides.
            # So do tuning settings changed meanwhile (bounds, target: a raise past a
            # lowered maxRatio would stand in status beside the clamped ratio the pods
            # run), and a new object of the same name (deleted and created again): the
            # metrics and the state were the old one's.
            body = await client.get(kube.BLEND_DEPLOYMENT, *key)
            bd = _parse(body, self.operator.settings.host_path_prefixes)
            if bd is None or not bd.spec.tuning.enabled or bd.metadata.uid != uid:
                return None
            status = body.get("status") or {}
            if ratio_in_force(bd.spec.blend.recompute_ratio, status) != ratio:
                LOG.info("%s/%s: the ratio moved during the evaluation; decided again next", *key)
                return None
            if bd.spec.tuning != spec:
                LOG.info(
                    "%s/%s: spec.tuning changed during the evaluation; decided again next", *key
                )
                return None
            notices = spec_notices(body.get("spec"))
            patched = await client.patch_status(
                *key, status_patch(bd, status, decision, seen, _now(), notices)
            )
        if key not in self._deleted:
            self._record(key, spec, decision, seen)
        if patched is not None:
            self.operator.keep_owner(key, patched)
        if decision.is_change:
            LOG.info(
                "%s/%s tuned %s -> %s: %s",
                *key,
                decision.from_ratio,
                decision.to_ratio,
                decision.reason,
            )
            self.operator.request_tuned(key)
        return decision

    async def read(self, bd: BlendDeployment, ratio: object) -> Reading:
        if not isinstance(ratio, int | float) or isinstance(ratio, bool):
            return failed("no ratio in force")
        session = self._get_session()
        target = await self.target(bd)
        window = window_seconds(bd.spec.tuning)
        since = since_last_change(bd.status, time.time())
        if since is not None and since > 0:  # a change stamped ahead of this clock: no limit
            window = min(window, since)
        recent = min(recent_seconds(bd.spec.tuning), window)
        url = bd.spec.tuning.prometheus_url
        if url is not None:
            source = PrometheusSource(str(url), session)
            return await source.read(target, float(ratio), window, recent)
        if self._scrape is None:
            self._scrape = ScrapeSource(session)
        return await self._scrape.read(target, float(ratio), window, recent)

    async def target(self, bd: BlendDeployment) -> Target:
        """The engine pods to read: for a direct scrape, each ready pod's /metrics URL on
        the metrics port, and on the engine's port too where TTFT is there instead (vLLM
        with the connector)."""
        namespace = bd.metadata.namespace
        urls, ttft_urls = {}, {}
        if bd.spec.tuning.prometheus_url is None:
            pods = await self.operator.client.list(kube.PODS, namespace, selector_string(bd))
            port, engine_port = metrics_port(bd), bd.spec.engine.port
            ready = {
                pod["metadata"]["name"]: ip
                for pod in pods
                if _is_ready(pod) and (ip := (pod.get("status") or {}).get("podIP"))
            }
            urls = {name: f"http://{host_port(ip, port)}/metrics" for name, ip in ready.items()}
            if port != engine_port:
                ttft_urls = {
                    n: f"http://{host_port(ip, engine_port)}/metrics" for n, ip in ready.items()
                }
        name = engine_name(bd.metadata.name)
        return Target(namespace, name, urls, ttft_histogram(bd), ttft_urls)

    async def is_leader(self, namespace: str) -> bool | None:
        """Whether this replica is the active one in the namespace's peering; None when the
        peering object cannot be read (a standby must not write, but keeps what it had)."""
        settings = self.operator.settings
        if settings.peering is None:
            return True
        clusterwide = not settings.namespaces
        kind = PEERING_KINDS["ClusterKopfPeering" if clusterwide else "KopfPeering"]
        try:
            peering = await self.operator.client.get(
                kind, None if clusterwide else namespace, settings.peering
            )
        except Exception as exc:  # cannot tell: a standby must not write, so do nothing
            LOG.warning("reading the peering object failed: %s", exc)
            return None
        peers = (peering or {}).get("status") or {}
        return self.operator.identity in peers and is_active(
            peers,
            self.operator.identity,
            self.operator.priority,
            datetime.datetime.now(datetime.UTC),
        )

    def _record(
        self, key: tuple, spec: TuningSpec, decision: Decision, seen: Reading | None = None
    ) -> None:
        gauges = (
            decision.to_ratio,
            spec.min_ratio,
            spec.max_ratio,
            spec.target_f1_proxy,
            1.0 if seen is not None and seen.signal == INLINE else 0.0,
        )
        metrics.TUNING.record(key, decision.direction, decision.code, gauges)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session


def interval_of(body: dict) -> float | None:
    """The owner's tuning interval, None if it is not tuned (or its spec is unreadable)."""
    tuning = (body.get("spec") or {}).get("tuning") or {}
    if tuning.get("enabled", True) is not True:
        return None
    interval = tuning.get("intervalSeconds", TuningSpec().interval_seconds)
    return float(interval) if isinstance(interval, int | float) and interval >= 1 else None


def _parse(
    body: dict | None, host_path_prefixes: tuple[str, ...] = DEFAULT_HOST_PATH_PREFIXES
) -> BlendDeployment | None:
    """The owner as the reconcile reads it: with the host paths this operator admits (a
    model on a hostPath the operator setting allows is tuned like any other)."""
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    try:
        return BlendDeployment.model_validate(body, context=validation_context(host_path_prefixes))
    except ValueError:  # invalid spec: the reconcile reports it; nothing to tune
        return None


def _is_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _within(value: float | None, low: float, high: float) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return min(max(value, low), high) if high != math.inf else max(value, low)


def _number(value: object, default: float) -> float:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default
    )


def _parse_time(text: object) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        parsed = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def _epoch(text: object) -> float | None:
    parsed = _parse_time(text)
    return parsed.timestamp() if parsed is not None else None


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _rfc3339_or_none(epoch: float | None) -> str | None:
    return None if epoch is None else _rfc3339(epoch)


def _rfc3339(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now() -> str:
    return _rfc3339(time.time())
