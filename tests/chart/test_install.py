"""What the chart installs: RBAC scoped to the watched namespaces, a `restricted` operator pod,
names valid for any release name, pinned images, host-path prefixes as given, the supported
Kubernetes versions, and the README's install commands."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from holeblend_operator import kube, rbac_command, settings
from holeblend_operator.cli import build_parser
from holeblend_operator.host_paths import check_host_path
from tests.chart.test_chart import CHART, HELM, ROOT, VALUES, _helm
from tests.chart.test_values_schema import _helm_fails

README = ROOT / "README.md"
DIGEST = "sha256:" + "0123456789abcdef" * 4
# A release name of helm's maximum length (53), and one with a leading digit and a dot.
LONG_RELEASE = "a" * 44 + "-release1"
ODD_RELEASE = "1.2-x"
EVERY_PART = [
    "--set",
    "monitoring.serviceMonitor.enabled=true,monitoring.prometheusRule.enabled=true",
    "--set",
    "monitoring.dashboards.enabled=true",
]
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?")


@pytest.fixture(autouse=True)
def _needs_helm():
    if not HELM.exists():
        pytest.fail("helm is missing: run `make tools` (make test does it)")


def render(tmp_path: Path, *args: str, release: str = "hb") -> list[dict]:
    text = _helm(
        "template", release, str(CHART), "--namespace", "holeblend-system", *args, tmp_path=tmp_path
    )
    return [doc for doc in yaml.safe_load_all(text) if doc]


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def operator_pod(objects: list[dict]) -> dict:
    (deployment,) = of_kind(objects, "Deployment")
    return deployment["spec"]["template"]["spec"]


def operator_settings(objects: list[dict]) -> settings.OperatorSettings:
    args = build_parser().parse_args(operator_pod(objects)["containers"][0]["args"])
    return settings.from_sources(args, environ={})


# --- RBAC -------------------------------------------------------------------------------


def expected_rules(*, namespaced: bool, peering: bool) -> list[dict]:
    kinds = [
        k
        for k in kube.ACCESS
        if k.namespaced == namespaced and (k.group != rbac_command.PEERING_GROUP or peering)
    ]
    return rbac_command.rules(tuple(kinds))


def rule_set(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize("replicas", [1, 2])
def test_watching_every_namespace_grants_one_cluster_role(replicas, tmp_path):
    objects = render(tmp_path, "--set", f"replicaCount={replicas}")
    assert not of_kind(objects, "Role") and not of_kind(objects, "RoleBinding")
    (role,) = of_kind(objects, "ClusterRole")
    (binding,) = of_kind(objects, "ClusterRoleBinding")
    expected = rule_set(expected_rules(namespaced=True, peering=False))
    expected |= rule_set(expected_rules(namespaced=False, peering=replicas > 1))
    # kopf uses the cluster-wide peering kind only: the namespaced one is never granted.
    assert rule_set(role["rules"]) == expected
    assert not {r for r in expected if r[1] == "kopfpeerings"}
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "hb-operator", "namespace": "holeblend-system"}
    ]


@pytest.mark.parametrize("replicas", [1, 2])
def test_watching_some_namespaces_grants_roles_there_and_only_reads_cluster_wide(
    replicas, tmp_path
):
    objects = render(
        tmp_path, "--set", f"replicaCount={replicas}", "--set", "watchNamespaces={team-a,team-b}"
    )
    roles, bindings = of_kind(objects, "Role"), of_kind(objects, "RoleBinding")
    assert {r["metadata"]["namespace"] for r in roles} == {"team-a", "team-b"}
    assert {b["metadata"]["namespace"] for b in bindings} == {"team-a", "team-b"}
    for role in roles:
        assert rule_set(role["rules"]) == rule_set(
            expected_rules(namespaced=True, peering=replicas > 1)
        )
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == "holeblend-system"
    # What stays cluster-wide: kopf's list and watch of CRDs and Namespaces, nothing else.
    (cluster_role,) = of_kind(objects, "ClusterRole")
    assert rule_set(cluster_role["rules"]) == {
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    }
    (binding,) = of_kind(objects, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]


def test_every_kind_the_operator_uses_is_granted_in_every_mode(tmp_path):
    """Roles and ClusterRole together cover kube.ACCESS, less the peering kind not in use."""
    for args, unused_peering in (
        ([], {"clusterkopfpeerings", "kopfpeerings"}),
        (["--set", "replicaCount=2"], {"kopfpeerings"}),
        (["--set", "watchNamespaces={a}"], {"clusterkopfpeerings", "kopfpeerings"}),
        (["--set", "watchNamespaces={a}", "--set", "replicaCount=2"], {"clusterkopfpeerings"}),
    ):
        objects = render(tmp_path, *args)
        granted = set()
        for role in of_kind(objects, "Role") + of_kind(objects, "ClusterRole"):
            granted |= rule_set(role["rules"])
        used = {
            (kind.group, kind.plural, verb)
            for kind in kube.ACCESS
            for verb in kind.verbs
            if kind.plural not in unused_peering
        }
        assert granted == used, args


def test_peering_needs_more_than_one_replica(tmp_path):
    for args in ([], ["--set", "watchNamespaces={a}"]):
        objects = render(tmp_path, *args)
        assert operator_settings(objects).peering is None
        assert not [o for o in objects if o["apiVersion"].startswith("kopf.dev/")]
        for role in of_kind(objects, "Role") + of_kind(objects, "ClusterRole"):
            assert "kopf.dev" not in {g for r in role["rules"] for g in r["apiGroups"]}


# --- upgrades ---------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.stem if v else "defaults")
def test_an_upgrade_stops_the_old_operator_before_starting_the_new_one(values, tmp_path):
    """A rolling update starts the new pod beside the old one: one replica runs without
    peering, so the two would reconcile every object at once, and a change of replicaCount
    switches between standalone and peering replicas, which do not see each other."""
    objects = render(tmp_path, *(["-f", str(values)] if values else []))
    (deployment,) = of_kind(objects, "Deployment")
    assert deployment["spec"].get("strategy") == {"type": "Recreate"}


# --- Pod Security Standards: restricted -------------------------------------------------

RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


def restricted_violations(pod: dict) -> list[str]:
    """The controls of the Pod Security Standards' `restricted` profile (which includes
    `baseline`) a pod spec breaks, by the names of the standard's sections."""
    problems = []
    pod_security = pod.get("securityContext") or {}
    containers = [
        *pod.get("initContainers", []),
        *pod.get("containers", []),
        *pod.get("ephemeralContainers", []),
    ]
    # Baseline: "Host Namespaces", "HostPath Volumes", "Sysctls".
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            problems.append(f"Host Namespaces: {field}")
    for volume in pod.get("volumes", []):
        types = set(volume) - {"name"}
        if "hostPath" in types:
            problems.append(f"HostPath Volumes: {volume['name']}")
        # Restricted: "Volume Types".
        if not types <= RESTRICTED_VOLUME_TYPES:
            problems.append(f"Volume Types: {volume['name']} {sorted(types)}")
    for sysctl in pod_security.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            problems.append(f"Sysctls: {sysctl['name']}")
    pod_seccomp = (pod_security.get("seccompProfile") or {}).get("type")
    for container in containers:
        name = container["name"]
        security = container.get("securityContext") or {}
        # Baseline: "Privileged Containers", "Host Ports", "HostProcess", "/proc Mount Type".
        if security.get("privileged"):
            problems.append(f"Privileged Containers: {name}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            problems.append(f"Host Ports: {name}")
        if (security.get("windowsOptions") or {}).get("hostProcess"):
            problems.append(f"HostProcess: {name}")
        if security.get("procMount", "Default") != "Default":
            problems.append(f"/proc Mount Type: {name}")
        # Restricted: "Privilege Escalation".
        if security.get("allowPrivilegeEscalation") is not False:
            problems.append(f"Privilege Escalation: {name}")
        # Restricted: "Running as Non-root" (pod level, or every container).
        non_root = security.get("runAsNonRoot", pod_security.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"Running as Non-root: {name}")
        # Restricted: "Running as Non-root user".
        if security.get("runAsUser", pod_security.get("runAsUser")) == 0:
            problems.append(f"Running as Non-root user: {name}")
        # Restricted: "Seccomp" (RuntimeDefault or Localhost, at pod level or on every container).
        seccomp = (security.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"Seccomp: {name}")
        # Restricted: "Capabilities" (drop ALL; add at most NET_BIND_SERVICE).
        capabilities = security.get("capabilities") or {}
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"Capabilities: {name} does not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"Capabilities: {name} adds {capabilities['add']}")
    return problems


@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.stem if v else "defaults")
def test_the_operator_pod_meets_the_restricted_pod_security_standard(values, tmp_path):
    objects = render(tmp_path, *(["-f", str(values)] if values else []))
    assert restricted_violations(operator_pod(objects)) == []


