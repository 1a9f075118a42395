"""One idempotent reconcile of a BlendDeployment: render, apply children, prune, write status.

Children are applied with owner references (kopf.adopt) and two annotations: a hash of the
applied object, and the applied object itself. A child whose hash matches and whose live
fields still contain what was applied is left alone (no write). Otherwise it gets one JSON
merge patch: the desired object plus nulls for fields applied last time and no longer
rendered (e.g. an Ascend nodeSelector after switching to CPU), so removals happen without
replacing the object and without touching fields the API server or others own. A spec whose
child would carry more annotations than the API server accepts is invalid (InvalidSpec).
Quantities (QUANTITY_FIELDS) are compared by value: the API server stores them in
canonical form, "0.5" as "500m" and "1024Mi" as "1Gi".
"""

import asyncio
import dataclasses
import hashlib
import json
from typing import Any

import kopf
import pydantic

from holeblend_operator import kube, metrics
from holeblend_operator.api import GROUP, BlendDeployment, format_validation_error
from holeblend_operator.host_paths import DEFAULT_HOST_PATH_PREFIXES, validation_context
from holeblend_operator.quantity import quantity_value
from holeblend_operator.render import engine_name, lookup_name, render_children, selector_string
from holeblend_operator.render.labels import MANAGED_BY, instance_label
from holeblend_operator.settings import DEFAULT_POD_LISTEN_ADDRESS
from holeblend_operator.status import (
    Observed,
    Problem,
    build_status,
    invalid_spec_status,
    is_available,
    is_ready,
    without_times,
)

HASH_ANNOTATION = f"{GROUP}/input-hash"
LAST_APPLIED_ANNOTATION = f"{GROUP}/last-applied"
# The most an object's annotations may hold, keys and values in UTF-8 bytes (apimachinery's
# ValidateAnnotations, TotalAnnotationSizeLimitB). The applied copy is the child itself, so
# the engine Deployment's grows with the spec's env, arguments and pod annotations.
ANNOTATIONS_MAX_BYTES = 256 * 1024
DEPLOYMENT = kube.CHILD_KINDS["Deployment"]

# Fields of type resource.Quantity, by the last keys of their path ("*": any key, such as a
# resource name; list positions do not count). The API server re-serializes a quantity in
# canonical form (apimachinery's Quantity.String: "0.5" -> "500m", "1024Mi" -> "1Gi",
# "0.5Gi" -> "512Mi"), so these compare by value; every other field compares as written
# (an env var's "1k" is not its "1000").
QUANTITY_FIELDS = (
    ("resources", "requests", "*"),  # containers; a PersistentVolumeClaim's spec
    ("resources", "limits", "*"),
    ("overhead", "*"),  # a pod's runtime-class overhead
    ("emptyDir", "sizeLimit"),
)


class InvalidSpec(Exception):
    """The spec does not pass the API models; the message names the field and the fix."""


class Blocked(Exception):
    """Children could not be applied for a reason a person must fix (status says which)."""


@dataclasses.dataclass(frozen=True)
class Options:
    """How much work one reconcile does."""

    create_first: bool  # POST each child before looking (right after the owner was created)
    prune: bool  # list owned children and delete those no longer rendered


def parse(
    body: dict, host_path_prefixes: tuple[str, ...] = DEFAULT_HOST_PATH_PREFIXES
) -> BlendDeployment:
    context = validation_context(host_path_prefixes)
    try:
        return BlendDeployment.model_validate(dict(body), context=context)
    except pydantic.ValidationError as exc:
        raise InvalidSpec(format_validation_error(exc)) from exc


def prepare(
    body: dict,
    host_path_prefixes: tuple[str, ...] = DEFAULT_HOST_PATH_PREFIXES,
    pod_listen_address: str = DEFAULT_POD_LISTEN_ADDRESS,
) -> tuple[BlendDeployment, list[dict]]:
    """The validated spec and the desired children (InvalidSpec if the spec is invalid), whose
    servers listen on `pod_listen_address` (the operator's --pod-listen-address)."""
    bd = parse(body, host_path_prefixes)
    return bd, desired_children(bd, body, pod_listen_address)


