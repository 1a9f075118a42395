"""`make demo`: the operator against an in-process Kubernetes API emulator, driven by kubectl.

Starts the emulator (with a stand-in Deployment controller), runs `holeblend-operator run`
as a subprocess, applies the CRD and examples/cpu.yaml with kubectl, prints the children and
`kubectl get bd` with its printer columns, then stops everything. `make demo` then runs
`holeblend-bench --quick`: full prefill, standard CacheBlend and hole mode on the real model.
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from holeblend_devtools import workloads
from holeblend_devtools.background import (
    EmulatorThread,
    environment_for,
    operator_command,
    stop_process,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "blenddeployments.blend.holeblend.io.yaml"
EXAMPLE = ROOT / "examples" / "cpu.yaml"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for Ready")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="holeblend-demo-") as workdir:
        kubeconfig = os.path.join(workdir, "kubeconfig")
        node = workloads.Node(allocatable={}, labels={})
        with EmulatorThread(kubeconfig, node=node, keep_requests=False) as cluster:
            env = environment_for(kubeconfig) | {"KUBECACHEDIR": os.path.join(workdir, "cache")}
            step(f"Kubernetes API emulator on {cluster.url}")
            operator = start_operator(env)
            try:
                ok = operator_stage(env, args.timeout)
            finally:
                stop_process(operator)
    step("stopped the operator and the emulator")
    return 0 if ok else 1


def operator_stage(env: dict, timeout: float) -> bool:
    kubectl(env, "apply", "-f", str(CRD))
    kubectl(env, "apply", "-f", str(EXAMPLE))
    name = "smollm2-demo"
    ready = wait_ready(env, name, timeout)
    kubectl(
        env,
        "get",
        "deployments,services,configmaps,poddisruptionbudgets",
        "-l",
        f"app.kubernetes.io/instance={name}",
    )
    kubectl(env, "get", "bd", "-o", "wide")
    kubectl(
        env,
        "get",
        "bd",
        name,
        "-o",
        "jsonpath={range .status.conditions[*]}{.type}={.status} ({.reason}){'\\n'}{end}",
    )
    return ready


def start_operator(env: dict) -> subprocess.Popen:
    step("holeblend-operator run --standalone")
    command = operator_command(
        "--health-port",
        "0",
        "--log-format",
        "plain",
        "--log-level",
        "warning",
    )
    return subprocess.Popen(command, env=env)


def wait_ready(env: dict, name: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        phase = subprocess.run(
            [KUBECTL, "get", "bd", name, "-o", "jsonpath={.status.phase}"],
            env=env,
            capture_output=True,
            text=True,
        ).stdout
        if phase == "Ready":
            step(f"{name} is Ready")
            return True
        time.sleep(0.3)
    step(f"{name} did not become Ready in {timeout} s")
    return False


def kubectl(env: dict, *args: str) -> None:
    step("kubectl " + " ".join(args))
    extra = ["--validate=false"] if args[0] == "apply" else []
    subprocess.run([KUBECTL, *args[:1], *extra, *args[1:]], env=env, check=True)


def step(message: str) -> None:
    print(f"\n==> {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
