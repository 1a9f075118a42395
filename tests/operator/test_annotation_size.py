"""A spec whose children would break the API server's annotation limit is refused, naming
the fields to shorten, instead of having every write of the engine Deployment refused.

The applied copy of a child (reconcile.LAST_APPLIED_ANNOTATION) is the child itself, so the
engine Deployment's annotations grow with its env and arguments; the CRD admits specs that
take it past the 256 KiB Kubernetes allows. The cluster here refuses what the API server
refuses (tests/operator/kube_rules.py: annotations_problems).
"""

import asyncio
import copy

import pytest

from holeblend_operator import kube, reconcile
from tests.operator import kube_rules
from tests.operator.crd_validation import api_server_errors
from tests.operator.test_kube_rules import manifest

FIRST = reconcile.Options(create_first=True, prune=False)


class Cluster:
    """Children by (kind, name); refuses an object whose annotations the API server refuses."""

    def __init__(self):
        self.objects: dict[tuple[str, str], dict] = {}
        self.statuses: list[dict] = []

    async def create(self, kind, body):
        problems = kube_rules.annotations_problems(body["metadata"].get("annotations", {}))
        if problems:
            raise kube.Invalid(f"create {kind.kind}: {'; '.join(problems)}")
        self.objects[(body["kind"], body["metadata"]["name"])] = copy.deepcopy(body)
        return copy.deepcopy(body)

    async def list(self, kind, namespace, selector):
        return []

    async def get(self, kind, namespace, name):
        return copy.deepcopy(self.objects.get((kind.kind, name)))

    async def patch_status(self, namespace, name, status):
        self.statuses.append(status)
        return {}


def with_env(num_vars: int) -> dict:
    """A spec the CRD admits: `num_vars` engine env vars of the longest value allowed."""
    spec = manifest(
        engine__env=[{"name": f"SETTING_{i}", "value": "x" * 4096} for i in range(num_vars)]
    )
    assert api_server_errors(spec) == []
    return spec


def degraded_message(status: dict) -> str:
    (condition,) = [c for c in status["conditions"] if c["type"] == "Degraded"]
    assert (condition["status"], condition["reason"]) == ("True", "InvalidSpec")
    return condition["message"]


def test_a_spec_over_the_annotation_limit_is_refused_naming_the_field_to_shorten():
    cluster = Cluster()
    with pytest.raises(reconcile.InvalidSpec, match=r"spec\.engine\.env \(\d+ bytes\)"):
        asyncio.run(reconcile.reconcile(cluster, with_env(64), FIRST, "t"))
    assert cluster.objects == {}
    message = degraded_message(cluster.statuses[-1])
    assert "spec.engine.env" in message and str(reconcile.ANNOTATIONS_MAX_BYTES) in message


def test_a_large_spec_within_the_annotation_limit_is_applied():
    cluster = Cluster()
    asyncio.run(reconcile.reconcile(cluster, with_env(48), FIRST, "t"))
    assert ("Deployment", "rag-engine") in cluster.objects
    assert cluster.statuses == []


def test_non_ascii_text_counts_as_the_applied_copy_spells_it():
    """The applied copy's JSON escapes non-ASCII characters (six bytes each), so a spec far
    below the limit in characters can take the copy over it."""
    spec = manifest(engine__podAnnotations={f"example.com/note-{i}": "é" * 4096 for i in range(11)})
    assert api_server_errors(spec) == []
    with pytest.raises(reconcile.InvalidSpec, match=r"spec\.engine\.podAnnotations"):
        reconcile.prepare(spec)
