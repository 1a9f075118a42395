"""kopf handlers: thin event handlers that route every trigger into `reconcile`.

Everything goes through watch events, handled with kopf's low-level event handlers:

- A BlendDeployment event whose render inputs (uid, generation, labels) differ from the last
  ones seen schedules a reconcile: a first create (POST before looking), an update or, after
  a restart, a resume. Our own status writes change none of them and cost nothing more.
- A child event whose object no longer contains what we render (edited or deleted by hand)
  schedules a reconcile of its owner; Deployment events schedule a status refresh. A child
  listed again after a watch gap schedules a reconcile of its owner too: kopf sends no
  DELETED event for what was deleted during the gap.
- Failures are retried here with capped, jittered exponential backoff; an invalid spec is
  reported in status and not retried until the spec changes. Retries and requeues read the
  owner afresh: an HA replica that kopf paused for a peer keeps its jobs but not its watches.

kopf's create/update handlers are not used: they would PATCH a diff-base annotation onto
every BlendDeployment after each change (one more write and one more watch event each) and
keep two deep copies of every object for their diffs. No timer and no finalizer (kopf timers
add one): owner references let the garbage collector delete the children, and nothing
outside the cluster needs cleaning up. The ratio tuner runs as a plain task
(`tuning_loop`) and asks for a reconcile when it changes the ratio. Another plain task
(`sweep`) reads, once every SWEEP_S, each owner that no event has shown meanwhile and
forgets those gone: one deleted during a watch gap gets no DELETED event.

Memory: what is kept per BlendDeployment is bounded and small (docs/operator.md, "Memory
and scale"): the owner as watched minus what nothing reads (managedFields, kubectl's
last-applied copy), its Deployments reduced to the fields the status reads, and its last
render. Each is kept packed (compact JSON, the larger ones zlib-compressed) rather than as
dicts: a decoded watch object costs about five times its JSON text in small Python objects,
and those objects, long-lived among the many short-lived ones of a burst, keep the
interpreter's memory arenas from ever being freed. They are unpacked when read (a
reconcile, a status refresh, a render), which costs tens of microseconds next to the API
round trips. An owner's lock exists only while it is held or awaited, and kopf keeps no
record per object (`EventMemories`). All of it is dropped when the owner (or child) is
deleted.
"""

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import random
import sys
import time
import uuid
import zlib

import kopf
from kopf._core.reactor import inventory

from holeblend_operator import kube, metrics, reconcile, tuning_loop
from holeblend_operator.api import GROUP, KIND, PLURAL, VERSION, spec_notices
from holeblend_operator.render import effective_recompute_ratio, engine_name, lookup_name
from holeblend_operator.render.labels import MANAGED_BY
from holeblend_operator.settings import OperatorSettings
from holeblend_operator.status import is_available

FIRST_CREATE = reconcile.Options(create_first=True, prune=False)
FULL = reconcile.Options(create_first=False, prune=True)
# Triggers of a reconcile for a spec seen for the first time by this process: the ones after
# which settings to change (api.spec_notices) are posted as Warning events.
SPEC_TRIGGERS = ("create", "update", "resume")
# A reconcile retried after a failure, at its backoff (or blocked_retry_s) time.
RETRY = "retry"
# Triggers of jobs that apply inputs a pending job has not seen (a new spec, a new ratio):
# they may run sooner than a pending retry's backoff.
NEW_INPUT_TRIGGERS = (*SPEC_TRIGGERS, "tune", "ratio")
DRIFT = reconcile.Options(create_first=False, prune=False)
# The finalizer name kopf would use, under our own group (kopf adds none here).
ANNOTATION_PREFIX = f"operator.{GROUP}"
LOG = logging.getLogger(__name__)
WORKER_LIMIT = 64  # kopf's per-object event workers at once (its default: no limit)
# How long an idle one waits for its object's next event (kopf's: 5 s). The handlers only
# schedule jobs, so a worker is done within milliseconds: one that lingered for a second
# would hold its slot, and in a burst the events of the objects without a worker pile up
# (as decoded bodies) in kopf's per-object queues meanwhile.
WORKER_IDLE_S = 0.1
# An owner that no event or read has shown for this long is read once (`sweep`).
SWEEP_S = 3600.0
# How long `cleanup` lets the reconciles and refreshes under way finish before it cancels
# them and closes the client. With kube.CLOSE_GRACE_S and the 5 s kopf then gives leftover
# tasks, well within the pod's terminationGracePeriodSeconds (the chart sets none: 30 s).
SHUTDOWN_GRACE_S = 10.0

