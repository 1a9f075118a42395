"""The one module of the operator that talks to the Kubernetes API.

Requests go through the `kubernetes` client's connection pool and credentials (kubeconfig
or in-cluster) on a small thread pool, as raw JSON: no model classes, no discovery.
`ACCESS` lists every (resource, verb) the operator uses; each request is checked against it,
and the RBAC manifest is generated from it, so the two cannot drift apart.

Failures are sorted for the caller: a missing object is `None` (or `False`), an object that
already exists is `None` from `create`, a rejected object raises `Invalid`, and anything
worth retrying (timeouts, connection errors, 409 conflicts, 429 and 5xx) raises
`Unavailable`, which the handlers turn into `kopf.TemporaryError` with a backoff.
"""

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import urllib.parse
from typing import Any

import kopf
import kubernetes.client
import kubernetes.config
import urllib3.exceptions

from holeblend_operator import metrics
from holeblend_operator.api import GROUP, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"


@dataclasses.dataclass(frozen=True)
class Kind:
    """A resource the operator uses, and what it does with it."""

    api_version: str  # "apps/v1", or "v1" for the core group
    kind: str
    plural: str
    verbs: tuple[str, ...]  # the RBAC verbs the operator needs
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def path(
        self, namespace: str | None, name: str | None = None, subresource: str | None = None
    ) -> str:
        root = "/api/v1" if self.group == "" else f"/apis/{self.api_version}"
        parts = [
            root,
            f"namespaces/{namespace}" if self.namespaced and namespace else None,
            self.plural,
            name,
            subresource,
        ]
        return "/".join(part for part in parts if part)


_CHILD_VERBS = ("get", "list", "watch", "create", "patch", "delete")
BLEND_DEPLOYMENT = Kind(
    f"{GROUP}/{VERSION}", "BlendDeployment", PLURAL, ("get", "list", "watch", "patch")
)
BLEND_DEPLOYMENT_STATUS = Kind(
    f"{GROUP}/{VERSION}", "BlendDeployment", f"{PLURAL}/status", ("get", "patch")
)
PODS = Kind("v1", "Pod", "pods", ("list",))
# Children by kind, as the render functions name them.
CHILD_KINDS = {
    "Deployment": Kind("apps/v1", "Deployment", "deployments", _CHILD_VERBS),
    "Service": Kind("v1", "Service", "services", _CHILD_VERBS),
    "ConfigMap": Kind("v1", "ConfigMap", "configmaps", _CHILD_VERBS),
    "PodDisruptionBudget": Kind(
        "policy/v1", "PodDisruptionBudget", "poddisruptionbudgets", _CHILD_VERBS
    ),
    "ServiceMonitor": Kind(
        "monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors", _CHILD_VERBS
    ),
}
# What kopf itself needs: events for handler outcomes, namespaces and CRDs for its scans,
# peering objects for `--peering` (HA: one active operator at a time).
FRAMEWORK_KINDS = (
    Kind("v1", "Event", "events", ("create",)),
    Kind("events.k8s.io/v1", "Event", "events", ("create",)),
    Kind("v1", "Namespace", "namespaces", ("list", "watch"), namespaced=False),
    Kind(
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        ("list", "watch"),
        namespaced=False,
    ),
    Kind(
        "kopf.dev/v1",
        "ClusterKopfPeering",
        "clusterkopfpeerings",
        ("list", "watch", "patch", "get"),
        namespaced=False,
    ),
    Kind("kopf.dev/v1", "KopfPeering", "kopfpeerings", ("list", "watch", "patch", "get")),
)
ACCESS = (BLEND_DEPLOYMENT, BLEND_DEPLOYMENT_STATUS, PODS, *CHILD_KINDS.values(), *FRAMEWORK_KINDS)


class Invalid(Exception):
    """The API server rejected an object (400/422): retrying the same object cannot help."""


class Forbidden(Exception):
    """The operator's service account lacks a permission; the RBAC manifest needs a fix."""


class Unavailable(Exception):
    """A failure worth retrying later: timeout, lost connection, conflict, 429 or 5xx."""


class NotServed(Exception):
    """The resource type does not exist in this cluster (e.g. no ServiceMonitor CRD)."""


