"""The process kubelet: a CPU Deployment's container runs as a local process with its env,
its ConfigMap volume updated the way kubelet does, readiness from its probe, and its
Service reachable on a local port."""

import json
import os
import signal
import sys
import urllib.error
import urllib.request

import pytest

from holeblend_devtools.background import EmulatorThread
from holeblend_devtools.kubelet import LOCAL_PORT_ANNOTATION, ProcessKubelet, write_atomically

# The container: serves its config file (read afresh on every request) and /ready once the
# file is there. Its argv: HOST PORT.
SERVER = r"""
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        path = os.environ["APP_CONFIG"]
        if self.path == "/ready":
            code, body = (200, b"ok") if os.path.exists(path) else (503, b"no config")
        else:
            code, body = 200, open(path, "rb").read()
        self.send_response(code); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
"""
LABELS = {"app": "echo"}


def deployment(replicas=1):
    container = {
        "name": "app",
        "command": [sys.executable],
        "args": ["-I", "-c", SERVER, "0.0.0.0", "8000"],
        "env": [{"name": "APP_CONFIG", "value": "/etc/app/settings.json"}],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/app"}],
    }
    return {
        "metadata": {"name": "echo", "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": "echo-config"}}],
                },
            },
        },
    }


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def served(url: str) -> object:
    """The JSON the Service answers with, or None while its proxy has no ready endpoint
    yet: the proxy learns a pod's readiness at its next tick, after the kubelet's own
    view, and refuses (resets) connections meanwhile, as kube-proxy does."""
    try:
        return json.loads(fetch(url))
    except (ConnectionError, urllib.error.URLError):
        return None


@pytest.fixture
def cluster(tmp_path):
    with EmulatorThread(str(tmp_path / "kubeconfig")) as emulator:
        yield emulator


def put(cluster, resource, body):
    cluster.call(cluster.api.put_object(resource, body))


def edit(cluster, resource, name, patch):
    cluster.call(cluster.api.edit_object(resource, "default", name, patch))


def settings(value: int) -> dict:
    return {"data": {"settings.json": json.dumps({"value": value})}}


