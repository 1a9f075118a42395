"""The chart's alerts fire for, and its dashboard shows, a BlendDeployment of any valid
name: also one whose Services the operator names with a hash (a dot, a leading digit, more
than 56 characters) and one whose instance label is hashed (more than 63 characters).

The series carry the labels a real scrape gives them. A real Prometheus gets the rendered
engine and lookup Services as targets with the meta labels Kubernetes service discovery
gives them, and applies the relabelings prometheus-operator generates for each endpoint of
the rendered ServiceMonitor, followed by that endpoint's own. promtool then evaluates the
chart's rules and the dashboard's queries on series with exactly those labels, beside the
operator's tuning series (`namespace` and `name`, kept by the chart's ServiceMonitor with
honorLabels).
"""

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from holeblend_devtools import prometheus
from holeblend_operator.api import BlendDeployment
from holeblend_operator.render import render_children
from holeblend_operator.render.naming import engine_name, lookup_name
from tests.chart.test_monitoring import RULES, dashboard, dashboard_expressions

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cpu.yaml"
NAMESPACE = "rag"
NAMES = [
    "llama-8b",  # its own Service names: <name>-engine, <name>-lookup
    "llama-3.1-8b",  # a dot: hashed Service names
    "qwen2.5-7b-instruct",
    "8b-chat",  # a leading digit: hashed Service names
    "m" * 60,  # over 56 characters: truncated and hashed Service names
    "rag." + "x" * 70,  # over 63 characters: a hashed instance label as well
]
# Families the lookup server exports; the engine's own holeblend_lookup_* are about its
# requests to it.
ENGINE_LOOKUP_FAMILIES = ("holeblend_lookup_seconds", "holeblend_lookup_failures")
ENGINE_LOOKUP_FAMILIES += ("holeblend_lookup_late",)
OPERATOR_SCRAPE = {"job": "hb-holeblend-metrics", "instance": "10.0.0.9:8080"}
GAUGES = {
    "holeblend_operator_tuning_target_f1_proxy": "0.9x40",
    "holeblend_operator_tuning_min_ratio": "0.05x40",
    "holeblend_operator_tuning_max_ratio": "0.15x40",
    "holeblend_operator_tuned_ratio": "0.1x40",
    "holeblend_recompute_ratio": "0.1x40",
}


def render(name: str) -> list[dict]:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"] = {"name": name, "namespace": NAMESPACE}
    manifest["spec"]["monitoring"] = {"serviceMonitor": {"enabled": True}}
    return render_children(BlendDeployment.model_validate(manifest))


def _meta_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _relabel_config(relabeling: dict) -> dict:
    """A ServiceMonitor relabeling as Prometheus's relabel_config (the same fields)."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return {keys.get(key, key): value for key, value in relabeling.items()}


def scrape_configs(name: str) -> list[dict]:
    """The scrape jobs prometheus-operator makes of the rendered ServiceMonitor (one per
    endpoint), with the Services it selects as static targets carrying Kubernetes service
    discovery's meta labels. The address is closed: only the target labels matter."""
    children = render(name)
    (monitor,) = [c for c in children if c["kind"] == "ServiceMonitor"]
    services = [c for c in children if c["kind"] == "Service"]
    jobs = []
    for index, endpoint in enumerate(monitor["spec"]["endpoints"]):
        targets = []
        for service in services:
            labels = service["metadata"]["labels"]
            if not monitor["spec"]["selector"]["matchLabels"].items() <= labels.items():
                continue
            meta = {
                "__meta_kubernetes_namespace": service["metadata"]["namespace"],
                "__meta_kubernetes_service_name": service["metadata"]["name"],
                "__meta_kubernetes_pod_name": f"{service['metadata']['name']}-0",
                "__meta_kubernetes_pod_container_name": "main",
                "__meta_kubernetes_endpoint_port_name": endpoint["port"],
            }
            for key, value in labels.items():
                meta[f"__meta_kubernetes_service_label_{_meta_name(key)}"] = value
                meta[f"__meta_kubernetes_service_labelpresent_{_meta_name(key)}"] = "true"
            targets.append({"targets": ["127.0.0.1:1"], "labels": meta})
        # prometheus-operator's own relabelings come first, in this order: keep the selected
        # Services and the endpoint's port, copy namespace, service, pod, container and job
        # from the meta labels, set endpoint; the endpoint's relabelings follow.
        selected = [
            {"action": "keep", "source_labels": [f"__meta_kubernetes_service_label_{k}"]}
            | {"regex": "|".join(e["values"])}
            for e in monitor["spec"]["selector"]["matchExpressions"]
            for k in [_meta_name(e["key"])]
        ]
        copied = [
            ("__meta_kubernetes_namespace", "namespace"),
            ("__meta_kubernetes_service_name", "service"),
            ("__meta_kubernetes_pod_name", "pod"),
            ("__meta_kubernetes_pod_container_name", "container"),
            ("__meta_kubernetes_service_name", "job"),
        ]
        generated = [
            *selected,
            {"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"]}
            | {"regex": endpoint["port"]},
            *({"source_labels": [s], "target_label": t} for s, t in copied),
            {"target_label": "endpoint", "replacement": endpoint["port"]},
        ]
        own = [_relabel_config(r) for r in endpoint.get("relabelings", [])]
        jobs.append(
            {
                "job_name": f"serviceMonitor/{NAMESPACE}/{monitor['metadata']['name']}/{index}",
                "static_configs": targets,
                "relabel_configs": generated + own,
            }
        )
    return jobs


