"""An API emulator per test and a helper to run the operator against it with kopf's KopfRunner."""

import collections
import contextlib
import copy
import pathlib
import shutil

import kopf
import kopf.testing
import pytest
import yaml

from holeblend_devtools import workloads
from holeblend_devtools.background import EmulatorThread
from holeblend_operator import handlers, metrics
from holeblend_operator.settings import OperatorSettings

ROOT = pathlib.Path(__file__).parents[2]
CRD = str(ROOT / "crds" / "blenddeployments.blend.holeblend.io.yaml")
# kubectl from `make tools` (what CI installs), else the one on PATH.
KUBECTL = (
    str(ROOT / ".tools" / "bin" / "kubectl")
    if (ROOT / ".tools" / "bin" / "kubectl").exists()
    else shutil.which("kubectl") or "kubectl"
)
BD = "blend.holeblend.io/v1alpha1/blenddeployments"
DEPLOYMENTS = "apps/v1/deployments"
NAME = "smollm2-demo"  # the CPU example's name
# Short delays so that retries and debounces fit in a fast test suite.
FAST = OperatorSettings(
    status_debounce_s=0.05,
    requeue_s=0.3,
    backoff_base_s=0.05,
    backoff_cap_s=0.5,
    blocked_retry_s=0.5,
    request_timeout_s=1.0,
    health_port=0,
)
# One emulated node with 8 NVIDIA GPUs and no Ascend NPUs.
NODE = workloads.Node(allocatable={"nvidia.com/gpu": 8}, labels={})


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    kubeconfig = str(tmp_path / "kubeconfig")
    with EmulatorThread(kubeconfig, crds=(CRD,), node=NODE) as emulator:
        monkeypatch.setenv("KUBECONFIG", kubeconfig)
        yield emulator


@contextlib.contextmanager
def running_operator(settings: OperatorSettings = FAST):
    registry = kopf.OperatorRegistry()
    handlers.register(settings, registry)
    args = ["run", "--standalone", "-A"]
    with kopf.testing.KopfRunner(args, registry=registry, timeout=30) as runner:
        yield runner


def example(name: str = "cpu.yaml") -> dict:
    with open(ROOT / "examples" / name) as file:
        return copy.deepcopy(yaml.safe_load(file))


def create(cluster: EmulatorThread, body: dict) -> dict:
    return cluster.call(cluster.api.put_object(BD, body))


def edit(cluster: EmulatorThread, resource: str, name: str, patch: dict) -> dict:
    return cluster.call(cluster.api.edit_object(resource, "default", name, patch))


def status_of(cluster: EmulatorThread, name: str) -> dict:
    return (cluster.get(BD, "default", name) or {}).get("status") or {}


def condition(cluster: EmulatorThread, name: str, kind: str) -> dict:
    found = [c for c in status_of(cluster, name).get("conditions") or [] if c["type"] == kind]
    return found[0] if found else {}


def owned_children(cluster: EmulatorThread, uid: str) -> list[tuple[str, str]]:
    found = []
    for resource in (DEPLOYMENTS, "v1/services", "v1/configmaps", "policy/v1/poddisruptionbudgets"):
        for obj in cluster.list(resource, "default"):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(ref["uid"] == uid for ref in refs):
                found.append((obj["kind"], obj["metadata"]["name"]))
    return sorted(found)


def is_ready(cluster: EmulatorThread, name: str = NAME, generation: int | None = 1) -> bool:
    """Ready for `generation` (any generation if None)."""
    status = status_of(cluster, name)
    current = generation is None or status.get("observedGeneration") == generation
    return status.get("phase") == "Ready" and current


def reconciles() -> collections.Counter:
    """The operator's reconcile counter by (trigger, result), read from its registry."""
    counts = collections.Counter()
    for metric in metrics.RECONCILES.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counts[(sample.labels["trigger"], sample.labels["result"])] = int(sample.value)
    return counts
