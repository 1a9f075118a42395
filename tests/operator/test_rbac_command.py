"""`holeblend-operator rbac`: the plain manifests of two operator namespaces apply side by side."""

import yaml

from holeblend_operator import rbac_command

CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding"}


def documents(namespace: str) -> list[dict]:
    return list(yaml.safe_load_all(rbac_command.render(namespace)))


def test_two_namespaces_manifests_share_no_cluster_scoped_object():
    """`kubectl apply` of the second would rebind the first's ClusterRoleBinding to its own
    ServiceAccount: the first operator would lose every permission without a word."""
    names = [
        {(d["kind"], d["metadata"]["name"]) for d in documents(ns) if d["kind"] in CLUSTER_SCOPED}
        for ns in ("ops-a", "ops-b")
    ]
    assert len(names[0]) == 2 and not names[0] & names[1]


def test_the_binding_grants_the_cluster_role_to_the_service_account_of_its_namespace():
    by_kind = {d["kind"]: d for d in documents("ops-a")}
    binding, account = by_kind["ClusterRoleBinding"], by_kind["ServiceAccount"]
    assert binding["roleRef"]["name"] == by_kind["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
    ]
    assert account["metadata"]["namespace"] == "ops-a"