def _active_targets(url: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/targets?state=active", timeout=10) as response:
        return json.loads(response.read())["data"]["activeTargets"]


@pytest.fixture(scope="module")
def target_labels() -> dict[str, list[dict]]:
    """Per BlendDeployment name, the labels of each of its scrape targets after relabeling
    by a real Prometheus (what `up` and every scraped series carry)."""
    jobs = {name: scrape_configs(name) for name in NAMES}
    every_job = [job for name_jobs in jobs.values() for job in name_jobs]
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": every_job}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prometheus, "config", lambda targets, rule_files: config)
        with prometheus.running_prometheus([]) as url:
            deadline = time.monotonic() + 30
            # Two components per BlendDeployment, one endpoint each (holeblend-serve).
            while len(targets := _active_targets(url)) < 2 * len(NAMES):
                assert time.monotonic() < deadline, targets
                time.sleep(0.5)
    by_job = {}
    for target in targets:
        by_job.setdefault(target["scrapePool"], []).append(target["labels"])
    return {name: [t for job in jobs[name] for t in by_job[job["job_name"]]] for name in NAMES}


def _labels(labels: dict) -> str:
    return "{" + ", ".join(f"{key}={json.dumps(value)}" for key, value in labels.items()) + "}"


def families(exprs: list[str]) -> set[str]:
    return set(re.findall(r"\b(holeblend_[a-z0-9_]+|up)\b", " ".join(exprs)))


def component_of(family: str) -> str:
    if family.startswith("holeblend_operator_"):
        return "operator"
    if family.startswith("holeblend_lookup_") and not family.startswith(ENGINE_LOOKUP_FAMILIES):
        return "lookup-server"
    return "engine"


def input_series(name: str, targets: list[dict], used: set[str]) -> list[dict]:
    """Series of every family the rules and the dashboard read: the engine's and the
    lookup server's with their scrape's labels, the operator's with `namespace` and `name`.
    The F1 proxy's mean is 0.5 against a target of 0.9, half the requests are rejected and
    the lookup server is down; the tuned ratio sits between its bounds."""
    by_component = {
        "engine": next(t for t in targets if t["service"] == engine_name(name)),
        "lookup-server": next(t for t in targets if t["service"] == lookup_name(name)),
    }
    series = [
        {"series": f"up{_labels(by_component['engine'])}", "values": "1x40"},
        {"series": f"up{_labels(by_component['lookup-server'])}", "values": "0x40"},
    ]
    for family in sorted(used - {"up"}):
        component = component_of(family)
        if component == "operator":
            labels = OPERATOR_SCRAPE | {"namespace": NAMESPACE, "name": name}
        else:
            labels = dict(by_component[component])
        values = GAUGES.get(family, "0+0.5x40" if family.endswith("_sum") else "0+1x40")
        if family.endswith("_bucket"):
            for le in ("0.1", "+Inf"):
                series.append(
                    {"series": f"{family}{_labels(labels | {'le': le})}", "values": values}
                )
        elif family == "holeblend_requests_total":
            for outcome in ("ok", "rejected"):
                labelled = _labels(labels | {"outcome": outcome})
                series.append({"series": f"{family}{labelled}", "values": values})
        else:
            series.append({"series": f"{family}{_labels(labels)}", "values": values})
    return series


def variable_values(board: dict, labels: dict) -> tuple[str, str]:
    """The `deployment` variable: the label its query lists, and the value it offers for a
    series with `labels` (after the variable's regex, as Grafana applies it)."""
    (variable,) = [v for v in board["templating"]["list"] if v["name"] == "deployment"]
    label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])[2]
    value = labels.get(label, "")
    if variable.get("regex"):
        match = re.search(variable["regex"].strip("/"), value)
        value = (match.group(1) if match.groups() else match.group(0)) if match else ""
    return label, value


