"""The tuner's direct scrape of pods in an IPv6-only cluster: a pod's address is an IPv6
one, which a URL must bracket (`http://fd00::7:8000/metrics` is no URL)."""

import aiohttp.web
import pytest
import yarl

from holeblend_operator import metrics
from holeblend_operator.api import BlendDeployment
from holeblend_operator.tuning_loop import TuningLoop
from tests.operator.test_tuning_loop import KEY, SPEC, VLLM_SPEC, _Operator, _PodsClient
from tests.operator.test_tuning_sources import metrics_page, vllm_page


class _IPv6PodsClient(_PodsClient):
    """One ready engine pod at `ip`."""

    def __init__(self, spec: dict, ip: str):
        super().__init__(spec)
        self.ip = ip

    async def list(self, kind, namespace, selector):
        (pod,) = await super().list(kind, namespace, selector)
        pod["status"]["podIP"] = self.ip
        return [pod]


async def test_pod_urls_bracket_an_ipv6_address():
    client = _IPv6PodsClient(VLLM_SPEC | {"engine": {"port": 8000}}, "fd00::7")
    target = await TuningLoop(_Operator(client)).target(BlendDeployment.model_validate(client.body))
    for url in (*target.pod_urls.values(), *target.ttft_urls.values()):
        parsed = yarl.URL(url)  # raises on the unbracketed form
        assert (parsed.host, parsed.path) == ("fd00::7", "/metrics"), url
    assert {yarl.URL(u).port for u in target.ttft_urls.values()} == {8000}


async def test_a_pod_on_ipv6_loopback_is_scraped():
    asked = []

    async def respond(request):
        asked.append(request.remote)
        n = len(asked)
        page = metrics_page(18 * n, 20 * n, ttft=(5 * n, 10 * n)) + vllm_page(100 * n, n)
        return aiohttp.web.Response(text=page, content_type="text/plain")

    app = aiohttp.web.Application()
    app.router.add_get("/metrics", respond)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    try:
        site = aiohttp.web.TCPSite(runner, "::1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = _IPv6PodsClient(SPEC | {"engine": {"port": port}}, "::1")
        loop = TuningLoop(_Operator(client))
        try:
            for _ in range(2):  # rates need two readings
                await loop.tune(KEY)
        finally:
            metrics.TUNING.forget(KEY)
            if loop._session is not None:
                await loop._session.close()
    finally:
        await runner.cleanup()
    assert asked == ["::1", "::1"]
    assert client.body["status"]["metrics"]["ttftSeconds"] == pytest.approx(0.5)
