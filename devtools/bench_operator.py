"""`make bench-operator`: time for N BlendDeployments to converge, next to the emulator's floor.

For each N: start a fresh emulator, run `holeblend-operator run` as a subprocess, create N
BlendDeployments at once (from a client process, as the replay sends its requests), and wait
until every one has status Ready for its generation (all children created and settled). Then replay the same API requests (recorded by the emulator:
the N creates, the operator's reads and writes, and its watch streams) without the operator,
from another process, against a fresh emulator, 16 in flight as the operator sends them:
that is the emulator's floor. Operator RSS and CPU come from /proc.

Memory: the operator's RSS once it watches with no objects (baseline), its peak (VmHWM),
its RSS at convergence, and then sampled every second for `--settle` seconds with nothing
changing (the tuner's own periodic writes aside). rss_per_object_mb = (RSS at the end of
that - baseline) / N; rss_flat says whether RSS still grew over the second half of it.
"""

import argparse
import asyncio
import copy
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import aiohttp
import yaml

from holeblend_devtools import workloads
from holeblend_devtools.background import (
    EmulatorThread,
    environment_for,
    operator_command,
    stop_process,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CRD = str(ROOT / "crds" / "blenddeployments.blend.holeblend.io.yaml")
BD = "blend.holeblend.io/v1alpha1/blenddeployments"
BD_PATH = "/apis/blend.holeblend.io/v1alpha1/namespaces/default/blenddeployments"
REPLAY_CONCURRENCY = 16  # the operator's own API concurrency (OperatorSettings.api_concurrency)
FLAT_MB = 2.0  # RSS growth over the second half of the settle time that still counts as flat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--counts", default="200,1000,5000", help="numbers of BlendDeployments")
    parser.add_argument("--json", dest="json_path", help="write the results here")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds to converge, per count"
    )
    parser.add_argument(
        "--settle", type=float, default=20.0, help="seconds RSS is sampled after convergence"
    )
    args = parser.parse_args(argv)
    results = [measure(int(n), args.timeout, args.settle) for n in args.counts.split(",")]
    text = json.dumps({"results": results}, indent=2)
    print(text)
    if args.json_path:
        pathlib.Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json_path).write_text(text + "\n")
    return 0


def measure(num_objects: int, timeout: float, settle_s: float = 20.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="holeblend-bench-") as workdir:
        kubeconfig = os.path.join(workdir, "kubeconfig")
        node = workloads.Node({}, {})
        with EmulatorThread(kubeconfig, crds=(CRD,), node=node, max_history=1) as cluster:
            operator = start_operator(environment_for(kubeconfig))
            try:
                result = converge(cluster, operator, num_objects, timeout, settle_s)
            finally:
                stop_process(operator)
        result["floor_s"] = replay(result.pop("requests"), result.pop("watches"), workdir)
    return {
        "num_objects": num_objects,
        "converge_s": round(result["converge_s"], 3),
        "floor_s": round(result["floor_s"], 3),
        "ratio_to_floor": round(result["converge_s"] / result["floor_s"], 2),
        "num_requests": result["num_requests"],
        "rss_mb": round(result["rss_mb"], 1),  # peak, until convergence
        "cpu_s_per_object": round(result["cpu_s"] / num_objects, 4),
        **memory(
            result["rss_baseline_mb"],
            result["rss_converged_mb"],
            result["rss_samples_mb"],
            num_objects,
        ),
    }


