"""values.schema.json against the templates and values.yaml: helm refuses what they cannot use.

Every value a template reads is declared in the schema and has a default in values.yaml;
every key the schema declares is read by a template (no dead keys); every object the chart
defines is closed (`additionalProperties: false`), so a misspelt key is an error, and helm
names the offending key in its message.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.chart.test_chart import CHART, HELM, VALUES, _helm

SCHEMA_FILE = CHART / "values.schema.json"
SCHEMA = json.loads(SCHEMA_FILE.read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
CHART_YAML = yaml.safe_load((CHART / "Chart.yaml").read_text())
TEMPLATE_FILES = sorted((CHART / "templates").iterdir())
# `.Values.a.b` and `$.Values.a.b`: the value paths the templates read.
VALUE_PATH = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
DIGEST = "sha256:" + "0123456789abcdef" * 4
# Keys helm itself sets: `global` reaches a chart that is a dependency of another one.
HELM_KEYS = {"global"}


@pytest.fixture(autouse=True)
def _needs_helm():
    if not HELM.exists():
        pytest.fail("helm is missing: run `make tools` (make test does it)")


def _helm_fails(tmp_path: Path, *args: str) -> str:
    """helm's output (lint reports on stdout, template on stderr) for a command that must fail."""
    env_dirs = {
        name: str(tmp_path / name.lower())
        for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")
    }
    result = subprocess.run(
        [str(HELM), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env_dirs},
        timeout=120,
    )
    assert result.returncode != 0, f"helm {' '.join(args)} succeeded:\n{result.stdout[:2000]}"
    return result.stdout + result.stderr


def template_paths() -> set[tuple[str, ...]]:
    paths = set()
    for path in TEMPLATE_FILES:
        for match in VALUE_PATH.finditer(path.read_text()):
            paths.add(tuple(match.group(1).strip(".").split(".")))
    return paths


def _resolve(node: dict) -> dict:
    ref = node.get("$ref")
    if ref:
        assert ref.startswith("#/definitions/"), ref
        return SCHEMA["definitions"][ref.rpartition("/")[2]]
    return node


def schema_node(path: tuple[str, ...]) -> dict | None:
    node = SCHEMA
    for key in path:
        node = _resolve(node).get("properties", {}).get(key)
        if node is None:
            return None
    return _resolve(node)