def test_the_restricted_check_sees_what_the_chart_used_to_miss(tmp_path):
    pod = operator_pod(render(tmp_path))
    del pod["securityContext"]["seccompProfile"]
    del pod["containers"][0]["securityContext"]["seccompProfile"]
    pod["containers"][0]["securityContext"]["capabilities"] = {"drop": ["NET_RAW"]}
    assert restricted_violations(pod) == [
        "Seccomp: operator",
        "Capabilities: operator does not drop ALL",
    ]


# --- names ------------------------------------------------------------------------------


@pytest.mark.parametrize("release", [LONG_RELEASE, ODD_RELEASE, "hb"])
@pytest.mark.parametrize("mode", ["clusterwide", "namespaced-ha"])
def test_every_name_is_valid_for_its_kind_whatever_the_release_name(release, mode, tmp_path):
    assert len(LONG_RELEASE) == 53  # helm's longest release name
    args = [*EVERY_PART]
    if mode == "namespaced-ha":
        args += ["--set", "replicaCount=2", "--set", "watchNamespaces={team-a}"]
    objects = render(tmp_path, *args, release=release)
    seen = set()
    for obj in objects:
        name, kind = obj["metadata"]["name"], obj["kind"]
        key = (kind, obj["metadata"].get("namespace"), name)
        assert key not in seen, f"two objects named {key}"
        seen.add(key)
        if kind == "Service":  # Service names are DNS-1035 labels
            assert DNS_1035_LABEL.fullmatch(name), (kind, name)
        assert DNS_1123_SUBDOMAIN.fullmatch(name) and len(name) <= 253, (kind, name)
        # Every other name fits a label value and a DNS label (pods' names and hostnames
        # derive from the Deployment's). The cluster-scoped objects and the peering (the
        # --peering flag) add the release namespace: a DNS subdomain is all they need.
        if kind not in ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering", "KopfPeering"):
            assert len(name) <= 63 and not name.endswith("-"), (kind, name)
        for label, value in obj["metadata"].get("labels", {}).items():
            assert LABEL_VALUE.fullmatch(value), (kind, label, value)
    # References name the objects rendered.
    names = {(kind, name) for kind, _, name in seen}
    pod = operator_pod(objects)
    assert ("ServiceAccount", pod["serviceAccountName"]) in names
    for binding in of_kind(objects, "RoleBinding") + of_kind(objects, "ClusterRoleBinding"):
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in names
        assert ("ServiceAccount", binding["subjects"][0]["name"]) in names
    peering = operator_settings(objects).peering
    if peering:
        assert ("KopfPeering", peering) in names


