"""Liveness on /healthz and the operator's Prometheus metrics on /metrics."""

import asyncio
import logging
import time
import weakref

import aiohttp.web
import prometheus_client

from holeblend_contract.dual_stack import listening_site

# kopf's names for its watch-stream tasks, one per resource and namespace.
WATCHER_TASK_PREFIXES = ("watcher for ", "peering observer for ")
# How long kopf's requests may keep failing certificate verification before liveness fails.
CERTIFICATE_FAILURE_S = 300.0
# A pause this long in those failures ends them: kopf logs every attempt of a failing
# request, the attempts 21 s apart at most (its default error_backoffs), and watches again
# at once after the last.
CERTIFICATE_QUIET_S = 60.0
# What an API request's certificate verification failure says, in kopf's log of it.
CERTIFICATE_FAILED = "CERTIFICATE_VERIFY_FAILED"


class CertificateFailures(logging.Handler):
    """How long kopf's API requests have been failing certificate verification without a
    pause, as kopf logs them.

    kopf builds its TLS context from the cluster CA bundle when it logs in, and logs in again
    only on a 401; its watch streams retry a failed connection for ever. After the cluster's
    CA rotates, they fail verification for good and the operator never sees an event again,
    while the watcher tasks run on (the operator's own client reads the new bundle). Only a
    restart makes kopf read it, so liveness fails."""

    def __init__(self, clock=time.monotonic):
        super().__init__(logging.ERROR)
        self._clock = clock
        self._first: float | None = None  # the first failure of the current run of them
        self._last: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if CERTIFICATE_FAILED not in record.getMessage():
            return
        now = self._clock()
        if self._last is None or now - self._last > CERTIFICATE_QUIET_S:
            self._first = now
        self._last = now

    def failing_for(self) -> float:
        """Seconds since the current run of failures began; 0 if there is none."""
        now = self._clock()
        if self._last is None or now - self._last > CERTIFICATE_QUIET_S:
            return 0.0
        return now - self._first


class HealthServer:
    """Healthy while the kopf operator task runs, has finished starting up, none of its
    watch streams has died, and its API requests have not been failing certificate
    verification for CERTIFICATE_FAILURE_S (CertificateFailures).

    kopf logs a watcher that fails for good (e.g. the API server refused it for longer than
    kopf's retries) and carries on without it: the operator then never sees that resource's
    events again. Only a restart brings the watcher back, so liveness fails."""

    def __init__(self, operator_task: asyncio.Task, ready: asyncio.Event, clock=time.monotonic):
        self._operator_task = operator_task
        self._ready = ready
        self._certificates = CertificateFailures(clock)
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
        await listening_site(self._runner, host, port).start()
        self.port = self._runner.addresses[0][1]
        logging.getLogger("kopf").addHandler(self._certificates)

    async def stop(self) -> None:
        logging.getLogger("kopf").removeHandler(self._certificates)
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
        failing_s = self._certificates.failing_for()
        if failing_s >= CERTIFICATE_FAILURE_S:
            text = f"API requests have failed certificate verification for {failing_s:.0f} s\n"
            return aiohttp.web.Response(status=503, text=text)
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
