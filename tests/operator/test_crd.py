"""The CRD is generated from the models, structural, and committed up to date."""

from pathlib import Path

import yaml

from holeblend_operator.api_docs import api_reference_markdown
from holeblend_operator.crd import build_crd, crd_yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = "blenddeployments.blend.holeblend.io.yaml"
# Keys a structural schema may not carry (Kubernetes rejects or ignores them).
FORBIDDEN_KEYS = {"$ref", "$defs", "title", "propertyNames", "patternProperties", "uniqueItems"}


def _walk(node, path="schema"):
    yield path, node
    for key in ("properties", "additionalProperties", "items"):
        child = node.get(key)
        if key == "properties":
            for name, sub in (child or {}).items():
                yield from _walk(sub, f"{path}.{name}")
        elif isinstance(child, dict):
            yield from _walk(child, f"{path}[{key}]")


def _schema():
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crd_matches_the_models():
    assert (ROOT / "crds" / CRD_FILE).read_text() == crd_yaml(), "run `make generate`"


def test_chart_crd_matches_the_models():
    assert (ROOT / "charts/holeblend/crds" / CRD_FILE).read_text() == crd_yaml(), (
        "run `make generate`"
    )


def test_committed_api_reference_matches_the_models():
    assert (ROOT / "docs/api.md").read_text() == api_reference_markdown(), "run `make generate`"


def test_generation_is_deterministic():
    assert crd_yaml() == crd_yaml()
    assert yaml.safe_load(crd_yaml()) == build_crd()


def test_every_schema_node_is_structural():
    for path, node in _walk(_schema()):
        assert not FORBIDDEN_KEYS & node.keys(), f"{path} has {FORBIDDEN_KEYS & node.keys()}"
        has_type = "type" in node or node.get("x-kubernetes-int-or-string")
        assert has_type, f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), (
                f"{path} uses anyOf outside int-or-string"
            )


def test_exclusive_bounds_use_openapi_booleans():
    ratio = _schema()["properties"]["spec"]["properties"]["blend"]["properties"]["recomputeRatio"]
    assert ratio["minimum"] == 0 and ratio["exclusiveMinimum"] is True
    assert ratio["maximum"] == 1 and "exclusiveMaximum" not in ratio


def test_object_defaults_are_complete_so_their_rules_can_read_them():
    spec = _schema()["properties"]["spec"]["properties"]
    assert spec["blend"]["properties"]["mode"]["default"] == "hole"
    assert spec["blend"]["default"]["mode"] == "hole"
    assert spec["blend"]["default"]["kv"] == spec["blend"]["properties"]["kv"]["default"]
    assert spec["accelerator"]["default"]["type"] == "ascend"
    assert spec["accelerator"]["default"]["count"] == 1


def test_scale_subresource_points_at_replicas_and_selector():
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]


def test_printer_columns_show_mode_ratio_ready_hits_f1_age():
    columns = [c["name"] for c in build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns[:6] == ["Mode", "Ratio", "Ready", "Hit%", "F1", "Age"]


def test_printer_columns_point_at_fields_that_exist():
    status = _schema()["properties"]["status"]["properties"]
    spec = _schema()["properties"]["spec"]["properties"]
    roots = {"status": status, "spec": spec}
    for column in build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]:
        parts = column["jsonPath"].split("[")[0].strip(".").split(".")
        if parts[0] == "metadata":
            continue
        node = {"properties": roots[parts[0]]}
        for part in parts[1:]:
            node = node["properties"][part]
        assert node is not None, column


def test_short_name_and_names():
    names = build_crd()["spec"]["names"]
    assert names["shortNames"] == ["bd"] and names["plural"] == "blenddeployments"
    assert build_crd()["metadata"]["name"] == "blenddeployments.blend.holeblend.io"


def _nullable_enums(node, path="schema"):
    for where, sub in _walk(node, path):
        if sub.get("nullable") and "enum" in sub:
            yield where


def test_no_nullable_field_has_an_enum_the_api_server_would_check_a_null_against():
    # kube-openapi validates a null against `enum` even where `nullable` admits it, and no
    # enum value matches a null: such a field would refuse the null the models take as unset.
    assert list(_nullable_enums(_schema())) == []


def test_a_null_toleration_effect_is_unset_for_the_api_server_as_for_the_operator():
    from holeblend_operator.api import BlendDeployment
    from tests.operator.crd_validation import api_server_errors

    manifest = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    manifest["spec"]["accelerator"] = {
        "tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": None}]
    }
    toleration = BlendDeployment.model_validate(manifest).spec.accelerator.tolerations[0]
    assert toleration.effect is None
    assert api_server_errors(manifest) == []
