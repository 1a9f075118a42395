"""Release names, namespaces and values that YAML could read as numbers, booleans or null
still render as strings wherever Kubernetes wants a string.

Helm accepts release names such as `2024`, `1e3`, `on` and `no`, and the values schema
accepts namespaces and a ServiceAccount name such as `123`. Written as a plain YAML scalar,
such a value decodes as an int, a float or a bool, and the API server (or kubectl, or Helm
itself) refuses the whole object: `cannot unmarshal number into Go struct field
ObjectMeta.metadata.labels of type string`. The documents are read here as Kubernetes reads
them, with YAML 1.1's implicit types as the Go YAML library resolves them (`y`, `n`, `on`,
`off`, `1e3`, `0x1f`, `0o17` are not strings there, while PyYAML reads some of them as
strings), and then checked against the Kubernetes schemas.
"""

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.chart.test_chart import CHART, _helm


class KubernetesYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the implicit types of go-yaml v2 (sigs.k8s.io/yaml, which
    kubectl, Helm and the API server decode manifests with): booleans include y/Y/n/N, a
    float needs no dot (1e3), an int may be written 0o17."""

    bool_values = {**yaml.SafeLoader.bool_values, "y": True, "n": False}


KubernetesYamlLoader.yaml_implicit_resolvers = {
    first: list(resolvers) for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
KubernetesYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN")
)
KubernetesYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+.0123456789"),
)
KubernetesYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?0o[0-7]+$"), list("-+0")
)

# Valid Helm release names (DNS-1123 subdomains of up to 53 characters) that are not strings
# as plain YAML scalars.
RELEASE_NAMES = ["2024", "1e3", "1.5", "0x1f", "0o17", "on", "no", "y", "true", "null"]
RELEASE_NAMESPACE = "123"
# Every other user-controlled scalar that lands in a string field, as the schema allows it.
VALUES = {
    "replicaCount": 2,  # the kopf peering objects, one per watched namespace
    "serviceAccount": {"create": True, "name": "1e3"},
    "monitoring": {
        "serviceMonitor": {"enabled": True, "interval": "0"},
        "prometheusRule": {"enabled": True},
        "dashboards": {"enabled": True, "namespace": "456"},
    },
}
WATCHING = {"some namespaces": ["789", "off"], "every namespace": []}
KINDS_OUTSIDE_KUBERNETES = {"KopfPeering", "ClusterKopfPeering", "ServiceMonitor"}
KINDS_OUTSIDE_KUBERNETES |= {"PrometheusRule"}


def render(tmp_path: Path, release: str, watch: list[str]) -> str:
    values = tmp_path / "values.yaml"
    # JSON, a subset of YAML with every string quoted: PyYAML's dump leaves 1e3 unquoted.
    values.write_text(json.dumps(VALUES | {"watchNamespaces": watch}))
    return _helm(
        "template", release, str(CHART), "--namespace", RELEASE_NAMESPACE, "-f", str(values),
        tmp_path=tmp_path,
    )  # fmt: skip


def non_strings(obj: dict) -> list[str]:
    """The metadata fields of `obj` that are not strings (names, namespaces, labels and
    annotations), and for a custom resource the string fields the chart fills from values."""
    metadata = obj["metadata"]
    found = [f"metadata.{k}" for k in ("name", "namespace") if k in metadata]
    found = [f for f in found if not isinstance(metadata[f.split(".")[1]], str)]
    for field in ("labels", "annotations"):
        for key, value in (metadata.get(field) or {}).items():
            if not isinstance(value, str):
                found.append(f"metadata.{field}.{key}: {value!r}")
    if obj["kind"] == "ServiceMonitor":
        for endpoint in obj["spec"]["endpoints"]:
            if not isinstance(endpoint["interval"], str):
                found.append(f"spec.endpoints.interval: {endpoint['interval']!r}")
            if not isinstance(endpoint["port"], str):
                found.append(f"spec.endpoints.port: {endpoint['port']!r}")
    return found


def test_the_loader_reads_plain_scalars_as_kubernetes_does():
    """The check below is only as good as its YAML reading: these plain scalars are ints,
    floats, booleans and null for Kubernetes, and quoting keeps each a string."""
    plain = "[2024, 1e3, 1.5, 0x1f, 0o17, on, no, y, N, true, null]"
    assert not any(isinstance(v, str) for v in yaml.load(plain, KubernetesYamlLoader))
    quoted = '["2024", "1e3", "1.5", "0x1f", "0o17", "on", "no", "y", "N", "true", "null"]'
    assert all(isinstance(v, str) for v in yaml.load(quoted, KubernetesYamlLoader))
    assert yaml.load("[hb-2024-operator, llama-3.1-8b, 30s]", KubernetesYamlLoader) == [
        "hb-2024-operator",
        "llama-3.1-8b",
        "30s",
    ]


@pytest.mark.parametrize("watch", list(WATCHING.values()), ids=list(WATCHING))
@pytest.mark.parametrize("release", RELEASE_NAMES)
def test_names_that_look_like_numbers_or_booleans_render_as_strings(release, watch, tmp_path):
    documents = [
        d for d in yaml.load_all(render(tmp_path, release, watch), KubernetesYamlLoader) if d
    ]
    kinds = {d["kind"] for d in documents}
    assert {"KopfPeering" if watch else "ClusterKopfPeering", "ServiceMonitor"} <= kinds
    assert ("RoleBinding" in kinds) == bool(watch)
    problems = [(obj["kind"], field) for obj in documents for field in non_strings(obj)]
    assert not problems
    for obj in documents:
        if obj["kind"] not in KINDS_OUTSIDE_KUBERNETES:
            kubernetes_validate.validate(obj, "1.30", strict=True)
    labels = documents[0]["metadata"]["labels"]
    assert labels["app.kubernetes.io/instance"] == release
    namespaces = {d["metadata"].get("namespace") for d in documents} - {None}
    assert set(watch) <= namespaces
    bindings = [d for d in documents if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    for binding in bindings:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "1e3", "namespace": RELEASE_NAMESPACE}
        ]
