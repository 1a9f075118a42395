"""Children whose quantities the API server stored in canonical form are left alone.

A real kube-apiserver parses every resource.Quantity field and stores it re-serialized
(apimachinery pkg/api/resource/quantity.go, Quantity.String and CanonicalizeBytes): the
largest suffix that keeps the number whole, in the format the value was written in. The
test cluster below does the same for the fields the renderer writes quantities into, from a
table of canonical forms written out by hand.
"""

import asyncio
import copy
import pathlib

import pytest
import yaml
from kmock._internal.dicts import merge_patch_dict  # the emulator's merge patch

from holeblend_operator import reconcile
from holeblend_operator.reconcile import contains, merge_patch

ROOT = pathlib.Path(__file__).parents[2]

# What the API server stores for each quantity the owner below writes (or the renderer
# derives: blend.kv.localCpuBytes 768Mi plus 256Mi of headroom is a KV volume of "1024Mi").
CANONICAL = {
    "0.5": "500m",
    "1.5": "1500m",
    "0.1": "100m",
    "1024Mi": "1Gi",
    "2048Mi": "2Gi",
    "0.5Gi": "512Mi",
    "0.25Gi": "256Mi",
}


def owner(generation: int = 1, **engine) -> dict:
    """The NVIDIA example with quantities written as a person might (0.5 CPU, 1024Mi)."""
    body = yaml.safe_load((ROOT / "examples" / "nvidia.yaml").read_text())
    body["metadata"].update(uid="uid-1", generation=generation)
    spec = body["spec"]
    spec["engine"] = {
        "resources": {
            "requests": {"cpu": "0.5", "memory": "1024Mi"},
            "limits": {"cpu": "1.5", "memory": "2048Mi"},
        },
        "shmSize": "0.5Gi",
        "env": [{"name": "BATCH_TOKENS", "value": "1000"}],
    } | engine
    spec["blend"]["kv"]["localCpuBytes"] = "768Mi"
    spec["lookupServer"] = {
        "resources": {"requests": {"cpu": "0.1", "memory": "128Mi"}, "limits": {"memory": "0.25Gi"}}
    }
    return body


def stored(obj: dict) -> dict:
    """`obj` as the API server keeps it: container resources and emptyDir sizes canonical."""
    obj = copy.deepcopy(obj)
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod.get("containers", []):
        for section in container.get("resources", {}).values():
            section.update({name: CANONICAL.get(q, q) for name, q in section.items()})
    for volume in pod.get("volumes", []):
        if "sizeLimit" in volume.get("emptyDir", {}):
            size = volume["emptyDir"]["sizeLimit"]
            volume["emptyDir"]["sizeLimit"] = CANONICAL.get(size, size)
    return obj


class Cluster:
    """Children by (kind, name), stored as the API server stores them; records each PATCH."""

    def __init__(self):
        self.objects: dict[tuple[str, str], dict] = {}
        self.patches: list[tuple[str, str, dict]] = []

    async def create(self, kind, body):
        key = (body["kind"], body["metadata"]["name"])
        if key in self.objects:
            return None
        self.objects[key] = stored(body)
        return copy.deepcopy(self.objects[key])

    async def get(self, kind, namespace, name):
        return copy.deepcopy(self.objects.get((kind.kind, name)))

    async def patch(self, kind, namespace, name, patch):
        self.patches.append((kind.kind, name, patch))
        key = (kind.kind, name)
        self.objects[key] = stored(merge_patch_dict(copy.deepcopy(self.objects[key]), patch))
        return copy.deepcopy(self.objects[key])

    async def list(self, kind, namespace, selector):
        return []

    async def delete(self, kind, namespace, name):
        return self.objects.pop((kind.kind, name), None) is not None

    async def patch_status(self, namespace, name, status):
        return {}


FIRST = reconcile.Options(create_first=True, prune=False)
AGAIN = reconcile.Options(create_first=False, prune=False)


