"""`holeblend-operator rbac`: the plain manifests of two operator namespaces apply side by side."""

from pathlib import Path

import yaml

from holeblend_operator import rbac_command, reconcile
from holeblend_operator.api import PLURAL, BlendDeployment

ROOT = Path(__file__).resolve().parents[2]

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


def test_the_role_lets_the_operator_set_block_owner_deletion_on_its_children():
    """Children are adopted with blockOwnerDeletion. Where the API server runs the
    OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened clusters), it
    requires of the writer `update` on the owner's `finalizers` subresource (its check:
    plugin/pkg/admission/gc), else it refuses every child create."""
    body = yaml.safe_load((ROOT / "examples" / "cpu.yaml").read_text())
    body["metadata"] |= {"namespace": "default", "uid": "u-1"}
    bd = BlendDeployment.model_validate(body)
    children = reconcile.desired_children(bd, body)
    refs = [ref for c in children for ref in c["metadata"]["ownerReferences"]]
    assert refs and all(ref["blockOwnerDeletion"] for ref in refs)
    role = next(d for d in documents("ops-a") if d["kind"] == "ClusterRole")
    for ref in refs:
        group = ref["apiVersion"].rpartition("/")[0]
        assert any(
            group in rule["apiGroups"]
            and f"{PLURAL}/finalizers" in rule["resources"]
            and "update" in rule["verbs"]
            for rule in role["rules"]
        ), ref
