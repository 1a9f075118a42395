"""Liveness on /healthz and the operator's Prometheus metrics on /metrics."""

import asyncio

import aiohttp.web
import prometheus_client


class HealthServer:
    """Healthy while the kopf operator task runs and has finished starting up."""

    def __init__(self, operator_task: asyncio.Task, ready: asyncio.Event):
        self._operator_task = operator_task
        self._ready = ready
        self._runner: aiohttp.web.AppRunner | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> None:
        app = aiohttp.web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = aiohttp.web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _healthz(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        if self._operator_task.done():
            return aiohttp.web.Response(status=503, text="operator stopped\n")
        if not self._ready.is_set():
            return aiohttp.web.Response(status=503, text="starting\n")
        return aiohttp.web.Response(text="ok\n")

    async def _metrics(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        body = prometheus_client.generate_latest()
        return aiohttp.web.Response(
            body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST}
        )