def substituted(expr: str, name: str) -> str:
    values = {"$__rate_interval": "5m", "$namespace": NAMESPACE, "$deployment": name}
    for variable, value in values.items():
        expr = expr.replace(variable, value)
    return expr


def run_promtool(tmp_path: Path, test: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m"}
                                   | {"tests": [test]}))  # fmt: skip
    return subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("name", NAMES, ids=lambda n: n[:24])
def test_the_alerts_fire_for_a_blenddeployment_of_any_name(name, target_labels, tmp_path):
    rules = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    series = input_series(name, target_labels[name], families(rules))
    firing = 'count by (alertname, namespace, blenddeployment) (ALERTS{alertstate="firing"})'
    alert_labels = {"namespace": NAMESPACE, "blenddeployment": name}
    expected = [
        {"labels": _labels({"alertname": alert} | alert_labels), "value": 1}
        for alert in (
            "HoleblendEngineQueueSaturated",
            "HoleblendLookupServerDown",
            "HoleblendQualityProxyBelowTarget",
        )
    ]
    test = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [{"expr": firing, "eval_time": "30m", "exp_samples": expected}],
    }
    result = run_promtool(tmp_path, test)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", NAMES, ids=lambda n: n[:24])
def test_the_dashboard_offers_the_blenddeployment_and_every_panel_selects_its_series(
    name, target_labels, tmp_path
):
    board = dashboard()
    exprs = dashboard_expressions(board)
    series = input_series(name, target_labels[name], families(exprs))
    engine = next(t for t in target_labels[name] if t["service"] == engine_name(name))
    label, offered = variable_values(board, engine)
    assert offered == name, f"the deployment variable offers {offered!r} ({label})"
    # Its query: label_values(holeblend_recompute_ratio{namespace="$namespace"}, <label>).
    listing = {
        "expr": f'group by ({label}) (holeblend_recompute_ratio{{namespace="{NAMESPACE}"}})',
        "eval_time": "30m",
        "exp_samples": [{"labels": _labels({label: engine[label]}), "value": 1}],
    }
    panels = [
        {
            "expr": f"group({substituted(expr, name)})",
            "eval_time": "30m",
            "exp_samples": [{"labels": "{}", "value": 1}],
        }
        for expr in exprs
        if "changes(" not in expr  # the decisions annotation: checked by its selector below
    ]
    decisions = [
        re.search(r"holeblend_operator_tuning_decisions_total\{[^}]*\}", e)[0]
        for e in exprs
        if "changes(" in e
    ]
    panels += [
        {
            "expr": f"group({substituted(selector, name)})",
            "eval_time": "30m",
            "exp_samples": [{"labels": "{}", "value": 1}],
        }
        for selector in decisions
    ]
    test = {"interval": "1m", "input_series": series, "promql_expr_test": [listing, *panels]}
    result = run_promtool(tmp_path, test)
    assert result.returncode == 0, result.stdout + result.stderr


VLLM_TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"


@pytest.mark.parametrize("name", NAMES, ids=lambda n: n[:24])
def test_the_ttft_panel_shows_vllms_own_histogram_on_vllm_pods(name, target_labels, tmp_path):
    """vLLM pods export no holeblend_ttft_seconds: vLLM's API server measures TTFT and
    exports vllm:time_to_first_token_seconds (labels model_name, engine) on the engine's
    port, which the ServiceMonitor scrapes with the same relabelings as the connector's.
    Each TTFT quantile reads it there: every observation below 0.1 s gives 0.1 q."""
    (panel,) = [p for p in dashboard()["panels"] if p["title"] == "Time to first token"]
    engine = next(t for t in target_labels[name] if t["service"] == engine_name(name))
    labels = engine | {"model_name": "llama-8b", "engine": "0"}
    series = [
        {"series": f"{VLLM_TTFT_BUCKET}{_labels(labels | {'le': le})}", "values": "0+1x40"}
        for le in ("0.1", "+Inf")
    ]
    quantiles = [
        {
            "expr": f"round({substituted(target['expr'], name)}, 0.0001)",
            "eval_time": "30m",
            "exp_samples": [{"labels": "{}", "value": quantile}],
        }
        for target, quantile in zip(panel["targets"], (0.05, 0.09, 0.099), strict=True)
    ]
    test = {"interval": "1m", "input_series": series, "promql_expr_test": quantiles}
    result = run_promtool(tmp_path, test)
    assert result.returncode == 0, result.stdout + result.stderr