Key = tuple[str, str]  # (namespace, name) of a BlendDeployment
# kubectl's copy of the applied manifest: nothing here reads it, so kept owners leave it out.
KUBECTL_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf builds a diff base (deep copies of the object) on every watch event for its
    create/update handlers; this operator has none, so there is nothing to build or store."""

    def build(self, *, body, extra_fields=None):
        return {}

    def fetch(self, *, body):
        return None


def pack(obj: dict) -> bytes:
    """A JSON object kept compact: its JSON text, compressed."""
    return zlib.compress(json.dumps(obj, separators=(",", ":")).encode(), 1)


def unpack(packed: bytes) -> dict:
    """The object `pack` kept (a new copy each time: callers may change it)."""
    return json.loads(zlib.decompress(packed))


class EventMemories(inventory.ResourceMemories):
    """kopf's per-object memories, none kept: kopf remembers, for every object it has seen
    (each BlendDeployment and each of its six children), a record of what its daemons,
    timers, indexes, memos and change handlers need, about 1.1 KB of small objects each (7.7
    KB per BlendDeployment), for the life of the object. This operator has event handlers
    only, which need none of it: every event gets a fresh record instead. (What is lost: the
    throttling of kopf's own unexpected processing errors per object, which without a
    record is per event.)"""

    async def recall(self, raw_body, *, memobase=None, noticed_by_listing=False, ephemeral=False):
        return await super().recall(
            raw_body, memobase=memobase, noticed_by_listing=noticed_by_listing, ephemeral=True
        )


@dataclasses.dataclass(slots=True)
class Kept:
    """A BlendDeployment as last watched (minus what nothing reads), packed, next to what the
    hot paths read without unpacking it: its render inputs, the status fields the ratio
    derives from, and its tuning interval (the tuner looks at every owner each second)."""

    packed: bytes
    inputs: tuple  # _inputs(owner)
    raw_ratio: tuple  # _raw_ratio(owner)
    interval: float | None  # tuning_loop.interval_of(owner): None if not tuned
    seen: float  # time.monotonic() when the API server last showed it (an event, a read)

    @classmethod
    def of(cls, body: dict) -> "Kept":
        slim = _slim_owner(body)
        return cls(
            pack(slim),
            _inputs(slim),
            _raw_ratio(slim),
            tuning_loop.interval_of(slim),
            time.monotonic(),
        )

    def body(self) -> dict:
        return unpack(self.packed)


@dataclasses.dataclass(slots=True)
class Rendered:
    """An owner's last render, kept compact: the applied JSON of its children, compressed
    (about 2.5 KB instead of about 45 KB of dicts and a validated model), and the replicas
    of its Deployments (read on every Deployment event). The children are materialized
    again when needed."""

    inputs: tuple  # _inputs(owner) it was rendered from
    raw_ratio: tuple  # the status fields the effective ratio derives from, as last seen
    ratio: float  # the effective ratio it was rendered with
    index: tuple[tuple[str, str], ...]  # (kind, name) per child
    packed: bytes  # the children's applied JSON, one a line, compressed
    replicas: tuple[tuple[str, int | None], ...]  # (name, spec.replicas) per Deployment

    @classmethod
    def of(cls, inputs: tuple, raw_ratio: tuple, ratio: float, children: list[dict]) -> "Rendered":
        applied = "\n".join(c["metadata"]["annotations"][APPLIED] for c in children)
        return cls(
            inputs,
            raw_ratio,
            ratio,
            tuple((sys.intern(c["kind"]), c["metadata"]["name"]) for c in children),
            zlib.compress(applied.encode(), 1),
            tuple(
                (c["metadata"]["name"], c["spec"].get("replicas"))
                for c in children
                if c["kind"] == "Deployment"
            ),
        )

    def materialize(self, kind: str | None = None, name: str | None = None) -> list[dict]:
        """The children as reconcile.desired_children returned them (those of `kind`, or
        the one of `kind` and `name`)."""
        wanted = [
            (kind is None or k == kind) and (name is None or n == name) for k, n in self.index
        ]
        if not any(wanted):
            return []
        lines = zlib.decompress(self.packed).decode().split("\n")
        return [_child(applied) for applied, keep in zip(lines, wanted, strict=True) if keep]


@dataclasses.dataclass
class Job:
    """Work pending for one BlendDeployment: a reconcile (with options) or a status refresh."""

    task: asyncio.Task
    options: reconcile.Options | None  # None: refresh the status only
    trigger: str
    due: float
    refetch: bool  # read the owner and its Deployments afresh instead of the watched copies


def merge(a: reconcile.Options | None, b: reconcile.Options | None) -> reconcile.Options | None:
    """The job that does both: the larger reconcile wins over a refresh; POST-first only if
    both are first creates; pruning if either prunes."""
    if a is None or b is None:
        return b if a is None else a
    return reconcile.Options(a.create_first and b.create_first, a.prune or b.prune)


class Operator:
    """The state the handlers share: settings, the API client, the owners as last watched,
    and the jobs pending per owner."""

    def __init__(self, settings: OperatorSettings):
        self.settings = settings
        self.client: kube.Client | None = None
        self._configuration = None
        self._owners: dict[Key, Kept] = {}  # BlendDeployments as last watched (informer cache)
        self._inputs: dict[Key, tuple] = {}  # their render inputs when last scheduled
        # Their render inputs when last reconciled successfully: a status refresh reports
        # (observedGeneration) only inputs whose children were applied.
        self._applied: dict[Key, tuple] = {}
        self._pending: dict[Key, Job] = {}
        self._running: set[asyncio.Task] = set()  # jobs no longer pending, under way
        self._stopping = False  # set by `cleanup`: no job is scheduled or started any more
        self._retries: dict[Key, int] = {}  # failed reconciles in a row
        self._locks: dict[Key, list] = {}  # [lock, holders and waiters] while in use
        # Reconciles and refreshes under way at once: twice the API concurrency keeps every
        # connection busy, and a burst (thousands created at once, a relist after a restart)
        # holds that many renders and API answers in memory, not one per object.
        self._slots = asyncio.Semaphore(2 * settings.api_concurrency)
        self._rendered: dict[Key, Rendered] = {}  # each owner's last render, compact
        # child (kind, namespace, name) -> (resourceVersion, generation) known to be current
        self._current: dict[tuple, tuple] = {}
        self._deployments: dict[Key, bytes] = {}  # our Deployments as last watched, packed
        # The ratio tuner (tuning_loop): identity and priority tell it whether this replica
        # is the active one under peering.
        self.identity = f"holeblend-operator-{uuid.uuid4().hex[:12]}"
        self.priority = settings.peering_priority
        self.tuning = tuning_loop.TuningLoop(self)
        self._tuning_task: asyncio.Task | None = None
        self._sweep_task: asyncio.Task | None = None

    async def startup(self, settings: kopf.OperatorSettings, **_) -> None:
        settings.persistence.diffbase_storage = NoDiffBase(prefix=ANNOTATION_PREFIX)
        # Watch only our children, filtered by the API server: clusters have many more
        # Deployments, Services and ConfigMaps than BlendDeployments.
        for kind in kube.CHILD_KINDS.values():
            settings.watching.label_selectors[kind.selector] = (
                f"app.kubernetes.io/managed-by={MANAGED_BY}"
            )
        settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
        settings.networking.request_timeout = self.settings.request_timeout_s
        # Kubernetes Events on the BlendDeployment for retries, failures and deprecated
        # settings only: a success event per reconcile would cost an API write each.
        settings.posting.level = logging.WARNING
        # kopf runs a worker task (and queue) per object with events pending, kept for
        # idle_timeout after its last event: unbounded, a burst of N objects means N workers
        # at once. The handlers only schedule jobs, so a few workers keep up.
        settings.queueing.worker_limit = WORKER_LIMIT
        settings.queueing.idle_timeout = WORKER_IDLE_S
        self._configure_peering(settings.peering)
        self.client = kube.Client.from_configuration(
            self.configuration(), self.settings.request_timeout_s, self.settings.api_concurrency
        )
        self._tuning_task = asyncio.get_running_loop().create_task(self.tuning.run())
        self._sweep_task = asyncio.get_running_loop().create_task(self._sweep_forever())

    def _configure_peering(self, peering) -> None:
        if self.settings.peering is None:
            peering.standalone = True
            return
        peering.standalone, peering.mandatory = False, True
        peering.name = self.settings.peering
        peering.lifetime = self.settings.peering_lifetime_s
        # Replicas of one Deployment would share a priority, and kopf pauses every operator
        # that sees a live peer of equal priority: a random priority per process makes exactly
        # one replica (the highest) active and the others stand by until its record expires.
        peering.priority = self.settings.peering_priority or random.randint(1, 2**30)
        self.priority = peering.priority

    def login(self, **_) -> kopf.ConnectionInfo:
        return kube.connection_info(self.configuration())

    def configuration(self):
        # kopf logs in and the startup handler builds the client: load credentials once for both.
        if self._configuration is None:
            self._configuration = kube.load_configuration()
        return self._configuration

    async def cleanup(self, **_) -> None:
        """Stop: cancel the pending jobs and the plain tasks, let the jobs under way finish
        (SHUTDOWN_GRACE_S at most), then close the client. Closed under a running reconcile,
        the client would fail its next request, and the reconcile would report a failure
        (a Warning event) and schedule a retry for a process that is going away."""
        self._stopping = True
        tasks = [job.task for job in self._pending.values()]
        tasks += [t for t in (self._tuning_task, self._sweep_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._running:
            _, late = await asyncio.wait(self._running, timeout=SHUTDOWN_GRACE_S)
            for task in late:  # the next process resumes every owner
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    def owner_event(self, body: dict, event_type: str | None) -> None:
        """Remember a BlendDeployment as watched; schedule a reconcile if its inputs changed."""
        meta = body.get("metadata", {})
        key = (meta.get("namespace"), meta.get("name"))
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            # Going away (others' finalizers may hold it a while): the garbage collector
            # takes the children; creating or fixing any now would only race it.
            self._forget(key)
            return
        self._owners[key] = kept = Kept.of(body)
        inputs = kept.inputs
        previous = self._inputs.get(key)
        if previous == inputs:
            # e.g. our own status write: nothing rendered depends on it, unless the ratio
            # fields of status moved the ratio the pods run with. The tuner asks for its
            # own re-render; a ratio inside the bounds patched by hand (`kubectl patch
            # --subresource=status`) has no one else to apply it, and the tuner would wait
            # for the pods for ever. (One outside them the tuner clamps, saying so.)
            rendered = self._rendered.get(key)
            if rendered is not None and rendered.raw_ratio != kept.raw_ratio:
                with contextlib.suppress(reconcile.InvalidSpec):
                    ratio = self._render_kept(key).ratio
                    if ratio != rendered.ratio and _is_tuned_ratio(kept.raw_ratio, ratio):
                        self.request(key, DRIFT, "ratio", delay=0)
            return
        self._inputs[key] = inputs
        self._retries.pop(key, None)
        observed = (body.get("status") or {}).get("observedGeneration")
        if previous is not None or observed not in (None, meta.get("generation")):
            self.request(key, FULL, "update", delay=0)  # changed while we watched, or before
        elif observed is None:
            # New, or never got as far as a status: POST the children first (a child that
            # exists already turns this into a full reconcile, pruning included).
            self.request(key, FIRST_CREATE, "create", delay=0)
        else:  # listed at start-up (or after a watch restart): children may have drifted
            self.request(key, FULL, "resume", delay=0)

    def _forget(self, key: Key) -> None:
        job = self._pending.pop(key, None)
        if job is not None:
            job.task.cancel()
        # Its children's versions and Deployments too: their DELETED events drop them, but
        # an owner found gone after a watch gap (`gone`, `_refetch`) took its children with
        # it meanwhile, and no event comes for those.
        rendered = self._rendered.get(key)
        for kind, name in rendered.index if rendered is not None else ():
            self._current.pop((kind, key[0], name), None)
            if kind == "Deployment":
                self._deployments.pop((key[0], name), None)
        # Not its lock: a job under way holds it, and `_lock` drops it when that job and those
        # waiting are done. Dropped now, a namesake (deleted and created again at once) would
        # get a new one, and its reconcile would run beside the old one's.
        tables = (
            self._owners,
            self._inputs,
            self._applied,
            self._retries,
            self._rendered,
        )
        for table in tables:
            table.pop(key, None)
        self.tuning.forget(key)

    @property
    def owners(self) -> dict[Key, Kept]:
        """The BlendDeployments as last watched, packed (the tuner reads their intervals)."""
        return self._owners

    def owner(self, key: Key) -> dict | None:
        """A BlendDeployment as last watched (a copy of its own), or None if unknown."""
        kept = self._owners.get(key)
        return kept.body() if kept is not None else None

    def keep_owner(self, key: Key, body: dict) -> None:
        """Keep a newer copy of a known BlendDeployment (the tuner's status write returns one),
        if its render inputs are those of the copy watched. Other inputs mean the watch has
        delivered a change the write's answer predates (or will deliver one it holds):
        kept, it would have the reconcile that change asked for apply the spec before it."""
        watched = self._owners.get(key)
        if watched is not None:
            kept = Kept.of(body)
            if kept.inputs == watched.inputs:
                self._owners[key] = kept

    def gone(self, key: Key, kept: Kept | None) -> None:
        """The API server no longer has the BlendDeployment watched as `kept` (the tuner's
        read found none): forget it as its DELETED event would have. After a watch gap
        (410 Gone, a pause for a peer) kopf lists the objects again and sends no event for
        those deleted meanwhile: without this, one tuned stays for the life of the process,
        read every interval, its gauges exported. One watched again since (created anew
        under its name while the read was under way) stays."""
        if kept is not None and self._owners.get(key) is kept:
            self._forget(key)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sweep(time.monotonic() - SWEEP_S)
            except Exception:  # a bug must not end the sweeps for good: log, sweep again later
                LOG.exception("sweep of the BlendDeployments failed")

    async def sweep(self, seen_before: float) -> None:
        """Read each owner that no event or read has shown since `seen_before` (monotonic),
        one at a time, and forget those the API server no longer has. After a watch gap on
        the owners' own watch, kopf's listing sends nothing for one deleted meanwhile: the
        tuner's read finds a tuned one gone, and a requeue one not Ready, but nothing reads
        an untuned Ready one again, and what is kept of it would stay for the life of the
        process. An owner whose watch is quiet costs one GET per SWEEP_S."""
        for key, kept in list(self._owners.items()):
            if kept.seen >= seen_before:
                continue
            try:
                body = await self.client.get(kube.BLEND_DEPLOYMENT, *key)
            except Exception as exc:  # API trouble: read at the next sweep
                LOG.warning("reading %s/%s failed: %s", *key, exc)
                continue
            if body is None or body.get("metadata", {}).get("deletionTimestamp"):
                self.gone(key, kept)
            else:
                kept.seen = time.monotonic()

    def lock(self, key: Key) -> contextlib.AbstractAsyncContextManager:
        """The owner's lock: one reconcile, status refresh or tuning write at a time."""
        return self._lock(key)

    def request_tuned(self, key: Key) -> None:
        """The tuner changed status.recomputeRatio: re-render the runtime ConfigMap now."""
        self.request(key, DRIFT, "tune", delay=0)

    def request(
        self,
        key: Key,
        options: reconcile.Options | None,
        trigger: str,
        delay: float | None = None,
        refetch: bool = False,
    ) -> None:
        """Reconcile (with `options`) or refresh the status (None) of a BlendDeployment soon.

        A request joins the pending one, and only one job per owner is pending at a time (a
        running one is no longer pending). The larger job wins, and the earlier time, except
        for retries: a pending retry keeps its backoff time when the request adds nothing to
        it (a smaller or equal job, for inputs it will read anyway), and a retry that joins a
        job adding nothing to it sets the time. Only a larger job, or one for new inputs (a
        spec change, a new ratio), runs a retry sooner. So Deployment events, which ask for
        status refreshes, do not undo the backoff while the API server is overloaded or an
        owner is blocked. Jobs for later (retries, requeues) `refetch`: by then the watched
        copies may be stale, e.g. in an HA replica that kopf paused for a peer, whose watches
        stopped."""
        if self._stopping:
            return  # the next process resumes every owner
        delay = self.settings.status_debounce_s if delay is None else delay
        due = time.monotonic() + delay
        pending = self._pending.get(key)
        if pending is not None:
            merged = merge(pending.options, options)
            refetch = refetch or pending.refetch
            adds = merged != pending.options or trigger in NEW_INPUT_TRIGGERS
            if pending.trigger == RETRY and not adds:
                due = pending.due  # keeps its backoff
            elif not (
                trigger == RETRY and merged == options and pending.trigger not in NEW_INPUT_TRIGGERS
            ):
                due = min(due, pending.due)
            # else: the retry's backoff, for the pending job's work too
            if due == pending.due and merged == pending.options and refetch == pending.refetch:
                return
            pending.task.cancel()
            trigger = trigger if adds else pending.trigger
            options = merged
        task = asyncio.get_running_loop().create_task(self._later(key, due))
        self._pending[key] = Job(task, options, trigger, due, refetch)

    async def _later(self, key: Key, due: float) -> None:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        job = self._pending.pop(key)
        task = asyncio.current_task()
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        options, trigger = job.options, job.trigger
        if job.refetch:
            changed = await self._refetch(key, job)
            if changed is None:
                return  # gone, or tried again later
            if changed:  # the spec moved on meanwhile: apply it, not just the old job
                options, trigger = merge(options, FULL), "update"
        if options is not None:
            await self.run(key, trigger, options)
        else:
            await self._refresh(key, from_watch=not job.refetch)

    async def _refetch(self, key: Key, job: Job) -> bool | None:
        """Read the owner afresh; whether its render inputs changed (None: gone, or failed)."""
        try:
            body = await self.client.get(kube.BLEND_DEPLOYMENT, *key)
        except Exception as exc:  # API trouble: the same job later
            LOG.warning("reading %s/%s failed: %s", *key, exc)
            self.request(key, job.options, job.trigger, self.settings.requeue_s, refetch=True)
            return None
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            self._forget(key)
            return None
        self._owners[key] = kept = Kept.of(body)
        previous, self._inputs[key] = self._inputs.get(key), kept.inputs
        return previous != self._inputs[key]

    async def run(self, key: Key, trigger: str, options: reconcile.Options) -> None:
        """One reconcile of a BlendDeployment; failures are retried later, never raised."""
        kept = self._owners.get(key)
        if kept is None:
            return  # deleted meanwhile
        started = time.monotonic()
        result = "error"
        try:
            # one reconcile or refresh per owner at a time (the lock first: a lock holder never
            # waits for a slot while others wait for its lock)
            async with self._lock(key), self._slots:
                if self._stopping:  # waited for its turn while the operator began to stop
                    result = "stopped"
                    return
                latest = self._latest(key, kept)
                # unpacked only now: the many that wait for a slot in a burst hold no copy
                body = latest.body()
                live = await reconcile.reconcile(self.client, body, options, _now(), self.prepared)
            self._remember_current(key[0], live)
            self._remember_written(key[0], live)
            self._applied[key] = latest.inputs
            self._retries.pop(key, None)
            LOG.info("%s/%s reconciled (%s) in %.3f s", *key, trigger, time.monotonic() - started)
            if trigger in SPEC_TRIGGERS:  # once per spec seen, not on every tune or retry
                for notice in spec_notices(body.get("spec")):
                    self._warn(key, "DeprecatedSetting", notice)
            # The children's controllers report after we wrote them: take another look soon.
            self.request(key, None, "child-status")
            result = "ok"
        except reconcile.InvalidSpec as exc:
            result = "invalid"  # reported in status; a spec change schedules the next try
            self._warn(key, "InvalidSpec", f"not reconciled until the spec changes: {exc}")
        except reconcile.Blocked as exc:
            result = "blocked"
            # Its status names the problem, and its children are not all applied: no refresh
            # (which sees no problem) may report them until a reconcile succeeds.
            self._applied.pop(key, None)
            self._retry(key, self.settings.blocked_retry_s, exc)
        except kube.Forbidden as exc:
            result = "forbidden"
            self._retry(key, self.settings.backoff_cap_s, exc)
        except kube.Unavailable as exc:
            result = "retry"
            self._retry(key, self.backoff(self._retries.get(key, 0)), exc)
        except Exception as exc:  # a bug must not stop this owner for good: log and retry
            LOG.exception("reconcile of %s/%s failed", *key)
            self._retry(key, self.settings.backoff_cap_s, exc)
        finally:
            self._drop_if_forgotten(key)
            metrics.RECONCILES.labels(trigger=trigger, result=result).inc()
            metrics.RECONCILE_SECONDS.labels(trigger=trigger).observe(time.monotonic() - started)

    def _retry(self, key: Key, delay: float, reason: Exception) -> None:
        self._retries[key] = self._retries.get(key, 0) + 1
        self._warn(key, "ReconcileFailed", f"retrying in {delay:.3g} s: {reason}")
        self.request(key, FULL, RETRY, delay=delay, refetch=True)

    def backoff(self, retry: int) -> float:
        """Exponential, capped, with jitter so that many objects do not retry in lockstep."""
        delay = min(self.settings.backoff_cap_s, self.settings.backoff_base_s * 2 ** min(retry, 16))
        return delay * random.uniform(0.5, 1.0)

    async def _refresh(self, key: Key, from_watch: bool = True) -> None:
        kept = self._owners.get(key)
        if kept is None:
            return
        later = {"delay": self.settings.requeue_s, "refetch": True}
        try:
            async with self._lock(key), self._slots:
                if self._stopping:
                    return
                latest = self._latest(key, kept)
                if latest.inputs != self._applied.get(key):
                    # Not reconciled yet (e.g. the spec changed while this waited for the
                    # lock): the status would report observedGeneration for children still
                    # of the previous spec. The reconcile that applies these inputs asks for
                    # a refresh when it succeeds; one that fails reports in status itself.
                    return
                body = latest.body()
                known = self._known(*key) if from_watch else {}  # else the Deployments are read
                ready = await reconcile.refresh(self.client, body, _now(), known, self.prepared)
            if not ready:  # look again later: pods may report why (e.g. Unschedulable)
                self.request(key, None, "child-status", **later)
        except Exception as exc:  # API trouble or a bug: say so and look again later
            LOG.warning("status refresh of %s/%s failed: %s", *key, exc)
            self.request(key, None, "child-status", **later)
        finally:
            self._drop_if_forgotten(key)

    def _latest(self, key: Key, kept: Kept) -> Kept:
        """The owner as last watched; `kept` if it was deleted since."""
        return self._owners.get(key) or kept

    def _drop_if_forgotten(self, key: Key) -> None:
        """An owner deleted while its reconcile or refresh ran: drop what that re-created
        (its render, its next job), or it would stay for the life of the process. (Its lock
        `_lock` drops once released.)"""
        if key not in self._owners:
            self._forget(key)

    def _warn(self, key: Key, reason: str, message: str) -> None:
        """Log, and post a Warning event on the BlendDeployment (`kubectl describe bd`)."""
        LOG.warning("%s/%s: %s: %s", *key, reason, message)
        body = self.owner(key)
        if body is not None:
            # LookupError: outside kopf's tasks, where its event queue is not set.
            with contextlib.suppress(LookupError):
                kopf.warn(body, reason=reason, message=message)

    @contextlib.asynccontextmanager
    async def _lock(self, key: Key):
        """Held while in use only: an owner's lock exists while someone holds or awaits it
        (a lock per owner for good would cost about 0.9 KB each)."""
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0 and self._locks.get(key) is entry:
                del self._locks[key]

    def remember(self, child: dict, event_type: str | None) -> None:
        """Keep the latest state of our Deployments (an informer cache), as far as the
        status reads them."""
        if child.get("kind") == "Deployment":
            key = (child["metadata"].get("namespace"), child["metadata"].get("name"))
            if event_type == "DELETED":
                self._deployments.pop(key, None)
            else:
                self._deployments[key] = pack(_slim_deployment(child))

    def _remember_written(self, namespace: str | None, live: dict) -> None:
        """Keep our Deployments as a reconcile's writes returned them (a POST or PATCH
        answer has the new generation), so that a status refresh that runs before the watch
        delivers those writes does not judge the rollout on the copies from before them.
        A watched copy of the same object at the same or a newer generation is kept: it
        can only be as new or newer."""
        for (kind, name), obj in live.items():
            if kind != "Deployment":
                continue
            meta = obj.get("metadata") or {}
            cached = self.deployment(namespace, name)
            if cached is not None:
                seen = cached.get("metadata", {})
                if seen.get("uid") == meta.get("uid") and seen.get("generation", 0) >= meta.get(
                    "generation", 0
                ):
                    continue
            self._deployments[(namespace, name)] = pack(_slim_deployment(obj))

    def deployment(self, namespace: str | None, name: str) -> dict | None:
        """One of our Deployments as last watched (what the status reads of it), or None."""
        packed = self._deployments.get((namespace, name))
        return unpack(packed) if packed is not None else None

    def child_event(self, child: dict, event_type: str | None) -> None:
        """Reconcile the owner of a drifted child; refresh its status on Deployment events."""
        self.remember(child, event_type)
        if event_type == "DELETED":  # also when its owner is gone: nothing else would drop it
            meta = child.get("metadata", {})
            self._current.pop((child.get("kind"), meta.get("namespace"), meta.get("name")), None)
        owner_name = _owner_name(child)
        key = (child.get("metadata", {}).get("namespace"), owner_name)
        if not owner_name or key not in self._owners:
            return  # not ours, or the owner is gone and the garbage collector takes the child
        if self.is_drifted(child, event_type, key):
            self.request(key, DRIFT, "drift")
        elif event_type is None and self._applied.get(key) == self._owners[key].inputs:
            # Listed again after a watch gap (410 Gone, a pause for a peer): kopf sends no
            # DELETED event for what was deleted meanwhile, so a sibling of this child may be
            # gone while its watched copy (a Deployment Ready as last seen) stays. A reconcile
            # without pruning creates it again and replaces that copy; the owner is read
            # afresh first (and forgotten if it went too). Its refresh follows. (The listing
            # at start-up looks the same: an owner whose resume ran before its children were
            # listed gets one more reconcile, reads only where nothing moved.)
            self.request(key, DRIFT, "relist", refetch=True)
        elif child.get("kind") == "Deployment":
            # Debounced while the Deployments settle; at once when the last one has: the
            # status is then final, and Ready shows without waiting out the debounce.
            delay = 0 if self._settled(key) else None
            self.request(key, None, "child-status", delay=delay)

    def _settled(self, key: Key) -> bool:
        """Every Deployment the owner renders is, as last watched, available as rendered."""
        try:
            rendered = self._render_kept(key)
        except reconcile.InvalidSpec:
            return False
        return all(
            is_available(self.deployment(key[0], name), replicas)
            for name, replicas in rendered.replicas
        )

    def _known(self, namespace: str, owner: str) -> dict:
        """The owner's Deployments as last seen on the watch; absent ones are fetched."""
        known = {}
        for name in (engine_name(owner), lookup_name(owner)):
            deployment = self.deployment(namespace, name)
            if deployment is not None:
                known[("Deployment", name)] = deployment
        return known

    def is_drifted(self, child: dict, event_type: str | None, owner: Key) -> bool:
        """Whether a child event shows the child deleted or changed away from what we render.

        Cheap for the common events: our own writes (same resourceVersion as written) and
        status updates by controllers (same generation) skip the full comparison."""
        meta = child.get("metadata", {})
        key = (child.get("kind"), meta.get("namespace"), meta.get("name"))
        if event_type == "DELETED":
            self._current.pop(key, None)
            return True
        seen_version, seen_generation = self._current.get(key, (None, None))
        if seen_version is not None and seen_version == meta.get("resourceVersion"):
            return False
        desired = self._desired(owner, *key[::2]) or []
        wanted = desired[0] if desired else None
        if wanted is None:
            return False  # invalid spec (status says so), or pruned on the next full reconcile
        same_spec = seen_generation is not None and seen_generation == meta.get("generation")
        if same_spec:  # only status moved: check what else a person may edit, the metadata
            current = reconcile.contains(meta, wanted["metadata"])
        else:
            current = reconcile.is_current(child, wanted)
        if current:
            self._current[_child_key(*key)] = (meta.get("resourceVersion"), meta.get("generation"))
        return not current

    def _remember_current(self, namespace: str | None, live: dict) -> None:
        for (kind, name), obj in live.items():
            meta = obj.get("metadata", {})
            self._current[_child_key(kind, namespace, name)] = (
                meta.get("resourceVersion"),
                meta.get("generation"),
            )

    def _desired(
        self, owner: Key, kind: str | None = None, name: str | None = None
    ) -> list[dict] | None:
        """The children the owner renders (those of `kind`, or the one of `kind` and `name`);
        None if its spec is invalid (status says so)."""
        try:
            rendered = self._render_kept(owner)
        except reconcile.InvalidSpec:
            return None
        return rendered.materialize(kind, name)

    def prepared(self, owner: dict) -> tuple:
        """reconcile.prepare, with the render cached per owner on its render inputs: uid,
        generation, labels and the ratio the pods run with (the one input render takes from
        the status). So the first status write, which records the ratio, costs no second
        render. The spec is validated again on each call (a fraction of a render)."""
        rendered = self._render(_key(owner), _inputs(owner), _raw_ratio(owner), owner)
        return reconcile.parse(owner, self.settings.host_path_prefixes), rendered.materialize()

    def _render_kept(self, key: Key) -> Rendered:
        """_render of the owner as last watched, unpacked only if the cache misses."""
        kept = self._owners[key]
        return self._render(key, kept.inputs, kept.raw_ratio, kept.body)

    def _render(self, key: Key, inputs: tuple, raw_ratio: tuple, owner) -> Rendered:
        """The owner's cached render if its inputs still hold, else a new one (InvalidSpec is
        raised, not cached). `owner`: the BlendDeployment, or a function that returns it."""
        rendered = self._rendered.get(key)
        if rendered is not None and rendered.inputs == inputs and rendered.raw_ratio == raw_ratio:
            return rendered
        owner = owner() if callable(owner) else owner
        if rendered is not None and rendered.inputs == inputs:
            # The ratio fields in status moved (a status write, the tuner): a new render only
            # if the ratio the pods run with moved too.
            bd = reconcile.parse(owner, self.settings.host_path_prefixes)
            if effective_recompute_ratio(bd) == rendered.ratio:
                rendered.raw_ratio = raw_ratio
                return rendered
        bd, children = reconcile.prepare(
            owner, self.settings.host_path_prefixes, self.settings.pod_listen_address
        )
        rendered = Rendered.of(inputs, raw_ratio, effective_recompute_ratio(bd), children)
        self._rendered[key] = rendered
        return rendered


def register(settings: OperatorSettings, registry: kopf.OperatorRegistry | None = None) -> Operator:
    """Register every handler in `registry` (kopf's default one if None)."""
    registry = registry or kopf.get_default_registry()
    operator = Operator(settings)

    async def on_owner_event(body, type, **_):
        operator.owner_event(dict(body), type)

    async def on_child_event(body, type, **_):
        operator.child_event(dict(body), type)

    kopf.on.login(registry=registry)(operator.login)
    kopf.on.startup(registry=registry)(operator.startup)
    kopf.on.cleanup(registry=registry)(operator.cleanup)
    kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="blenddeployments")(on_owner_event)
    # kopf watches a resource only while the API serves it: ServiceMonitors from the moment
    # their CRD appears (it watches the CRDs), and none where the CRD is never installed.
    for kind in kube.CHILD_KINDS.values():
        kopf.on.event(
            kind.group,
            kind.api_version.rpartition("/")[2],
            kind.plural,
            registry=registry,
            id=f"child-{kind.plural}",
            labels={"app.kubernetes.io/managed-by": MANAGED_BY},
        )(on_child_event)
    return operator


