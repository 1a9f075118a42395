"""Rotated credentials reach both the operator's client and kopf's re-login."""

import sys

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

    app = aiohttp.web.Application()
    app.router.add_get("/api/v1/namespaces/default/pods", get_pod_list)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = f"http://127.0.0.1:{runner.addresses[0][1]}"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path, token_file, server)))
    client = kube.Client.from_configuration(kube.load_configuration(), 5.0, 4)
    try:
        with pytest.raises(kube.Unavailable, match="401"):  # retried, not "re-apply the RBAC"
            await client.list(kube.PODS, "default", "app=x")
        token_file.write_text("second")
        found = await client.list(kube.PODS, "default", "app=x")
    finally:
        await client.close()
        await runner.cleanup()
    assert seen == ["Bearer first", "Bearer second"]
    assert [pod["metadata"]["name"] for pod in found] == ["p"]