async def reconcile(
    client: kube.Client, body: dict, options: Options, now: str, prepared=prepare
) -> dict:
    """Bring the children in line with the spec; raise if that is not possible.

    Status is written here only for problems; otherwise `refresh` writes it once the
    children's controllers have reported (the caller schedules it right after).
    Returns the children as the API server last returned them, by (kind, name).
    `prepared` may be a caching version of `prepare`."""
    try:
        bd, children = prepared(body)
    except InvalidSpec as exc:
        await _write_invalid(client, body, str(exc), now)
        raise
    problem, live = await _apply_all(client, bd, children, options)
    if problem is not None:
        observed = await observe(client, bd, problem, live)
        await write_status(client, bd, body.get("status") or {}, observed, now)
        raise Blocked(f"{problem.reason}: {problem.message}")
    return live


async def refresh(
    client: kube.Client, body: dict, now: str, known: dict | None = None, prepared=prepare
) -> bool:
    """Re-derive the status from the children (after a child changed); True if Ready.

    `known` maps (kind, name) to children as last seen on the watch, saving a GET each.
    Ready counts the lookup server, as the status does: the handlers look again (reading
    the owner afresh) only at owners not Ready, and the refresh after the lookup server's
    next event may skip its write, comparing with a watched status older than this one."""
    try:
        bd, _ = prepared(body)
    except InvalidSpec:
        return True  # the handlers already reported it; nothing to wait for
    observed = await observe(client, bd, None, known or {})
    await write_status(client, bd, body.get("status") or {}, observed, now)
    return is_ready(bd, observed)


def desired_children(
    bd: BlendDeployment, body: dict, pod_listen_address: str = DEFAULT_POD_LISTEN_ADDRESS
) -> list[dict]:
    children = render_children(bd, pod_listen_address)
    kopf.adopt(children, owner=body)
    for child in children:
        applied = _canonical(child)
        annotations = child["metadata"].setdefault("annotations", {})
        annotations[HASH_ANNOTATION] = hashlib.sha256(applied.encode()).hexdigest()[:16]
        annotations[LAST_APPLIED_ANNOTATION] = applied
        _check_annotation_size(child, body)
    return children


def _check_annotation_size(child: dict, body: dict) -> None:
    """InvalidSpec if the child's annotations, its applied copy included, exceed what the API
    server accepts: every write of it would be refused, naming an annotation nobody wrote."""
    annotations = child["metadata"]["annotations"]
    size = sum(len(key.encode()) + len(value.encode()) for key, value in annotations.items())
    if size <= ANNOTATIONS_MAX_BYTES:
        return
    fields = sorted(_field_sizes(body.get("spec") or {}), key=lambda item: -item[1])
    largest = [field for field in fields[:3] if field[1] >= 1024] or fields[:1]
    raise InvalidSpec(
        f"{child['kind']} {child['metadata']['name']} would carry {size} bytes of annotations "
        f"(its applied copy, {LAST_APPLIED_ANNOTATION}, included), over the "
        f"{ANNOTATIONS_MAX_BYTES} bytes Kubernetes allows; shorten the largest fields: "
        + ", ".join(f"spec.{path} ({num_bytes} bytes)" for path, num_bytes in largest)
    )


def _field_sizes(spec: dict) -> list[tuple[str, int]]:
    """The spec's fields two levels down (engine.env, engine.extraArgs, ...) with the size of
    their JSON text, as the applied copy spells it."""
    sizes = []
    for section, value in spec.items():
        fields = value.items() if isinstance(value, dict) else [(None, value)]
        for name, field in fields:
            path = section if name is None else f"{section}.{name}"
            sizes.append((path, len(json.dumps(field, separators=(",", ":")))))
    return sizes


