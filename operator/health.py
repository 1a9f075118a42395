"""Liveness on /healthz and the operator's Prometheus metrics on /metrics."""

import asyncio
import weakref

import aiohttp.web
import prometheus_client

# kopf's names for its watch-stream tasks, one per resource and namespace.
WATCHER_TASK_PREFIXES = ("watcher for ", "peering observer for ")


class HealthServer:
    """Healthy while the kopf operator task runs, has finished starting up, and none of its
    watch streams has died.

    kopf logs a watcher that fails for good (e.g. the API server refused it for longer than
    kopf's retries) and carries on without it: the operator then never sees that resource's
    events again. Only a restart brings the watcher back, so liveness fails."""

    def __init__(self, operator_task: asyncio.Task, ready: asyncio.Event):
        self._operator_task = operator_task
        self._ready = ready
        self._runner: aiohttp.web.AppRunner | None = None
        # Watchers seen running; kopf drops those it stops on purpose (a namespace gone).
        self._watchers: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()
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
        dead = self._dead_watchers()
        if dead:
            return aiohttp.web.Response(status=503, text=f"{dead[0]} has stopped\n")
        return aiohttp.web.Response(text="ok\n")

    def _dead_watchers(self) -> list[str]:
        """Names of watch-stream tasks that ended other than by cancellation (kopf's stop)."""
        self._watchers.update(
            task
            for task in asyncio.all_tasks()
            if task.get_name().startswith(WATCHER_TASK_PREFIXES)
        )
        return sorted(
            task.get_name() for task in self._watchers if task.done() and not task.cancelled()
        )

    async def _metrics(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        body = prometheus_client.generate_latest()
        return aiohttp.web.Response(
            body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST}
        )
