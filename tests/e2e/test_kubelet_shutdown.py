"""The process kubelet on a machine it shares: a pod address whose port something else
holds is skipped, and neither a stop cut short by a second Ctrl-C nor a closed terminal
(the demo's SIGHUP) leaves a pod running."""

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from holeblend_devtools.background import EmulatorThread
from holeblend_devtools.kubelet import ProcessKubelet
from tests.e2e.test_kubelet import LABELS, deployment, put, served, settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Squatter(http.server.BaseHTTPRequestHandler):
    """Another program on the pod's address and port (a second demo, a leftover server)."""

    def do_GET(self):
        body = b'"squatter"'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


@pytest.fixture
def cluster(tmp_path):
    with EmulatorThread(str(tmp_path / "kubeconfig")) as emulator:
        yield emulator


def test_a_pod_address_whose_port_is_taken_is_skipped(cluster, tmp_path):
    port = free_port()
    body = deployment()
    container = body["spec"]["template"]["spec"]["containers"][0]
    container["args"][-1] = str(port)
    container["ports"][0]["containerPort"] = port
    put(cluster, "v1/configmaps", {"metadata": {"name": "echo-config"}} | settings(1))
    service = {"spec": {"selector": LABELS, "ports": [{"port": 80, "targetPort": "http"}]}}
    put(cluster, "v1/services", {"metadata": {"name": "echo"}} | service)
    kubelet = ProcessKubelet(cluster, tmp_path / "pods", tick_s=0.1)
    first = "127.0.0.2"  # the address a fresh kubelet gives its first pod
    with http.server.ThreadingHTTPServer((first, port), Squatter) as squatter:
        threading.Thread(target=squatter.serve_forever, daemon=True).start()
        with kubelet:
            put(cluster, "apps/v1/deployments", body)
            cluster.wait_for(lambda: [p.is_ready for p in kubelet.pods.values()] == [True], 30)
            (pod,) = kubelet.pods.values()
            assert pod.ip != first
            url = f"{kubelet.local_url('default', 'echo')}/settings"
            assert cluster.wait_for(lambda: served(url), timeout=10) == {"value": 1}
            assert pod.restarts == 0
        squatter.shutdown()


# A stack as `make demo` runs it, with one pod running the shell command in argv[2]. It
# prints the pod's pid once the pod runs, then sleeps until interrupted.
STACK = r"""
import sys, time
from holeblend_devtools.background import EmulatorThread
from holeblend_devtools.kubelet import ProcessKubelet
workdir, command = sys.argv[1], sys.argv[2]
container = {"name": "app", "command": ["sh", "-c", command]}
body = {
    "metadata": {"name": "slow", "namespace": "default"},
    "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "slow"}},
             "template": {"metadata": {"labels": {"app": "slow"}},
                          "spec": {"containers": [container]}}},
}
with EmulatorThread(f"{workdir}/kubeconfig") as cluster:
    with ProcessKubelet(cluster, f"{workdir}/pods", tick_s=0.1) as kubelet:
        cluster.call(cluster.api.put_object("apps/v1/deployments", body))
        pod = cluster.wait_for(lambda: [p for p in kubelet.pods.values() if p.process], 30)[0]
        print(pod.process.pid, flush=True)
        time.sleep(600)
"""


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_second_ctrl_c_while_stopping_leaves_no_pod_running(tmp_path):
    marker = tmp_path / "got-sigterm"
    draining = f"trap 'echo > {marker}' TERM; while :; do sleep 0.1; done"  # ignores SIGTERM
    stack = subprocess.Popen(
        [sys.executable, "-I", "-c", STACK, str(tmp_path), draining],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    pid = int(stack.stdout.readline())
    try:
        stack.send_signal(signal.SIGINT)  # Ctrl-C: the kubelet sends the pod SIGTERM
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        stack.send_signal(signal.SIGINT)  # and again, while the pod is draining
        stack.wait(timeout=30)
        assert not is_running(pid)
    finally:
        stack.kill()
        stack.wait()
        if is_running(pid):
            os.killpg(pid, signal.SIGKILL)


def test_closing_the_demo_terminal_leaves_no_pod_running(tmp_path):
    demo = "from holeblend_devtools import demo\ndemo.exit_on_signals()\n"
    stack = subprocess.Popen(
        [sys.executable, "-I", "-c", demo + STACK, str(tmp_path), "exec sleep 600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    pid = int(stack.stdout.readline())
    try:
        stack.send_signal(signal.SIGHUP)
        stack.wait(timeout=60)
        assert not is_running(pid)
    finally:
        stack.kill()
        stack.wait()
        if is_running(pid):
            os.killpg(pid, signal.SIGKILL)