def reconciled(cluster: Cluster, body: dict, options=AGAIN) -> list[tuple[str, str, dict]]:
    """The PATCHes one reconcile of `body` sends."""
    before = len(cluster.patches)
    asyncio.run(reconcile.reconcile(cluster, body, options, "t"))
    return cluster.patches[before:]


def created() -> Cluster:
    cluster = Cluster()
    assert reconciled(cluster, owner(), FIRST) == []
    return cluster


def engine_pod(cluster: Cluster) -> dict:
    return cluster.objects[("Deployment", "llama-8b-engine")]["spec"]["template"]["spec"]


def test_the_cluster_stores_other_text_than_the_operator_renders():
    """The premise: each kind of quantity rendered is stored in another spelling."""
    pod = engine_pod(created())
    assert pod["containers"][0]["resources"]["limits"] == {
        "cpu": "1500m",
        "memory": "2Gi",
        "nvidia.com/gpu": "1",
    }
    sizes = {v["name"]: v["emptyDir"].get("sizeLimit") for v in pod["volumes"] if "emptyDir" in v}
    assert (sizes["shm"], sizes["kv-cache"]) == ("512Mi", "1Gi")


def test_canonical_quantities_leave_every_child_unchanged_on_the_next_reconcile():
    cluster = created()
    assert reconciled(cluster, owner()) == []


def edit_limit(pod: dict) -> None:
    pod["containers"][0]["resources"]["limits"]["cpu"] = "1"


def edit_env(pod: dict) -> None:
    """The same number, but an env var is a string: "1k" is not what was rendered."""
    pod["containers"][0]["env"] = [
        {**var, "value": "1k"} if var["name"] == "BATCH_TOKENS" else var
        for var in pod["containers"][0]["env"]
    ]


@pytest.mark.parametrize("edit", [edit_limit, edit_env], ids=["cpu-limit", "env-value"])
def test_a_changed_value_is_patched_back_once(edit):
    cluster = created()
    edit(engine_pod(cluster))

    ((kind, name, patch),) = reconciled(cluster, owner())

    assert (kind, name) == ("Deployment", "llama-8b-engine")
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["cpu"] == "1.5"
    assert {"name": "BATCH_TOKENS", "value": "1000"} in container["env"]
    assert reconciled(cluster, owner()) == []


def test_a_spec_change_patches_no_quantity_of_equal_value():
    """Only the replica count changed: the patch carries it (and the new annotations), not
    the pod template, whose quantities the cluster holds in canonical form."""
    cluster = created()
    scaled = owner(generation=2)
    scaled["spec"]["replicas"] = 3

    ((kind, name, patch),) = reconciled(cluster, scaled)

    assert (kind, name) == ("Deployment", "llama-8b-engine")
    assert patch["spec"] == {"replicas": 3}


def field(*path_and_value) -> dict:
    """{"a": {"b": value}} from ("a", "b", value)."""
    *path, value = path_and_value
    for key in reversed(path):
        value = {key: value}
    return value


@pytest.mark.parametrize(
    ("path", "live", "desired", "same"),
    [
        pytest.param(("resources", "limits", "cpu"), "500m", "0.5", True, id="container-limit"),
        pytest.param(
            ("spec", "resources", "requests", "storage"), "1Gi", "1024Mi", True, id="claim"
        ),
        pytest.param(("overhead", "memory"), "512Mi", "0.5Gi", True, id="pod-overhead"),
        pytest.param(("emptyDir", "sizeLimit"), "1k", "1000", True, id="empty-dir-size"),
        pytest.param(("resources", "limits", "cpu"), "1", "0.5", False, id="other-value"),
        pytest.param(("env", "value"), "1k", "1000", False, id="env-value"),
        pytest.param(("annotations", "limits"), "1k", "1000", False, id="annotation"),
        pytest.param(("data", "sizeLimit"), "1Gi", "1024Mi", False, id="configmap-key"),
    ],
)
def test_only_quantity_fields_compare_by_value(path, live, desired, same):
    live, desired = field(*path, live), field(*path, desired)
    assert contains(live, desired) is same
    assert (merge_patch(live, desired) == {}) is same
