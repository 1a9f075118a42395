"""The HTTP routes of `holeblend-serve` (aiohttp) and the server's life cycle.

Life cycle: the listener opens at once (`/healthz` answers 200 while the model loads);
the model loads and warms up on the compute thread; then `/ready` answers 200 and the
completion routes take requests. On SIGTERM (or SIGINT) `/ready` turns 503, new requests
get 503, and the server waits up to `drain_timeout` for queued and running requests to
finish before it closes.

A completion request is checked fully before it is queued: body shape (400 naming the
field), model name (404), prompt build and length against the context (400), queue room
(429 with Retry-After). A client that disconnects cancels its job (aiohttp cancels the
handler; the compute thread sees the flag between tokens or drops the job unstarted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from holeblend_contract.blend_settings import Dtype
from holeblend_runtime.blend_config import from_settings
from holeblend_runtime.engine import Mode, ReferenceEngine
from holeblend_runtime.kv_store import LocalKVStore
from holeblend_runtime.serve import requests as parsing
from holeblend_runtime.serve.live_config import LiveConfig
from holeblend_runtime.serve.metrics import ServeMetrics
from holeblend_runtime.serve.requests import BadRequest, RagRequest
from holeblend_runtime.serve.responses import (
    IncrementalText,
    ResponseWriter,
    error_body,
    sse,
    usage,
)
from holeblend_runtime.serve.settings import ServeSettings
from holeblend_runtime.serve.worker import EngineWorker, Finished, Job, PrefillDone, QueueFull
from holeblend_runtime.shadow import ShadowMetrics, ShadowRequest, ShadowScorer
from holeblend_runtime.tiered_store import with_remote_tiers

log = logging.getLogger(__name__)

WARM_UP_DOCUMENTS = ("Warm-up document one, a few words long.", "And a second one.")


class HttpError(Exception):
    def __init__(self, status: int, body: dict, headers: dict | None = None) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body, self.headers = status, body, headers or {}


class Server:
    """The routes and the state they share."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.metrics = ServeMetrics()
        self.live = LiveConfig(
            settings.config,
            on_error=self.metrics.config_reload_errors.inc,
            on_reload=self._on_reload,
        )
        _check_dtype(self.live.startup.model.dtype)
        self.metrics.recompute_ratio.set(self.live.recompute_ratio)
        self.model_name = self.live.startup.model.api_name
        self.engine: ReferenceEngine | None = None
        self.worker: EngineWorker | None = None
        self.shadow: ShadowScorer | None = None
        self.is_ready = False
        self.is_draining = False
        self.num_active = 0

    def _on_reload(self) -> None:
        self.metrics.config_reloads.inc()
        self.metrics.recompute_ratio.set(self.live.recompute_ratio)

    # --- life cycle -------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_route)
        return app

    def load(self) -> None:
        """Load the model and warm it up (blocking: call it off the event loop)."""
        settings = self.live.startup
        store = LocalKVStore(max(settings.kv.local_cpu_bytes, 1))
        self.engine = ReferenceEngine.load(
            from_settings(settings), store, cache_dir=self.settings.cache_dir,
            num_threads=self.settings.torch_threads,
        )  # fmt: skip
        self.engine.store = with_remote_tiers(self.engine, settings, store, self.metrics.registry)
        prompt = self.engine.build_prompt("Warm-up.", WARM_UP_DOCUMENTS, "Ready?")
        self.engine.generate(self.engine.prefill(prompt, Mode.FULL), 2)
        self.metrics.kv_store_capacity_bytes.set(store.capacity_bytes)
        self.worker = EngineWorker(self.engine, self.live, self.metrics, self.settings.queue_size)
        self._start_shadow(settings.shadow_sample_rate)
        self.worker.start()

    def _start_shadow(self, sample_rate: float) -> None:
        """Quality proxies (runtime/shadow.py) for a share of the answered requests."""
        if sample_rate <= 0:
            return
        worker = self.worker
        self.shadow = ShadowScorer(
            self.engine.model, self.engine.tokenizer, sample_rate,
            is_busy=lambda: worker.num_pending > 0,
            # Offered from the compute thread while its own request still counts as pending.
            is_backlogged=lambda: worker.num_pending > 1,
            metrics=ShadowMetrics(self.metrics.registry),
        )  # fmt: skip
        worker.on_answered = lambda prompt, answer, ratio: self.shadow.offer(
            ShadowRequest(prompt, answer, ratio)
        )

    async def drain(self) -> None:
        """Refuse new requests; wait for queued and running ones (at most drain_timeout)."""
        self.is_draining = True
        deadline = time.monotonic() + self.settings.drain_timeout
        while self._num_pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._num_pending():
            log.warning("drain timeout: %d requests still pending", self._num_pending())

    def _num_pending(self) -> int:
        return self.num_active + (self.worker.num_pending if self.worker else 0)

    # --- plain routes -----------------------------------------------------------------

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _: web.Request) -> web.Response:
        if self.is_ready and not self.is_draining:
            return web.json_response({"status": "ready"})
        state = "draining" if self.is_draining else "loading"
        return web.json_response({"status": state}, status=503)

    async def models(self, _: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "holeblend"}
        return web.json_response({"object": "list", "data": [model]})

    async def metrics_route(self, _: web.Request) -> web.Response:
        if self.engine is not None:
            store = self.engine.store
            self.metrics.kv_store_bytes.set(store.num_bytes)
            self.metrics.kv_store_entries.set(len(store))
        body = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # --- completions ------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parsing.parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parsing.parse_chat)

    async def _complete(self, request: web.Request, parse: Callable) -> web.StreamResponse:
        arrived = time.perf_counter()
        self.num_active += 1
        outcome = "error"
        try:
            job, rag = await self._admit(request, parse, arrived)
            outcome, response = await self._respond(request, job, rag)
            return response
        except HttpError as error:
            outcome = _outcome_of(error.status)
            return web.json_response(error.body, status=error.status, headers=error.headers)
        except (asyncio.CancelledError, ConnectionResetError):
            outcome = "cancelled"
            raise
        finally:
            self.num_active -= 1
            self._count(outcome, arrived)

    def _count(self, outcome: str, arrived: float) -> None:
        mode = str(self.worker.mode) if self.worker else "unknown"
        self.metrics.requests.labels(mode, outcome).inc()
        if outcome == "ok":
            self.metrics.request_duration.labels(mode).observe(time.perf_counter() - arrived)

    async def _admit(self, request: web.Request, parse, arrived: float) -> tuple[Job, RagRequest]:
        if self.is_draining or not self.is_ready:
            message = "shutting down" if self.is_draining else "the model is still loading"
            raise HttpError(503, error_body(message, None, "unavailable"), {"Retry-After": "5"})
        try:
            rag = parse(await _json(request), self.engine.blend_config.separator, self._is_control)
            if rag.model != self.model_name:
                message = (
                    f"the model {rag.model!r} does not exist; this server has {self.model_name!r}"
                )
                raise BadRequest("model", message, status=404)
            job = self._job(rag, arrived)
        except BadRequest as error:
            kind = "not_found_error" if error.status == 404 else "invalid_request_error"
            raise HttpError(error.status, error_body(str(error), error.param, kind)) from None
        try:
            self.worker.submit(job)
        except QueueFull as full:
            body = error_body(str(full), None, "rate_limit_error")
            raise HttpError(429, body, {"Retry-After": str(full.retry_after_s)}) from None
        return job, rag

    def _is_control(self, text: str) -> bool:
        return self.engine.tokenizer.token_to_id(text) is not None

    def _job(self, rag: RagRequest, arrived: float) -> Job:
        field = "prompt" if rag.kind == "completion" else "messages"
        try:
            prompt = self.engine.build_prompt(rag.system, rag.documents, rag.question)
        except ValueError as error:
            param = str(error).split(":", 1)[0]
            raise BadRequest(
                param if param.startswith("documents") else field, str(error)
            ) from None
        max_tokens = rag.max_tokens or self.settings.default_max_tokens
        context = self.engine.config.context_length
        if prompt.num_tokens >= context:
            message = f"{prompt.num_tokens} prompt tokens reach the model context of {context}"
            raise BadRequest(field, message)
        if rag.max_tokens and prompt.num_tokens + max_tokens > context:
            message = (
                f"{prompt.num_tokens} prompt tokens + {max_tokens} exceed the model context "
                f"of {context}; ask for at most {context - prompt.num_tokens}"
            )
            raise BadRequest("max_tokens", message)
        max_tokens = min(max_tokens, context - prompt.num_tokens)
        deadline = arrived + self.settings.request_timeout
        return Job(prompt, max_tokens, arrived, deadline, asyncio.get_running_loop())

    async def _respond(self, request: web.Request, job: Job, rag: RagRequest):
        writer = ResponseWriter(rag, self.model_name)
        try:
            if rag.stream:
                return await self._stream(request, job, rag, writer)
            return await self._whole(job, writer)
        finally:
            job.cancelled.set()  # no effect once finished; stops a job whose client left

    async def _events(self, job: Job):
        """The job's events until Finished; TimeoutError past the deadline."""
        while True:
            remaining = job.deadline - time.perf_counter()
            async with asyncio.timeout(max(remaining, 0) + 1.0):
                event = await job.events.get()
            if isinstance(event, Exception):
                message = f"the engine failed: {event}"
                raise HttpError(500, error_body(message, None, "server_error"))
            if isinstance(event, PrefillDone):
                self.metrics.ttft.labels(event.mode).observe(event.ttft_s)
            yield event
            if isinstance(event, Finished):
                return

    async def _whole(self, job: Job, writer: ResponseWriter):
        text = IncrementalText(self.engine.tokenizer.decode)
        prefill = finished = None
        try:
            async for event in self._events(job):
                if isinstance(event, PrefillDone):
                    prefill = event
                elif isinstance(event, int):
                    text.add(event)
                else:
                    finished = event
        except TimeoutError:
            finished = Finished("timeout")
        if finished.reason in ("timeout", "cancelled"):
            raise _timeout_error(self.settings.request_timeout)
        body = writer.whole(text.text, finished.reason, usage(prefill, len(text.token_ids)))
        return "ok", web.json_response(body)

    async def _stream(self, request: web.Request, job: Job, rag: RagRequest, writer):
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        text = IncrementalText(self.engine.tokenizer.decode)
        prefill, finish, is_first, outcome = None, "stop", True, "ok"
        try:
            async for event in self._events(job):
                if isinstance(event, PrefillDone):
                    prefill = event
                elif isinstance(event, int) and (delta := text.add(event)):
                    await response.write(sse(writer.chunk(delta, first=is_first)))
                    is_first = False
                elif isinstance(event, Finished) and event.reason in ("timeout", "cancelled"):
                    raise TimeoutError
                elif isinstance(event, Finished):
                    finish = event.reason
            await response.write(sse(writer.chunk(text.rest(), finish, first=is_first)))
            if rag.include_usage:
                await response.write(sse(writer.usage_chunk(usage(prefill, len(text.token_ids)))))
        except TimeoutError:
            outcome = "timeout"
            await response.write(sse(_timeout_error(self.settings.request_timeout).body))
        except HttpError as error:
            outcome = _outcome_of(error.status)
            await response.write(sse(error.body))
        await response.write(sse("[DONE]"))
        await response.write_eof()
        return outcome, response


async def _json(request: web.Request):
    try:
        return await request.json()
    except ValueError as error:
        raise BadRequest(None, f"the body is not valid JSON ({error})") from None


def _timeout_error(timeout: float) -> HttpError:
    message = f"the request did not finish within the server's timeout of {timeout} s"
    return HttpError(504, error_body(message, None, "timeout"))


def _outcome_of(status: int) -> str:
    if status == 504:
        return "timeout"
    if status in (429, 503):
        return "rejected"
    return "bad_request" if status < 500 else "error"


def _check_dtype(dtype: Dtype) -> None:
    if dtype not in (Dtype.AUTO, Dtype.FLOAT32):
        raise ValueError(
            f"model.dtype: the reference engine computes in float32, got {dtype}; "
            "set auto or float32"
        )