# Applied before the rest, which is applied only once they all succeeded: what the pods
# read when they start (the runtime ConfigMap, blend.json) and the Services they address.
# A pod reads the restart keys of blend.json once, at start; a Deployment patched to a new
# runtime-config hash while its ConfigMap patch failed would start pods on the old file,
# and nothing restarts them once the ConfigMap is written (the hash no longer changes).
FIRST_KINDS = ("ConfigMap", "Service")


async def _apply_all(
    client: kube.Client, bd: BlendDeployment, children: list[dict], options: Options
) -> tuple[Problem | None, dict]:
    """Apply every child; the problem a person must fix (if any) and the children as written.

    In two stages, each in parallel: FIRST_KINDS, then (only if all of those were applied)
    the Deployments and the rest. A failure in the first stage leaves the Deployments as
    they were, so pods never roll to a config their ConfigMap does not hold yet."""
    uid = bd.metadata.uid
    first = [child for child in children if child["kind"] in FIRST_KINDS]
    rest = [child for child in children if child["kind"] not in FIRST_KINDS]
    try:
        results = await _apply_stage(client, first, uid, options.create_first)
        results += await _apply_stage(client, rest, uid, options.create_first)
        # A first create that finds children already there is a retry after a crash or restart:
        # an earlier spec may have left children this one no longer renders.
        if options.prune or any(action != "created" for action, _ in results):
            await prune(client, bd, children)
    except kube.Invalid as exc:
        return Problem("ChildRejected", f"the API server rejected a child: {exc}"), {}
    except ChildConflict as exc:
        return Problem("ChildConflict", str(exc)), {}
    except kube.NotServed as exc:
        message = f"{exc}; install that CRD or turn the feature off in the spec"
        return Problem("ResourceNotServed", message), {}
    return None, {(obj["kind"], obj["metadata"]["name"]): obj for _, obj in results if obj}


