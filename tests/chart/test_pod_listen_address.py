"""The chart's podListenAddress reaches the operator as --pod-listen-address, which the
operator reads; helm refuses a value that is no IP address, naming the key."""

import pytest
import yaml

from holeblend_operator import settings
from holeblend_operator.cli import build_parser
from tests.chart.test_chart import CHART, _helm
from tests.chart.test_values_schema import _helm_fails


def operator_settings(tmp_path, *args: str) -> settings.OperatorSettings:
    text = _helm("template", "hb", str(CHART), *args, tmp_path=tmp_path)
    deployment = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return settings.from_sources(build_parser().parse_args(container["args"]), {})


def test_pods_listen_on_every_ipv4_address_by_default(tmp_path):
    assert operator_settings(tmp_path).pod_listen_address == "0.0.0.0"


def test_the_chart_passes_every_address_to_the_operator(tmp_path):
    chosen = operator_settings(tmp_path, "--set", "podListenAddress=::")
    assert chosen.pod_listen_address == "::"


@pytest.mark.parametrize("value", ["localhost", "", "[::]", "10.0.0.1"])
def test_helm_refuses_a_listen_address_other_than_every_address(value, tmp_path):
    args = ["--set-string", f"podListenAddress={value}"]
    output = _helm_fails(tmp_path, "template", "hb", str(CHART), *args)
    assert "values don't meet the specifications of the schema" in output, output
    assert "/podListenAddress" in output, output
