"""The one module of the operator that talks to the Kubernetes API.

Requests carry the `kubernetes` client's credentials (kubeconfig or in-cluster) and go out
through aiohttp on the operator's event loop, as raw JSON: no model classes, no discovery.
`ACCESS` lists every (resource, verb) the operator uses; each request is checked against it,
and the RBAC manifest is generated from it, so the two cannot drift apart.

Failures are sorted for the caller: a missing object is `None` (or `False`), an object that
already exists is `None` from `create`, a rejected object raises `Invalid`, and anything
worth retrying (timeouts, connection errors, a 401 for expired credentials, 409 conflicts,
429 and 5xx) raises `Unavailable`, which the handlers retry with a capped, jittered
exponential backoff. A 429 or 5xx that says when to come back (Retry-After, in seconds) is
sent again then, up to RETRY_AFTER_RESENDS times, before it counts as a failure: an API
server shedding load (priority and fairness) expects its clients to wait that long.
"""

import asyncio
import contextlib
import dataclasses
import json
import os
import ssl
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf
import kubernetes.client
import kubernetes.config

from holeblend_operator import metrics
from holeblend_operator.api import GROUP, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"
AUTH_REFRESH_S = 60.0  # how often credentials are re-read (tokens expire in minutes to hours)
RETRY_AFTER_MAX_S = 60.0  # the longest Retry-After honoured; a longer one waits this long
RETRY_AFTER_RESENDS = 3  # per request; then the handlers' backoff takes over
CLOSE_GRACE_S = 5.0  # how long `close` waits for the answers to requests in flight


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

    @property
    def selector(self) -> str:
        """kopf's resource selector notation: plural.version.group."""
        version = self.api_version.rpartition("/")[2]
        return ".".join(part for part in (self.plural, version, self.group) if part)

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
# The operator writes nothing but the status of BlendDeployments; it reads one afresh before
# a retry or requeue (its watched copy may be stale by then).
BLEND_DEPLOYMENT = Kind(f"{GROUP}/{VERSION}", "BlendDeployment", PLURAL, ("get", "list", "watch"))
BLEND_DEPLOYMENT_STATUS = Kind(
    f"{GROUP}/{VERSION}", "BlendDeployment", f"{PLURAL}/status", ("patch",)
)
# Children carry an owner reference with blockOwnerDeletion (kopf.adopt): where the
# OwnerReferencesPermissionEnforcement admission plugin runs (OpenShift, hardened clusters),
# setting it requires update on the owner's finalizers, else every child create is refused.
BLEND_DEPLOYMENT_FINALIZERS = Kind(
    f"{GROUP}/{VERSION}", "BlendDeployment", f"{PLURAL}/finalizers", ("update",)
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
ACCESS = (
    BLEND_DEPLOYMENT,
    BLEND_DEPLOYMENT_STATUS,
    BLEND_DEPLOYMENT_FINALIZERS,
    PODS,
    *CHILD_KINDS.values(),
    *FRAMEWORK_KINDS,
)


class Invalid(Exception):
    """The API server rejected an object (400/422): retrying the same object cannot help."""


class Forbidden(Exception):
    """The operator's service account lacks a permission; the RBAC manifest needs a fix."""


class Unavailable(Exception):
    """A failure worth retrying later: timeout, lost connection, 401, conflict, 429 or 5xx."""


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


def bearer_token(config: kubernetes.client.Configuration) -> str | None:
    """The "Bearer <token>" header value, read through the client's refresh hook (a
    rotated service account token, an exec plugin's); None without a token."""
    return config.auth_settings().get("BearerToken", {}).get("value")


def connection_info(config: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    """The same credentials for kopf's own requests (watches, events, peering).

    kopf calls this again when the API server answers 401: the token is read through the
    client's refresh hook, so a rotated service account token (or an exec plugin's) is
    the one handed over, not the expired one kopf has just discarded."""
    token = bearer_token(config)
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
    """Raw JSON requests over one aiohttp session; one instance per operator process.

    The `kubernetes` client supplies the URL and the auth headers (it refreshes expiring
    tokens), aiohttp sends the request on kopf's event loop: no threads, no model classes.
    """

    def __init__(self, api: kubernetes.client.ApiClient, timeout_s: float, max_in_flight: int):
        self._api = api
        self._host = api.configuration.host  # the property scans the environment: read once
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_in_flight = max_in_flight
        # Built now, not on the first request: loading the CA bundle takes tens of ms,
        # which would otherwise delay the first reconcile.
        self._ca = _read_ca(api.configuration)  # what the context trusts, to notice a change
        self._ssl = _ssl_context(api.configuration)
        self._session: aiohttp.ClientSession | None = None
        self._auth: dict[str, str] = {}
        self._auth_read_at: float | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()

    @classmethod
    def from_configuration(
        cls, config: kubernetes.client.Configuration, timeout_s: float, max_in_flight: int
    ) -> "Client":
        return cls(kubernetes.client.ApiClient(config), timeout_s, max_in_flight)

    async def close(self) -> None:
        """Close the session once the requests in flight have their answers (CLOSE_GRACE_S at
        most). Closed under them, a write the API server received, and may well apply, would
        be reported failed, and its reconcile retried as the operator stops."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), CLOSE_GRACE_S)
        if self._session is not None:
            await self._session.close()

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
        resends = 0
        while True:
            status, data, resend_after_s = await self._send(method, url, body)
            metrics.API_REQUESTS.labels(verb=verb, resource=kind.plural, code=str(status)).inc()
            if resend_after_s is None or resends == RETRY_AFTER_RESENDS:
                break
            resends += 1
            await asyncio.sleep(resend_after_s)
        if status == 401:  # the token expired or rotated: read it afresh for the retry
            self._auth_read_at = None
        return _interpret(status, data, verb, kind, missing_ok=missing_ok, exists_ok=exists_ok)

    async def _send(self, method: str, url: str, body: Any) -> tuple[int, bytes, float | None]:
        """The answer's status and body, and when to send the request again: after the
        server's Retry-After, or at once if a TLS handshake failed under a CA bundle that has
        changed since (None: not again)."""
        content_type = MERGE_PATCH if method == "PATCH" else "application/json"
        headers = {
            "Accept": "application/json",
            "Content-Type": content_type,
            **self._auth_headers(),
        }
        data = None if body is None else json.dumps(body)
        context = self._ssl
        self._in_flight += 1
        self._idle.clear()
        try:
            async with self._get_session().request(
                method,
                self._host + url,
                headers=headers,
                data=data,
                timeout=self._timeout,
                ssl=context,
            ) as response:
                return (
                    response.status,
                    await response.read(),
                    _retry_after(response.status, response.headers),
                )
        except aiohttp.ClientConnectorCertificateError as exc:
            self._reload_ca()
            return 0, _no_answer(exc), 0.0 if self._ssl is not context else None
        except (
            aiohttp.ClientError,
            TimeoutError,
            OSError,
            RuntimeError,
        ) as exc:  # RuntimeError: closed
            return 0, _no_answer(exc), None
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    def _reload_ca(self) -> None:
        """Trust the CA bundle's file as it is now, if it changed: the cluster's CA rotated
        and the kubelet replaced the mounted file. Read after a failed TLS handshake only,
        not per request; a file unreadable at that moment keeps the bundle already loaded."""
        config = self._api.configuration
        try:
            ca = _read_ca(config)
            if ca != self._ca:
                self._ssl, self._ca = _ssl_context(config), ca
        except (OSError, ValueError, ssl.SSLError):  # gone, or written half, for a moment
            pass

    def _auth_headers(self) -> dict[str, str]:
        # The client's auth settings run its token-refresh hook (exec plugins, rotated service
        # account tokens), which costs about a millisecond: do it once a minute, not per request.
        now = time.monotonic()
        if self._auth_read_at is None or now - self._auth_read_at > AUTH_REFRESH_S:
            token = bearer_token(self._api.configuration)
            self._auth = {"Authorization": token} if token else {}
            self._auth_read_at = now
        return self._auth

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:  # created on first use: it binds to the running loop
            connector = aiohttp.TCPConnector(ssl=self._ssl, limit=self._max_in_flight)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session


def _read_ca(config: kubernetes.client.Configuration) -> bytes | None:
    """The CA bundle's text; None where the system's CAs are trusted (or none checked)."""
    if not (config.verify_ssl and config.ssl_ca_cert):
        return None
    with open(config.ssl_ca_cert, "rb") as file:
        return file.read()


def _ssl_context(config: kubernetes.client.Configuration) -> ssl.SSLContext | bool:
    if not config.verify_ssl:
        return False
    context = ssl.create_default_context(cafile=config.ssl_ca_cert)
    if config.cert_file:
        context.load_cert_chain(config.cert_file, config.key_file)
    return context


def _retry_after(status: int, headers: Mapping[str, str]) -> float | None:
    """The wait a 429 or 5xx answer asks for in its Retry-After header, at most
    RETRY_AFTER_MAX_S; None for other answers, and for an absent header or one that is not
    a number of seconds (an HTTP date): the handlers' backoff then."""
    if status != 429 and status < 500:
        return None
    value = headers.get("Retry-After", "").strip()
    if not (value.isascii() and value.isdigit()):
        return None
    return min(float(value), RETRY_AFTER_MAX_S)


def _no_answer(exc: Exception) -> bytes:
    """The body for a request that got no answer (status 0): what went wrong."""
    return f"{type(exc).__name__}: {exc}".encode()


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
    if status == 401:
        raise Unavailable(f"{verb} {kind.plural}: HTTP 401: credentials rejected: {message}")
    if status == 403:
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