def schema_leaves(node: dict = SCHEMA, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths of the schema's declared keys that have no declared keys below them."""
    node = _resolve(node)
    if "properties" not in node:
        return [prefix]
    leaves = []
    for key, child in node["properties"].items():
        leaves += schema_leaves(child, (*prefix, key))
    return leaves


def closed_objects(node: dict = SCHEMA, where: str = "") -> list[tuple[str, object]]:
    """(path, additionalProperties) of every schema node that declares properties."""
    found = []
    if "properties" in node:
        found.append((where or "/", node.get("additionalProperties")))
        for key, child in node["properties"].items():
            found += closed_objects(child, f"{where}/{key}")
    for key in ("items",):
        if isinstance(node.get(key), dict):
            found += closed_objects(node[key], f"{where}/[]")
    for name, child in node.get("definitions", {}).items():
        found += closed_objects(child, f"#/definitions/{name}")
    return found


def test_the_schema_is_draft_07_the_dialect_helm_validates():
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"


def test_the_templates_read_values():
    assert len(template_paths()) > 15  # the regex finds them (guards the tests below)


@pytest.mark.parametrize("path", sorted(template_paths()), ids=".".join)
def test_every_value_a_template_reads_is_in_the_schema_and_in_values_yaml(path):
    assert schema_node(path) is not None, f"{'.'.join(path)} is not in values.schema.json"
    node = DEFAULTS
    for key in path:
        assert isinstance(node, dict) and key in node, f"{'.'.join(path)} not in values.yaml"
        node = node[key]


def test_every_schema_key_is_read_by_a_template():
    read = template_paths()
    dead = [
        ".".join(leaf)
        for leaf in schema_leaves()
        if leaf[0] not in HELM_KEYS
        and not any(leaf[: len(path)] == path for path in read)  # read itself or whole
    ]
    assert not dead, f"values.schema.json declares keys no template reads: {dead}"


def test_every_object_the_chart_defines_is_closed():
    open_objects = [where for where, extra in closed_objects() if extra is not False]
    assert not open_objects, f"additionalProperties is not false at {open_objects}"


def test_values_yaml_sets_exactly_the_keys_the_schema_declares():
    def walk(values: dict, path: tuple[str, ...]) -> None:
        node = schema_node(path)
        declared = set(node["properties"]) - (HELM_KEYS if not path else set())
        assert set(values) == declared, ".".join(path) or "top level"
        assert set(node.get("required", values)) == set(values), ".".join(path) or "top level"
        for key, value in values.items():
            if isinstance(value, dict) and "properties" in (schema_node((*path, key)) or {}):
                walk(value, (*path, key))

    walk(DEFAULTS, ())


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--set", "replicaCount=2", "--set", "watchNamespaces={team-a,team-b}"],
        ["--set", "replicaCount=0"],
        ["--set", f"image.digest={DIGEST}", "--set-json", "hostPathPrefixes=[]"],
        ["--set", "serviceAccount.create=false", "--set", "serviceAccount.name=existing"],
        ["--set", "monitoring.dashboards.namespace=monitoring", "--set", "metricsPort=9100"],
    ],
    ids=["defaults", "ha-namespaced", "stopped", "pinned", "own-sa", "monitoring-ns"],
)
def test_lint_strict_passes_with_valid_values(args, tmp_path):
    _helm("lint", "--strict", str(CHART), *args, tmp_path=tmp_path)


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--set", "replicacount=2"], "replicacount"),  # a typo of replicaCount
        (["--set", "image.digst=x"], "digst"),
        (["--set", "monitoring.serviceMonitor.enable=true"], "enable"),
        (["--set", "tolerations[0].efect=NoSchedule"], "efect"),
        (["--set-string", "replicaCount=two"], "/replicaCount"),
        (["--set", "replicaCount=-1"], "/replicaCount"),
        (["--set", "watchNamespaces=team-a"], "/watchNamespaces"),  # a string, not a list
        (["--set", "hostPathPrefixes=/data/models"], "/hostPathPrefixes"),
        (["--set", "watchNamespaces={Team_A}"], "/watchNamespaces/0"),
        (["--set", "hostPathPrefixes={data/models}"], "/hostPathPrefixes/0"),
        (["--set", "hostPathPrefixes={/data/../etc}"], "/hostPathPrefixes/0"),
        (["--set", "hostPathPrefixes=null"], "hostPathPrefixes"),
        (["--set", "image.digest=sha256:abc"], "/image/digest"),
        (["--set", "image.repository=ghcr.io/holeblend/operator:1.0"], "/image/repository"),
        (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        (["--set", "metricsPort=70000"], "/metricsPort"),
        (["--set-string", "monitoring.serviceMonitor.enabled=yes"], "/monitoring/serviceMonitor"),
        (["--set", "monitoring.serviceMonitor.interval=30 seconds"], "interval"),
        (["--set", "resources.requests.cpu=lots"], "/resources/requests/cpu"),
        (["--set", "serviceAccount.name=Not_A_Name"], "/serviceAccount/name"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_helm_refuses_bad_values_naming_the_key(args, key, tmp_path):
    output = _helm_fails(tmp_path, "template", "hb", str(CHART), *args)
    assert "values don't meet the specifications of the schema" in output, output
    assert key in output, output
    output = _helm_fails(tmp_path, "lint", "--strict", str(CHART), *args)
    assert "[ERROR] values.yaml" in output and key in output, output


def parent_chart(tmp_path: Path) -> Path:
    """A chart with no templates of its own that has this one as its dependency."""
    parent = tmp_path / "parent"
    shutil.copytree(CHART, parent / "charts" / CHART.name)
    chart = {
        "apiVersion": "v2",
        "name": "parent",
        "version": "0.1.0",
        "dependencies": [{"name": CHART.name, "version": CHART_YAML["version"]}],
    }
    (parent / "Chart.yaml").write_text(yaml.safe_dump(chart))
    return parent


def test_the_chart_renders_as_a_dependency_of_another_chart(tmp_path):
    """helm hands a dependency the parent's `global` values, even when there are none."""
    parent = parent_chart(tmp_path)
    for args in ([], ["--set", "global.imageRegistry=registry.example.com"]):
        text = _helm(
            "template",
            "hb",
            str(parent),
            "--set",
            "holeblend.replicaCount=2",
            *args,
            tmp_path=tmp_path,
        )
        (deployment,) = [
            doc for doc in yaml.safe_load_all(text) if doc and doc["kind"] == "Deployment"
        ]
        assert deployment["spec"]["replicas"] == 2


def test_a_dependency_still_refuses_a_misspelt_key(tmp_path):
    parent = parent_chart(tmp_path)
    output = _helm_fails(
        tmp_path, "template", "hb", str(parent), "--set", "holeblend.replicacount=2"
    )
    assert "replicacount" in output, output


def test_a_values_file_with_a_typo_is_refused(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text("watchNamespace: [team-a]\n")  # watchNamespaces without its s
    assert "watchNamespace" in _helm_fails(
        tmp_path, "template", "hb", str(CHART), "-f", str(values)
    )


@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.stem if v else "defaults")
def test_schema_admits_the_values_files_the_tests_use(values):
    """The schema is valid draft-07 and admits the values files (helm checks the same)."""
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    merged = json.loads(json.dumps(DEFAULTS))
    if values:

        def merge(into: dict, extra: dict) -> None:
            for key, value in extra.items():
                if isinstance(value, dict) and isinstance(into.get(key), dict):
                    merge(into[key], value)
                else:
                    into[key] = value

        merge(merged, yaml.safe_load(values.read_text()))
    jsonschema.Draft7Validator(SCHEMA).validate(merged)