def test_the_long_release_name_is_cut_and_keeps_the_suffix(tmp_path):
    objects = render(tmp_path, *EVERY_PART, release=LONG_RELEASE)
    (service,) = of_kind(objects, "Service")
    assert service["metadata"]["name"].endswith("-metrics")
    assert len(service["metadata"]["name"]) == 63
    (deployment,) = of_kind(objects, "Deployment")
    assert deployment["metadata"]["name"] == f"{LONG_RELEASE}-operator"


# --- images -----------------------------------------------------------------------------


def test_an_image_digest_pins_the_operator_image(tmp_path):
    pod = operator_pod(render(tmp_path))
    assert pod["containers"][0]["image"] == "ghcr.io/holeblend/operator:0.1.0"
    pod = operator_pod(
        render(tmp_path, "--set", f"image.digest={DIGEST}", "--set", "image.tag=ignored")
    )
    assert pod["containers"][0]["image"] == f"ghcr.io/holeblend/operator@{DIGEST}"


def test_runtime_images_reach_the_operator(tmp_path):
    pod = operator_pod(
        render(
            tmp_path,
            "--set",
            "runtimeImages.repository=registry.example.com/rt,runtimeImages.tag=1.2.3",
        )
    )
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["HOLEBLEND_RUNTIME_IMAGE_REPOSITORY"] == "registry.example.com/rt"
    assert env["HOLEBLEND_RUNTIME_IMAGE_TAG"] == "1.2.3"


# --- host paths -------------------------------------------------------------------------


def test_host_path_prefixes_default_to_the_operators_defaults(tmp_path):
    config = operator_settings(render(tmp_path))
    assert config.host_path_prefixes == settings.OperatorSettings().host_path_prefixes


def test_an_empty_host_path_list_admits_no_host_path(tmp_path):
    objects = render(tmp_path, "--set-json", "hostPathPrefixes=[]")
    assert "--host-path-prefix=" in operator_pod(objects)["containers"][0]["args"]
    config = operator_settings(objects)
    assert config.host_path_prefixes == ()
    with pytest.raises(ValueError, match=r"allows \(none\)"):
        check_host_path("/data/models/llama", config.host_path_prefixes)


