"""Rotated credentials reach both the operator's client and kopf's re-login."""

import contextlib
import ssl
import sys
from collections.abc import AsyncIterator

import aiohttp.web
import pytest
import yaml

from holeblend_operator import kube

# An exec credential plugin that hands out whatever token the file holds, already expired,
# so that the client runs it again on every read (as it would once a real token expires).
PLUGIN = (
    "import json, sys; token = open(sys.argv[1]).read().strip(); "
    "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', "
    "'kind': 'ExecCredential', 'status': {'token': token, "
    "'expirationTimestamp': '2000-01-01T00:00:00Z'}}))"
)

# A cluster CA rotated from OLD_CA to NEW_CA, and the API server's certificate (for 127.0.0.1)
# from NEW_CA. Made with `openssl req` and `openssl ca` (EC P-256, valid 2000-2100).
OLD_CA = """\
-----BEGIN CERTIFICATE-----
MIIBZjCCAQugAwIBAgIBATAKBggqhkjOPQQDAjAZMRcwFQYDVQQDDA5vbGQgY2x1
c3RlciBDQTAgFw0wMDAxMDEwMDAwMDBaGA8yMTAwMDEwMTAwMDAwMFowGTEXMBUG
A1UEAwwOb2xkIGNsdXN0ZXIgQ0EwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAATE
O4w2mQN1el5iK0jNdQ1vDZf/XXnzo7YlDuBkooJNDmnwWI1BwxW77s+dp/E44jFO
kzG0dNpdv63VbfCN4tbEo0IwQDAPBgNVHRMBAf8EBTADAQH/MA4GA1UdDwEB/wQE
AwICBDAdBgNVHQ4EFgQUJQ4u6cnVOXFKpUA8xHTlvy2gnmswCgYIKoZIzj0EAwID
SQAwRgIhANYLxnA6/lnC4ZixufyZDynTl3i/6LOVcX3xSLtdoNi6AiEAnooAkiA6
Cj1gl0bZfip0pdPayXwDQL7XlSh3DHn2nWA=
-----END CERTIFICATE-----
"""
NEW_CA = """\
-----BEGIN CERTIFICATE-----
MIIBZTCCAQugAwIBAgIBAjAKBggqhkjOPQQDAjAZMRcwFQYDVQQDDA5uZXcgY2x1
c3RlciBDQTAgFw0wMDAxMDEwMDAwMDBaGA8yMTAwMDEwMTAwMDAwMFowGTEXMBUG
A1UEAwwObmV3IGNsdXN0ZXIgQ0EwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAARL
SXEeFBWZk4YNwGLGKM4vI/rABUuqrIVDmHuKSjJ2HbgEMlcQxl7HVlVaNXOhzrGH
qjOga9XBz3n7MNFWSl0fo0IwQDAPBgNVHRMBAf8EBTADAQH/MA4GA1UdDwEB/wQE
AwICBDAdBgNVHQ4EFgQUBLm3AyIxC5vnzeTjnvO57BLW1KgwCgYIKoZIzj0EAwID
SAAwRQIhANf04M0XAQYRlRMhN9RKK85Hjtqu3UXR7aLJ/vYA/92BAiAy+3mSDJjQ
no858vyEK8VJoYGwomk6bdX1IEuMssVTLw==
-----END CERTIFICATE-----
"""
SERVER_CERTIFICATE = """\
-----BEGIN CERTIFICATE-----
MIIBqTCCAU6gAwIBAgIBAzAKBggqhkjOPQQDAjAZMRcwFQYDVQQDDA5uZXcgY2x1
c3RlciBDQTAgFw0wMDAxMDEwMDAwMDBaGA8yMTAwMDEwMTAwMDAwMFowGTEXMBUG
A1UEAwwOa3ViZS1hcGlzZXJ2ZXIwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAASr
LtE9Gz1eh0nqtN9dNj6yDNKahJP4G1KBHnCW99ih3KUpzxqsZUOCAYkMVDRafTh9
pyVRVbVdy37zR99mZ/6no4GEMIGBMAkGA1UdEwQCMAAwDwYDVR0RBAgwBocEfwAA
ATAdBgNVHQ4EFgQUNs27vhU2VP+MwqmIaVmXLE4pjXAwHwYDVR0jBBgwFoAUBLm3
AyIxC5vnzeTjnvO57BLW1KgwDgYDVR0PAQH/BAQDAgeAMBMGA1UdJQQMMAoGCCsG
AQUFBwMBMAoGCCqGSM49BAMCA0kAMEYCIQCM5cnay0QmeRHuYdXJ4Dk6qsTJGWPQ
8JBZ3UqTQWhzlgIhAMardwFD1RIjIDdUbEshoUFYn8on5+XbLC7WByY64ZlV
-----END CERTIFICATE-----
"""
SERVER_KEY = """\
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgp9CdJLSR5IoAr6Zl
Up/P7z9anHvNqCgbZEwUvPHzXh2hRANCAASrLtE9Gz1eh0nqtN9dNj6yDNKahJP4
G1KBHnCW99ih3KUpzxqsZUOCAYkMVDRafTh9pyVRVbVdy37zR99mZ/6n
-----END PRIVATE KEY-----
"""