APPLIED = reconcile.LAST_APPLIED_ANNOTATION


def _child(applied: str) -> dict:
    """A child as reconcile.desired_children rendered it, from its applied JSON."""
    child = json.loads(applied)
    annotations = child["metadata"].setdefault("annotations", {})
    annotations[reconcile.HASH_ANNOTATION] = hashlib.sha256(applied.encode()).hexdigest()[:16]
    annotations[APPLIED] = applied
    return child


def _child_key(kind: str | None, namespace: str | None, name: str | None) -> tuple:
    """A child's key in the table of current versions, its kind and namespace shared with
    every other child's (decoded JSON makes a new string of each)."""
    return (
        sys.intern(kind) if kind else kind,
        sys.intern(namespace) if namespace else namespace,
        name,
    )


def _key(owner: dict) -> Key:
    meta = owner.get("metadata", {})
    return (meta.get("namespace"), meta.get("name"))


def _is_tuned_ratio(raw_ratio: tuple, ratio: float) -> bool:
    """Whether status.recomputeRatio (`_raw_ratio`'s first field) is `ratio` as it is, not
    clamped into the bounds or replaced by the spec's ratio."""
    try:
        return float(raw_ratio[0]) == ratio
    except ValueError:
        return False


def _raw_ratio(owner: dict) -> tuple:
    """The status fields the effective ratio derives from, exactly as written."""
    status = owner.get("status") or {}
    tuned, base = status.get("recomputeRatio"), (status.get("tuning") or {}).get("baseRatio")
    return (repr(tuned), repr(base))


