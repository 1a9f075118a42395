"""The closed loop on one machine, for `make demo` and `make closed-loop`.

`LiveStack` starts the API emulator with the process kubelet (CPU engine pods run
`holeblend-serve` for real), `holeblend-operator run`, and, on request, a real Prometheus
that scrapes the engine pods. With `vllm_stand_in()` the kubelet also runs the vLLM pods of
a BlendDeployment on an NVIDIA GPU (`vllm_example`) on this machine's CPU, with the CPU
build of vLLM from the vLLM environment: the pod the operator renders (flags, blend.json,
the connector, its metrics port), SmolLM2 from a hostPath. `RagStream` sends a RAG request
stream to the engine Service's local port: prompts of the synthetic workload (docs/bench.md)
drawn with Zipf popularity, each first sent without its hole documents, so hits, holes and
misses mix; to vLLM as token ids (`/v1/completions`, `make_body`), to holeblend-serve as
chat messages with documents.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from holeblend_devtools import prometheus
from holeblend_devtools.background import (
    EmulatorThread,
    environment_for,
    operator_command,
    stop_process,
)
from holeblend_devtools.kubelet import DeviceStandIn, ProcessKubelet
from holeblend_runtime import local_http
from holeblend_runtime.bench.workload import QAPrompt, WorkloadConfig, generate_workload

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "blenddeployments.blend.holeblend.io.yaml"
EXAMPLE = ROOT / "examples" / "cpu.yaml"
BD = "blend.holeblend.io/v1alpha1/blenddeployments"
VLLM_ENV = ROOT / ".venv-vllm"  # `make test-vllm`'s environment: the CPU build of vLLM
# What a vLLM pod's CPU stand-in gets: vLLM's KV cache on the CPU (GiB; room for four
# clients' ~500-token prompts and a shadow many times over).
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
ENGINE_PORT = 8000  # the OpenAI API (holeblend-serve's metrics too)
CONNECTOR_METRICS_PORT = 9464  # a vLLM pod's holeblend_* series (HOLEBLEND_METRICS_PORT)


def vllm_stand_in(bin_dir: Path, venv: Path = VLLM_ENV) -> DeviceStandIn:
    """NVIDIA pods run here on the CPU with vLLM from `venv`: a `vllm` in `bin_dir` starts
    the CPU build's API server (`vllm_shim`); SystemExit when the environment is absent."""
    python = venv / "bin" / "python"
    if not python.exists() or not (venv / ".installed").exists():
        raise SystemExit(f"{venv} is missing or incomplete: `make test-vllm` installs it")
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "vllm"
    shim.write_text(f"#!{python} -I\nfrom holeblend_devtools.vllm_shim import main\n\nmain()\n")
    shim.chmod(0o755)
    return DeviceStandIn(frozenset({"nvidia.com/gpu"}), bin_dir, dict(VLLM_CPU_ENV))


def vllm_example(model_dir: Path, **tuning) -> dict:
    """The CPU example as a one-GPU NVIDIA deployment: vLLM pods with the connector, the
    model from a hostPath (the operator must admit its parent: `--host-path-prefix`)."""
    body = example(**tuning)
    spec = body["spec"]
    spec["accelerator"] = {"type": "nvidia", "count": 1}
    spec["model"]["source"] = {"hostPath": {"path": str(model_dir)}}
    spec["model"]["maxModelLen"] = 2048
    spec["engine"].pop("shmSize", None)
    return body


def log_tail(path: Path, num_bytes: int) -> str:
    """The last `num_bytes` of a log file ("" if there is none yet)."""
    return path.read_bytes()[-num_bytes:].decode(errors="replace") if path.exists() else ""


