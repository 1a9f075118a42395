"""The closed loop's recorder (`holeblend_devtools.timeline`) against the engine's own
metrics objects served over HTTP: mean TTFT between samples and how fast quality samples
arrive."""

import http.server
import threading

import pytest
from prometheus_client import generate_latest

from holeblend_devtools import timeline
from holeblend_runtime.quality.shadow import ShadowMetrics, ShadowScore
from holeblend_runtime.serve.metrics import ServeMetrics


@pytest.fixture
def engine_metrics():
    metrics = ServeMetrics()
    shadow = ShadowMetrics(metrics.registry)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            page = generate_latest(metrics.registry)
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield metrics, shadow, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_the_recorder_reads_ttft_between_samples_and_counts_quality_samples(engine_metrics):
    metrics, shadow, url = engine_metrics
    status = {"recomputeRatio": 0.2, "metrics": {"f1Proxy": 0.7, "hitPercent": 40.0}}
    recorder = timeline.Recorder(lambda: status, url)
    first = recorder.sample()
    assert (first.ratio, first.f1_proxy, first.hit_percent) == (0.2, 0.7, 40.0)
    assert first.ttft_s is None and first.quality_samples == 0
    metrics.ttft.labels(mode="hole").observe(0.5)
    metrics.ttft.labels(mode="hole").observe(1.5)
    for ratio, f1 in ((0.2, 1.0), (0.2, 0.0), (0.4, 0.5)):  # samples at two ratios all count
        shadow.observe(ShadowScore(f1=f1, top1=1.0, ratio=ratio, seconds=1.0))
    second = recorder.sample()
    assert second.ttft_s == pytest.approx(1.0)
    assert second.quality_samples == 3
    assert recorder.sample().ttft_s is None  # nothing finished since


def test_quality_samples_per_interval_over_the_recorded_span():
    def at(t_s, count):
        return timeline.Sample(t_s, t_s, 0.2, None, None, None, count)

    samples = [at(0.0, None), at(1.0, 2.0), at(31.0, 7.0), at(61.0, 12.0)]
    assert timeline.quality_samples_per(samples, 30) == pytest.approx(5.0)
    assert timeline.quality_samples_per(samples[:2], 30) is None  # one counted sample
    assert timeline.quality_samples_per([], 30) is None
