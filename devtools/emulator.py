"""A Kubernetes API emulator for tests, the demo and benchmarks, built on kmock.

kmock serves discovery, watch buses and the object store. This subclass adds what an
operator and kubectl rely on and kmock leaves out:

- object lookup by direct key and lists from a per-namespace index, so the cost of a
  request does not grow with the number of stored objects (kmock scans them all);
- uid, resourceVersion, generation, creationTimestamp, generateName, optimistic
  concurrency (409 on a stale resourceVersion), watches that resume from a resourceVersion;
- the status subresource (the main resource ignores status, /status ignores the rest)
  and the scale subresource (autoscaling/v1 Scale);
- PUT, server-side apply as an upsert, JSON patch with `test` ops (422 on failure);
- defaults from a CRD's structural schema, label selectors, owner-reference garbage collection, CRDs installed from their YAML
  (also by `kubectl apply -f crd.yaml`) with server-side printing of printer columns;
- kubectl fixes: core `/api/v1` reports groupVersion `v1`, lists carry kind/apiVersion;
- scripted faults (status codes, delays) for retry tests;
- optionally a stand-in Deployment controller and scheduler (see `workloads`).
"""

import asyncio
import collections
import contextlib
import copy
import dataclasses
import datetime
import json
import uuid
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import apps, dicts, references, rendering

from holeblend_devtools import schemas, selectors, tables, workloads

Resource = references.resource
CRD_RESOURCE = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
DEPLOYMENTS = Resource("apps", "v1", "deployments")
PODS = Resource("", "v1", "pods")
# Seconds a watch stays open when the client names no timeoutSeconds.
DEFAULT_WATCH_SECONDS = 3600
# Metadata a Scale object carries over from its owner.
_SCALE_META = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
# Watch events kept for clients that resume from a resourceVersion.
EVENT_LOG_SIZE = 200_000

# Printer columns of the built-in kinds the demo shows (the real server has many more).
BUILTIN_COLUMNS = {
    DEPLOYMENTS: (
        tables.PrinterColumn("Replicas", "integer", ".spec.replicas"),
        tables.PrinterColumn("Ready", "integer", ".status.readyReplicas"),
        tables.PrinterColumn(
            "Available", "string", '.status.conditions[?(@.type=="Available")].status'
        ),
    ),
    Resource("", "v1", "services"): (tables.PrinterColumn("Type", "string", ".spec.type"),),
    PODS: (tables.PrinterColumn("Status", "string", ".status.phase"),),
}


@dataclasses.dataclass
class Fault:
    """A scripted misbehaviour: answer the next `times` matching requests with `status`."""

    verb: str  # get, list, watch, create, patch, update, delete, or "*" for any
    plural: str | None = None  # resource plural; None matches any resource
    status: int | None = 503  # HTTP status to answer with; None serves normally after the delay
    times: int = 1  # matching requests affected; the fault is gone after that
    delay: float = 0.0  # seconds to wait first; longer than a client's timeout is a timeout
    name: str | None = None  # object name; None matches any

    def matches(self, verb: str, request: rendering.Request) -> bool:
        return (
            self.times > 0
            and self.verb in ("*", verb)
            and self.plural in (None, request.resource.plural)
            and self.name in (None, request.name)
        )


@dataclasses.dataclass(frozen=True)
class ScalePaths:
    """Where a resource keeps what its scale subresource reads and writes."""

    spec_replicas: str = ".spec.replicas"
    status_replicas: str = ".status.replicas"
    selector: str | None = ".status.selector"


class ApiError(kmock.KubernetesError):
    """A Kubernetes Status error with a standard reason (AlreadyExists, Conflict, ...)."""


def _error(status: int, reason: str, message: str) -> ApiError:
    return ApiError(status=status, reason=reason, message=message, details={})


