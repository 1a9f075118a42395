"""A process kubelet for the API emulator: CPU pods run as local processes.

A controller on its own thread that reads the emulator's objects every `tick_s` and does
what a Deployment controller, a kubelet and kube-proxy would, on this machine:

1. **Which Deployments.** Those whose pods ask for no device (no extended resources) and
   whose containers' commands are installed here (`holeblend-serve`, `holeblend-lookup`,
   any executable on PATH) run for real. With a `DeviceStandIn`, pods that ask for the
   devices it names run too, on this machine's CPU, with its commands' directory first on
   PATH (e.g. the vLLM environment, whose CPU build of vLLM then serves a "GPU" pod) and
   its env. Others settle as the emulator's stand-in does (`workloads.deployment_status`):
   available at once, nothing runs.
2. **Pods.** `spec.replicas` Pod objects per Deployment, each a process running the first
   container's command and args with its env. Each pod gets its own loopback address
   (127.0.0.2, 127.0.0.3, ..., skipping those where another program holds its ports) as
   its podIP; an argument `0.0.0.0` (listen on every interface of the pod) becomes that
   address, so pods share ports as they do in a cluster.
   A changed pod template replaces the pods (stop, then start: Recreate).
3. **ConfigMap volumes** are materialized the way kubelet does it: the keys in a
   timestamped directory, a `..data` symlink to it, and one symlink per key through
   `..data`; an update writes a new directory and swaps `..data` atomically (rename of a
   symlink), so a reader never sees half a file. A hostPath volume is that path of this
   machine (the node). Env values and args that start with a ConfigMap or hostPath
   volume's mountPath are pointed at its directory (no mount namespaces here; other
   volumes, e.g. emptyDir, are not emulated: their paths stay as written).
4. **Readiness** comes from each container's readinessProbe (httpGet on the pod's address,
   its timeoutSeconds and failureThreshold, polled every `tick_s`, not every periodSeconds);
   a Deployment is available only when all its pods are ready. A process that exits is restarted with a doubling backoff and
   shows `CrashLoopBackOff` meanwhile.
5. **Services** get a TCP proxy on 127.0.0.1 to their ready endpoints; its port is written
   to the Service as the annotation `LOCAL_PORT_ANNOTATION`. In-cluster service URLs
   (`http://NAME.NAMESPACE.svc:PORT`) inside materialized files and env become these local
   addresses (there is no cluster DNS here). A pod's own loopback in its files, env and
   args (`http://127.0.0.1:PORT`, `http://localhost:PORT`: a vLLM pod's shadow requests to
   its own server) becomes its podIP, where it listens.

Everything started is stopped by `stop()` (processes by their pid: SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from holeblend_devtools import workloads
from holeblend_runtime import local_http

DEPLOYMENTS, PODS = "apps/v1/deployments", "v1/pods"
CONFIGMAPS, SERVICES = "v1/configmaps", "v1/services"
LOCAL_PORT_ANNOTATION = "emulator.holeblend.io/local-port"
LAST_POD_ADDRESS = 254  # pods get 127.0.0.2 to 127.0.0.254
_SVC_URL = re.compile(r"(https?://)([a-z0-9-]+)\.([a-z0-9-]+)\.svc(?:\.cluster\.local)?:(\d+)")
# For the pods' and Services' local addresses: never through an HTTP proxy from the
# environment (http_proxy), which cannot reach them; no_proxy rarely names 127.0.0.2 and up.


@dataclasses.dataclass(frozen=True)
class DeviceStandIn:
    """Pods that ask for these extended resources run here on the CPU: `bin_dir` goes first
    on their PATH (where a CPU build of their engine is installed) and `env` into their
    environment (e.g. the CPU engine's KV cache size)."""

    resources: frozenset[str] = frozenset({"nvidia.com/gpu"})
    bin_dir: Path | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    def runs(self, pod_spec: dict) -> bool:
        """Whether this pod is one it runs: it asks for devices, all of them its own."""
        requests = workloads._extended_requests(pod_spec)
        return bool(requests) and set(requests) <= self.resources


@dataclasses.dataclass
class Pod:
    name: str
    namespace: str
    ip: str
    template_hash: str
    deployment: str
    container: dict
    volumes: dict[str, Path]  # volume name -> local directory
    configmap_of: dict[str, str]  # volume name -> ConfigMap name (ConfigMap volumes only)
    process: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    is_ready: bool = False
    num_failed_probes: int = 0  # in a row; not ready after the probe's failureThreshold
    log: Any = None
    # Content hash of each volume as last written; goes with the pod (and its directory),
    # so a later pod of the same name writes its volumes anew.
    written: dict[str, str] = dataclasses.field(default_factory=dict)


class ProcessKubelet:
    """`with ProcessKubelet(cluster, workdir): ...` runs CPU pods of `cluster` locally."""

    def __init__(
        self,
        cluster,
        workdir: str | Path,
        tick_s: float = 0.3,
        stand_in: DeviceStandIn | None = None,
    ):
        self.cluster = cluster  # background.EmulatorThread
        self.workdir = Path(workdir)
        self.tick_s = tick_s
        self.stand_in = stand_in
        self.pods: dict[tuple[str, str], Pod] = {}  # (namespace, pod name) -> pod
        self._proxies: dict[tuple[str, str], ServiceProxy] = {}
        self._next_ip = 2
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-kubelet", daemon=True)

    def __enter__(self) -> ProcessKubelet:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopped.set()
        try:
            if self._thread.is_alive():
                self._thread.join(timeout=30)
            for pod in list(self.pods.values()):
                _stop_process(pod)
        finally:
            # A second Ctrl-C cuts the graceful stop short; pods run in their own sessions,
            # so no terminal signal reaches them and nothing else would stop them.
            for pod in list(self.pods.values()):
                _kill_process(pod)
            for proxy in self._proxies.values():
                proxy.close()

    def local_url(self, namespace: str, service: str) -> str | None:
        proxy = self._proxies.get((namespace, service))
        return f"http://127.0.0.1:{proxy.port}" if proxy else None

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self.sync()
            except Exception as exc:  # a dev tool: say it and go on
                print(f"process kubelet: {type(exc).__name__}: {exc}", file=sys.stderr)
            self._stopped.wait(self.tick_s)

    def sync(self) -> None:
        configmaps = {_key(c): c for c in self.cluster.list(CONFIGMAPS)}
        services = self.cluster.list(SERVICES)
        self._sync_proxies(services)
        wanted: set[tuple[str, str]] = set()
        for deployment in self.cluster.list(DEPLOYMENTS):
            if is_runnable(deployment, self.stand_in):
                wanted |= self._sync_deployment(deployment, configmaps)
            else:
                self._settle_stand_in(deployment)
        for key in [k for k in self.pods if k not in wanted]:
            self._delete_pod(self.pods.pop(key))
        for pod in self.pods.values():
            self._sync_volumes(pod, configmaps)
            self._sync_process(pod)
        self._sync_endpoints(services)

    # --- Deployments and pods ---------------------------------------------------------

    def _sync_deployment(self, deployment: dict, configmaps: dict) -> set[tuple[str, str]]:
        meta = deployment["metadata"]
        template = deployment["spec"]["template"]
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        replicas = deployment["spec"].get("replicas", 1)
        names = {(meta["namespace"], f"{meta['name']}-{digest}-{i}") for i in range(replicas)}
        for key in names - set(self.pods):
            self.pods[key] = self._new_pod(deployment, key[1], digest, configmaps)
        ready = sum(1 for key in names if self.pods[key].is_ready)
        self._write_deployment_status(deployment, replicas, ready)
        return names

    def _new_pod(self, deployment: dict, name: str, digest: str, configmaps: dict) -> Pod:
        meta, template = deployment["metadata"], deployment["spec"]["template"]
        container = template["spec"]["containers"][0]
        ip = self._free_address(container)
        volumes, configmap_of = {}, {}
        for volume in template["spec"].get("volumes", []):
            if "configMap" in volume:
                volumes[volume["name"]] = self.workdir / meta["namespace"] / name / volume["name"]
                configmap_of[volume["name"]] = volume["configMap"]["name"]
            elif "hostPath" in volume:
                volumes[volume["name"]] = Path(volume["hostPath"]["path"])
        pod = Pod(
            name, meta["namespace"], ip, digest, meta["name"], container, volumes, configmap_of
        )
        owner = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": meta["name"],
            "uid": meta["uid"],
            "controller": True,
        }
        body = {
            "metadata": {
                "name": name,
                "namespace": meta["namespace"],
                "labels": template["metadata"].get("labels", {}),
                "ownerReferences": [owner],
            },
            "spec": template["spec"],
        }
        self.cluster.call(self.cluster.api.put_object(PODS, body))
        self._sync_volumes(pod, configmaps)
        self._write_pod_status(pod)
        return pod

    def _free_address(self, container: dict) -> str:
        """The next pod address whose ports are free. Another program may hold them (a
        second `make demo`, a server left running, anything listening on 0.0.0.0): the pod
        would then crash on bind while its probe, answered by that program, calls it ready."""
        ports = sorted(_ports(container))
        for number in range(self._next_ip, LAST_POD_ADDRESS + 1):
            ip = f"127.0.0.{number}"
            if all(_is_free(ip, port) for port in ports):
                self._next_ip = number + 1
                return ip
        print(
            f"process kubelet: port(s) {ports} of container {container['name']} are in use on "
            f"every pod address up to 127.0.0.{LAST_POD_ADDRESS} (something listens on "
            "0.0.0.0?): stop that program, or give the container another port",
            file=sys.stderr,
        )
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        return ip

    def _delete_pod(self, pod: Pod) -> None:
        _stop_process(pod)
        with contextlib.suppress(Exception):  # gone already (garbage collected with its owner)
            self.cluster.call(self.cluster.api.delete_object(PODS, pod.namespace, pod.name))
        shutil.rmtree(self.workdir / pod.namespace / pod.name, ignore_errors=True)

    def _sync_process(self, pod: Pod) -> None:
        was_ready = pod.is_ready
        if pod.process is not None and pod.process.poll() is not None:
            pod.process, pod.is_ready = None, False
            pod.restarts += 1
            pod.next_start = time.monotonic() + min(2.0**pod.restarts, 30.0)
        if pod.process is None and time.monotonic() >= pod.next_start:
            self._start(pod)
        if pod.process is not None:
            pod.is_ready = self._probe(pod)
        if pod.is_ready != was_ready or pod.process is None:
            self._write_pod_status(pod)

    def _start(self, pod: Pod) -> None:
        container = pod.container
        command = [*container.get("command", []), *container.get("args", [])]
        command = [self._local_value(pod, arg) for arg in command]
        stand_in = _stand_in_for({"containers": [container]}, self.stand_in)
        search_path = _search_path(stand_in)
        command[0] = shutil.which(command[0], path=search_path) or command[0]
        command = [pod.ip if arg == "0.0.0.0" else arg for arg in command]
        env = dict(os.environ)
        if stand_in is not None:  # a device pod on the CPU: its engine's CPU build first
            env["PATH"] = search_path
            env.update(stand_in.env)
        env.update(
            {
                e["name"]: self._local_value(pod, e.get("value", ""))
                for e in container.get("env", [])
            }
        )
        path = self.log_path(pod)
        path.parent.mkdir(parents=True, exist_ok=True)
        pod.log = open(path, "ab")  # noqa: SIM115 - closed with the pod
        pod.process = subprocess.Popen(
            command, env=env, stdout=pod.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log_path(self, pod: Pod) -> Path:
        """Where the pod's container output goes."""
        return self.workdir / pod.namespace / pod.name / "container.log"

    def _local_value(self, pod: Pod, value: str) -> str:
        """An env value or arg as the pod sees it here: mounted paths, also inside a longer
        value (a JSON argument naming a mounted file), point at the volume's directory."""
        for mount in pod.container.get("volumeMounts", []):
            if mount["name"] in pod.volumes:
                path = re.escape(mount["mountPath"].rstrip("/"))
                local = str(pod.volumes[mount["name"]]).replace("\\", "\\\\")
                value = re.sub(rf"(?<![\w.-]){path}(?=/|$|[\"',\s])", local, value)
        return self._local_urls(_own_loopback(pod, value))

    def _probe(self, pod: Pod) -> bool:
        """Ready once the probe passes; not ready after failureThreshold failures in a row."""
        if probe(pod):
            pod.num_failed_probes = 0
            return True
        pod.num_failed_probes += 1
        threshold = (pod.container.get("readinessProbe") or {}).get("failureThreshold", 3)
        return pod.is_ready and pod.num_failed_probes < threshold

    # --- volumes ----------------------------------------------------------------------

    def _sync_volumes(self, pod: Pod, configmaps: dict) -> None:
        for volume, configmap in pod.configmap_of.items():
            directory = pod.volumes[volume]
            source = configmaps.get((pod.namespace, configmap))
            data = {
                k: self._local_urls(_own_loopback(pod, v))
                for k, v in ((source or {}).get("data") or {}).items()
            }
            digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
            if pod.written.get(volume) != digest:
                write_atomically(directory, data)
                pod.written[volume] = digest

    def _local_urls(self, text: str) -> str:
        def local(match: re.Match) -> str:
            proxy = self._proxies.get((match[3], match[2]))
            return f"{match[1]}127.0.0.1:{proxy.port}" if proxy else match[0]

        return _SVC_URL.sub(local, text)

    # --- Services ---------------------------------------------------------------------

    def _sync_proxies(self, services: list[dict]) -> None:
        for service in services:
            key = _key(service)
            if key not in self._proxies:
                self._proxies[key] = ServiceProxy()
                annotation = {LOCAL_PORT_ANNOTATION: str(self._proxies[key].port)}
                self._edit(SERVICES, *key, {"metadata": {"annotations": annotation}})

    def _sync_endpoints(self, services: list[dict]) -> None:
        for service in services:
            selector = service["spec"].get("selector") or {}
            port = service["spec"]["ports"][0]
            endpoints = [
                (pod.ip, _container_port(pod.container, port.get("targetPort", port["port"])))
                for pod in self.pods.values()
                if pod.is_ready
                and pod.namespace == service["metadata"]["namespace"]
                and selector.items() <= self._labels(pod).items()
            ]
            self._proxies[_key(service)].endpoints = endpoints

    def _labels(self, pod: Pod) -> dict:
        found = self.cluster.get(PODS, pod.namespace, pod.name) or {}
        return found.get("metadata", {}).get("labels", {})

    # --- status -----------------------------------------------------------------------

    def _write_pod_status(self, pod: Pod) -> None:
        running = pod.process is not None
        state = {"running": {}} if running else {"waiting": {"reason": "CrashLoopBackOff"}}
        ready = "True" if pod.is_ready else "False"
        status = {
            "phase": "Running" if running else "Pending",
            "podIP": pod.ip,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": ready},
                {"type": "ContainersReady", "status": ready},
            ],
            "containerStatuses": [
                {
                    "name": pod.container["name"],
                    "ready": pod.is_ready,
                    "restartCount": pod.restarts,
                    "state": state
                    if pod.restarts or running
                    else {"waiting": {"reason": "ContainerCreating"}},
                }
            ],
        }
        self._edit(PODS, pod.namespace, pod.name, {"status": status})

    def _write_deployment_status(self, deployment: dict, replicas: int, ready: int) -> None:
        generation = deployment["metadata"].get("generation", 1)
        available = ready >= replicas
        status = workloads.deployment_status(deployment, None)
        status.update(
            observedGeneration=generation,
            replicas=replicas,
            updatedReplicas=replicas,
            readyReplicas=ready,
            availableReplicas=ready,
            unavailableReplicas=replicas - ready,
        )
        status["conditions"][0] = workloads._condition(
            "Available", available, *workloads._available_reason(available)
        )
        if deployment.get("status") != status:
            self._edit(DEPLOYMENTS, *_key(deployment), {"status": status})

    def _settle_stand_in(self, deployment: dict) -> None:
        status = workloads.deployment_status(deployment, None)
        if deployment.get("status") != status:
            self._edit(DEPLOYMENTS, *_key(deployment), {"status": status})

    def _edit(self, resource: str, namespace: str, name: str, patch: dict) -> None:
        with contextlib.suppress(Exception):  # gone meanwhile: the next tick sees it
            self.cluster.call(self.cluster.api.edit_object(resource, namespace, name, patch))


