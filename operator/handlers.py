"""kopf handlers: thin wrappers that route every trigger into `reconcile`.

create, update and resume share one reconcile. Children are watched instead of polled:
a child event whose object no longer contains what we render (edited or deleted by hand)
triggers a reconcile of its owner, and Deployment events refresh the owner's status, both
debounced per owner; owners that are not ready yet are looked at again after a while.
No timer and no finalizer (kopf timers add one): owner references let the garbage
collector delete the children, and nothing outside the cluster needs cleaning up.
"""

import asyncio
import datetime
import logging
import random
import time

import kopf

from holeblend_operator import kube, metrics, reconcile
from holeblend_operator.api import GROUP, KIND, PLURAL, VERSION
from holeblend_operator.render import engine_name, lookup_name
from holeblend_operator.render.labels import MANAGED_BY
from holeblend_operator.settings import OperatorSettings

FIRST_CREATE = reconcile.Options(create_first=True, prune=False)
FULL = reconcile.Options(create_first=False, prune=True)
DRIFT = reconcile.Options(create_first=False, prune=False)
# Progress and diff-base annotations under our own group, none in status (a structural
# schema would prune an unknown status.kopf field on a real cluster).
ANNOTATION_PREFIX = f"operator.{GROUP}"


class OwnerOnlyDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf builds a diff base (two deep copies of the object) for every watch event of every
    resource, but only BlendDeployments have create/update handlers that use it; children
    have event handlers only. Skipping it saves two deep copies per child event."""

    def build(self, *, body, extra_fields=None):
        if body.get("kind") != KIND:
            return {}
        return super().build(body=body, extra_fields=extra_fields)

    def fetch(self, *, body):
        if body.get("kind") != KIND:
            return None
        return super().fetch(body=body)


class CopyFreeProgress(kopf.AnnotationsProgressStorage):
    """kopf deep-copies both diff essences on every owner event to strip progress annotations;
    they are there only while a handler is being retried, and the essences are fresh copies."""

    def clear(self, *, essence):
        annotations = essence.get("metadata", {}).get("annotations", {})
        if any(key.startswith(f"{self.prefix}/") for key in annotations):
            return super().clear(essence=essence)
        self.remove_empty_stanzas(essence)  # as kopf's clear does
        return essence


class Operator:
    """The state the handlers share: settings, the API client, pending status refreshes."""

    def __init__(self, settings: OperatorSettings):
        self.settings = settings
        self.client: kube.Client | None = None
        self._configuration = None
        self._pending: dict[tuple[str, str], tuple[asyncio.Task, bool, float]] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._prepared: dict[tuple, tuple] = {}
        # child (kind, namespace, name) -> (resourceVersion, generation) known to be current
        self._current: dict[tuple, tuple] = {}
        self._owners: kopf.Index | None = None
        self._deployments: dict[tuple[str, str], dict] = {}  # our Deployments as last watched

    async def startup(self, settings: kopf.OperatorSettings, **_) -> None:
        settings.persistence.progress_storage = CopyFreeProgress(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = OwnerOnlyDiffBase(prefix=ANNOTATION_PREFIX)
        # Watch only our children, filtered by the API server: clusters have many more
        # Deployments, Services and ConfigMaps than BlendDeployments.
        for kind in kube.CHILD_KINDS.values():
            settings.watching.label_selectors[kind.selector] = (
                f"app.kubernetes.io/managed-by={MANAGED_BY}"
            )
        # Named under our group, but never added: no handler here needs a finalizer.
        settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
        settings.networking.request_timeout = self.settings.request_timeout_s
        # Kubernetes Events on the BlendDeployment for retries and failures only: a success
        # event per child event would cost an API write each.
        settings.posting.level = logging.WARNING
        self._configure_peering(settings.peering)
        self.client = kube.Client.from_configuration(
            self.configuration(), self.settings.request_timeout_s, self.settings.api_concurrency
        )

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

    def login(self, **_) -> kopf.ConnectionInfo:
        return kube.connection_info(self.configuration())

    def configuration(self):
        # kopf logs in and the startup handler builds the client: load credentials once for both.
        if self._configuration is None:
            self._configuration = kube.load_configuration()
        return self._configuration

    async def cleanup(self, **_) -> None:
        tasks = [task for task, _, _ in self._pending.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    async def run(
        self, body: kopf.Body, trigger: str, options: reconcile.Options, retry: int
    ) -> None:
        started = time.monotonic()
        result = "error"
        meta = body.get("metadata", {})
        key = (meta.get("namespace"), meta.get("name"))
        try:
            async with self._lock(key):  # one reconcile or refresh per owner at a time
                live = await reconcile.reconcile(
                    self.client, dict(body), options, _now(), self.prepared
                )
            self._remember_current(key[0], live)
            # The children's controllers report after we wrote them: take another look soon.
            self.request(*key, full=False)
            result = "ok"
        except reconcile.InvalidSpec as exc:
            result = "invalid"
            raise kopf.PermanentError(f"invalid spec: {exc}") from exc
        except reconcile.Blocked as exc:
            result = "blocked"
            raise kopf.TemporaryError(str(exc), delay=self.settings.blocked_retry_s) from exc
        except kube.Forbidden as exc:
            result = "forbidden"
            raise kopf.TemporaryError(str(exc), delay=self.settings.backoff_cap_s) from exc
        except kube.Unavailable as exc:
            result = "retry"
            raise kopf.TemporaryError(str(exc), delay=self.backoff(retry)) from exc
        finally:
            metrics.RECONCILES.labels(trigger=trigger, result=result).inc()
            metrics.RECONCILE_SECONDS.labels(trigger=trigger).observe(time.monotonic() - started)

    def backoff(self, retry: int) -> float:
        """Exponential, capped, with jitter so that many objects do not retry in lockstep."""
        delay = min(self.settings.backoff_cap_s, self.settings.backoff_base_s * 2 ** min(retry, 16))
        return delay * random.uniform(0.5, 1.0)

    def request(self, namespace: str, name: str, full: bool, delay: float | None = None) -> None:
        """Reconcile (full) or refresh the status of a BlendDeployment soon. Requests join a
        pending one: the earliest time and the larger job (full over refresh) win."""
        key = (namespace, name)
        delay = self.settings.status_debounce_s if delay is None else delay
        due = time.monotonic() + delay
        pending = self._pending.get(key)
        if pending is not None:
            task, pending_full, pending_due = pending
            if pending_due <= due and (pending_full or not full):
                return
            task.cancel()
            full, due = full or pending_full, min(due, pending_due)
        task = asyncio.get_running_loop().create_task(self._later(key, full, due))
        self._pending[key] = (task, full, due)

    async def _later(self, key: tuple[str, str], full: bool, due: float) -> None:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        del self._pending[key]
        trigger = "drift" if full else "child-status"
        try:
            body = await self._owner(key)
            if body is None:
                return
            if full:
                await self.run(body, trigger, DRIFT, retry=0)
                return
            async with self._lock(key):
                ready = await reconcile.refresh(
                    self.client, body, _now(), self._known(*key), self.prepared
                )
            if not ready:  # look again later: pods may report why (e.g. Unschedulable)
                self.request(*key, full=False, delay=self.settings.requeue_s)
        except (kopf.PermanentError, kopf.TemporaryError, kube.Unavailable, kube.Forbidden) as exc:
            logging.getLogger(__name__).warning("%s of %s/%s failed: %s", trigger, *key, exc)
            self.request(*key, full=full, delay=self.settings.requeue_s)

    def _lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    def remember(self, owners: kopf.Index, child: dict, event_type: str | None) -> None:
        """Keep kopf's owner index and the latest state of our Deployments (an informer cache)."""
        self._owners = owners
        if child.get("kind") == "Deployment":
            key = (child["metadata"].get("namespace"), child["metadata"].get("name"))
            if event_type == "DELETED":
                self._deployments.pop(key, None)
            else:
                self._deployments[key] = child

    async def _owner(self, key: tuple[str, str]) -> dict | None:
        if self._owners is not None:
            found = list(self._owners.get(key, []))
            return found[0] if found else None
        return await self.client.get(kube.BLEND_DEPLOYMENT, *key)

    def _known(self, namespace: str, owner: str) -> dict:
        """The owner's Deployments as last seen on the watch; absent ones are fetched."""
        known = {}
        for name in (engine_name(owner), lookup_name(owner)):
            if (namespace, name) in self._deployments:
                known[("Deployment", name)] = self._deployments[(namespace, name)]
        return known

    def is_drifted(self, child: dict, event_type: str | None, owner: dict) -> bool:
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
        try:
            desired = self.prepared(owner)[1]
        except reconcile.InvalidSpec:
            return False
        wanted = next((c for c in desired if (c["kind"], c["metadata"]["name"]) == key[::2]), None)
        if wanted is None:
            return False  # pruned on the next full reconcile
        same_spec = seen_generation is not None and seen_generation == meta.get("generation")
        if same_spec:  # only status moved: check what else a person may edit, the metadata
            current = reconcile.contains(meta, wanted["metadata"])
        else:
            current = reconcile.is_current(child, wanted)
        if current:
            self._current[key] = (meta.get("resourceVersion"), meta.get("generation"))
        return not current

    def _remember_current(self, namespace: str | None, live: dict) -> None:
        for (kind, name), obj in live.items():
            meta = obj.get("metadata", {})
            self._current[(kind, namespace, name)] = (
                meta.get("resourceVersion"),
                meta.get("generation"),
            )

    def prepared(self, owner: dict) -> tuple:
        """reconcile.prepare, cached per owner spec, labels and tuned ratio (render inputs)."""
        meta, status = owner.get("metadata", {}), owner.get("status") or {}
        # render reads the tuned ratio and the spec ratio it derives from (effective ratio).
        tuned = (status.get("recomputeRatio"), (status.get("tuning") or {}).get("baseRatio"))
        labels = tuple(sorted((meta.get("labels") or {}).items()))
        cache_key = (meta.get("uid"), meta.get("generation"), labels, tuned)
        if cache_key not in self._prepared:
            if len(self._prepared) > 4096:
                self._prepared.clear()
            self._prepared[cache_key] = reconcile.prepare(owner)  # InvalidSpec is not cached
        return self._prepared[cache_key]