async def _apply_stage(
    client: kube.Client, children: list[dict], owner_uid: str | None, create_first: bool
) -> list[tuple[str, dict | None]]:
    """Apply `children` at once and wait for all of them; then raise the first failure (in
    the children's order), so that no write of a failed stage is still under way."""
    results = await asyncio.gather(
        *(apply_child(client, child, owner_uid, create_first) for child in children),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


class ChildConflict(Exception):
    """A child's name is taken by an object this BlendDeployment does not own."""


async def apply_child(
    client: kube.Client, desired: dict, owner_uid: str | None, create_first: bool
) -> tuple[str, dict | None]:
    """Create, patch or leave one child; returns what it did and the object as written."""
    kind = kube.CHILD_KINDS[desired["kind"]]
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    if create_first and (created := await client.create(kind, desired)) is not None:
        return _count(kind, "created"), created
    live = await client.get(kind, namespace, name)
    if live is None:
        if (created := await client.create(kind, desired)) is None:
            raise kube.Unavailable(f"{kind.kind} {name} appeared while being created")
        return _count(kind, "created"), created
    if not is_owned_by(live, owner_uid):
        if _is_left_by_deleted_namesake(live, desired, owner_uid):
            # Deleted and created again (`kubectl delete` + `apply`): the garbage collector
            # deletes the old owner's children in the background, soon.
            raise kube.Unavailable(
                f"{kind.kind} {namespace}/{name} still belongs to a deleted BlendDeployment "
                "of the same name; waiting for the garbage collector to delete it"
            )
        raise ChildConflict(
            f"{kind.kind} {namespace}/{name} exists and is not owned by this "
            "BlendDeployment; delete or rename it"
        )
    if is_current(live, desired):
        return _count(kind, "unchanged"), live
    patched = await client.patch(kind, namespace, name, merge_patch(live, desired))
    return _count(kind, "patched"), patched


async def prune(client: kube.Client, bd: BlendDeployment, children: list[dict]) -> None:
    """Delete owned children that the spec no longer renders (lookup server off, ...)."""
    selector = (
        f"app.kubernetes.io/instance={instance_label(bd)},app.kubernetes.io/managed-by={MANAGED_BY}"
    )
    wanted = {(child["kind"], child["metadata"]["name"]) for child in children}
    found = await asyncio.gather(
        *(client.list(kind, bd.metadata.namespace, selector) for kind in kube.CHILD_KINDS.values())
    )
    for kind, objects in zip(kube.CHILD_KINDS.values(), found, strict=True):
        for obj in objects:
            name = obj["metadata"]["name"]
            if is_owned_by(obj, bd.metadata.uid) and (kind.kind, name) not in wanted:
                await client.delete(kind, bd.metadata.namespace, name)
                _count(kind, "deleted")


async def observe(
    client: kube.Client, bd: BlendDeployment, problem: Problem | None, known: dict
) -> Observed:
    """The engine and lookup Deployments (from `known` where possible) and, while the
    controller reports engine pods that are not ready, those pods (for the reason)."""
    name = bd.metadata.name
    lookup_wanted = bd.spec.lookup_server.enabled
    engine, lookup = await asyncio.gather(
        _deployment(client, bd, engine_name(name), known),
        _deployment(client, bd, lookup_name(name), known) if lookup_wanted else _none(),
    )
    pods: list[dict] = []
    if has_unready_pods(engine, bd.spec.replicas):
        pods = await client.list(kube.PODS, bd.metadata.namespace, selector_string(bd))
    return Observed(engine=engine, lookup=lookup, engine_pods=pods, problem=problem)


async def _deployment(
    client: kube.Client, bd: BlendDeployment, name: str, known: dict
) -> dict | None:
    if ("Deployment", name) in known:
        return known[("Deployment", name)]
    return await client.get(DEPLOYMENT, bd.metadata.namespace, name)


def has_unready_pods(deployment: dict | None, replicas: int) -> bool:
    """The Deployment controller has reported, and its rollout is not complete: pods of the
    current template are missing or not available yet, or old ones are still running. The
    pods then tell why (a new pod in CrashLoopBackOff while the old one still serves)."""
    if deployment is None or "status" not in deployment:
        return False  # just created: nothing to diagnose until the controller reports
    return not is_available(deployment, replicas)


async def write_status(
    client: kube.Client, bd: BlendDeployment, current: dict, observed: Observed, now: str
) -> bool:
    """Patch the status if anything but transition times changed; True if it wrote."""
    new = build_status(bd, observed, current.get("conditions") or [], now)
    return await _patch_status(client, bd.metadata.namespace, bd.metadata.name, current, new)


async def _write_invalid(client: kube.Client, body: dict, message: str, now: str) -> None:
    meta, current = body.get("metadata", {}), body.get("status") or {}
    new = invalid_spec_status(meta.get("generation"), message, current.get("conditions") or [], now)
    await _patch_status(client, meta.get("namespace"), meta.get("name"), current, new)


async def _patch_status(
    client: kube.Client, namespace: str, name: str, current: dict, new: dict
) -> bool:
    """Merge-patch `new` onto the status unless only transition times would change."""
    if is_contained(without_times(new), without_times(current)):
        return False
    await client.patch_status(namespace, name, new)
    metrics.STATUS_WRITES.inc()
    return True


def is_contained(new: dict, current: dict) -> bool:
    """True if merge-patching `new` onto `current` would change nothing."""
    for key, value in new.items():
        live = current.get(key)
        if isinstance(value, dict) and isinstance(live, dict):
            if not is_contained(value, live):
                return False
        elif live != value:
            return False
    return True


def _is_left_by_deleted_namesake(live: dict, desired: dict, owner_uid: str | None) -> bool:
    """Whether `live` is owned by an earlier BlendDeployment of our owner's name (another
    uid): names are unique, so that one is gone, and its dependents go with it (an orphaning
    delete removes the owner references first)."""

    def owner(ref: dict) -> tuple:  # the group, not the version: the CRD may have moved on
        return (str(ref.get("apiVersion")).split("/")[0], ref.get("kind"), ref.get("name"))

    ours = [owner(ref) for ref in desired["metadata"].get("ownerReferences") or []]
    return any(
        owner(ref) in ours and ref.get("uid") != owner_uid
        for ref in live.get("metadata", {}).get("ownerReferences") or []
    )


def is_owned_by(obj: dict, owner_uid: str | None) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner_uid for ref in refs)