class LiveStack:
    """Emulator + process kubelet + operator (+ Prometheus); everything stops on exit."""

    def __init__(
        self,
        workdir: str | Path,
        operator_flags: tuple[str, ...] = (),
        stand_in: DeviceStandIn | None = None,
    ):
        self.workdir = Path(workdir)
        self.stand_in = stand_in
        self.kubeconfig = str(self.workdir / "kubeconfig")
        self.cluster = EmulatorThread(self.kubeconfig, crds=(str(CRD),), keep_requests=False)
        self.kubelet: ProcessKubelet | None = None
        self.operator: subprocess.Popen | None = None
        self._prometheus: contextlib.ExitStack | None = None
        self.prometheus_url: str | None = None
        self.env: dict[str, str] = {}
        self._operator_flags = operator_flags

    def __enter__(self) -> LiveStack:
        self.cluster.__enter__()
        self.env = environment_for(self.kubeconfig) | {
            "KUBECACHEDIR": str(self.workdir / "kube-cache")
        }
        self.kubelet = ProcessKubelet(
            self.cluster, self.workdir / "pods", stand_in=self.stand_in
        ).__enter__()
        flags = ("--health-port", "0", "--log-format", "plain", "--log-level", "warning")
        try:
            log = open(self.workdir / "operator.log", "w")  # noqa: SIM115 - kept with the process
            self.operator = subprocess.Popen(
                operator_command(*flags, *self._operator_flags),
                env=self.env,
                stdout=log,
                stderr=log,
            )
        except BaseException:  # the kubelet and the emulator started: stop them
            self.__exit__()
            raise
        return self

    def __exit__(self, *_) -> None:
        """Stop everything, each part even when stopping an earlier one was interrupted (a
        second Ctrl-C while the operator stops would otherwise leave the pods running)."""
        try:
            if self._prometheus is not None:
                self._prometheus.close()
            if self.operator is not None:
                stop_process(self.operator)
        finally:
            try:
                if self.kubelet is not None:
                    self.kubelet.stop()
            finally:
                self.cluster.__exit__(None, None, None)

    def apply(self, body: dict) -> None:
        self.cluster.call(self.cluster.api.put_object(BD, body))

    def patch(self, name: str, patch: dict) -> None:
        self.cluster.call(self.cluster.api.edit_object(BD, "default", name, patch))

    def delete(self, name: str, timeout_s: float = 60) -> None:
        """Delete the BlendDeployment and wait until its pods are gone."""
        self.cluster.call(self.cluster.api.delete_object(BD, "default", name))
        deadline = time.monotonic() + timeout_s
        while self.engine_pods(name) and time.monotonic() < deadline:
            time.sleep(0.3)
        if self._prometheus is not None:
            self._prometheus.close()
            self._prometheus = self.prometheus_url = None

    def status(self, name: str) -> dict:
        return (self.cluster.get(BD, "default", name) or {}).get("status") or {}

    def wait_ready(self, name: str, timeout_s: float) -> bool:
        """Ready in status, which now needs the engine processes to pass their probes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.status(name).get("phase") == "Ready" and self.engine_url(name):
                return True
            time.sleep(0.5)
        return False

    def engine_url(self, name: str) -> str | None:
        return self.kubelet.local_url("default", f"{name}-engine") if self.kubelet else None

    def engine_log_tail(self, name: str, num_bytes: int = 2000) -> str:
        """The end of each engine pod's container log (for errors)."""
        tails = []
        for pod in self.engine_pods(name):
            tails.append(f"--- {pod.name}\n{log_tail(self.kubelet.log_path(pod), num_bytes)}")
        return "\n".join(tails) or "(no engine pod)"

    def engine_pods(self, name: str) -> list:
        return [p for p in self.kubelet.pods.values() if p.deployment == f"{name}-engine"]

    def metrics_url(self, name: str, port: int = ENGINE_PORT) -> str | None:
        """The first engine pod's /metrics on `port` (a vLLM pod's holeblend_* series are
        on CONNECTOR_METRICS_PORT)."""
        pods = self.engine_pods(name)
        return f"http://{pods[0].ip}:{port}/metrics" if pods else None

    def start_prometheus(self, name: str, port: int = ENGINE_PORT) -> str:
        """A real Prometheus scraping the engine pods (labels as a ServiceMonitor gives)."""
        targets = [
            prometheus.ScrapeTarget(
                f"{pod.ip}:{port}",
                {"namespace": "default", "service": f"{name}-engine", "pod": pod.name},
            )
            for pod in self.engine_pods(name)
        ]
        self._prometheus = contextlib.ExitStack()
        self.prometheus_url = self._prometheus.enter_context(prometheus.running_prometheus(targets))
        return self.prometheus_url


def example(**tuning) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["spec"]["tuning"] = body["spec"].get("tuning", {}) | tuning
    return body


@dataclasses.dataclass
class Sent:
    t: float
    status: int
    seconds: float
    usage: dict


def first_pass_or_hole(workload: WorkloadConfig, qa: QAPrompt, is_first: bool) -> tuple[str, ...]:
    """A question's documents: the first time without its hole documents (in a seeded
    order when the workload shuffles pass 1, as retrieval order varies), later whole, so
    they blend cached documents around a hole."""
    shuffle = workload.shuffle_first_pass and is_first
    return qa.document_texts(
        without_holes=is_first, shuffle_seed=workload.seed if shuffle else None
    )


