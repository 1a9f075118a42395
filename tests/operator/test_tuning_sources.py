"""The tuner's metrics sources against real HTTP servers on 127.0.0.1: engine pods that
answer, vanish or send garbage, and Prometheus stand-ins that are down, slow or wrong.
(The same PromQL against a real Prometheus: tests/e2e/test_closed_loop.py.)"""

import asyncio
import contextlib
import json

import aiohttp
import aiohttp.web
import pytest

from holeblend_operator.tuning_sources import (
    PrometheusSource,
    ScrapeSource,
    Target,
    parse_metrics,
    reading,
)

# vLLM's TTFT histogram, as its API server names it (vllm/v1/metrics/loggers.py).
VLLM_TTFT = "vllm:time_to_first_token_seconds"


def metrics_page(
    f1_sum, f1_count, ratio=0.15, prompt=1000, reused=800, label=None, ttft=(10, 20)
) -> str:
    """holeblend-serve's /metrics (with `ttft`: holeblend_ttft_seconds' sum and count), or
    the connector's on a vLLM pod (`ttft` None: vLLM measures TTFT, on its own /metrics)."""
    label = label or str(ratio)
    ttft_series = ""
    if ttft is not None:
        ttft_series = (
            f"holeblend_ttft_seconds_sum {ttft[0]}\nholeblend_ttft_seconds_count {ttft[1]}\n"
        )
    return f"""# TYPE holeblend_f1_proxy histogram
holeblend_f1_proxy_bucket{{ratio="{label}",le="+Inf"}} {f1_count}
holeblend_f1_proxy_sum{{ratio="{label}"}} {f1_sum}
holeblend_f1_proxy_count{{ratio="{label}"}} {f1_count}
holeblend_f1_proxy_sum{{ratio="0.1"}} 50
holeblend_f1_proxy_count{{ratio="0.1"}} 100
# TYPE holeblend_top1_agreement histogram
holeblend_top1_agreement_sum{{ratio="{label}"}} {f1_sum}
holeblend_top1_agreement_count{{ratio="{label}"}} {f1_count}
# TYPE holeblend_prompt_tokens counter
holeblend_prompt_tokens_total {prompt}
# TYPE holeblend_reused_tokens counter
holeblend_reused_tokens_total {reused}
# TYPE holeblend_ttft_seconds histogram
{ttft_series}# TYPE holeblend_recompute_ratio gauge
holeblend_recompute_ratio {ratio}
"""


def vllm_page(ttft_sum, ttft_count, engines=("0",)) -> str:
    """vLLM's own /metrics on the engine's port, as its API server writes it (prometheus_client,
    labels model_name and engine: vllm/v1/metrics/loggers.py), with other series beside
    TTFT; each engine index has the given totals."""
    page = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-8b"} 3.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="llama-8b"} 999.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="llama-8b"} 7.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
"""
    for engine in engines:
        labels = f'engine="{engine}",model_name="llama-8b"'
        page += f"""vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} 0.0
vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {ttft_count}
vllm:time_to_first_token_seconds_count{{{labels}}} {ttft_count}
vllm:time_to_first_token_seconds_sum{{{labels}}} {ttft_sum}
"""
    return (
        page
        + """# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="llama-8b"} 1.79e+09