def load_configuration() -> kubernetes.client.Configuration:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG)."""
    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        # Read KUBECONFIG now: the client library captured it when it was first imported.
        path = os.environ.get("KUBECONFIG") or None
        kubernetes.config.load_kube_config(config_file=path, client_configuration=config)
    return config


def connection_info(config: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    """The same credentials for kopf's own requests (watches, its annotations, events)."""
    token = (config.api_key or {}).get("authorization") or (config.api_key or {}).get("BearerToken")
    scheme, _, token = (token or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


class Client:
    """Raw JSON requests on a bounded thread pool; one instance per operator process."""

    def __init__(self, api: kubernetes.client.ApiClient, timeout_s: float, max_workers: int):
        self._api = api
        self._timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kube")

    @classmethod
    def from_configuration(
        cls, config: kubernetes.client.Configuration, timeout_s: float, max_workers: int
    ) -> "Client":
        config.connection_pool_maxsize = max_workers
        return cls(kubernetes.client.ApiClient(config), timeout_s, max_workers)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._api.close()

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict | None:
        return await self._call("get", kind, "GET", kind.path(namespace, name), missing_ok=True)

    async def list(self, kind: Kind, namespace: str | None, label_selector: str) -> list[dict]:
        query = {"labelSelector": label_selector}
        try:
            found = await self._call("list", kind, "GET", kind.path(namespace), query=query)
        except NotServed:
            return []
        return found.get("items", [])

    async def create(self, kind: Kind, body: dict) -> dict | None:
        """The created object, or None when one with that name already exists."""
        path = kind.path(body["metadata"].get("namespace"))
        return await self._call("create", kind, "POST", path, body=body, exists_ok=True)

    async def patch(self, kind: Kind, namespace: str | None, name: str, patch: dict) -> dict | None:
        """JSON merge patch; None if the object is gone."""
        path = kind.path(namespace, name)
        return await self._call("patch", kind, "PATCH", path, body=patch, missing_ok=True)

    async def patch_status(self, namespace: str, name: str, status: dict) -> dict | None:
        path = BLEND_DEPLOYMENT.path(namespace, name, "status")
        body = {"status": status}
        return await self._call(
            "patch", BLEND_DEPLOYMENT_STATUS, "PATCH", path, body=body, missing_ok=True
        )

    async def delete(self, kind: Kind, namespace: str | None, name: str) -> bool:
        """True if it was deleted now, False if it was already gone."""
        found = await self._call(
            "delete", kind, "DELETE", kind.path(namespace, name), missing_ok=True
        )
        return found is not None

    async def _call(
        self,
        verb: str,
        kind: Kind,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: dict | None = None,
        missing_ok: bool = False,
        exists_ok: bool = False,
    ) -> Any:
        if verb not in kind.verbs:  # keeps ACCESS (and so RBAC) complete: see the module doc
            raise PermissionError(f"{verb} {kind.plural} is not declared in kube.ACCESS")
        url = path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        loop = asyncio.get_running_loop()
        status, data = await loop.run_in_executor(self._pool, self._send, method, url, body)
        metrics.API_REQUESTS.labels(verb=verb, resource=kind.plural, code=str(status)).inc()
        return _interpret(status, data, verb, kind, missing_ok=missing_ok, exists_ok=exists_ok)

    def _send(self, method: str, url: str, body: Any) -> tuple[int, bytes]:
        headers = {
            "Accept": "application/json",
            "Content-Type": MERGE_PATCH if method == "PATCH" else "application/json",
        }
        _, full_url, headers, body, _ = self._api.param_serialize(
            method, url, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            response = self._api.call_api(
                method, full_url, headers, body, _request_timeout=self._timeout_s
            )
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            return 0, str(exc).encode()  # 0: no answer (timeout or connection failure)
        except kubernetes.client.ApiException as exc:
            return exc.status or 0, (exc.body or b"") if isinstance(exc.body, bytes) else str(
                exc.body
            ).encode()
        return response.status, response.read()


def _interpret(
    status: int, data: bytes, verb: str, kind: Kind, *, missing_ok: bool, exists_ok: bool
) -> Any:
    if 200 <= status < 300:
        return json.loads(data) if data else {}
    message = _message(data)
    if status == 404 and missing_ok and "could not find the requested resource" not in message:
        return None
    if status == 404:
        raise NotServed(f"{kind.plural}: {message}")
    if status == 409 and exists_ok and _reason(data) == "AlreadyExists":
        return None
    if status in (400, 422):
        raise Invalid(f"{verb} {kind.kind}: {message}")
    if status in (401, 403):
        raise Forbidden(f"{verb} {kind.plural} forbidden: {message}; re-apply the operator's RBAC")
    where = "no answer" if status == 0 else f"HTTP {status}"
    raise Unavailable(f"{verb} {kind.plural}: {where}: {message}")


def _message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("message", ""))[:300]
    except (ValueError, AttributeError):
        return data[:300].decode(errors="replace")


def _reason(data: bytes) -> str:
    try:
        return str(json.loads(data).get("reason", ""))
    except (ValueError, AttributeError):
        return ""
