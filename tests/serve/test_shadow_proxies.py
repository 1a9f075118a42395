"""holeblend-serve's quality proxies as wired in the server (app.py, worker.py): the inline
statistic of every blended request, the shadow within its token budget (scored while the
engine serves: nothing waits for idle), the pairs that calibrate the inline proxy, and
`qualityProxies: false` turning all of it off."""

from __future__ import annotations

import threading
import time

from holeblend_devtools.serve_process import get
from holeblend_runtime.quality.inline_proxy import MIN_PAIRS
from holeblend_runtime.quality.shadow import serving_time_share
from tests.serve.conftest import example_settings_json, start_server
from tests.serve.test_server import DOCS, NEW_DOC, completion, metric


def blend_three(server) -> None:
    assert completion(server, DOCS)[0] == 200  # full miss: caches the documents
    status, body, _ = completion(server, [DOCS[0], NEW_DOC, DOCS[2]], max_tokens=6)
    assert status == 200 and body["usage"]["holeblend"]["hole_tokens"] > 0  # blended
    status, body, _ = completion(server, DOCS, max_tokens=6)
    assert status == 200 and body["usage"]["holeblend"]["lookup_mode"] == "pure-hit"


def test_blended_requests_get_the_inline_statistic_and_budgeted_shadows(tmp_path):
    settings = example_settings_json(shadowSampleRate=1.0, shadowBudget=1.0)
    server = start_server(tmp_path, settings)
    try:
        blend_three(server)
        deadline = time.monotonic() + 120
        while metric(server, "holeblend_inline_proxy_pairs") < 1:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        # Every blended request's statistic is exported; with one pair the calibrated
        # proxy says nothing yet.
        assert metric(server, "holeblend_inline_residual_deviation_count") == 2
        assert metric(server, "holeblend_inline_f1_proxy_count") == 0
        assert metric(server, "holeblend_shadow_tokens_total") > 0
        scored = metric(server, "holeblend_shadow_requests_total", outcome="scored")
        assert scored >= 1 and metric(server, "holeblend_inline_proxy_pairs") == scored
        # Its work ran in units through the gate (at least a layer each), counted by the
        # engine's state as each started.
        units = metric(server, "holeblend_shadow_units_total")
        assert units >= 30 and metric(server, "holeblend_shadow_unit_seconds_total") > 0
        # The inline proxy is blind (one pair): the shadow may take the larger share.
        assert metric(server, "holeblend_shadow_time_share") == serving_time_share(1.0, blind=True)
    finally:
        assert server.stop() == 0, server.log()


def test_the_shadows_time_share_falls_to_its_budget_once_the_inline_proxy_estimates(tmp_path):
    settings = example_settings_json(shadowSampleRate=1.0, shadowBudget=0.05)
    server = start_server(tmp_path, settings)
    blind, calibrated = serving_time_share(0.05, blind=True), serving_time_share(0.05)
    try:
        assert metric(server, "holeblend_shadow_time_share") == blind  # nothing calibrated
        assert completion(server, DOCS)[0] == 200  # full miss: caches the documents
        for scored in range(1, MIN_PAIRS + 1):  # the same cached prompt: the same statistic
            status, body, _ = completion(server, DOCS, max_tokens=6)
            assert status == 200 and body["usage"]["holeblend"]["lookup_mode"] == "pure-hit"
            assert metric(server, "holeblend_shadow_time_share") == blind
            wait_for(server, "holeblend_shadow_requests_total", scored, outcome="scored")
        assert metric(server, "holeblend_inline_f1_proxy_count") == 0
        status, _, _ = completion(server, DOCS, max_tokens=6)
        assert status == 200 and metric(server, "holeblend_inline_f1_proxy_count") == 1
        assert metric(server, "holeblend_shadow_time_share") == calibrated < blind
    finally:
        assert server.stop() == 0, server.log()


def wait_for(server, name: str, value: float, timeout_s: float = 120, **labels) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(server, name, **labels) < value:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)


def test_an_idle_engine_scores_past_the_sample_rate_up_to_the_idle_floor(tmp_path):
    """A sample rate that samples nothing: every shadow here is the idle floor's doing,
    and only requests that end with no other pending are offered to it."""
    settings = example_settings_json(
        shadowSampleRate=1e-9, shadowIdleSamples=3, shadowIdleSeconds=3600
    )
    server = start_server(tmp_path, settings)
    try:
        assert completion(server, DOCS)[0] == 200  # full miss: caches the documents
        for scored, documents in enumerate(([DOCS[0], NEW_DOC, DOCS[2]], DOCS), start=1):
            status, body, _ = completion(server, documents, max_tokens=6)  # blends
            assert status == 200 and body["usage"]["holeblend"]["reused_tokens"] > 0
            # It ended with the engine idle: scored although the sample rate skips all.
            wait_for(server, "holeblend_shadow_requests_total", scored, outcome="scored")
        # A blended request that ends while another runs is not idle: the sample rate
        # decides, and skips it.
        long = threading.Thread(
            target=completion,
            args=(server, [DOCS[0], NEW_DOC, DOCS[2]]),
            kwargs={"max_tokens": 96, "ignore_eos": True},
        )
        long.start()
        time.sleep(0.5)
        status, body, _ = completion(server, [DOCS[0], NEW_DOC, DOCS[2]], max_tokens=1)
        assert status == 200 and body["usage"]["holeblend"]["reused_tokens"] > 0
        assert metric(server, "holeblend_shadow_requests_total", outcome="not_sampled") == 1
        long.join(120)
        # The long one ends with the engine idle: the floor's third place.
        wait_for(server, "holeblend_shadow_requests_total", 3, outcome="scored")
        time.sleep(0.5)
        offers = {
            outcome: metric(server, "holeblend_shadow_requests_total", outcome=outcome)
            for outcome in ("scored", "not_sampled", "over_budget", "dropped_full")
        }
        assert offers == {"scored": 3, "not_sampled": 1, "over_budget": 0, "dropped_full": 0}
    finally:
        assert server.stop() == 0, server.log()


def test_quality_proxies_off_means_no_shadow_and_no_inline_proxy(tmp_path):
    settings = example_settings_json(shadowSampleRate=1.0, qualityProxies=False)
    server = start_server(tmp_path, settings)
    try:
        blend_three(server)
        time.sleep(1.0)
        for name in (
            "holeblend_shadow_requests_total",
            "holeblend_shadow_tokens_total",
            "holeblend_inline_residual_deviation_count",
            "holeblend_f1_proxy_count",
        ):
            assert metric(server, name) == 0, name
        assert "holeblend_inline_f1_proxy" not in server_metrics(server)
    finally:
        assert server.stop() == 0, server.log()


def server_metrics(server) -> str:
    return get(server.url + "/metrics")[1]