@attrs.define(kw_only=True)
class ClusterEmulator(kmock.KubernetesEmulator):
    """The emulator; use as `async with ClusterEmulator() as api, kmock.Server(api): ...`."""

    node: workloads.Node | None = None  # when set, Deployments settle as on that node
    collect_garbage: bool = True  # delete dependents of deleted owners, like the GC controller
    keep_requests: bool = True  # record requests (kmock's `requests`); off for long benchmarks
    max_history: int = 2  # object versions kept for assertions (kmock keeps all by default)
    faults: list[Fault] = attrs.field(factory=list)

    _rv: int = attrs.field(default=0, init=False)
    _names: dict = attrs.field(factory=lambda: collections.defaultdict(dict), init=False)
    _scales: dict = attrs.field(factory=dict, init=False)
    _columns: dict = attrs.field(factory=lambda: dict(BUILTIN_COLUMNS), init=False)
    _log: collections.deque = attrs.field(
        factory=lambda: collections.deque(maxlen=EVENT_LOG_SIZE), init=False
    )
    _tasks: set = attrs.field(factory=set, init=False)
    _schemas: dict = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        self._scales[DEPLOYMENTS] = ScalePaths(selector=".spec.selector")

    # --- public helpers -------------------------------------------------------------

    def install_crd(self, crd: dict[str, Any]) -> None:
        """Serve the custom resource a CRD declares (first served version)."""
        spec = crd["spec"]
        version = next(v for v in spec["versions"] if v.get("served", True))
        resource = Resource(spec["group"], version["name"], spec["names"]["plural"])
        subresources = version.get("subresources") or {}
        self.resources[resource] = kmock.ResourceInfo(
            kind=spec["names"]["kind"],
            singular=spec["names"].get("singular", spec["names"]["kind"].lower()),
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            shortnames=set(spec["names"].get("shortNames", [])),
            categories=set(spec["names"].get("categories", [])),
            subresources=set(subresources),
            verbs={
                "get",
                "list",
                "watch",
                "create",
                "patch",
                "update",
                "delete",
                "deletecollection",
            },
        )
        if "scale" in subresources:
            self._scales[resource] = _scale_paths(subresources["scale"])
        self._schemas[resource] = (version.get("schema") or {}).get("openAPIV3Schema") or {}
        columns = version.get("additionalPrinterColumns") or []
        self._columns[resource] = tuple(tables.PrinterColumn.from_crd(c) for c in columns)

    def get_object(self, resource: Resource | str, namespace: str | None, name: str) -> dict | None:
        """The stored object (a copy), or None."""
        key = (Resource(resource), namespace, name)
        obj = self._objects._objects.get(key)
        return None if obj is None or obj.deleted else copy.deepcopy(obj.raw)

    def list_objects(self, resource: Resource | str, namespace: str | None = None) -> list[dict]:
        """Stored objects of a resource (copies), in creation order."""
        resource = Resource(resource)
        return [copy.deepcopy(self._stored(k).raw) for k in self._keys(resource, namespace, ())]

    async def put_object(self, resource: Resource | str, body: dict[str, Any]) -> dict:
        """Create an object as if a client POSTed it (e.g. a Node or a hand-made Pod)."""
        resource = Resource(resource)
        async with self._lock:
            return await self._insert(resource, body.get("metadata", {}).get("namespace"), body)

    async def edit_object(
        self, resource: Resource | str, namespace: str | None, name: str, patch: dict
    ) -> dict:
        """Merge-patch an object as if a person edited it by hand (status included)."""
        resource = Resource(resource)
        async with self._lock:
            old = self._require((resource, namespace, name))
            new = dicts.merge_patch_dict(copy.deepcopy(old), patch)
            return await self._commit(resource, (resource, namespace, name), old, dict(new))

    async def delete_object(
        self, resource: Resource | str, namespace: str | None, name: str
    ) -> None:
        """Delete an object at once, as a client's DELETE would (dependents are collected)."""
        resource = Resource(resource)
        async with self._lock:
            if self._exists((resource, namespace, name)):
                await self._delete_now(resource, (resource, namespace, name))

    def count_objects(self, resource: Resource | str, namespace: str | None, predicate) -> int:
        """How many stored objects satisfy `predicate(obj)`; no copies (for polling loops)."""
        keys = self._keys(Resource(resource), namespace, ())
        return sum(1 for key in keys if predicate(self._stored(key).raw))

    def take_requests(self) -> list[rendering.Request]:
        """The requests recorded so far (kmock's log), clearing the log."""
        taken, self._requests[:] = list(self._requests), []
        return taken

    # --- kmock overrides ------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        response = await super().__call__(raw_request)
        if not self.keep_requests:
            self._requests.clear()
        return response

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        # kubectl rejects the core group's "/v1" (kmock joins an empty group with a slash).
        payload = await super()._serve_version(request)
        if request.resource is not None and request.resource.group == "":
            payload["groupVersion"] = request.resource.version
        for entry in payload["resources"]:
            if "/" in entry["name"]:  # subresources have no short names of their own
                entry.update(shortNames=[], categories=[], singularName="")
                if entry["name"].endswith("/scale"):
                    entry.update(kind="Scale", group="autoscaling", version="v1")
        return payload

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.resource.plural is None:
            return await apps.RawHandler._handle(self, request)  # discovery, /version, ...
        verb = _verb(request)
        try:
            await self._apply_faults(verb, request)
            return await self._route(verb)(request)
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)

    # --- routing --------------------------------------------------------------------

    def _route(self, verb: str):
        routes = {
            "watch": self._watch,
            "list": self._list,
            "get": self._get,
            "create": self._create,
            "patch": self._patch,
            "update": self._replace,
            "delete": self._delete,
            "deletecollection": self._delete_collection,
        }
        if verb not in routes:
            raise _error(405, "MethodNotAllowed", f"{verb} is not supported here")
        return routes[verb]

    async def _apply_faults(self, verb: str, request: rendering.Request) -> None:
        for fault in self.faults:
            if fault.matches(verb, request):
                fault.times -= 1
                await asyncio.sleep(fault.delay)
                if fault.status is not None:
                    raise _error(fault.status, _reason(fault.status), f"injected fault: {verb}")
                return

    def _info(self, resource: Resource) -> kmock.ResourceInfo:
        if resource not in self.resources:
            raise _error(
                404,
                "NotFound",
                f"the server could not find the requested resource ({resource.plural})",
            )
        return self.resources[resource]

    # --- reads ----------------------------------------------------------------------

    async def _get(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._info(request.resource)
        obj = self._require(self._key(request))
        if request.subresource == "scale":
            return _json(self._scale_of(request.resource, obj))
        if _wants_table(request):
            return _json(self._table(request.resource, [obj]))
        return _json(obj)

    async def _list(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        info = self._info(request.resource)
        requirements = selectors.parse(request.params.get("labelSelector"))
        names = _field_names(request.params.get("fieldSelector"))
        keys = self._keys(request.resource, request.namespace, requirements)
        items = [self._stored(k).raw for k in keys if names is None or k[2] in names]
        if _wants_table(request):
            return _json(self._table(request.resource, items))
        return _json(
            {
                "apiVersion": _api_version(request.resource),
                "kind": f"{info.kind}List",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )

    def _keys(self, resource: Resource, namespace: str | None, requirements: tuple) -> list:
        if namespace is not None:
            spaces = [namespace]
        else:
            spaces = [ns for (res, ns) in list(self._names) if res == resource]
        keys = [
            (resource, ns, name) for ns in spaces for name in self._names.get((resource, ns), {})
        ]
        if not requirements:
            return keys
        return [k for k in keys if selectors.matches(requirements, _labels(self._stored(k).raw))]

    async def _watch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._info(request.resource)
        requirements = selectors.parse(request.params.get("labelSelector"))
        since = request.params.get("resourceVersion") or None
        seconds = float(request.params.get("timeoutSeconds") or DEFAULT_WATCH_SECONDS)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        bus = self._buses[request.resource]
        async with self._lock:
            marker = await bus.mark()
            backlog = self._backlog(request, requirements, since)
        try:
            async with asyncio.timeout(seconds):
                for event in backlog:
                    await _write_event(response, event)
                async for event in bus.stream(since=marker):
                    if self._event_matches(request, requirements, event):
                        await _write_event(response, event)
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(ValueError, RuntimeError):  # gone at loop shutdown
                await bus.unmark(marker)
        return response

    def _backlog(self, request: rendering.Request, requirements: tuple, since: str | None) -> list:
        if since in (None, "0"):
            keys = self._keys(request.resource, request.namespace, requirements)
            return [{"type": "ADDED", "object": self._stored(k).raw} for k in keys]
        if not since.isdigit() or (self._log and int(since) < self._log[0][0] - 1):
            gone = {
                "kind": "Status",
                "apiVersion": "v1",
                "code": 410,
                "reason": "Expired",
                "status": "Failure",
                "message": f"too old resource version: {since}",
            }
            return [{"type": "ERROR", "object": gone}]
        return [
            event
            for rv, resource, event in self._log
            if rv > int(since)
            and resource == request.resource
            and self._event_matches(request, requirements, event)
        ]

    def _event_matches(self, request: rendering.Request, requirements: tuple, event: dict) -> bool:
        meta = event.get("object", {}).get("metadata", {})
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        return selectors.matches(requirements, meta.get("labels"))

    def _table(self, resource: Resource, items: list[dict]) -> dict:
        return tables.render_table(self._columns.get(resource, ()), items, str(self._rv))

    # --- writes ---------------------------------------------------------------------

    async def _create(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._info(request.resource)
        body = _body(request)
        if not isinstance(body, dict):
            raise _error(400, "BadRequest", "the request body must be a JSON object")
        async with self._lock:
            created = await self._insert(request.resource, request.namespace, body)
        return _json(created, status=201)

    async def _insert(
        self, resource: Resource, namespace: str | None, body: dict, keep_status: bool = False
    ) -> dict:
        info = self._info(resource)
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        name = meta.get("name") or _generated_name(meta.get("generateName"))
        if not name:
            raise _error(
                422, "Invalid", "metadata.name: Required value: name or generateName is required"
            )
        namespace = (namespace or meta.get("namespace") or "default") if info.namespaced else None
        key = (resource, namespace, name)
        if self._exists(key):
            raise _error(409, "AlreadyExists", f'{resource.plural} "{name}" already exists')
        body.setdefault("apiVersion", _api_version(resource))
        body.setdefault("kind", info.kind)
        if "status" in info.subresources and not keep_status:  # clients set status via /status
            body.pop("status", None)
        body = schemas.with_defaults(body, self._schemas.get(resource, {}))
        meta = body["metadata"]
        self._rv += 1
        meta.update(
            name=name,
            uid=str(uuid.uuid4()),
            resourceVersion=str(self._rv),
            generation=1,
            creationTimestamp=_now(),
        )
        meta.pop("generateName", None)
        if namespace is not None:
            meta["namespace"] = namespace
        self._store(key, body)
        await self._emit(resource, "ADDED", body)
        self._after_write(resource, key, None, body)
        return body

    async def _patch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._info(request.resource)
        content_type = request.headers.get("Content-Type", "")
        key = self._key(request)
        async with self._lock:
            if "apply-patch" in content_type and not self._exists(key):
                body = dict(
                    _body(request),
                    metadata={**_body(request).get("metadata", {}), "name": request.name},
                )
                return _json(
                    await self._insert(request.resource, request.namespace, body), status=201
                )
            old = self._require(key)
            new = self._patched(request, old, content_type)
            result = await self._commit(request.resource, key, old, new)
        if request.subresource == "scale":
            return _json(self._scale_of(request.resource, result))
        return _json(result)

    def _patched(self, request: rendering.Request, old: dict, content_type: str) -> dict:
        patch = _body(request)
        if request.subresource == "scale":
            return self._with_replicas(request.resource, old, patch)
        if "json-patch" in content_type:
            new = _json_patch(old, patch)
        else:
            _check_version(old, patch)
            new = dict(dicts.merge_patch_dict(copy.deepcopy(old), patch or {}))
        return self._restrict(request, old, new)

    async def _replace(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._info(request.resource)
        key = self._key(request)
        body = _body(request)
        async with self._lock:
            old = self._require(key)
            _check_version(old, body)
            if request.subresource == "scale":
                new = self._with_replicas(request.resource, old, body)
            else:
                new = self._restrict(
                    request,
                    old,
                    {
                        **copy.deepcopy(body),
                        "metadata": {**old["metadata"], **body.get("metadata", {})},
                    },
                )
            result = await self._commit(request.resource, key, old, new)
        if request.subresource == "scale":
            return _json(self._scale_of(request.resource, result))
        return _json(result)

    def _restrict(self, request: rendering.Request, old: dict, new: dict) -> dict:
        """Apply the status-subresource rules: each endpoint changes only its own part."""
        info = self._info(request.resource)
        if request.subresource == "status":
            result = {k: v for k, v in old.items() if k != "status"}
            if new.get("status") is not None:
                result["status"] = new["status"]
            return result
        if "status" in info.subresources:
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                new["status"] = old["status"]
        meta = dict(new.get("metadata") or {})
        for field in ("uid", "creationTimestamp", "generation", "name", "namespace"):
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
        new["metadata"] = meta
        return new

    async def _commit(self, resource: Resource, key: tuple, old: dict, new: dict) -> dict:
        """Store a changed object: bump resourceVersion and generation, notify watchers."""
        new = schemas.with_defaults(new, self._schemas.get(resource, {}))
        if new == old:
            return old
        new["metadata"] = dict(new["metadata"])
        if _spec_of(new) != _spec_of(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(resource, key, new)
            return new
        self._store(key, new)
        await self._emit(resource, "MODIFIED", new)
        self._after_write(resource, key, old, new)
        return new

    async def _delete(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._info(request.resource)
        key = self._key(request)
        async with self._lock:
            obj = self._require(key)
            if obj["metadata"].get("finalizers"):
                if obj["metadata"].get("deletionTimestamp"):
                    return _json(obj)
                marked = {**obj, "metadata": {**obj["metadata"], "deletionTimestamp": _now()}}
                return _json(await self._commit(request.resource, key, obj, marked))
            await self._delete_now(request.resource, key)
        return _json(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Success",
                "details": {
                    "name": request.name,
                    "kind": request.resource.plural,
                    "uid": obj["metadata"]["uid"],
                },
            }
        )

    async def _delete_collection(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._info(request.resource)
        requirements = selectors.parse(request.params.get("labelSelector"))
        async with self._lock:
            for key in self._keys(request.resource, request.namespace, requirements):
                await self._delete_now(request.resource, key)
        return _json({"kind": "Status", "apiVersion": "v1", "status": "Success"})

    async def _delete_now(self, resource: Resource, key: tuple) -> None:
        """Remove a stored object; its DELETED event carries a new resourceVersion."""
        obj = self._stored(key).raw
        self._rv += 1
        gone = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self._rv)}}
        await self._remove(resource, key, gone)

    async def _remove(self, resource: Resource, key: tuple, last: dict) -> None:
        self._objects._objects[key].delete()
        self._names[(resource, key[1])].pop(key[2], None)
        await self._emit(resource, "DELETED", last)
        if self.collect_garbage:
            await self._collect_dependents(last["metadata"]["uid"])

    async def _collect_dependents(self, owner_uid: str) -> None:
        # Background propagation: dependents go after their owner, then their own dependents.
        for (resource, namespace), names in list(self._names.items()):
            for name in list(names):
                key = (resource, namespace, name)
                refs = self._stored(key).raw["metadata"].get("ownerReferences") or []
                if any(ref.get("uid") == owner_uid for ref in refs):
                    await self._delete_now(resource, key)

    # --- store ----------------------------------------------------------------------

    def _key(self, request: rendering.Request) -> tuple:
        info = self._info(request.resource)
        return (request.resource, request.namespace if info.namespaced else None, request.name)

    def _stored(self, key: tuple) -> kmock.Object:
        return self._objects._objects[key]

    def _exists(self, key: tuple) -> bool:
        obj = self._objects._objects.get(key)
        return obj is not None and not obj.deleted

    def _require(self, key: tuple) -> dict:
        if not self._exists(key):
            raise _error(404, "NotFound", f'{key[0].plural} "{key[2]}" not found')
        return self._stored(key).raw

    def _store(self, key: tuple, body: dict) -> None:
        obj = self._objects._objects.get(key)
        if obj is None:
            self._objects[key] = body
        else:
            obj.create(body)
            if len(obj.history) > self.max_history:
                del obj.history[: -self.max_history]
        self._names[(key[0], key[1])][key[2]] = None

    async def _emit(self, resource: Resource, kind: str, obj: dict) -> None:
        event = {"type": kind, "object": obj}
        self._log.append((self._rv, resource, event))
        await self._buses[resource].put(event)

    # --- scale subresource ----------------------------------------------------------

    def _scale_of(self, resource: Resource, obj: dict) -> dict:
        paths = self._scale_paths(resource)
        selector = tables.evaluate(paths.selector, obj) if paths.selector else None
        if isinstance(selector, dict):  # Deployments keep a structured selector in spec
            selector = ",".join(f"{k}={v}" for k, v in selector.get("matchLabels", {}).items())
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {k: v for k, v in obj["metadata"].items() if k in _SCALE_META},
            "spec": {"replicas": tables.evaluate(paths.spec_replicas, obj) or 0},
            "status": {
                "replicas": tables.evaluate(paths.status_replicas, obj) or 0,
                "selector": selector or "",
            },
        }

    def _with_replicas(self, resource: Resource, old: dict, scale: dict) -> dict:
        replicas = (scale or {}).get("spec", {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise _error(
                422, "Invalid", "spec.replicas: Invalid value: must be a non-negative integer"
            )
        path = self._scale_paths(resource).spec_replicas.strip(".").split(".")
        new = copy.deepcopy(old)
        target = new
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = replicas
        return new

    def _scale_paths(self, resource: Resource) -> ScalePaths:
        if resource not in self._scales:
            raise _error(404, "NotFound", f"{resource.plural} has no scale subresource")
        return self._scales[resource]

    # --- stand-in controllers -------------------------------------------------------

    def _after_write(self, resource: Resource, key: tuple, old: dict | None, new: dict) -> None:
        if resource == CRD_RESOURCE:
            self.install_crd(new)
        elif (
            resource == DEPLOYMENTS
            and self.node is not None
            and _spec_of(new) != _spec_of(old or {})
        ):
            task = asyncio.get_running_loop().create_task(self._settle_deployment(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _settle_deployment(self, key: tuple) -> None:
        async with self._lock:
            if not self._exists(key):
                return
            deployment = self._stored(key).raw
            reason = workloads.unschedulable_reason(deployment, self.node)
            status = workloads.deployment_status(deployment, reason)
            await self._commit(DEPLOYMENTS, key, deployment, {**deployment, "status": status})
            await self._sync_pending_pods(self._stored(key).raw, reason)

    async def _sync_pending_pods(self, deployment: dict, reason: str | None) -> None:
        namespace = deployment["metadata"]["namespace"]
        for pod in workloads.pending_pods(deployment, reason) if reason else []:
            if not self._exists((PODS, namespace, pod["metadata"]["name"])):
                owner = {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": deployment["metadata"]["name"],
                    "uid": deployment["metadata"]["uid"],
                    "controller": True,
                }
                pod["metadata"]["ownerReferences"] = [owner]
                await self._insert(PODS, namespace, pod, keep_status=True)
        if reason is None:
            for key in self._owned_by(PODS, namespace, deployment["metadata"]["uid"]):
                await self._delete_now(PODS, key)

    def _owned_by(self, resource: Resource, namespace: str, uid: str) -> list:
        keys = self._keys(resource, namespace, ())
        return [
            k
            for k in keys
            if any(
                r.get("uid") == uid
                for r in self._stored(k).raw["metadata"].get("ownerReferences", [])
            )
        ]


# --- request helpers ----------------------------------------------------------------


def _verb(request: rendering.Request) -> str:
    method = request.method.value if hasattr(request.method, "value") else str(request.method)
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name else "list"
    if method == "DELETE":
        return "delete" if request.name else "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method, method.lower())


def _body(request: rendering.Request) -> Any:
    if "protobuf" in request.headers.get("Content-Type", ""):
        raise _error(415, "UnsupportedMediaType", "protobuf bodies are not supported; send JSON")
    if request.data is not None and not isinstance(request.data, str | bytes):
        return request.data
    if request.text:
        return yaml.safe_load(request.text)  # server-side apply bodies may be YAML
    return None


def _wants_table(request: rendering.Request) -> bool:
    return "as=Table" in request.headers.get("Accept", "")


def _field_names(selector: str | None) -> set[str] | None:
    if not selector:
        return None
    names = {
        v
        for k, _, v in (t.partition("=") for t in selector.split(","))
        if k.strip() == "metadata.name"
    }
    return names or None


def _check_version(old: dict, body: Any) -> None:
    wanted = (
        (body or {}).get("metadata", {}).get("resourceVersion") if isinstance(body, dict) else None
    )
    if wanted and wanted != old["metadata"]["resourceVersion"]:
        raise _error(
            409,
            "Conflict",
            "the object has been modified; please apply your changes to the latest version and try again",
        )


def _json_patch(old: dict, ops: Any) -> dict:
    try:
        return jsonpatch.apply_patch(copy.deepcopy(old), ops)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
        raise _error(422, "Invalid", f"the JSON patch does not apply: {exc}") from exc


def _spec_of(obj: dict) -> dict:
    # Everything but metadata and status counts for generation, as for custom resources.
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _labels(obj: dict) -> dict:
    return obj.get("metadata", {}).get("labels") or {}


def _api_version(resource: Resource) -> str:
    return resource.version if resource.group == "" else f"{resource.group}/{resource.version}"


def _generated_name(prefix: str | None) -> str | None:
    return f"{prefix}{uuid.uuid4().hex[:5]}" if prefix else None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _reason(status: int) -> str:
    return {
        409: "Conflict",
        429: "TooManyRequests",
        500: "InternalError",
        503: "ServiceUnavailable",
        504: "Timeout",
    }.get(status, "InternalError")


def _scale_paths(scale: dict) -> ScalePaths:
    return ScalePaths(
        spec_replicas=scale.get("specReplicasPath", ".spec.replicas"),
        status_replicas=scale.get("statusReplicasPath", ".status.replicas"),
        selector=scale.get("labelSelectorPath"),
    )


def _json(payload: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(
        text=json.dumps(payload), status=status, content_type="application/json"
    )


async def _write_event(response: aiohttp.web.StreamResponse, event: dict) -> None:
    await response.write(json.dumps(event).encode() + b"\n")


def write_kubeconfig(path: str, url: str, namespace: str = "default") -> None:
    """A kubeconfig that points kubectl, kopf and the kubernetes client at the emulator."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url.rstrip("/")}}],
        "users": [{"name": "emulator", "user": {"token": "emulator"}}],
        "contexts": [
            {
                "name": "emulator",
                "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
            }
        ],
        "current-context": "emulator",
    }
    with open(path, "w") as file:
        yaml.safe_dump(config, file)
