"""The operator's Helm chart lints, renders valid objects, and matches the code it runs."""

import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from holeblend_operator.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "holeblend"
HELM = ROOT / ".tools" / "bin" / "helm"
VALUES = [None, *sorted((CHART / "ci").glob("*.yaml"))]


def _helm(*args: str, tmp_path: Path) -> str:
    env = {**os.environ}
    for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[name] = str(tmp_path / name.lower())
    result = subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _render(tmp_path: Path, values: Path | None) -> list[dict]:
    extra = ["-f", str(values)] if values else []
    text = _helm(
        "template", "hb", str(CHART), "--namespace", "holeblend-system", *extra, tmp_path=tmp_path
    )
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(autouse=True)
def _needs_helm():
    if not HELM.exists():
        pytest.fail("helm is missing: run `make tools` (make test does it)")


@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.stem if v else "defaults")
def test_chart_lints(values, tmp_path):
    extra = ["-f", str(values)] if values else []
    _helm("lint", "--strict", str(CHART), *extra, tmp_path=tmp_path)


@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.stem if v else "defaults")
def test_rendered_objects_are_valid_kubernetes(values, tmp_path):
    for obj in _render(tmp_path, values):
        if obj["apiVersion"] in ("kopf.dev/v1", "monitoring.coreos.com/v1"):
            continue  # custom resources (kopf's peering objects; prometheus-operator's)
        for version in ("1.30", "1.37.0"):
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.stem if v else "defaults")
def test_operator_arguments_are_accepted_by_the_operator_cli(values, tmp_path):
    deployment = next(o for o in _render(tmp_path, values) if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    assert args.command == "run"
    port = int(args.health_port)
    assert container["ports"][0]["containerPort"] == port


def test_ha_values_turn_on_peering(tmp_path):
    values = CHART / "ci" / "ha-values.yaml"
    deployment = next(o for o in _render(tmp_path, values) if o["kind"] == "Deployment")
    args = build_parser().parse_args(
        deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert args.peering and args.namespaces == ["team-a", "team-b"]


def test_ha_values_create_the_peering_objects_the_replicas_use(tmp_path):
    objects = _render(tmp_path, CHART / "ci" / "ha-values.yaml")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    args = build_parser().parse_args(
        deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    peerings = [o for o in objects if o["kind"] == "KopfPeering"]
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in peerings} == {
        ("team-a", args.peering),
        ("team-b", args.peering),
    }


def test_single_replica_needs_no_peering(tmp_path):
    assert not [o for o in _render(tmp_path, None) if "KopfPeering" in o["kind"]]


def test_chart_ships_the_peering_crds_of_deploy():
    shipped = (CHART / "crds" / "kopf-peering.yaml").read_text()
    assert shipped == (ROOT / "deploy" / "kopf-peering.yaml").read_text(), "run `make generate`"