def _slim_owner(body: dict) -> dict:
    """The BlendDeployment minus what nothing here reads (a shallow copy where it differs):
    managedFields and kubectl's last-applied copy of the manifest, each often larger than
    the rest of the object. (The status stays whole: the API models validate all of it.)"""
    meta = body.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if "managedFields" not in meta and KUBECTL_LAST_APPLIED not in annotations:
        return body
    meta = {k: v for k, v in meta.items() if k != "managedFields"}
    if KUBECTL_LAST_APPLIED in annotations:
        meta["annotations"] = {k: v for k, v in annotations.items() if k != KUBECTL_LAST_APPLIED}
    return {**body, "metadata": meta}


def _slim_deployment(child: dict) -> dict:
    """What the status and the readiness checks read of a Deployment (status.is_available,
    status.build_status): kind, identity and generation, spec.replicas, the status."""
    meta = child.get("metadata") or {}
    slim = {
        "kind": child.get("kind"),
        "metadata": {
            k: meta[k]
            for k in ("name", "namespace", "uid", "generation", "resourceVersion")
            if k in meta
        },
        "spec": {k: v for k, v in (child.get("spec") or {}).items() if k == "replicas"},
    }
    if "status" in child:
        slim["status"] = child["status"]
    return slim


def _inputs(owner: dict) -> tuple:
    """What a reconcile renders from, besides the status: a change here needs one."""
    meta = owner.get("metadata", {})
    return (
        meta.get("uid"),
        meta.get("generation"),
        tuple(sorted((meta.get("labels") or {}).items())),
    )


def _owner_name(child: dict) -> str | None:
    for ref in child.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(GROUP + "/"):
            return ref.get("name")
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