@pytest.mark.slow
def test_a_cpu_deployment_runs_as_a_process_and_becomes_available_when_ready(cluster, tmp_path):
    put(cluster, "v1/configmaps", {"metadata": {"name": "echo-config"}} | settings(1))
    service = {
        "metadata": {"name": "echo"},
        "spec": {"selector": LABELS, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    put(cluster, "v1/services", service)
    with ProcessKubelet(cluster, tmp_path / "pods", tick_s=0.1) as kubelet:
        put(cluster, "apps/v1/deployments", deployment())
        cluster.wait_for(
            lambda: (
                (cluster.get("apps/v1/deployments", "default", "echo").get("status") or {}).get(
                    "readyReplicas"
                )
                == 1
            ),
            timeout=30,
        )
        (pod,) = cluster.list("v1/pods", "default")
        assert (
            pod["status"]["podIP"].startswith("127.0.0.") and pod["status"]["podIP"] != "127.0.0.1"
        )

        def is_pod_ready() -> bool:
            (pod,) = cluster.list("v1/pods", "default")
            return {"type": "Ready", "status": "True"} in pod["status"]["conditions"]

        # Read again until ready: on a loaded machine a readiness probe can time out once
        # between the Deployment's status and this read (the pod is then briefly unready).
        cluster.wait_for(is_pod_ready, timeout=30)
        port = cluster.get("v1/services", "default", "echo")["metadata"]["annotations"][
            LOCAL_PORT_ANNOTATION
        ]
        url = f"http://127.0.0.1:{port}/settings"
        assert cluster.wait_for(lambda: served(url), timeout=10) == {"value": 1}

        # A ConfigMap update reaches the running process without a restart.
        (local,) = kubelet.pods.values()
        first_pid = local.process.pid
        edit(cluster, "v1/configmaps", "echo-config", settings(2))
        cluster.wait_for(lambda: served(url) == {"value": 2}, timeout=10)
        assert local.process.pid == first_pid
        volume = local.volumes["config"]
        assert os.readlink(volume / "settings.json") == "..data/settings.json"
        assert (volume / "..data").is_symlink()

        # A process that dies is restarted, and the pod is not ready meanwhile.
        os.kill(first_pid, signal.SIGKILL)
        cluster.wait_for(lambda: local.restarts == 1 and local.is_ready, timeout=20)
        assert (
            cluster.get("v1/pods", "default", pod["metadata"]["name"])["status"][
                "containerStatuses"
            ][0]["restartCount"]
            == 1
        )

        # Scaled to zero: the process stops and the pod goes.
        edit(cluster, "apps/v1/deployments", "echo", {"spec": {"replicas": 0}})
        cluster.wait_for(lambda: not kubelet.pods and not cluster.list("v1/pods", "default"), 10)
        assert local.process is None

        # Scaled back: a pod of the same name (same template) gets its volume written anew
        # (its directory went with the old pod) and becomes ready again.
        edit(cluster, "apps/v1/deployments", "echo", {"spec": {"replicas": 1}})
        cluster.wait_for(lambda: [p.is_ready for p in kubelet.pods.values()] == [True], 30)
        (again,) = kubelet.pods.values()
        assert again.name == local.name
        assert cluster.wait_for(lambda: served(url), timeout=10) == {"value": 2}


def test_an_update_swaps_the_data_link_in_one_step(tmp_path):
    write_atomically(tmp_path, {"a.json": "1"})
    first = os.readlink(tmp_path / "..data")
    write_atomically(tmp_path, {"a.json": "2"})
    assert os.readlink(tmp_path / "..data") != first
    assert not (tmp_path / first).exists()  # the old payload is removed after the swap
    assert (tmp_path / "a.json").read_text() == "2"


def test_deployments_that_ask_for_devices_or_missing_commands_are_not_run():
    from holeblend_devtools.kubelet import is_runnable

    assert is_runnable(deployment())
    gpu = deployment()
    gpu["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": 1}
    }
    assert not is_runnable(gpu)
    vllm = deployment()
    vllm["spec"]["template"]["spec"]["containers"][0]["command"] = ["no-such-command-here"]
    assert not is_runnable(vllm)


# A device pod's stand-in engine: records its argv, env, PATH and the config file its JSON
# argument names, into the hostPath volume mounted at /models, then idles.
RECORDER = r"""
import json, os, sys, time
config = json.loads(sys.argv[3])["config"]
seen = {
    "argv": sys.argv[1:], "config_path": config, "config": open(config).read(),
    "self_url": os.environ["SELF_URL"], "stand_in": os.environ.get("STAND_IN"),
    "path0": os.environ["PATH"].split(os.pathsep)[0],
}
model_dir = os.path.dirname(sys.argv[2])
with open(os.path.join(model_dir, "seen.json.tmp"), "w") as f:
    json.dump(seen, f)
os.replace(os.path.join(model_dir, "seen.json.tmp"), os.path.join(model_dir, "seen.json"))
time.sleep(600)
"""


@pytest.mark.slow
def test_a_device_pod_runs_on_the_cpu_under_a_stand_in_as_the_pod_would_see_it(cluster, tmp_path):
    from holeblend_devtools.kubelet import DeviceStandIn, is_runnable

    host, bin_dir = tmp_path / "node-models", tmp_path / "stand-in-bin"
    host.mkdir()
    bin_dir.mkdir()
    engine = bin_dir / "fake-engine"
    engine.write_text(f"#!{sys.executable} -I\n{RECORDER}")
    engine.chmod(0o755)
    stand_in = DeviceStandIn(frozenset({"nvidia.com/gpu"}), bin_dir, {"STAND_IN": "yes"})
    body = deployment()
    container = body["spec"]["template"]["spec"]["containers"][0]
    container["command"] = ["fake-engine"]
    # A JSON argument naming a mounted file, the model under a hostPath mount, "every
    # interface" (the pod's address), and the pod's own loopback in env and in its config.
    container["args"] = ["0.0.0.0", "/models/m", json.dumps({"config": "/etc/app/blend.json"})]
    container["env"] = [{"name": "SELF_URL", "value": "http://localhost:9464/metrics"}]
    container["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    container["volumeMounts"].append({"name": "model", "mountPath": "/models"})
    del container["readinessProbe"]
    body["spec"]["template"]["spec"]["volumes"].append(
        {"name": "model", "hostPath": {"path": str(host), "type": "Directory"}}
    )
    assert not is_runnable(body)
    assert is_runnable(body, stand_in)
    other_device = json.loads(json.dumps(body))
    other_device["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {
        "huawei.com/Ascend910": 1
    }
    assert not is_runnable(other_device, stand_in)

    config = {"data": {"blend.json": json.dumps({"engineUrl": "http://127.0.0.1:8000"})}}
    put(cluster, "v1/configmaps", {"metadata": {"name": "echo-config"}} | config)
    with ProcessKubelet(cluster, tmp_path / "pods", tick_s=0.1, stand_in=stand_in) as kubelet:
        put(cluster, "apps/v1/deployments", body)
        cluster.wait_for(lambda: (host / "seen.json").exists(), timeout=30)
        (pod,) = kubelet.pods.values()
    seen = json.loads((host / "seen.json").read_text())
    assert seen["argv"][0] == pod.ip != "127.0.0.1"
    assert seen["argv"][1] == f"{host}/m"
    assert seen["config_path"] == f"{pod.volumes['config']}/blend.json"
    assert json.loads(seen["config"]) == {"engineUrl": f"http://{pod.ip}:8000"}
    assert seen["self_url"] == f"http://{pod.ip}:9464/metrics"
    assert seen["stand_in"] == "yes"
    assert seen["path0"] == str(bin_dir)


def test_the_vllm_shim_serves_the_model_with_cpu_sized_blocks():
    from holeblend_devtools.vllm_shim import command

    args = command(["serve", "/models", "--port", "8000", "--block-size", "16"], "/py")
    assert args == [
        "/py", "-I", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models",
        "--port", "8000", "--block-size", "32",
    ]  # fmt: skip
    assert command(["serve", "m", "--block-size", "64"], "/py")[-1] == "64"
    assert command(["serve", "m", "--block-size", "40"], "/py")[-1] == "64"
    for wrong in ([], ["serve"], ["chat", "m"]):
        with pytest.raises(ValueError, match="usage: vllm serve MODEL"):
            command(wrong, "/py")
