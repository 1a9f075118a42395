"""Where the operator's pods listen: its --pod-listen-address reaches the engine (vLLM and
holeblend-serve) and the lookup server, and anything but an IP address is refused by name."""

import json

import pytest

from holeblend_operator import settings
from holeblend_operator.api import BlendDeployment
from holeblend_operator.cli import main
from holeblend_operator.render import render_children

MANIFEST = {
    "apiVersion": "blend.holeblend.io/v1alpha1",
    "kind": "BlendDeployment",
    "metadata": {"name": "rag", "namespace": "serving"},
    "spec": {
        "model": {"name": "Qwen/Qwen3-8B", "source": {"pvc": {"claimName": "models"}}},
        "lookupServer": {"enabled": True},
    },
}


def host_flags(accelerator: str, listen_address: str | None = None) -> dict[str, str]:
    """The --host each Deployment's container is given, by component."""
    spec = {**MANIFEST["spec"], "accelerator": {"type": accelerator}}
    bd = BlendDeployment.model_validate({**MANIFEST, "spec": spec})
    children = (
        render_children(bd) if listen_address is None else render_children(bd, listen_address)
    )
    hosts = {}
    for child in children:
        if child["kind"] == "Deployment":
            args = child["spec"]["template"]["spec"]["containers"][0]["args"]
            component = child["metadata"]["labels"]["app.kubernetes.io/component"]
            hosts[component] = args[args.index("--host") + 1]
    return hosts


@pytest.mark.parametrize("accelerator", ["nvidia", "cpu"])
def test_pods_listen_on_every_ipv4_address_by_default(accelerator):
    assert host_flags(accelerator) == {"engine": "0.0.0.0", "lookup-server": "0.0.0.0"}


@pytest.mark.parametrize("accelerator", ["nvidia", "ascend", "cpu"])
def test_the_listen_address_reaches_engine_and_lookup_pods(accelerator):
    assert host_flags(accelerator, "::") == {"engine": "::", "lookup-server": "::"}


def test_the_setting_is_read_from_its_flag_and_environment_variable():
    parsed = settings.from_sources(None, {"HOLEBLEND_OPERATOR_POD_LISTEN_ADDRESS": "::"})
    assert parsed.pod_listen_address == "::"
    assert settings.OperatorSettings().pod_listen_address == "0.0.0.0"


@pytest.mark.parametrize(
    "raw", ["", "localhost", "0.0.0.0 ", "[::]", "fe80::1%eth0", "::/0", "10.0.0.1", "::1"]
)
def test_a_listen_address_other_than_every_address_is_refused_by_its_flag(raw):
    with pytest.raises(ValueError, match=r"--pod-listen-address\) must be 0.0.0.0"):
        settings.from_sources(None, {"HOLEBLEND_OPERATOR_POD_LISTEN_ADDRESS": raw})


def test_the_operator_refuses_a_bad_listen_address_before_it_starts(capsys):
    assert main(["run", "--pod-listen-address", "pods.example"]) == 2
    error = capsys.readouterr().err
    assert "--pod-listen-address" in error and "'pods.example'" in error


@pytest.mark.parametrize(("listen_address", "metrics_host"), [(None, None), ("::", "::")])
def test_the_connector_metrics_listen_where_the_vllm_engine_does(listen_address, metrics_host):
    """vLLM pods export the connector's metrics on a port of their own, which the
    ServiceMonitor scrapes on the pod's address: IPv4 alone would miss it in an IPv6-only
    cluster. At the default nothing is added (the pods' template stays as it was)."""
    bd = BlendDeployment.model_validate({**MANIFEST, "spec": {**MANIFEST["spec"]}})
    children = render_children(bd) if listen_address is None else render_children(bd, "::")
    engine = next(c for c in children if c["kind"] == "Deployment")
    env = {
        var["name"]: var.get("value")
        for var in engine["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert "HOLEBLEND_METRICS_PORT" in env
    assert env.get("HOLEBLEND_METRICS_HOST") == metrics_host


def test_the_render_command_renders_with_the_listen_address(tmp_path, capsys):
    manifest = tmp_path / "bd.json"
    manifest.write_text(json.dumps(MANIFEST))
    assert main(["render", "-f", str(manifest), "-o", "json", "--pod-listen-address", "::"]) == 0
    children = json.loads(capsys.readouterr().out)["items"]
    hosts = [
        c["spec"]["template"]["spec"]["containers"][0]["args"]
        for c in children
        if c["kind"] == "Deployment"
    ]
    assert hosts and all(args[args.index("--host") + 1] == "::" for args in hosts)
