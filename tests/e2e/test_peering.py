"""HA: two operator processes share a kopf peering object; one works, the other stands by."""

import re
import signal
import subprocess
import time

import pytest
import yaml

from holeblend_devtools.background import operator_command
from tests.e2e.conftest import BD, NAME, ROOT, create, edit, example, status_of
from tests.e2e.test_process import fetch, free_port
from tests.e2e.test_tuning import EnginePod, add_ready_pod, history, tuned_example

PEERING = "kopf.dev/v1/clusterkopfpeerings"


def start(port: int) -> subprocess.Popen:
    command = operator_command(
        "--peering",
        "holeblend",
        "--peering-lifetime-s",
        "4",  # keep-alives every second: 3 s of margin on a busy machine
        "--health-host",
        "127.0.0.1",
        "--health-port",
        str(port),
        "--status-debounce-s",
        "0.05",
        "--log-level",
        "warning",
    )
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def reconciles(port: int) -> float:
    text = fetch(f"http://127.0.0.1:{port}/metrics")[1]
    found = re.findall(
        r'holeblend_operator_reconciles_total\{result="ok",trigger="(?:create|update)"\} (\S+)',
        text,
    )
    return sum(float(value) for value in found)


def tuning_decisions(port: int) -> float:
    text = fetch(f"http://127.0.0.1:{port}/metrics")[1]
    found = re.findall(r"holeblend_operator_tuning_decisions_total\{[^}]*\} (\S+)", text)
    return sum(float(value) for value in found)


def start_peers(cluster) -> tuple[list[int], list[subprocess.Popen]]:
    """Two operator processes sharing the peering object, both seen in it."""
    with open(ROOT / "deploy" / "kopf-peering.yaml") as file:
        for crd in yaml.safe_load_all(file):
            cluster.run(lambda crd=crd: cluster.api.install_crd(crd))
    cluster.call(cluster.api.put_object(PEERING, {"metadata": {"name": "holeblend"}}))
    ports = [free_port(), free_port()]
    processes = [start(port) for port in ports]
    for port in ports:
        cluster.wait_for(
            lambda port=port: fetch(f"http://127.0.0.1:{port}/healthz")[0] == 200, timeout=20
        )
    cluster.wait_for(
        lambda: len(cluster.get(PEERING, None, "holeblend").get("status") or {}) == 2,
        timeout=20,
    )
    time.sleep(1.0)  # both have seen each other's keep-alive: the lower one pauses
    return ports, processes


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=20)


def test_only_one_replica_reconciles_and_the_standby_takes_over(cluster):
    ports, processes = start_peers(cluster)
    try:
        create(cluster, example())
        cluster.wait_for(
            lambda: status_of(cluster, "smollm2-demo").get("phase") == "Ready", timeout=20
        )
        counts = [reconciles(port) for port in ports]
        assert sorted(counts) == [0.0, 1.0], counts
        active = counts.index(1.0)
        processes[active].send_signal(signal.SIGKILL)  # a crash: no goodbye in the peering object
        processes[active].wait()
        standby = ports[1 - active]
        edit(cluster, BD, "smollm2-demo", {"spec": {"replicas": 2}})
        cluster.wait_for(lambda: reconciles(standby) >= 1.0, timeout=20)
        cluster.wait_for(
            lambda: status_of(cluster, "smollm2-demo").get("observedGeneration") == 2, timeout=20
        )
    finally:
        stop_all(processes)


@pytest.mark.slow
def test_only_the_active_replica_tunes_and_the_standby_continues_from_status(cluster):
    ports, processes = start_peers(cluster)
    try:
        with EnginePod(cluster) as pod:
            create(cluster, tuned_example(pod.port))
            cluster.wait_for(lambda: status_of(cluster, NAME).get("phase") == "Ready", 20)
            engine = cluster.get("apps/v1/deployments", "default", f"{NAME}-engine")
            add_ready_pod(cluster, engine["spec"]["selector"]["matchLabels"])
            cluster.wait_for(lambda: any(h["direction"] == "up" for h in history(cluster)), 60)
            counts = [tuning_decisions(port) for port in ports]
            assert sorted(counts)[0] == 0 and sorted(counts)[1] >= 1, counts
            active = 0 if counts[0] else 1
            processes[active].send_signal(signal.SIGKILL)
            processes[active].wait()
            standby = ports[1 - active]
            cluster.wait_for(lambda: tuning_decisions(standby) >= 1, timeout=30)
            # It went on from the ratio the active replica left in status, not from the spec.
            cluster.wait_for(lambda: status_of(cluster, NAME)["recomputeRatio"] == 0.1125, 30)
            ups = [
                (h["fromRatio"], h["toRatio"]) for h in history(cluster) if h["direction"] == "up"
            ]
            assert ups == [(0.05, 0.075), (0.075, 0.1125)]
    finally:
        stop_all(processes)
