"""Two installs of one release name, each in its own namespace, own disjoint objects; the
operator pod's probes outlast a slow answer while kopf relists every object."""

from pathlib import Path

import pytest
import yaml

from holeblend_operator.cli import build_parser
from tests.chart.test_chart import CHART, HELM, _helm
from tests.chart.test_install import as_helm_template, helm_commands, install_section

CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}
# Per-team installs: one release name, one namespace each, each watching its team's.
TEAMS = {"ops-a": "team-a", "ops-b": "team-b"}
MODES = {
    "every-namespace": [],
    "every-namespace-ha": ["--set", "replicaCount=2"],
    "some-namespaces": ["--set", "watchNamespaces={%s}"],
    "some-namespaces-ha": ["--set", "watchNamespaces={%s}", "--set", "replicaCount=2"],
}


@pytest.fixture(autouse=True)
def _needs_helm():
    if not HELM.exists():
        pytest.fail("helm is missing: run `make tools` (make test does it)")


def render(tmp_path: Path, namespace: str, *args: str) -> list[dict]:
    text = _helm(
        "template", "holeblend", str(CHART), "--namespace", namespace, *args, tmp_path=tmp_path
    )
    return [doc for doc in yaml.safe_load_all(text) if doc]


def owned(objects: list[dict], namespace: str) -> set[tuple[str, str | None, str]]:
    """(kind, namespace, name) of each object: what helm checks ownership of."""
    return {
        (
            o["kind"],
            None if o["kind"] in CLUSTER_SCOPED else o["metadata"].get("namespace", namespace),
            o["metadata"]["name"],
        )
        for o in objects
    }


@pytest.mark.parametrize("mode", MODES)
def test_two_installs_of_one_release_name_own_no_object_in_common(mode, tmp_path):
    installs = {}
    for namespace, team in TEAMS.items():
        args = [a.replace("%s", team) for a in MODES[mode]]
        installs[namespace] = owned(render(tmp_path, namespace, *args), namespace)
    assert not installs["ops-a"] & installs["ops-b"]


@pytest.mark.parametrize("mode", MODES)
def test_each_install_binds_its_own_service_account_to_its_own_cluster_role(mode, tmp_path):
    for namespace, team in TEAMS.items():
        objects = render(tmp_path, namespace, *[a.replace("%s", team) for a in MODES[mode]])
        (role,) = [o for o in objects if o["kind"] == "ClusterRole"]
        (binding,) = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"][0]["namespace"] == namespace
        assert namespace in role["metadata"]["name"]


@pytest.mark.parametrize("mode", ["every-namespace-ha", "some-namespaces-ha"])
def test_the_replicas_peer_through_the_object_the_install_creates(mode, tmp_path):
    objects = render(tmp_path, "ops-a", *[a.replace("%s", "team-a") for a in MODES[mode]])
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    args = build_parser().parse_args(
        deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    peerings = [o for o in objects if o["kind"] in ("KopfPeering", "ClusterKopfPeering")]
    assert peerings and {p["metadata"]["name"] for p in peerings} == {args.peering}


def test_the_readme_names_the_cluster_role_its_install_command_creates(tmp_path):
    template, _ = as_helm_template(helm_commands()[0], tmp_path)
    objects = [d for d in yaml.safe_load_all(_helm(*template, tmp_path=tmp_path)) if d]
    (role,) = [o for o in objects if o["kind"] == "ClusterRole"]
    assert f"`{role['metadata']['name']}`" in install_section()


def test_the_liveness_probe_outlasts_a_slow_answer_during_a_relist(tmp_path):
    """/healthz is answered on kopf's event loop, which a relist of thousands of objects keeps
    busy: the default 1 s timeout, three times over, restarted the pod, and the restart
    relisted every object again."""
    (deployment,) = [o for o in render(tmp_path, "ops-a") if o["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    liveness, readiness = container["livenessProbe"], container["readinessProbe"]
    assert liveness["httpGet"] == {"path": "/healthz", "port": "http"}
    assert liveness.get("timeoutSeconds", 1) >= 5
    # A restart takes at least a minute of unanswered probes.
    assert liveness["periodSeconds"] * liveness.get("failureThreshold", 3) >= 60
    # Readiness only takes the pod out of its Service (the metrics scrape): same timeout.
    assert readiness.get("timeoutSeconds", 1) == liveness["timeoutSeconds"]