class RagStream:
    """One client thread: a request, a think time, the next; stops on `stop()`.

    Several streams at once (`client` of `clients`, paired): each sends every
    `clients`-th question from its `client`-th, so that no two send the same question."""

    def __init__(
        self,
        url: str,
        workload: WorkloadConfig,
        think_s: float = 0.5,
        max_tokens: int = 8,
        seed: int = 0,
        zipf_s: float = 1.1,
        is_paired: bool = False,
        warm_max_tokens: int | None = None,
        client: int = 0,
        clients: int = 1,
        make_body: Callable[[str, Sequence[str], str, int], dict] | None = None,
    ):
        if not 0 <= client < clients:
            raise ValueError(f"client: must be within [0, {clients}), got {client}")
        self.url, self.think_s, self.max_tokens = url, think_s, max_tokens
        self.zipf_s = zipf_s
        # Paired: the questions in order, each sent twice (without its hole documents, then
        # with them: a hole request); no question repeats until all were sent.
        self.is_paired = is_paired
        # Paired, with warm_max_tokens set: the first request of a pair only puts its
        # documents in the cache, as an earlier user's question on them did: it asks for
        # that many tokens, and the hole request follows it without a think time.
        self.warm_max_tokens = warm_max_tokens
        self.client, self.clients = client, clients
        # The engine's request body (`/v1/completions`); None: holeblend-serve's chat body.
        self.make_body = make_body
        self._next = 0
        self.workload = workload
        self.prompts: list[QAPrompt] = list(generate_workload(workload))
        self._rng = random.Random(seed)
        self._weights = [1 / (i + 1) ** zipf_s for i in range(len(self.prompts))]
        self._seen: set[int] = set()
        self.sent: list[Sent] = []
        self.num_repeated = 0  # paired requests of questions already sent (the list wrapped)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rag-stream-{client}", daemon=True)

    def start(self) -> RagStream:
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Stop after the request in flight (`stop` waits for it)."""
        self._stop.set()

    def stop(self) -> None:
        self.request_stop()
        self._thread.join(timeout=180)

    def switch(self, workload: WorkloadConfig) -> None:
        """A different corpus from now on (the closed loop's workload change)."""
        self.workload = workload
        self.prompts = list(generate_workload(workload))
        self._weights = [1 / (i + 1) ** self.zipf_s for i in range(len(self.prompts))]
        self._seen = set()
        self._next = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.is_paired:
                pair, second = divmod(self._next, 2)
                question = pair * self.clients + self.client
                index, is_first = question % len(self.prompts), not second
                self.num_repeated += question >= len(self.prompts)
                self._next += 1
            else:
                index = self._rng.choices(range(len(self.prompts)), self._weights)[0]
                is_first = index not in self._seen
            qa = self.prompts[index]
            documents = first_pass_or_hole(self.workload, qa, is_first)
            self._seen.add(index)
            is_warm = self.is_paired and is_first and self.warm_max_tokens is not None
            max_tokens = self.warm_max_tokens if is_warm else self.max_tokens
            self.sent.append(self.send(qa.system, documents, qa.question, max_tokens))
            if not is_warm and self.think_s > 0:
                self._stop.wait(self.think_s)

    def send(self, system: str, documents, question: str, max_tokens: int | None = None) -> Sent:
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        if self.make_body is not None:
            body, path = self.make_body(system, documents, question, max_tokens), "completions"
        else:
            body = {
                "model": "smollm2",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
                "documents": list(documents),
                "max_tokens": max_tokens,
            }
            path = "chat/completions"
        request = urllib.request.Request(
            f"{self.url}/v1/{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        started = time.monotonic()
        try:
            with local_http.LOCAL.open(request, timeout=120) as response:
                answer = json.loads(response.read())
                status = response.status
        except urllib.error.HTTPError as error:
            answer, status = {}, error.code
        except OSError:
            answer, status = {}, 0
        return Sent(time.time(), status, time.monotonic() - started, answer.get("usage") or {})


def summary_of_usage(sent: list[Sent]) -> dict:
    ok = [s for s in sent if s.status == 200]
    prompt = sum(s.usage.get("prompt_tokens", 0) for s in ok)
    cached = sum((s.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for s in ok)
    # None when no response says (vLLM's usage carries no cached-token count).
    reported = any(s.usage.get("prompt_tokens_details") is not None for s in ok)
    return {
        "requests": len(sent),
        "ok": len(ok),
        "reused_share": cached / prompt if prompt and reported else None,
        "mean_request_s": sum(s.seconds for s in ok) / len(ok) if ok else None,
    }


def print_history(history: list[dict]) -> None:
    for entry in history:
        print(
            f"  {entry.get('time', '')}  {entry.get('direction', ''):4}  "
            f"{entry.get('fromRatio')} -> {entry.get('toRatio')}  {entry.get('reason', '')}"
        )
