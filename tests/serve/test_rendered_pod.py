"""The operator's CPU engine container is a valid holeblend-serve command line."""

import yaml

from holeblend_operator.api import BlendDeployment
from holeblend_operator.render import render_children
from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.settings import parse_settings
from tests.serve.conftest import CPU_EXAMPLE


def test_rendered_cpu_container_parses_and_probes_existing_routes():
    bd = BlendDeployment.model_validate(yaml.safe_load(CPU_EXAMPLE.read_text()))
    [deployment] = [
        c
        for c in render_children(bd)
        if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-engine")
    ]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    settings = parse_settings(container["args"], {})
    assert str(settings.config) == container["env"][0]["value"]
    assert settings.port == container["ports"][0]["containerPort"]
    routes = {r.resource.canonical for r in Server.__new__(Server).app().router.routes()}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in routes
