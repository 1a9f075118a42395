"""Two installs of one release name, each in its own namespace with every monitoring part on
and their dashboards in one namespace where Grafana's sidecar looks, own no object in common,
and Grafana gets one dashboard of each: a file, uid and title of its own."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.chart.test_chart import CHART, HELM, _helm
from tests.chart.test_monitoring import DASHBOARDS, RULES, dashboard
from tests.chart.test_two_installs import TEAMS, owned

MONITORING_VALUES = CHART / "ci" / "monitoring-values.yaml"
# Grafana's limit on a dashboard uid.
MAX_UID_LENGTH = 40


@pytest.fixture(autouse=True)
def _needs_helm():
    if not HELM.exists():
        pytest.fail("helm is missing: run `make tools` (make test does it)")


def render(tmp_path: Path, namespace: str, *args: str, release: str = "holeblend") -> list[dict]:
    text = _helm(
        "template", release, str(CHART), "--namespace", namespace,
        "-f", str(MONITORING_VALUES), *args, tmp_path=tmp_path,
    )  # fmt: skip
    return [doc for doc in yaml.safe_load_all(text) if doc]


def _labels(labels: dict, family: str = "") -> str:
    return family + "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in labels.items()) + "}"


def dashboards_of(objects: list[dict]) -> dict[str, dict]:
    """Each dashboard ConfigMap's data key (the file the sidecar writes) and its dashboard."""
    configmaps = [o for o in objects if o["kind"] == "ConfigMap"]
    return {key: json.loads(text) for c in configmaps for key, text in c["data"].items()}


def test_two_installs_with_monitoring_own_no_object_in_common(tmp_path):
    a, b = (owned(render(tmp_path, namespace), namespace) for namespace in TEAMS)
    assert not a & b


def test_two_installs_give_grafana_distinct_dashboard_files_uids_and_titles(tmp_path):
    a, b = (dashboards_of(render(tmp_path, namespace)) for namespace in TEAMS)
    assert len(a) == len(b) == len(DASHBOARDS)
    assert not a.keys() & b.keys()
    assert not {d["uid"] for d in a.values()} & {d["uid"] for d in b.values()}
    assert not {d["title"] for d in a.values()} & {d["title"] for d in b.values()}


def test_a_dashboard_uid_stays_within_grafanas_limit_for_the_longest_names(tmp_path):
    objects = render(tmp_path, "n" * 63, release="r" * 53)
    for board in dashboards_of(objects).values():
        assert len(board["uid"]) <= MAX_UID_LENGTH, board["uid"]


def test_an_install_changes_nothing_in_its_dashboards_but_uid_and_title(tmp_path):
    (board,) = dashboards_of(render(tmp_path, "ops-a")).values()
    original = dashboard()
    assert original["title"] in board["title"] and "ops-a" in board["title"]
    assert {k: v for k, v in board.items() if k not in ("uid", "title")} == {
        k: v for k, v in original.items() if k not in ("uid", "title")
    }


def rules_of(tmp_path: Path, namespace: str, team: str) -> Path:
    """The rules file Prometheus gets from an install's PrometheusRule."""
    objects = render(tmp_path, namespace, "--set", f"watchNamespaces={{{team}}}")
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    path = tmp_path / f"{namespace}.rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    return path


@pytest.mark.parametrize("namespace", TEAMS)
def test_an_install_alerts_only_about_the_namespaces_it_watches(namespace, tmp_path):
    """Per-team installs each watch their team's namespace. Unscoped, every install's rules
    fire for every team's BlendDeployments: the alerts page lists each alert once per
    install, and a team that turned the alerts off gets them from the other team's rules."""
    series = []
    for team in TEAMS.values():
        engine = {"namespace": team, "blenddeployment": "chat", "service": "chat-engine"}
        tuning = {"namespace": team, "name": "chat", "job": "holeblend-operator-metrics"}
        series += [
            {"series": _labels(engine | {"component": "lookup-server"}, "up"), "values": "0x40"},
            {"series": _labels(tuning, "holeblend_operator_tuned_ratio"), "values": "0.15x40"},
            {"series": _labels(tuning, "holeblend_operator_tuning_max_ratio"), "values": "0.15x40"},
        ]
    firing = 'count by (alertname, namespace) (ALERTS{alertstate="firing"})'
    expected = [
        {"labels": _labels({"alertname": alert, "namespace": TEAMS[namespace]}), "value": 1}
        for alert in ("HoleblendLookupServerDown", "HoleblendTunerPinnedAtMaxRatio")
    ]
    test = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [{"expr": firing, "eval_time": "35m", "exp_samples": expected}],
    }
    path = tmp_path / "test.yaml"
    rule_files = [str(rules_of(tmp_path, namespace, TEAMS[namespace]))]
    path.write_text(yaml.safe_dump({"rule_files": rule_files, "tests": [test]}))
    result = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_scoped_rules_limit_every_selector_and_change_nothing_else(tmp_path):
    path = rules_of(tmp_path, "ops-a", "team-a")
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    scoped, original = yaml.safe_load(path.read_text()), yaml.safe_load(RULES.read_text())
    matcher = 'namespace=~"team-a"'
    for group, original_group in zip(scoped["groups"], original["groups"], strict=True):
        for rule, original_rule in zip(group["rules"], original_group["rules"], strict=True):
            expr, original_expr = rule.pop("expr"), original_rule.pop("expr")
            selectors = re.findall(r"\b(?:holeblend_[a-z0-9_]+|up)\b", original_expr)
            assert expr.count(matcher) == len(selectors), expr
            unscoped = expr.replace(f"{{{matcher}, ", "{").replace(f"{{{matcher}}}", "")
            assert unscoped == original_expr
            assert rule == original_rule


def test_an_install_watching_every_namespace_loads_the_rules_file_unchanged(tmp_path):
    (rule,) = [o for o in render(tmp_path, "ops-a") if o["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_dashboard_names_stay_distinct_when_cut_to_63_characters(tmp_path):
    release = "r" * 53
    names = [
        c["metadata"]["name"]
        for namespace in ("n" * 62 + "a", "n" * 62 + "b")
        for c in render(tmp_path, namespace, release=release)
        if c["kind"] == "ConfigMap"
    ]
    assert len(set(names)) == len(names) == 2 * len(DASHBOARDS)
    assert all(len(name) <= 63 and not name.endswith("-") for name in names), names