"""
    )


class Server:
    """An aiohttp server on 127.0.0.1 whose answer a test sets."""

    def __init__(self):
        self.answer = (200, "", "text/plain")
        self.respond = None  # or an aiohttp handler that answers by the request
        self.delay_s = 0.0
        self.runner = None
        self.port = None

    async def handle(self, request):
        await asyncio.sleep(self.delay_s)
        if self.respond is not None:
            return await self.respond(request)
        status, text, content_type = self.answer
        return aiohttp.web.Response(status=status, text=text, content_type=content_type)

    async def start(self):
        app = aiohttp.web.Application()
        app.router.add_route("GET", "/{tail:.*}", self.handle)
        self.runner = aiohttp.web.AppRunner(app)
        await self.runner.setup()
        site = aiohttp.web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self):
        await self.runner.cleanup()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def servers(count):
    started = [await Server().start() for _ in range(count)]
    try:
        async with aiohttp.ClientSession() as session:
            yield started, session
    finally:
        for server in started:
            with contextlib.suppress(Exception):
                await server.stop()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def target(*urls) -> Target:
    pods = {f"pod-{i}": f"{url}/metrics" for i, url in enumerate(urls)}
    return Target("default", "rag-engine", pods)


def vllm_target(*pairs) -> Target:
    """vLLM pods: the connector's metrics port and vLLM's own /metrics, per pod."""
    pods = {f"pod-{i}": f"{connector}/metrics" for i, (connector, _) in enumerate(pairs)}
    engines = {f"pod-{i}": f"{engine}/metrics" for i, (_, engine) in enumerate(pairs)}
    return Target("default", "rag-engine", pods, VLLM_TTFT, engines)


def as_increases(page: str) -> dict:
    """A page's counters as if they had all grown from zero within the window."""
    increases: dict = {}
    for (metric, label), value in parse_metrics(page, at=0).counters.items():
        increases.setdefault(metric, {})[label] = value
    return increases


def test_the_reading_counts_only_samples_taken_at_the_ratio_in_force():
    increases = as_increases(metrics_page(18, 20, ratio=0.15))
    seen = reading(increases, 0.15, [0.15], age_s=3)
    assert (seen.f1_proxy, seen.num_samples, seen.hit_percent) == (0.9, 20, 80.0)
    assert seen.ttft_seconds == 0.5
    other = reading(increases, 0.1, [0.15], age_s=3)
    assert (other.f1_proxy, other.num_samples) == (0.5, 100)


def inline_page(f1_sum, count, top1_sum=None, ratio=0.15) -> str:
    top1_sum = f1_sum if top1_sum is None else top1_sum
    return f"""# TYPE holeblend_inline_f1_proxy histogram
holeblend_inline_f1_proxy_bucket{{ratio="{ratio}",le="+Inf"}} {count}
holeblend_inline_f1_proxy_sum{{ratio="{ratio}"}} {f1_sum}
holeblend_inline_f1_proxy_count{{ratio="{ratio}"}} {count}
holeblend_inline_f1_proxy_sum{{ratio="0.1"}} 1
holeblend_inline_f1_proxy_count{{ratio="0.1"}} 1000
# TYPE holeblend_inline_top1_proxy histogram
holeblend_inline_top1_proxy_sum{{ratio="{ratio}"}} {top1_sum}
holeblend_inline_top1_proxy_count{{ratio="{ratio}"}} {count}
"""


def test_the_reading_carries_the_inline_proxy_at_the_ratio_in_force_next_to_the_shadow():
    increases = as_increases(metrics_page(2, 3) + inline_page(160, 200, top1_sum=180))
    seen = reading(increases, 0.15, [0.15], age_s=3)
    assert (seen.f1_proxy, seen.num_samples, seen.signal) == (pytest.approx(2 / 3), 3, "shadow")
    assert (seen.inline_f1_proxy, seen.inline_top1, seen.inline_num_samples) == (0.8, 0.9, 200)
    # Without inline series (an older runtime): nothing to fall back on.
    plain = reading(as_increases(metrics_page(2, 3)), 0.15, [0.15], age_s=3)
    assert (plain.inline_f1_proxy, plain.inline_num_samples) == (None, 0)