def register(settings: OperatorSettings, registry: kopf.OperatorRegistry | None = None) -> Operator:
    """Register every handler in `registry` (kopf's default one if None)."""
    registry = registry or kopf.get_default_registry()
    operator = Operator(settings)
    resource = (GROUP, VERSION, PLURAL)

    async def on_create(body, retry, **_):
        # A retried create may follow an operator restart and a spec change: do the full job.
        await operator.run(body, "create", FIRST_CREATE if retry == 0 else FULL, retry)

    async def on_update(body, retry, **_):
        await operator.run(body, "update", FULL, retry)

    async def on_resume(body, retry, **_):
        await operator.run(body, "resume", FULL, retry)

    async def blend_deployments(body, namespace, name, **_):
        return {(namespace, name): dict(body)}

    async def on_child_event(body, type, namespace, blend_deployments, **_):
        operator.remember(blend_deployments, dict(body), type)
        owner_name = _owner_name(body)
        owners = list(blend_deployments.get((namespace, owner_name), [])) if owner_name else []
        if not owners:
            return  # not ours, or the owner is gone and the garbage collector takes the child
        if operator.is_drifted(dict(body), type, owners[0]):
            operator.request(namespace, owner_name, full=True)
        elif body.get("kind") == "Deployment":
            operator.request(namespace, owner_name, full=False)

    kopf.on.login(registry=registry)(operator.login)
    kopf.on.startup(registry=registry)(operator.startup)
    kopf.on.cleanup(registry=registry)(operator.cleanup)
    kopf.index(*resource, registry=registry, id="blend_deployments")(blend_deployments)
    kopf.on.create(*resource, registry=registry, id="reconcile-create")(on_create)
    kopf.on.update(*resource, registry=registry, id="reconcile-update")(on_update)
    kopf.on.resume(*resource, registry=registry, id="reconcile-resume")(on_resume)
    for kind in kube.CHILD_KINDS.values():
        if kind.kind != "ServiceMonitor":  # watched only where its CRD exists; see README
            kopf.on.event(
                kind.group,
                kind.api_version.rpartition("/")[2],
                kind.plural,
                registry=registry,
                id=f"child-{kind.plural}",
                labels={"app.kubernetes.io/managed-by": MANAGED_BY},
            )(on_child_event)
    return operator


def _owner_name(child: dict) -> str | None:
    for ref in child.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(GROUP + "/"):
            return ref.get("name")
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
