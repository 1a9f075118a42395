"""The tuner's PromQL evaluated by Prometheus's own engine (`promtool test rules`) on
series with a pod restart in the window, and the reading made of those answers.

Pod e-0 restarts 310 s in. At ratio 0.15 its F1 `_sum` comes back past its old value
(1 -> 4.5) while its `_count` does not (10 -> 5); at ratio 0.1 the other way round
(9 -> 6, 10 -> 12). Pod e-1 grows steadily at 0.15; pod e-2 starts 400 s in, so its
series are new in the window. The expected answers are worked out here from the samples
(`expected_answer`), independently of the PromQL, and promtool checks Prometheus agrees.
"""

import json
import subprocess

import aiohttp.web
import pytest
import yaml

from holeblend_operator import tuning_sources
from holeblend_operator.tuning_sources import F1, PrometheusSource, Target
from tests.operator.test_tuning_sources import servers

STEP_S = 10  # one sample every STEP_S seconds, the first at 0
WINDOW_S = 300
TARGET = Target("default", "rag-engine", {})
SELECTOR = f'namespace="{TARGET.namespace}",service="{TARGET.service}"'


def restarting(before: float, after: float) -> list[float]:
    """`before` up to 300 s, then (restarted at 310 s) `after`, up to 610 s."""
    return [before] * 31 + [after] * 31


SERIES = {
    (f"{F1}_sum", "e-0", "0.15"): restarting(1, 4.5),
    (f"{F1}_count", "e-0", "0.15"): restarting(10, 5),
    (f"{F1}_sum", "e-0", "0.1"): restarting(9, 6),
    (f"{F1}_count", "e-0", "0.1"): restarting(10, 12),
    (f"{F1}_sum", "e-1", "0.15"): [1.5 * i for i in range(62)],
    (f"{F1}_count", "e-1", "0.15"): [2.0 * i for i in range(62)],
    (f"{F1}_sum", "e-2", "0.15"): [None] * 40 + [0.5 * i for i in range(1, 23)],
    (f"{F1}_count", "e-2", "0.15"): [None] * 40 + [1.0 * i for i in range(1, 23)],
}
# 500 s: the restart well inside the window. 605 s: the window starts at 305 s, so the
# restart lies between the sample `offset` takes as its start (300 s) and the next.
EVAL_TIMES = (500, 605)


def labels_of(key: tuple[str, str, str], named: bool = True) -> dict[str, str]:
    metric, pod, ratio = key
    labels = {"namespace": TARGET.namespace, "service": TARGET.service, "pod": pod}
    return ({"__name__": metric} if named else {}) | labels | {"ratio": ratio}


def promql_series(labels: dict[str, str]) -> str:
    name = labels.get("__name__", "")
    rest = {k: v for k, v in labels.items() if k != "__name__"}
    return name + "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(rest.items())) + "}"


def samples(values: list[float | None]) -> list[tuple[int, float]]:
    return [(STEP_S * i, v) for i, v in enumerate(values) if v is not None]


def last_at(points: list[tuple[int, float]], at: int) -> tuple[int, float] | None:
    """The sample an instant query at `at` finds: the newest at most 5 minutes old."""
    found = [(t, v) for t, v in points if at - tuning_sources.LOOKBACK_S < t <= at]
    return found[-1] if found else None


def expected_answer(metric: str, at: int, window_s: int) -> list[tuple[dict, float]]:
    """What the tuner's query for `metric` should give at `at`: each series now, a window
    ago, and how often it went down from that sample on (over the window if it has none)."""
    answer = []
    for key, values in SERIES.items():
        if key[0] != metric:
            continue
        labels, points = labels_of(key), samples(values)
        now, then = last_at(points, at), last_at(points, at - window_s)
        if now is None:
            continue
        start = then[0] if then else at - window_s
        since = [v for t, v in points if start <= t <= at]
        resets = sum(b < a for a, b in zip(since, since[1:], strict=False))
        answer.append((labels, now[1]))
        if then:
            answer.append((labels | {tuning_sources.VALUE_LABEL: "then"}, then[1]))
        resets_labels = labels_of(key, named=False) | {tuning_sources.VALUE_LABEL: "resets"}
        answer.append((resets_labels, float(resets)))
    return answer


def promtool(tmp_path, tests: list[dict]) -> subprocess.CompletedProcess:
    """Runs `tests` (expression, time, expected samples) on SERIES."""
    series = [
        {
            "series": promql_series(labels_of(key)),
            "values": " ".join("_" if v is None else f"{v:g}" for v in values),
        }
        for key, values in SERIES.items()
    ]
    test = {"interval": f"{STEP_S}s", "input_series": series, "promql_expr_test": tests}
    # promtool holds the input back to the last evaluation step before an eval_time (with
    # the default 1m, the series at 500 s read as at 480 s): a step that divides them all.
    config = {"rule_files": [], "evaluation_interval": "5s", "tests": [test]}
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )


def expr_test(expr: str, at: int, answer: list[tuple[dict, float]]) -> dict:
    expected = [{"labels": promql_series(labels), "value": value} for labels, value in answer]
    return {"expr": expr, "eval_time": f"{at}s", "exp_samples": expected}


def old_query(metric: str) -> str:
    """The per-series query the tuner used: a series counts from zero only when it itself
    went down."""
    series = f"{metric}{{{SELECTOR}}}"
    per_series = f"(({series} - {series} offset {WINDOW_S}s) >= 0 or {series})"
    return f"sum by (ratio) {per_series}"


def test_the_per_series_query_pairs_a_grown_sum_with_a_restarted_count(tmp_path):
    """Why the restart is decided per pod: per series, e-0's `_sum` at 0.15 reads +3.5
    (4.5 - 1) beside its restarted `_count` read whole (5), a mean of 0.7 for 0.9; at 0.1
    its restarted `_sum` (6) beside a `_count` of +2, a mean of 3.0 for a proxy in [0, 1]."""
    steady = (1.5 * 50 - 1.5 * 20, 2.0 * 50 - 2.0 * 20)  # e-1, 200 s -> 500 s
    new = (0.5 * 11, 1.0 * 11)  # e-2, from 400 s
    expected = {
        f"{F1}_sum": {"0.15": 3.5 + steady[0] + new[0], "0.1": 6.0},
        f"{F1}_count": {"0.15": 5.0 + steady[1] + new[1], "0.1": 2.0},
    }
    tests = [
        expr_test(old_query(metric), 500, [({"ratio": r}, v) for r, v in by_ratio.items()])
        for metric, by_ratio in expected.items()
    ]
    result = promtool(tmp_path, tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_gives_each_series_now_a_window_ago_and_its_resets_since_then(tmp_path):
    """The tuner's queries, as it builds them, on the same series: e-0's restart shows in its
    `_count` at 0.15 and its `_sum` at 0.1 (also at 605 s, where the resets over the window
    alone see none), e-1's series have a value then and no resets, e-2's none then."""
    tests = [
        expr_test(
            tuning_sources._window_query(metric, SELECTOR, window_s),
            at,
            expected_answer(metric, at, window_s),
        )
        for metric in (f"{F1}_sum", f"{F1}_count")
        for at in EVAL_TIMES
        for window_s in (WINDOW_S, 90)
    ]
    # The resets over the window alone miss e-0's restart at 605 s.
    count = f'{F1}_count{{{SELECTOR},pod="e-0",ratio="0.15"}}'
    unnamed = labels_of((f"{F1}_count", "e-0", "0.15"), named=False)
    tests.append(expr_test(f"resets({count}[{WINDOW_S}s])", 605, [(unnamed, 0.0)]))
    result = promtool(tmp_path, tests)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("at", EVAL_TIMES)
async def test_a_pod_restarted_in_the_window_counts_its_sum_and_count_from_zero(at):
    """Prometheus's answers to the tuner's queries (those promtool checks above) read as a
    window: e-0 counted from zero at both ratios, e-1 its increase, e-2 from zero; the
    series summed by ratio."""
    answers = {
        tuning_sources._window_query(metric, SELECTOR, span): expected_answer(metric, at, span)
        for metric in (f"{F1}_sum", f"{F1}_count")
        for span in (WINDOW_S, 90)
    }
    async with servers(1) as ((prometheus,), session):

        async def handle(request):
            query = request.query["query"]
            answer = answers.get(query, [])
            if query.startswith(tuning_sources.RATIO_GAUGE):
                answer = [({}, 0.15)]
            result = [{"metric": m, "value": [at, str(v)]} for m, v in answer]
            data = {"resultType": "vector", "result": result}
            return aiohttp.web.json_response({"status": "success", "data": data})

        prometheus.respond = handle
        source = PrometheusSource(prometheus.url, session)
        seen = await source.read(TARGET, 0.15, WINDOW_S, recent_s=90)
        other = await source.read(TARGET, 0.1, WINDOW_S)
    steady = 1.5 * WINDOW_S / STEP_S, 2.0 * WINDOW_S / STEP_S  # e-1 over the window
    started = at // STEP_S - 39  # e-2's samples since it started, at 400 s
    assert seen.error is None and seen.num_samples == 5 + steady[1] + started
    assert seen.f1_proxy == pytest.approx((4.5 + steady[0] + 0.5 * started) / seen.num_samples)
    assert (other.num_samples, other.f1_proxy) == (12, pytest.approx(0.5))
    # The recent 90 s start after e-0's restart: e-1 and e-2 grew 9 samples each.
    assert seen.recent_num_samples == 2.0 * 9 + 9
    assert seen.recent_f1_proxy == pytest.approx((1.5 * 9 + 0.5 * 9) / 27)
