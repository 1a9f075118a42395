"""Children whose empty optional fields the API server left out are left alone.

The API server stores a child as its Go type serializes it: a string field tagged
`omitempty` that holds "" is not there when the object is read back
(staging/src/k8s.io/api/core/v1/types.go: EnvVar.Value; Toleration.Key, Operator, Value and
Effect). A rendered "" in one of them would never be found on the live child, so every
reconcile would patch it again. The test cluster below stores children that way.
"""

import copy

from holeblend_operator import reconcile
from holeblend_operator.render import render_children
from tests.operator.test_child_quantities import FIRST, Cluster, owner, reconciled

# Toleration fields of type string: Go leaves each out when it is "".
TOLERATION_STRINGS = ("key", "operator", "value", "effect")


def without_empty_strings(obj: dict) -> dict:
    """`obj` as the API server returns it: empty env values and toleration strings left out."""
    obj = copy.deepcopy(obj)
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod.get("containers", []):
        for var in container.get("env", []):
            if var.get("value") == "":
                del var["value"]
    for toleration in pod.get("tolerations", []):
        for name in TOLERATION_STRINGS:
            if toleration.get(name) == "":
                del toleration[name]
    return obj


class OmittingCluster(Cluster):
    """The quantity-canonicalizing cluster, leaving out empty strings as Go does."""

    async def create(self, kind, body):
        created = await super().create(kind, body)
        return created and self._store((body["kind"], body["metadata"]["name"]))

    async def patch(self, kind, namespace, name, patch):
        await super().patch(kind, namespace, name, patch)
        return self._store((kind.kind, name))

    def _store(self, key: tuple[str, str]) -> dict:
        self.objects[key] = without_empty_strings(self.objects[key])
        return copy.deepcopy(self.objects[key])


def owner_with_empty_values() -> dict:
    """An env var set to "" (it is defined, but empty) and tolerations with empty strings."""
    body = owner(env=[{"name": "PYTHONWARNINGS", "value": ""}, {"name": "HF_HUB_OFFLINE"}])
    body["spec"]["accelerator"]["tolerations"] = [
        {"key": "", "operator": "Exists"},
        {"key": "dedicated", "operator": "Equal", "value": "", "effect": "NoSchedule"},
    ]
    return body


def test_empty_env_values_and_toleration_strings_leave_the_engine_unchanged():
    cluster = OmittingCluster()
    assert reconciled(cluster, owner_with_empty_values(), FIRST) == []

    assert reconciled(cluster, owner_with_empty_values()) == []


def test_the_empty_variables_and_tolerations_are_rendered_as_the_server_stores_them():
    """Still defined (an empty variable is not an unset one), with nothing to leave out."""
    body = owner_with_empty_values()
    bd = reconcile.parse(body)
    engine = render_children(bd)[0]

    assert without_empty_strings(engine) == engine
    pod = engine["spec"]["template"]["spec"]
    names = [var["name"] for var in pod["containers"][0]["env"]]
    assert {"PYTHONWARNINGS", "HF_HUB_OFFLINE"} <= set(names)
    assert pod["tolerations"] == [
        {"operator": "Exists"},
        {"key": "dedicated", "operator": "Equal", "effect": "NoSchedule"},
    ]
