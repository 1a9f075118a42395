"""`make demo`: holeblend serving for real on one machine, the ratio tuner closing the loop.

1. Starts the Kubernetes API emulator with the process kubelet (`devtools/kubelet.py`: CPU
   pods run as local processes, so the engine pod really runs `holeblend-serve`),
   `holeblend-operator run`, and applies the CRD and examples/cpu.yaml with kubectl.
2. Waits for real readiness (the engine's /ready probe), prints the children and
   `kubectl get bd -o wide`.
3. Shortens the tuning interval for the demo, uses a real Prometheus if one is installed
   (else the operator scrapes the pod), and sends a RAG request stream to the engine
   Service's local port while the tuner acts on the live metrics.
4. Prints `kubectl get bd -o wide` (HIT% and F1 filled in), the ratio history from status,
   writes out/demo-closed-loop.png (ratio, F1 proxy and TTFT over time), stops everything.
`make demo` then runs `holeblend-bench --quick`: full prefill, standard CacheBlend and hole
mode on the real model.
"""

import argparse
import importlib.util
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from holeblend_devtools import closed_loop, prometheus, timeline
from holeblend_runtime.bench.workload import WorkloadConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "blenddeployments.blend.holeblend.io.yaml"
EXAMPLE = ROOT / "examples" / "cpu.yaml"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for Ready")
    parser.add_argument("--stream-seconds", type=float, default=90.0, help="RAG stream length")
    parser.add_argument("--png", default="out/demo-closed-loop.png")
    args = parser.parse_args(argv)
    exit_on_signals()
    with (
        tempfile.TemporaryDirectory(prefix="holeblend-demo-") as workdir,
        closed_loop.LiveStack(workdir) as stack,
    ):
        step(f"Kubernetes API emulator on {stack.cluster.url}, process kubelet, operator")
        ok = operator_stage(stack.env, args.timeout) and loop_stage(stack, args)
        if not ok:
            show_logs(stack)
    step("stopped the engine, the operator, Prometheus and the emulator")
    return 0 if ok else 1


def exit_on_signals() -> None:
    """SIGTERM (a CI timeout, a kill) and SIGHUP (the terminal closed) unwind like Ctrl-C,
    so every started process is stopped. Their default ends the interpreter at once, and
    the pods, in sessions of their own, would run on holding their ports."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))


DEMO_TUNING = {  # faster than the example's, so the loop acts within the demo
    "intervalSeconds": 10,
    "cooldownSeconds": 20,
    "minSamples": 3,
    "shadowSampleRate": 0.5,
    "targetF1Proxy": 0.8,
    "band": 0.05,
}


def loop_stage(stack: closed_loop.LiveStack, args) -> bool:
    """The RAG stream with the tuner acting; False when a request of it failed."""
    name = "smollm2-demo"
    if prometheus.is_installed():
        url = stack.start_prometheus(name)
        step(f"a real Prometheus on {url} scrapes the engine pod; the tuner queries it")
        patch = json.dumps({"spec": {"tuning": {"prometheusUrl": url}}})
        kubectl(stack.env, "patch", "bd", name, "--type=merge", "-p", patch)
    else:
        step("no Prometheus here: the operator scrapes the engine pod's /metrics itself")
    url = stack.engine_url(name)
    step(f"RAG request stream to the engine Service on {url} for {args.stream_seconds:.0f} s")
    workload = WorkloadConfig(
        seed=1, num_questions=6, num_documents=4, min_document_tokens=60, max_document_tokens=100
    )
    recorder = timeline.Recorder(lambda: stack.status(name), f"{url}/metrics")
    stream = closed_loop.RagStream(url, workload, think_s=1.5)
    with recorder:
        stream.start()
        time.sleep(args.stream_seconds)
        stream.stop()
    usage = closed_loop.summary_of_usage(stream.sent)
    print(json.dumps(usage))
    kubectl(stack.env, "get", "bd", "-o", "wide")
    show_conditions(stack.env, name)
    step("tuning history (status.tuning.history)")
    closed_loop.print_history((stack.status(name).get("tuning") or {}).get("history") or [])
    target = DEMO_TUNING["targetF1Proxy"]
    timeline.plot(recorder.samples, args.png, f"{name}: closed loop", target=target)
    step(f"wrote {args.png}")
    num_failed = usage["requests"] - usage["ok"]
    if num_failed:
        step(f"{num_failed} of the {usage['requests']} requests to the engine failed")
    return not num_failed


def show_conditions(env: dict, name: str) -> None:
    conditions = "{range .status.conditions[*]}{.type}={.status} ({.reason}){'\\n'}{end}"
    kubectl(env, "get", "bd", name, "-o", f"jsonpath={conditions}")


def operator_stage(env: dict, timeout: float) -> bool:
    kubectl(env, "apply", "-f", str(CRD))
    kubectl(env, "apply", "-f", str(EXAMPLE))
    name = "smollm2-demo"
    # Before the pods start, so they start once: the demo's tuning is faster (DEMO_TUNING).
    kubectl(env, "patch", "bd", name, "--type=merge", "-p", demo_patch())
    ready = wait_ready(env, name, timeout)
    kubectl(
        env,
        "get",
        "deployments,pods,services,configmaps,poddisruptionbudgets",
        "-l",
        f"app.kubernetes.io/instance={name}",
    )
    kubectl(env, "get", "bd", "-o", "wide")
    show_conditions(env, name)
    return ready


def show_logs(stack: closed_loop.LiveStack, num_bytes: int = 3000) -> None:
    """The end of the operator's and of each pod's log. They go with the demo's temporary
    directory, so this is where a user sees why the engine never became ready."""
    logs = {"the operator": stack.workdir / "operator.log"}
    for pod in stack.kubelet.pods.values():
        logs[f"pod {pod.name}"] = stack.kubelet.log_path(pod)
    for name, path in logs.items():
        text = closed_loop.log_tail(path, num_bytes)
        step(f"the end of {name}'s log ({path}, removed when the demo exits)")
        print(text.strip() or "(empty)", flush=True)


def demo_patch() -> str:
    spec: dict = {"tuning": DEMO_TUNING}
    if importlib.util.find_spec("holeblend_runtime.lookup_server") is None:
        step("this tree has no lookup server yet: each pod reuses only its own cache")
        spec["lookupServer"] = {"enabled": False}
    return json.dumps({"spec": spec})


def wait_ready(env: dict, name: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if read_phase(env, name, max(deadline - time.monotonic(), 0.1)) == "Ready":
            step(f"{name} is Ready")
            return True
        time.sleep(0.3)
    step(f"{name} did not become Ready in {timeout} s")
    return False


def read_phase(env: dict, name: str, timeout: float) -> str:
    """The BlendDeployment's phase; "" when kubectl gets no answer within `timeout` (it waits
    for an API server that stopped answering as long as it takes)."""
    try:
        return subprocess.run(
            [KUBECTL, "get", "bd", name, "-o", "jsonpath={.status.phase}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        ).stdout
    except subprocess.TimeoutExpired:
        return ""


def kubectl(env: dict, *args: str) -> None:
    step("kubectl " + " ".join(args))
    extra = ["--validate=false"] if args[0] == "apply" else []
    subprocess.run([KUBECTL, *args[:1], *extra, *args[1:]], env=env, check=True)


def step(message: str) -> None:
    print(f"\n==> {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