def test_host_path_prefixes_reach_the_operator_as_written(tmp_path):
    prefixes = ["/data/a'b\"c", "/mnt/[x]", "/srv/{y}:z", "/opt/*&!#", "/x,y"]
    values = tmp_path / "prefixes.yaml"
    values.write_text(yaml.safe_dump({"hostPathPrefixes": prefixes}))
    objects = render(tmp_path, "-f", str(values))
    assert operator_settings(objects).host_path_prefixes == tuple(prefixes)


# --- Kubernetes versions ----------------------------------------------------------------


def test_the_chart_states_the_kubernetes_versions_it_supports(tmp_path):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.30.0-0"
    # The oldest version the chart's objects are validated against (test_chart.py) and the
    # README's install section name the same minimum.
    assert '"1.30"' in (ROOT / "tests" / "chart" / "test_chart.py").read_text()
    assert "Kubernetes 1.30 or later" in install_section()
    render(tmp_path, "--kube-version", "1.30.0")
    output = _helm_fails(tmp_path, "template", "hb", str(CHART), "--kube-version", "1.29.9")
    assert "kubeVersion" in output


# --- README: Install on a cluster -------------------------------------------------------


def install_section() -> str:
    text = README.read_text()
    start = text.index("\n## Install on a cluster\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", install_section(), flags=re.S)


def shell_commands() -> list[list[str]]:
    commands = []
    for block in code_blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def helm_commands() -> list[list[str]]:
    return [c for c in shell_commands() if c[:2] in (["helm", "install"], ["helm", "upgrade"])]


def as_helm_template(command: list[str], tmp_path: Path) -> tuple[list[str], list[str]]:
    """The README's helm install/upgrade as `helm template` arguments and `helm lint` ones."""
    _, verb, release, chart, *flags = command
    assert (ROOT / chart).is_dir(), chart
    (values_block,) = code_blocks("yaml")
    resolved = []
    for i, flag in enumerate(flags):
        if i and flags[i - 1] in ("-f", "--values"):
            flag = str(tmp_path / flag)  # the values file the README shows
            Path(flag).write_text(values_block)
        resolved.append(flag)
    lint_flags = [f for f in resolved if f != "--create-namespace"]
    return (
        ["template", release, str(ROOT / chart), *resolved],
        ["lint", "--strict", str(ROOT / chart), *lint_flags],
    )


def test_the_readme_installs_and_upgrades_with_helm():
    verbs = [c[1] for c in helm_commands()]
    assert verbs == ["install", "upgrade"]


@pytest.mark.parametrize("index", [0, 1], ids=["install", "upgrade"])
def test_the_readmes_helm_commands_render_and_lint(index, tmp_path):
    command = helm_commands()[index]
    template, lint = as_helm_template(command, tmp_path)
    objects = [d for d in yaml.safe_load_all(_helm(*template, tmp_path=tmp_path)) if d]
    _helm(*lint, tmp_path=tmp_path)
    (deployment,) = of_kind(objects, "Deployment")
    image = operator_pod(objects)["containers"][0]["image"]
    assert image.startswith("registry.example.com/holeblend/operator:")
    # The README's checks name what the install creates.
    namespace = command[command.index("--namespace") + 1]
    port_forward = next(c for c in shell_commands() if "port-forward" in c)
    assert port_forward[port_forward.index("-n") + 1] == namespace
    assert f"deploy/{deployment['metadata']['name']}" in port_forward
    port = operator_pod(objects)["containers"][0]["ports"][0]["containerPort"]
    assert str(port) in port_forward


def test_the_readmes_other_commands_name_what_exists():
    commands = shell_commands()
    dockerfile = (ROOT / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)", dockerfile, flags=re.M))
    built = set()
    for command in commands:
        if command[:2] == ["docker", "build"]:
            built.add(command[command.index("--target") + 1])
    loop = next(c for c in commands if c[:2] == ["for", "variant"])
    variants = [word.rstrip(";") for word in loop[3 : loop.index("do")]]
    built = {t.replace("$variant", v) for t in built for v in variants} | {"operator"}
    assert built <= targets and "operator" in built and "runtime-cpu" in built
    applied = [c[c.index("-f") + 1] for c in commands if c[:2] == ["kubectl", "apply"]]
    assert applied and all((ROOT / path).exists() for path in applied)
    assert ["kubectl", "get", "blenddeployments"] in commands
