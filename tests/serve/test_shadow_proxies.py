"""holeblend-serve's quality proxies as wired in the server (app.py, worker.py): the inline
statistic of every blended request, the shadow within its token budget (scored while the
engine serves: nothing waits for idle), the pairs that calibrate the inline proxy, and
`qualityProxies: false` turning all of it off."""

from __future__ import annotations

import time

from holeblend_devtools.serve_process import get
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