def is_current(live: dict, desired: dict) -> bool:
    """Same inputs as last applied, and nobody changed the applied fields since."""
    live_hash = live.get("metadata", {}).get("annotations", {}).get(HASH_ANNOTATION)
    desired_hash = desired["metadata"]["annotations"][HASH_ANNOTATION]
    return live_hash == desired_hash and contains(live, desired)


def contains(live: Any, desired: Any, path: tuple[str, ...] = ()) -> bool:
    """Every field of `desired` is in `live` with the same value (server defaults may add more).

    `path` holds the keys that lead to both (list positions left out), for QUANTITY_FIELDS."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and contains(live[k], v, (*path, k)) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(contains(a, b, path) for a, b in zip(live, desired, strict=True))
        )
    if is_quantity_field(path):
        return _same_quantity(live, desired)
    # The API server may return 8 where "8" was sent (ports): compare as text.
    return live == desired or str(live) == str(desired)


def is_quantity_field(path: tuple[str, ...]) -> bool:
    """Whether the field at `path` is a Kubernetes quantity (one of QUANTITY_FIELDS)."""
    return any(_ends_with(path, field) for field in QUANTITY_FIELDS)


def _ends_with(path: tuple[str, ...], field: tuple[str, ...]) -> bool:
    tail = path[-len(field) :]
    return len(tail) == len(field) and all(
        want in ("*", key) for want, key in zip(field, tail, strict=True)
    )


def _same_quantity(live: Any, desired: Any) -> bool:
    try:
        return quantity_value(live) == quantity_value(desired)
    except ValueError:  # not a quantity (edited by hand): as text, like any other field
        return str(live) == str(desired)


def merge_patch(live: dict, desired: dict) -> dict:
    """A JSON merge patch with only what differs from `live`, plus nulls for fields that were
    applied last time and are no longer rendered. Lists are replaced whole (merge-patch rules)."""
    applied_before = live.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED_ANNOTATION)
    previous = json.loads(applied_before) if applied_before else {}
    return _merged(_changes(live, desired, previous), _removals(previous, desired))


def _changes(live: dict, desired: dict, previous: dict, path: tuple[str, ...] = ()) -> dict:
    """What differs from `live`, and (whole) every list or value rendered otherwise than
    last time (`previous`): `contains` lets a list's items hold more than desired (server
    defaults), so a field dropped inside one (a container's memory limit) would otherwise
    never be removed. A merge patch replaces a list whole, dropped fields included.
    Quantities equal in value are no change (`contains`)."""
    changes: dict[str, Any] = {}
    for key, value in desired.items():
        current = live.get(key)
        before = previous.get(key) if isinstance(previous, dict) else None
        where = (*path, key)
        if isinstance(value, dict) and isinstance(current, dict):
            nested = _changes(current, value, before if isinstance(before, dict) else {}, where)
            if nested:
                changes[key] = nested
        elif (
            key not in live
            or not contains(current, value, where)
            or (before is not None and not _is_same(before, value, where))
        ):
            changes[key] = value
    return changes


def _is_same(before: Any, value: Any, path: tuple[str, ...]) -> bool:
    """The same fields with the same values (quantities by value): nothing was dropped."""
    return contains(before, value, path) and contains(value, before, path)


def _removals(previous: dict, desired: dict) -> dict:
    removals: dict[str, Any] = {}
    for key, old in previous.items():
        if key not in desired:
            removals[key] = None
        elif (
            isinstance(old, dict)
            and isinstance(desired[key], dict)
            and (nested := _removals(old, desired[key]))
        ):
            removals[key] = nested
    return removals


def _merged(changes: dict, removals: dict) -> dict:
    merged = dict(changes)
    for key, value in removals.items():
        merged[key] = _merged(changes.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def _canonical(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _count(kind: kube.Kind, action: str) -> str:
    metrics.CHILD_WRITES.labels(kind=kind.kind, action=action).inc()
    return action


async def _none() -> None:
    return None