def is_runnable(deployment: dict, stand_in: DeviceStandIn | None = None) -> bool:
    """A CPU pod (no extended resources, or only those `stand_in` runs on the CPU) whose
    first container's command is installed."""
    spec = deployment.get("spec", {}).get("template", {}).get("spec", {})
    containers = spec.get("containers") or []
    if not containers:
        return False
    stand_in = _stand_in_for(spec, stand_in)
    if workloads._extended_requests(spec) and stand_in is None:
        return False
    command = containers[0].get("command") or []
    found = shutil.which(command[0], path=_search_path(stand_in)) if command else None
    return found is not None


def _stand_in_for(pod_spec: dict, stand_in: DeviceStandIn | None) -> DeviceStandIn | None:
    """The stand-in when it runs this pod (a device pod); None for CPU pods."""
    return stand_in if stand_in is not None and stand_in.runs(pod_spec) else None


_LOOPBACK_URL = re.compile(r"(https?://)(?:127\.0\.0\.1|localhost)(?=:\d)")


def _own_loopback(pod: Pod, text: str) -> str:
    """A pod's loopback URLs point at its own address (each pod has one here)."""
    return _LOOPBACK_URL.sub(lambda m: m.group(1) + pod.ip, text)


def _search_path(stand_in: DeviceStandIn | None = None) -> str:
    first = [str(stand_in.bin_dir)] if stand_in is not None and stand_in.bin_dir else []
    return os.pathsep.join([*first, str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def probe(pod: Pod) -> bool:
    check = pod.container.get("readinessProbe") or {}
    port = _probe_port(pod.container)
    if port is None:
        return pod.process is not None and pod.process.poll() is None
    url = f"http://{pod.ip}:{port}{check['httpGet'].get('path', '/')}"
    try:
        with local_http.LOCAL.open(url, timeout=check.get("timeoutSeconds", 1)) as response:
            return 200 <= response.status < 400
    except OSError:
        return False


def _ports(container: dict) -> set[int]:
    """The ports the container listens on: those it declares and its probe's."""
    ports = {int(declared["containerPort"]) for declared in container.get("ports", [])}
    probed = _probe_port(container)
    return ports if probed is None else ports | {probed}


def _probe_port(container: dict) -> int | None:
    """The port of the container's HTTP readiness probe; None without one."""
    http = (container.get("readinessProbe") or {}).get("httpGet")
    return None if http is None else _container_port(container, http.get("port", 80))


def _is_free(ip: str, port: int) -> bool:
    """Whether a server could listen on ip:port now (bound as servers bind, with
    SO_REUSEADDR, so a recently closed connection does not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True


def _container_port(container: dict, port: int | str) -> int:
    for declared in container.get("ports", []):
        if declared.get("name") == port:
            return int(declared["containerPort"])
    return int(port)


def write_atomically(directory: Path, data: dict[str, str]) -> None:
    """kubelet's ConfigMap volume layout: ..TIMESTAMP/ with the files, ..data -> it, and
    KEY -> ..data/KEY; an update swaps ..data in one rename."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("..%Y_%m_%d_%H_%M_%S.%f")
    payload = directory / stamp
    payload.mkdir()
    for key, value in data.items():
        (payload / key).write_text(value)
    link = directory / "..data_tmp"
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(stamp)
    previous = os.readlink(directory / "..data") if (directory / "..data").is_symlink() else None
    os.replace(link, directory / "..data")
    for key in data:
        if not (directory / key).is_symlink():
            (directory / key).symlink_to(f"..data/{key}")
    if previous is not None:
        shutil.rmtree(directory / previous, ignore_errors=True)


def _stop_process(pod: Pod) -> None:
    process = pod.process  # kept on the pod until it is stopped, for `_kill_process`
    if process is not None and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            _kill_process(pod)
            process.wait()
    pod.process = None
    if pod.log is not None:
        pod.log.close()
        pod.log = None


def _kill_process(pod: Pod) -> None:
    """SIGKILL a pod's process group that is still running (its stop was cut short)."""
    if pod.process is not None and pod.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pod.process.pid, signal.SIGKILL)


class ServiceProxy:
    """A TCP proxy on 127.0.0.1 to a Service's ready endpoints (round robin)."""

    def __init__(self):
        self.endpoints: list[tuple[str, int]] = []
        self._next = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    def close(self) -> None:
        self._closed = True
        self._server.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        endpoints = list(self.endpoints)
        if not endpoints:
            client.close()  # no ready endpoint: connection refused, as kube-proxy does
            return
        self._next += 1
        try:
            upstream = socket.create_connection(endpoints[self._next % len(endpoints)], timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream)


def _pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            source.close()


def _key(obj: dict) -> tuple[str, str]:
    return obj["metadata"]["namespace"], obj["metadata"]["name"]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