def memory(baseline: float, converged: float, samples: list[float], num_objects: int) -> dict:
    """RSS figures after convergence (see the module doc)."""
    settled = samples[-1] if samples else converged
    half = samples[len(samples) // 2 :] or [settled]
    growth = settled - min(half)
    return {
        "rss_baseline_mb": round(baseline, 1),
        "rss_converged_mb": round(converged, 1),
        "rss_settled_mb": round(settled, 1),
        "rss_per_object_mb": round((settled - baseline) / num_objects, 4),
        "rss_samples_mb": [round(sample, 1) for sample in samples],
        "rss_growth_after_settle_mb": round(growth, 1),
        "rss_flat": growth <= FLAT_MB,
    }


def converge(
    cluster: EmulatorThread,
    operator: subprocess.Popen,
    num_objects: int,
    timeout: float,
    settle_s: float = 20.0,
) -> dict:
    """Create the objects at once; time until all are Ready; what the operator sent meanwhile;
    its RSS before, at and after convergence."""
    cluster.wait_for(lambda: operator_watching(cluster), timeout=30)
    time.sleep(1.0)  # start-up done: the watches are open and their initial lists handled
    baseline_mb = current_rss(operator.pid)
    startup = cluster.run(cluster.api.take_requests)
    watches = sorted({r.url.path for r in startup if r.params.get("watch")})
    # The creates come from another process, as in the replay: sent from the emulator's own
    # thread they would take its time and count against the operator only.
    with multiprocessing.get_context("spawn").Pool(1) as client:
        client.apply(_ready)  # the client process is up and has imported what it needs
        bodies = manifests(num_objects)
        started = time.monotonic()
        created = client.apply_async(create_from_client, (cluster.url, bodies))
        cluster.wait_for(
            lambda: count_ready(cluster) >= num_objects, timeout=timeout, interval=0.01
        )
        converge_s = time.monotonic() - started
        created.get(timeout=timeout)
    rss_mb, cpu_s = usage(operator.pid)
    converged_mb = current_rss(operator.pid)
    requests = recorded(cluster.run(cluster.api.take_requests))
    samples = []
    for _ in range(round(settle_s)):
        time.sleep(1.0)
        samples.append(current_rss(operator.pid))
    return {
        "converge_s": converge_s,
        "rss_mb": rss_mb,
        "rss_baseline_mb": baseline_mb,
        "rss_converged_mb": converged_mb,
        "rss_samples_mb": samples,
        "cpu_s": cpu_s,
        "requests": requests,
        "watches": watches,
        "num_requests": len(requests),
    }


def start_operator(env: dict) -> subprocess.Popen:
    command = operator_command(
        "--health-port",
        "0",
        "--log-level",
        "warning",
        "--status-debounce-s",
        "0.2",
    )
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def operator_watching(cluster: EmulatorThread) -> bool:
    requests = cluster.run(lambda: list(cluster.api))  # kmock iterates its request log
    return any(r.params.get("watch") and "blenddeployments" in str(r.url) for r in requests)


def manifests(num_objects: int) -> list[dict]:
    """The CPU example, `num_objects` times under other names."""
    with open(ROOT / "examples" / "cpu.yaml") as file:
        example = yaml.safe_load(file)
    bodies = []
    for index in range(num_objects):
        body = copy.deepcopy(example)
        body["metadata"] = {"name": f"bench-{index:04d}", "namespace": "default"}
        bodies.append(body)
    return bodies


def _ready() -> None:
    pass


def create_from_client(url: str, bodies: list[dict]) -> None:
    asyncio.run(create_all(url, bodies))


async def create_all(url: str, bodies: list[dict]) -> None:
    async def create(session, body):
        async with session.post(BD_PATH, json=body) as response:
            if response.status != 201:
                raise RuntimeError(f"create {body['metadata']['name']}: {response.status}")

    async with aiohttp.ClientSession(url) as session:
        await asyncio.gather(*(create(session, body) for body in bodies))


def count_ready(cluster: EmulatorThread) -> int:
    return cluster.run(lambda: cluster.api.count_objects(BD, "default", is_ready))


def is_ready(obj: dict) -> bool:
    status = obj.get("status") or {}
    return status.get("phase") == "Ready" and status.get("observedGeneration") == 1


def recorded(requests: list) -> list[tuple[str, str, bytes, str]]:
    """The operator's requests (and the N creates) minus long-lived watches and discovery."""
    kept = []
    for request in list(requests):
        if (
            request.params.get("watch")
            or request.resource is None
            or request.resource.plural is None
        ):
            continue
        content_type = request.headers.get("Content-Type", "application/json")
        kept.append(
            (str(request.method.value), str(request.url.path_qs), request.body, content_type)
        )
    return kept


def replay(requests: list, watches: list[str], workdir: str) -> float:
    """Seconds a fresh emulator takes to serve the recorded requests while streaming the same
    watches, sent from another process (as the operator's were), 16 in flight."""
    kubeconfig = os.path.join(workdir, "replay-kubeconfig")
    node = workloads.Node({}, {})
    emulator = EmulatorThread(kubeconfig, crds=(CRD,), node=node, max_history=1)
    with emulator as cluster, multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(replay_from_client, (cluster.url, requests, watches))


def replay_from_client(url: str, requests: list, watches: list[str]) -> float:
    return asyncio.run(_replay(url, requests, watches))


async def _replay(url: str, requests: list, watches: list[str]) -> float:
    semaphore = asyncio.Semaphore(REPLAY_CONCURRENCY)

    async def send(session, method, path, body, content_type):
        headers = {"Content-Type": content_type}
        async with (
            semaphore,
            session.request(method, path, data=body or None, headers=headers) as response,
        ):
            await response.read()

    async def drain(session, path):
        async with session.get(path, params={"watch": "true"}) as response:
            async for _ in response.content:
                pass

    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=None)) as session:
        streams = [asyncio.create_task(drain(session, path)) for path in watches]
        await asyncio.sleep(0.5)  # the streams are open, as the operator's were
        started = time.monotonic()
        await asyncio.gather(*(send(session, *request) for request in requests))
        elapsed = time.monotonic() - started
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        return elapsed


def current_rss(pid: int) -> float:
    """The process's resident set now (MB)."""
    with open(f"/proc/{pid}/status") as file:
        return next(int(line.split()[1]) for line in file if line.startswith("VmRSS:")) / 1024


def usage(pid: int) -> tuple[float, float]:
    """Peak RSS (MB) and CPU seconds (user + system) of a running process."""
    with open(f"/proc/{pid}/status") as file:
        peak_kb = next(int(line.split()[1]) for line in file if line.startswith("VmHWM:"))
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return peak_kb / 1024, (int(fields[11]) + int(fields[12])) / ticks


if __name__ == "__main__":
    sys.exit(main())