def write_kubeconfig(tmp_path, token_file, server="https://127.0.0.1:6443"):
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": ["-c", PLUGIN, str(token_file)],
            "interactiveMode": "Never",
        }
    }
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.asynccontextmanager
async def serving_pod_lists(
    get_pod_list, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[str]:
    """An API server on 127.0.0.1 whose pod list in `default` is answered by `get_pod_list`
    (over TLS with `ssl_context`); yields its URL."""
    app = aiohttp.web.Application()
    app.router.add_get("/api/v1/namespaces/default/pods", get_pod_list)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    try:
        await aiohttp.web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context).start()
        scheme = "https" if ssl_context else "http"
        yield f"{scheme}://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def client_of(config) -> AsyncIterator[kube.Client]:
    """The operator's client (5 s timeout, 4 requests in flight at most), closed at the end."""
    client = kube.Client.from_configuration(config, 5.0, 4)
    try:
        yield client
    finally:
        await client.close()


def test_kopf_logs_in_again_with_the_rotated_token_not_the_expired_one(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("first")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path, token_file)))
    config = kube.load_configuration()  # loaded once, shared by kopf's login and the client
    assert kube.connection_info(config).token == "first"
    token_file.write_text("second")  # rotated while the operator runs
    info = kube.connection_info(config)
    assert (info.scheme, info.token) == ("Bearer", "second")


def test_client_certificates_alone_give_kopf_no_token():
    config = kube.kubernetes.client.Configuration()
    config.host = "https://127.0.0.1:6443"
    info = kube.connection_info(config)
    assert info.token is None and info.scheme is None


async def test_a_401_is_retried_with_the_rotated_token_not_blamed_on_rbac(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("first")
    seen = []

    async def get_pod_list(request):
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer second":
            return aiohttp.web.json_response({"message": "Unauthorized"}, status=401)
        return aiohttp.web.json_response({"items": [{"metadata": {"name": "p"}}]})

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    async with serving_pod_lists(get_pod_list) as server:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path, token_file, server)))
        async with client_of(kube.load_configuration()) as client:
            with pytest.raises(kube.Unavailable, match="401"):  # retried, not "re-apply the RBAC"
                await client.list(kube.PODS, "default", "app=x")
            token_file.write_text("second")
            found = await client.list(kube.PODS, "default", "app=x")
    assert seen == ["Bearer first", "Bearer second"]
    assert [pod["metadata"]["name"] for pod in found] == ["p"]


async def test_a_rotated_cluster_ca_is_trusted_without_a_restart(tmp_path):
    (tmp_path / "server.crt").write_text(SERVER_CERTIFICATE)
    (tmp_path / "server.key").write_text(SERVER_KEY)
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")

    async def get_pod_list(_):
        return aiohttp.web.json_response({"items": [{"metadata": {"name": "p"}}]})

    ca_file = tmp_path / "ca.crt"  # the service account's mounted bundle
    ca_file.write_text(OLD_CA)
    async with serving_pod_lists(get_pod_list, serving) as server:
        config = kube.kubernetes.client.Configuration()
        config.host = server
        config.ssl_ca_cert = str(ca_file)
        async with client_of(config) as client:
            with pytest.raises(kube.Unavailable, match="certificate"):  # not the CA trusted yet
                await client.list(kube.PODS, "default", "app=x")
            ca_file.write_text(OLD_CA + NEW_CA)  # the kubelet updates the bundle as the CA rotates
            found = await client.list(kube.PODS, "default", "app=x")
    assert [pod["metadata"]["name"] for pod in found] == ["p"]