async def test_the_scrape_reads_the_inline_proxy_over_the_window_and_its_recent_part():
    async with servers(1) as ((a,), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        for f1_sum, count in [(10, 10), (90, 110), (170, 210)]:  # every 10 s
            a.answer = (200, metrics_page(1, 1) + inline_page(f1_sum, count), "text/plain")
            seen = await source.read(target(a.url), 0.15, window_s=60, recent_s=10)
            clock.now += 10
        assert (seen.inline_num_samples, seen.inline_f1_proxy) == (200, pytest.approx(0.8))
        assert seen.recent_inline_num_samples == 100
        assert seen.recent_inline_f1_proxy == pytest.approx(0.8)


def test_a_ratio_label_written_differently_still_matches():
    increases = as_increases(metrics_page(9, 10, ratio=0.15, label="0.15000"))
    assert reading(increases, 0.15, [], None).num_samples == 10


async def test_the_scrape_window_is_the_increase_since_the_oldest_snapshot_in_it():
    async with servers(2) as ((a, b), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        a.answer = b.answer = (200, metrics_page(10, 10), "text/plain")
        first = await source.read(target(a.url, b.url), 0.15, window_s=30)
        assert first.num_samples == 0  # the first sight of a pod is its baseline
        clock.now += 10
        a.answer = (200, metrics_page(19, 20, prompt=1500, reused=1200), "text/plain")
        b.answer = (200, metrics_page(14, 15, prompt=1200, reused=900), "text/plain")
        second = await source.read(target(a.url, b.url), 0.15, window_s=30)
        assert second.num_samples == 15 and second.f1_proxy == pytest.approx(13 / 15)
        assert second.hit_percent == pytest.approx(100 * 500 / 700)
        assert second.ratios_in_force == (0.15,)


async def test_the_recent_part_of_the_scrape_window_counts_from_the_snapshot_that_old():
    async with servers(1) as ((a,), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        pages = [(10, 10), (19, 20), (27, 30), (28, 40)]  # F1 sum, count every 10 s
        for f1_sum, count in pages:
            a.answer = (200, metrics_page(f1_sum, count), "text/plain")
            seen = await source.read(target(a.url), 0.15, window_s=60, recent_s=20)
            clock.now += 10
        # The window: since the first snapshot; the recent part: since the one 20 s old.
        assert (seen.num_samples, seen.f1_proxy) == (30, pytest.approx(18 / 30))
        assert (seen.recent_num_samples, seen.recent_f1_proxy) == (20, pytest.approx(9 / 20))
        # Not asked for: not read.
        a.answer = (200, metrics_page(29, 50), "text/plain")
        plain = await source.read(target(a.url), 0.15, window_s=60)
        assert (plain.recent_f1_proxy, plain.recent_num_samples) == (None, 0)


async def test_prometheus_is_asked_for_the_recent_part_of_the_window_too():
    async with servers(1) as ((prometheus,), session):
        asked = []
        sample = {"ratio": "0.15", "pod": "e-0"}

        async def handle(request):
            query = request.query["query"]
            asked.append(query)
            if "holeblend_f1_proxy_count" in query:
                value = 8 if "offset 90s" in query else 40
            elif "holeblend_f1_proxy_sum" in query:
                value = 2 if "offset 90s" in query else 30
            elif "timestamp" in query:
                return aiohttp.web.json_response(json.loads(vector(({}, 4.0))))
            else:
                value = 0.15
            return aiohttp.web.json_response(json.loads(vector((sample, value))))

        prometheus.respond = handle
        seen = await PrometheusSource(prometheus.url, session).read(target(), 0.15, 300, 90)
        assert (seen.error, seen.num_samples, seen.f1_proxy) == (None, 40, 0.75)
        assert (seen.recent_num_samples, seen.recent_f1_proxy) == (8, 0.25)
        recent = [q for q in asked if "offset 90s" in q]
        assert len(recent) == 4
        assert sum("holeblend_f1_proxy_" in q for q in recent) == 2
        assert sum("holeblend_inline_f1_proxy_" in q for q in recent) == 2


async def test_a_series_that_appears_after_a_ratio_change_counts_from_zero():
    async with servers(1) as ((a,), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        a.answer = (200, metrics_page(10, 10, ratio=0.15), "text/plain")
        await source.read(target(a.url), 0.225, window_s=30)
        clock.now += 10
        a.answer = (200, metrics_page(5, 6, ratio=0.225), "text/plain")
        seen = await source.read(target(a.url), 0.225, window_s=30)
        assert (seen.num_samples, seen.ratios_in_force) == (6, (0.225,))


async def test_a_restarted_pod_counts_from_zero_instead_of_going_negative():
    async with servers(1) as ((a,), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        a.answer = (200, metrics_page(90, 100), "text/plain")
        await source.read(target(a.url), 0.15, window_s=30)
        clock.now += 10
        a.answer = (200, metrics_page(4, 5), "text/plain")
        assert (await source.read(target(a.url), 0.15, window_s=30)).num_samples == 5


async def test_a_restart_that_only_the_f1_sum_shows_counts_sum_and_count_from_zero():
    """A restarted pod whose new F1 `_count` (12) already passed the baseline's (10) while
    its `_sum` (6) did not: per series, the count read +2 and the sum 6 from zero, a mean
    of 3.0 over 2 samples. Every counter of a restarted pod starts again from zero."""
    async with servers(1) as ((a,), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        a.answer = (200, metrics_page(9, 10, prompt=1000, reused=800), "text/plain")
        await source.read(target(a.url), 0.15, window_s=30)
        clock.now += 10
        a.answer = (200, metrics_page(6, 12, prompt=200, reused=100), "text/plain")
        seen = await source.read(target(a.url), 0.15, window_s=30, recent_s=30)
        assert (seen.num_samples, seen.f1_proxy) == (12, pytest.approx(0.5))
        assert (seen.recent_num_samples, seen.recent_f1_proxy) == (12, pytest.approx(0.5))
        assert seen.hit_percent == pytest.approx(50)


async def test_a_restart_between_the_baseline_and_now_counts_from_zero():
    """The pod restarted after the window's baseline (10 samples), was scraped low (2),
    and by now counts past the baseline (12): not 2 samples since the baseline, 12."""
    async with servers(1) as ((a,), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        for f1_sum, count in [(9, 10), (1, 2), (11, 12)]:
            page = metrics_page(f1_sum, count, prompt=100 * count, reused=80 * count)
            a.answer = (200, page, "text/plain")
            seen = await source.read(target(a.url), 0.15, window_s=60)
            clock.now += 10
        assert (seen.num_samples, seen.f1_proxy) == (12, pytest.approx(11 / 12))


async def test_pods_that_vanish_mid_scrape_are_left_out_and_the_rest_count():
    async with servers(2) as ((a, b), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        a.answer = b.answer = (200, metrics_page(10, 10), "text/plain")
        await source.read(target(a.url, b.url), 0.15, window_s=30)
        clock.now += 10
        a.answer = (200, metrics_page(20, 20), "text/plain")
        await b.stop()  # gone between the pod list and the scrape
        seen = await source.read(target(a.url, b.url), 0.15, window_s=30)
        assert (seen.error, seen.num_samples) == (None, 10)


@pytest.mark.parametrize(
    "answer",
    [
        (200, "<html><body>502 Bad Gateway</body></html>", "text/html"),
        (200, "holeblend_f1_proxy_sum{ratio= garbage", "text/plain"),
        (503, "overloaded", "text/plain"),
    ],
)
async def test_pods_that_answer_garbage_give_an_error_reading(answer):
    async with servers(1) as ((a,), session):
        a.answer = answer
        seen = await ScrapeSource(session).read(target(a.url), 0.15, window_s=30)
        assert seen.error and a.url in seen.error


async def test_no_ready_pods_is_an_error_reading():
    async with aiohttp.ClientSession() as session:
        seen = await ScrapeSource(session).read(target(), 0.15, window_s=30)
        assert "no ready engine pods" in seen.error


def vector(*items) -> str:
    result = [{"metric": labels, "value": [1700000000.0, str(value)]} for labels, value in items]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ((200, "<html>login page</html>", "text/html"), "not a query answer"),
        (
            (200, '{"status": "success", "data": {"resultType": "matrix"}}', "application/json"),
            "vector",
        ),
        (
            (200, '{"status": "success", "data": {"result": [1, 2]}}', "application/json"),
            "not a query",
        ),
        ((400, '{"status": "error", "error": "parse error"}', "application/json"), "parse error"),
        ((200, "\x00\xff garbage", "application/octet-stream"), "not a query answer"),
    ],
)
async def test_a_prometheus_that_answers_garbage_gives_an_error_reading(answer, says):
    async with servers(1) as ((prometheus,), session):
        prometheus.answer = answer
        seen = await PrometheusSource(prometheus.url, session).read(target(), 0.15, 60)
        assert seen.error and says in seen.error, seen.error


async def test_a_prometheus_that_is_down_or_slow_gives_an_error_reading_in_time():
    async with servers(1) as ((slow,), session):
        slow.delay_s, slow.answer = 1.5, (200, vector(), "application/json")
        seen = await asyncio.wait_for(
            PrometheusSource(slow.url, session, timeout_s=0.3).read(target(), 0.15, 60), 3
        )
        assert "TimeoutError" in seen.error
        await slow.stop()
        down = await PrometheusSource(slow.url, session).read(target(), 0.15, 60)
        assert "ClientConnectorError" in down.error or "Connect" in down.error


async def test_a_prometheus_without_the_engine_series_gives_an_error_reading():
    async with servers(1) as ((prometheus,), session):
        prometheus.answer = (200, vector(), "application/json")
        seen = await PrometheusSource(prometheus.url, session).read(target(), 0.15, 60)
        assert "no holeblend_recompute_ratio series" in seen.error


def window_answer(pod: str, now: float, then: float, resets: int = 0, **labels) -> list:
    """One series in Prometheus's answer to the tuner's window query: its value now, a
    window ago and its resets since, the last two marked (the promtool tests check the
    query: tests/operator/test_tuning_sources_promql.py)."""
    series = {"namespace": "default", "service": "rag-engine", "pod": pod} | labels
    return [
        (series, now),
        (series | {"holeblend_value": "then"}, then),
        (series | {"holeblend_value": "resets"}, resets),
    ]


async def test_a_restart_that_only_the_token_counters_show_counts_all_the_pods_series_from_zero():
    """Pod e-0 restarted and its F1 `_sum` and `_count` both came back past their old values:
    only its token counters went down. All its series count from zero (12 samples, not 2);
    e-1 counts its increase."""
    answers = {
        "holeblend_f1_proxy_sum": window_answer("e-0", 4.5, 1, ratio="0.15")
        + window_answer("e-1", 30, 21, ratio="0.15"),
        "holeblend_f1_proxy_count": window_answer("e-0", 12, 10, ratio="0.15")
        + window_answer("e-1", 40, 30, ratio="0.15"),
        "holeblend_prompt_tokens_total": window_answer("e-0", 100, 1000, resets=1)
        + window_answer("e-1", 2000, 1000),
        "holeblend_reused_tokens_total": window_answer("e-0", 80, 800, resets=1)
        + window_answer("e-1", 1800, 900),
        "holeblend_recompute_ratio": [({}, 0.15)],
    }
    async with servers(1) as ((prometheus,), session):

        async def handle(request):
            answer = answers.get(request.query["query"].split("{")[0], [])
            return aiohttp.web.json_response(json.loads(vector(*answer)))

        prometheus.respond = handle
        seen = await PrometheusSource(prometheus.url, session).read(target(), 0.15, 300)
    assert (seen.error, seen.num_samples) == (None, 12 + 10)
    assert seen.f1_proxy == pytest.approx((4.5 + 9) / 22)
    assert seen.hit_percent == pytest.approx(100 * (80 + 900) / (100 + 1000))


async def test_deployments_in_one_namespace_keep_their_own_scrape_history():
    """One source reads every BlendDeployment in turn: a read forgets only its own
    deployment's pods that are gone, never another deployment's history (which left every
    deployment but one of a namespace without a window, reading no samples, forever)."""
    async with servers(2) as ((a, b), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        first = Target("default", "first-engine", {"first-pod": f"{a.url}/metrics"})
        second = Target("default", "second-engine", {"second-pod": f"{b.url}/metrics"})
        for count in (10, 20, 30):
            a.answer = b.answer = (200, metrics_page(0.9 * count, count), "text/plain")
            seen = [await source.read(t, 0.15, window_s=600) for t in (first, second)]
            clock.now += 10
        assert [s.num_samples for s in seen] == [20, 20]
        assert seen[1].f1_proxy == pytest.approx(0.9)
        # A deployment deleted: its history goes, the other's stays.
        source.forget("default", "first-engine")
        a.answer = b.answer = (200, metrics_page(36, 40), "text/plain")
        assert (await source.read(first, 0.15, window_s=600)).num_samples == 0  # a new baseline
        assert (await source.read(second, 0.15, window_s=600)).num_samples == 30


async def test_a_vllm_pods_ttft_is_the_mean_of_vllms_histogram_on_its_engine_port():
    """vLLM pods: the connector's port has no TTFT; vLLM's API server exports its own
    `vllm:time_to_first_token_seconds` on the engine's port. Its window mean, over the pods
    and engine indexes, the same arithmetic as holeblend-serve's."""
    async with servers(4) as ((a, a_vllm, b, b_vllm), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        pods = vllm_target((a.url, a_vllm.url), (b.url, b_vllm.url))
        a.answer = b.answer = (200, metrics_page(10, 10, ttft=None), "text/plain")
        a_vllm.answer = (200, vllm_page(100, 50, engines=("0", "1")), "text/plain")
        b_vllm.answer = (200, vllm_page(7, 70), "text/plain")
        assert (await source.read(pods, 0.15, window_s=30)).ttft_seconds is None  # baseline
        clock.now += 10
        a.answer = b.answer = (200, metrics_page(19, 20, ttft=None), "text/plain")
        a_vllm.answer = (200, vllm_page(101, 54, engines=("0", "1")), "text/plain")  # +2 s, +8
        b_vllm.answer = (200, vllm_page(9, 72), "text/plain")  # +2 s over +2 requests
        seen = await source.read(pods, 0.15, window_s=30)
        assert seen.error is None and seen.ttft_seconds == pytest.approx(4 / 10)
        assert (seen.num_samples, seen.f1_proxy) == (20, pytest.approx(0.9))


async def test_prometheus_reads_vllms_ttft_histogram_for_vllm_pods():
    async with servers(1) as ((prometheus,), session):
        asked = []

        async def handle(request):
            query = request.query["query"]
            asked.append(query)
            if f"{VLLM_TTFT}_sum" in query:
                return aiohttp.web.json_response(json.loads(vector(({}, 12.0))))
            if f"{VLLM_TTFT}_count" in query:
                return aiohttp.web.json_response(json.loads(vector(({}, 30.0))))
            if "timestamp" in query:
                return aiohttp.web.json_response(json.loads(vector(({}, 4.0))))
            if query.startswith("holeblend_recompute_ratio"):
                return aiohttp.web.json_response(json.loads(vector(({}, 0.15))))
            return aiohttp.web.json_response(json.loads(vector()))

        prometheus.respond = handle
        pods = Target("default", "rag-engine", {}, VLLM_TTFT)
        seen = await PrometheusSource(prometheus.url, session).read(pods, 0.15, 300)
        assert (seen.error, seen.ttft_seconds) == (None, pytest.approx(0.4))
        ttft = [q for q in asked if "first_token" in q]
        assert len(ttft) == 2 and all('service="rag-engine"' in q for q in ttft)
        assert not any("holeblend_ttft" in q for q in asked)


@pytest.mark.parametrize("ttft", ["holeblend_ttft_seconds", VLLM_TTFT])
async def test_a_failed_ttft_query_keeps_the_other_figures(ttft):
    async with servers(1) as ((prometheus,), session):

        async def handle(request):
            query = request.query["query"]
            if ttft in query and "_count" in query:
                return aiohttp.web.json_response({"status": "error", "error": "x"}, status=503)
            if ttft in query:
                return aiohttp.web.json_response(json.loads(vector(({}, 12.0))))
            if "holeblend_f1_proxy_count" in query:
                return aiohttp.web.json_response(json.loads(vector(({"ratio": "0.15"}, 40))))
            if "holeblend_f1_proxy_sum" in query:
                return aiohttp.web.json_response(json.loads(vector(({"ratio": "0.15"}, 36))))
            if "timestamp" in query:
                return aiohttp.web.json_response(json.loads(vector(({}, 4.0))))
            return aiohttp.web.json_response(json.loads(vector(({}, 0.15))))

        prometheus.respond = handle
        pods = target() if ttft != VLLM_TTFT else Target("default", "rag-engine", {}, ttft)
        seen = await PrometheusSource(prometheus.url, session).read(pods, 0.15, 300)
        assert (seen.error, seen.num_samples, seen.f1_proxy) == (None, 40, pytest.approx(0.9))
        assert seen.ttft_seconds is None  # not 12 s over no requests, nor 0


@pytest.mark.parametrize(
    "failure",
    [
        "closed",  # vLLM's port refuses the connection
        (503, "overloaded", "text/plain"),
        (200, "<html><body>502 Bad Gateway</body></html>", "text/html"),
        (200, "vllm:time_to_first_token_seconds_count{engine= garbage", "text/plain"),
    ],
)
async def test_a_failed_ttft_scrape_keeps_the_other_figures_and_no_window_counts_from_it(
    failure,
):
    async with servers(3) as ((connector, engine, closed), session):
        await closed.stop()
        clock = Clock()
        source = ScrapeSource(session, clock=clock)

        async def read(f1_count, ttft_sum, ttft_count, failure=None):
            tokens = {"prompt": 100 * f1_count, "reused": 80 * f1_count}
            page = metrics_page(0.9 * f1_count, f1_count, ttft=None, **tokens)
            connector.answer = (200, page, "text/plain")
            engine.answer = (200, vllm_page(ttft_sum, ttft_count), "text/plain")
            if failure is not None and failure != "closed":
                engine.answer = failure
            ttft_at = closed if failure == "closed" else engine
            pods = vllm_target((connector.url, ttft_at.url))
            seen = await source.read(pods, 0.15, window_s=10)
            clock.now += 10
            return seen

        await read(10, 100, 100)
        assert (await read(20, 110, 120)).ttft_seconds == pytest.approx(0.5)
        failed = await read(30, 120, 140, failure)
        assert failed.error is None and failed.ttft_seconds is None
        assert (failed.num_samples, failed.f1_proxy) == (10, pytest.approx(0.9))
        assert failed.hit_percent == pytest.approx(80)
        # The next window starts at the failed read: no TTFT baseline, so TTFT is left out
        # rather than the pod's whole past (180 s over 180 requests) counted from zero.
        after = await read(40, 180, 180)
        assert (after.ttft_seconds, after.num_samples) == (None, 10)
        assert (await read(50, 182, 190)).ttft_seconds == pytest.approx(0.2)


async def test_holeblend_serve_pods_keep_their_own_ttft_histogram_on_one_scrape():
    async with servers(1) as ((a,), session):
        asked = []

        async def respond(request):
            asked.append(request.path)
            n = len(asked)
            # vLLM's histogram on the same page would give 100 s.
            page = metrics_page(10, 10, ttft=(10 * n, 20 * n)) + vllm_page(100 * n, n)
            return aiohttp.web.Response(text=page, content_type="text/plain")

        a.respond = respond
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        await source.read(target(a.url), 0.15, window_s=30)
        clock.now += 10
        seen = await source.read(target(a.url), 0.15, window_s=30)
        assert seen.ttft_seconds == pytest.approx(0.5)
        assert len(asked) == 2  # one request per pod and read


def in_two_writes(page: str, cut_after: str):
    """A handler that sends `page` in two writes, the second a moment later, cut just after
    `cut_after` (a page that arrives in several reads, as vLLM's /metrics of 50 KB and more
    does over a pod network)."""
    data = page.encode()
    cut = data.index(cut_after.encode()) + len(cut_after.encode())

    async def respond(request):
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(data[:cut])
        await asyncio.sleep(0.05)
        await response.write(data[cut:])
        await response.write_eof()
        return response

    return respond


async def test_a_page_that_arrives_in_several_reads_is_read_whole():
    """One `content.read(n)` returns what has arrived, not n bytes: each page was cut where
    its first part ended, here inside a number (F1 count 10 read as 1, TTFT sum 100 as 1),
    and the cut page parsed as if whole: a wrong TTFT (0 s) and sample count."""
    async with servers(2) as ((connector, engine), session):
        clock = Clock()
        source = ScrapeSource(session, clock=clock)
        pods = vllm_target((connector.url, engine.url))
        sum_0 = 'vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama-8b"} 1'
        for f1_count, ttft_sum, ttft_count in [(10, 100, 50), (15, 104, 52)]:
            page = metrics_page(0.9 * f1_count, f1_count, ttft=None)
            connector.respond = in_two_writes(page, '_f1_proxy_count{ratio="0.15"} 1')
            engine.respond = in_two_writes(vllm_page(ttft_sum, ttft_count, ("0", "1")), sum_0)
            seen = await source.read(pods, 0.15, window_s=30)
            clock.now += 10
        assert seen.error is None
        assert (seen.num_samples, seen.f1_proxy) == (5, pytest.approx(0.9))
        assert seen.ttft_seconds == pytest.approx(8 / 4)  # +4 s on each engine, +2 requests


async def test_a_prometheus_answer_that_arrives_in_several_reads_is_read_whole():
    async with servers(1) as ((prometheus,), session):

        async def handle(request):
            query = request.query["query"]
            value = 40 if "holeblend_f1_proxy_count" in query else 36
            if "holeblend_f1_proxy" not in query:
                value = 4.0 if "timestamp" in query else 0.15
            answer = vector(({"ratio": "0.15"}, value))
            return await in_two_writes(answer, '"value": [')(request)

        prometheus.respond = handle
        seen = await PrometheusSource(prometheus.url, session).read(target(), 0.15, 300)
        assert (seen.error, seen.num_samples, seen.f1_proxy) == (None, 40, pytest.approx(0.9))


async def test_a_page_over_the_limit_is_an_error_not_its_first_part(monkeypatch):
    """A page over MAX_BODY_BYTES is garbage; its first MAX_BODY_BYTES, cut here at a line's
    end, parsed as if whole, gave a reading without the series past the cut."""
    page = metrics_page(9, 10)
    limit = page.index("# TYPE holeblend_top1_agreement")
    async with servers(1) as ((a,), session):
        monkeypatch.setattr("holeblend_operator.tuning_sources.MAX_BODY_BYTES", limit)
        a.answer = (200, page, "text/plain")
        seen = await ScrapeSource(session).read(target(a.url), 0.15, window_s=30)
        assert seen.error and f"over {limit} bytes" in seen.error
