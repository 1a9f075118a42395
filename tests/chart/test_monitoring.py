"""The chart's monitoring: the alert rules, the Grafana dashboard and the ServiceMonitor,
each behind its own values flag; the expressions checked by a real Prometheus."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from holeblend_devtools import prometheus
from tests.chart.test_chart import CHART, _render

RULES = CHART / "rules" / "holeblend.rules.yaml"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
MONITORING_VALUES = CHART / "ci" / "monitoring-values.yaml"
MONITORING_KINDS = {"PrometheusRule", "ServiceMonitor"}
# Grafana's variables, as a Prometheus query would see them after substitution.
VARIABLES = {
    "${datasource}": "prometheus",
    "$__rate_interval": "1m",
    "$namespace": "default",
    "$deployment": "smollm2-demo",
}


def dashboard(path: Path = DASHBOARDS[0]) -> dict:
    return json.loads(path.read_text())


def dashboard_expressions(board: dict) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in board["annotations"]["list"] if "expr" in a]
    return exprs


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def substituted(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def test_the_rules_file_passes_promtool():
    result = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout


def test_the_alerts_cover_quality_lookup_tuner_bounds_and_queue():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {rule["alert"]: rule for group in groups for rule in group["rules"]}
    assert alerts["HoleblendQualityProxyBelowTarget"]["for"] == "10m"
    assert alerts["HoleblendTunerPinnedAtMaxRatio"]["for"] == "30m"
    assert alerts["HoleblendTunerPinnedAtMinRatio"]["for"] == "30m"
    assert "HoleblendLookupServerDown" in alerts and "HoleblendEngineQueueSaturated" in alerts
    assert all(rule["annotations"]["description"] for rule in alerts.values())


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_the_dashboard_is_a_valid_grafana_dashboard(path):
    board = dashboard(path)
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    assert board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), ids
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
    used = set(re.findall(r"\$(\w+)", " ".join(dashboard_expressions(board))))
    assert used <= set(variables) | {"__rate_interval"}, used


def test_the_dashboard_shows_what_the_issue_asks_for():
    board = dashboard()
    titles = " | ".join(p["title"] for p in board["panels"]).lower()
    for topic in ("reuse", "hit rate", "hole", "ratio", "f1", "kv deviation", "first token"):
        assert topic in titles, topic
    for topic in ("queue wait", "lookup latency", "errors"):
        assert topic in titles, topic
    (decisions,) = board["annotations"]["list"]
    assert "holeblend_operator_tuning_decisions_total" in decisions["expr"]


def test_the_decisions_annotation_marks_every_decision_also_a_counters_first(tmp_path):
    """The operator creates the counter of a (direction, reason) at its first decision: at
    1, with no earlier sample for changes() to compare. That decision is marked like the
    next one; a hold, and the minutes between decisions, are not."""
    (annotation,) = dashboard()["annotations"]["list"]
    expr = substituted(annotation["expr"])
    labels = 'namespace="default",name="smollm2-demo",pod="holeblend-operator-0"'
    family = "holeblend_operator_tuning_decisions_total"
    decided = f'{family}{{{labels},direction="up",reason="BelowTarget"}}'
    held = f'{family}{{{labels},direction="hold",reason="InBand"}}'
    series = [
        {"series": decided, "values": "_x10 1x10 2x10"},  # decided at 10m and at 21m
        {"series": held, "values": "_x4 1+1x30"},  # held every minute from 4m
    ]
    up = [{"labels": '{direction="up", reason="BelowTarget"}', "value": 1}]
    marks = {"9m": [], "10m": up, "11m": up, "14m": [], "21m": up, "25m": []}
    test = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [
            {"expr": expr, "eval_time": at, "exp_samples": samples} for at, samples in marks.items()
        ],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump({"evaluation_interval": "1m", "tests": [test]}))
    result = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_with_the_default_values_no_monitoring_object_is_rendered(tmp_path):
    objects = _render(tmp_path, None)
    assert not [o for o in objects if o["kind"] in MONITORING_KINDS]
    assert not [o for o in objects if o["kind"] == "ConfigMap"]


@pytest.mark.parametrize("flag", ["serviceMonitor", "prometheusRule", "dashboards"])
def test_each_flag_renders_only_its_part(flag, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"monitoring": {flag: {"enabled": True}}}))
    kinds = {o["kind"] for o in _render(tmp_path, values)}
    expected = {
        "serviceMonitor": {"ServiceMonitor", "Service"},
        "prometheusRule": {"PrometheusRule"},
        "dashboards": {"ConfigMap"},
    }[flag]
    others = {"ServiceMonitor", "Service", "PrometheusRule", "ConfigMap"} - expected
    assert expected <= kinds and not kinds & others, kinds


def test_the_rendered_objects_carry_the_files_unchanged(tmp_path):
    objects = _render(tmp_path, MONITORING_VALUES)
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    configmaps = [o for o in objects if o["kind"] == "ConfigMap"]
    assert len(configmaps) == len(DASHBOARDS)
    for configmap, path in zip(configmaps, DASHBOARDS, strict=True):
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert configmap["metadata"]["namespace"] == "monitoring"
        # Uid and title name the install (tests/chart/test_monitoring_installs.py).
        (text,) = configmap["data"].values()
        rendered, original = json.loads(text), dashboard(path)
        assert rendered | {"uid": None, "title": None} == original | {"uid": None, "title": None}
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    (service,) = [o for o in objects if o["kind"] == "Service"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


@pytest.fixture(scope="module")
def prometheus_url():
    rules = (str(RULES),)
    with prometheus.running_prometheus([], rule_files=rules) as url:
        yield url


@pytest.mark.parametrize(
    "expr", dashboard_expressions(dashboard()) + rule_expressions(), ids=lambda e: e[:60]
)
def test_every_expression_parses_in_a_real_prometheus(prometheus_url, expr):
    prometheus.query(prometheus_url, substituted(expr))  # QueryError on a parse error


def test_a_real_prometheus_loads_every_alert_rule(prometheus_url):
    loaded = prometheus.rules(prometheus_url)
    assert len(loaded) == len(rule_expressions())
    assert all(rule["health"] in ("ok", "unknown") for rule in loaded), loaded


def test_a_tuner_whose_bounds_are_equal_is_not_reported_pinned(tmp_path):
    """minRatio == maxRatio (the API allows it) leaves the tuner nothing to do: neither
    pinned alert fires (both did, for good, the max one saying quality needs a higher
    ratio). With room between the bounds, the ratio held at one still fires its alert."""
    tuning = 'namespace="default",name="{name}",pod="holeblend-operator-0"'
    series = []
    for name, low, high in (("fixed", 0.15, 0.15), ("tuned", 0.15, 0.3)):
        labels = tuning.format(name=name)
        for family, value in (("tuned", 0.15), ("tuning_max", high), ("tuning_min", low)):
            metric = f"holeblend_operator_{family}_ratio{{{labels}}}"
            series.append({"series": metric, "values": f"{value}x40"})
    groups = yaml.safe_load(RULES.read_text())["groups"]
    (rule,) = [
        r for g in groups for r in g["rules"] if r["alert"] == "HoleblendTunerPinnedAtMinRatio"
    ]
    annotations = {
        key: text.replace("{{ $labels.namespace }}", "default").replace(
            "{{ $labels.name }}", "tuned"
        )
        for key, text in rule["annotations"].items()
    }
    firing = {
        "exp_labels": {"severity": "info", "namespace": "default", "name": "tuned"},
        "exp_annotations": annotations,
    }
    test = {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": "35m", "alertname": "HoleblendTunerPinnedAtMaxRatio", "exp_alerts": []},
            {
                "eval_time": "35m",
                "alertname": "HoleblendTunerPinnedAtMinRatio",
                "exp_alerts": [firing],
            },
        ],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "tests": [test]}))
    result = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
