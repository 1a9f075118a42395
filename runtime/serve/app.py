"""The HTTP routes of `holeblend-serve` (aiohttp) and the server's life cycle.

Life cycle: the listener opens at once (`/healthz` answers 200 while the model loads);
the model loads and warms up on the compute thread; then `/ready` answers 200 and the
completion routes take requests. On SIGTERM (or SIGINT) `/ready` turns 503, new requests
get 503, and the server waits up to `drain_timeout` for queued and running requests to
finish before it closes.

A completion request is checked fully before it is queued: body size (413) and arrival
within `body_timeout` (408), body shape (400 naming the field), model name (404), prompt
build and length against the context (400), queue room (429 with Retry-After; checked
before the body is read too, so a full queue refuses at once; from then until it is queued
or refused the request holds its place, so no more bodies are read and parsed at once
than the queue has room for). A client that sends `Expect: 100-continue` gets the 503,
429 or 413 (for the length it announces) in place of `100 Continue`, before it sends the
body. Parsing and tokenizing run on a small thread pool, never on the event loop, so a
huge prompt cannot stall `/healthz` or other streams; a prompt whose character count
alone proves it longer than the context is refused without tokenizing.
A client that disconnects cancels its job (aiohttp cancels the handler; the compute
thread sees the flag between tokens or drops the job unstarted); one that stops reading a
stream is disconnected once a write has waited past its request's deadline plus
`WRITE_GRACE_S`. Every error, the router's 404 and 405 included, is an OpenAI-style JSON
body (`error_middleware`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import HttpVersion11, hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST

from holeblend_contract.blend_settings import Dtype
from holeblend_runtime.blend.config import from_settings
from holeblend_runtime.blend.segments import SegmentedPrompt
from holeblend_runtime.engine import BlendEngine, Mode, Prefill
from holeblend_runtime.kv.admission import AdmissionMetrics, admission_policy
from holeblend_runtime.kv.store import LocalKVStore
from holeblend_runtime.kv.tiers import pod_name, with_remote_tiers
from holeblend_runtime.model.threads import serial_pool
from holeblend_runtime.quality.inline_proxy import InlineProxy, residual_deviation
from holeblend_runtime.quality.shadow import (
    ShadowBudget,
    ShadowGate,
    ShadowMetrics,
    ShadowRequest,
    ShadowScorer,
    serving_catch_up_s,
    serving_time_share,
)
from holeblend_runtime.quality.shared_calibration import SharedCalibration, calibration_scope
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
from holeblend_runtime.serve.worker import (
    Answered,
    ComputeThreadEnded,
    EngineWorker,
    Finished,
    Job,
    PrefillDone,
    QueueFull,
    is_blended,
)

log = logging.getLogger(__name__)

WARM_UP_DOCUMENTS = ("Warm-up document one, a few words long.", "And a second one.")
# Bytes of one request body at most (413 beyond).
MAX_BODY_BYTES = 16 << 20
# Threads that parse and tokenize request bodies.
PARSE_THREADS = 2
# Seconds past a request's deadline its streamed answer may take to reach the client (the
# last writes after a 504 event included); then the connection is closed.
WRITE_GRACE_S = 2.0
_ERROR_TYPES = {404: "not_found_error", 429: "rate_limit_error", 503: "unavailable"}


class HttpError(Exception):
    def __init__(
        self, status: int, body: dict, headers: dict | None = None, close: bool = False
    ) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body, self.headers = status, body, headers or {}
        # Close the connection after the answer (the rest of the body was not read).
        self.close = close

    def response(self) -> web.Response:
        response = web.json_response(self.body, status=self.status, headers=self.headers)
        if self.close:
            response.force_close()
        return response


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """The router's and aiohttp's HTTP errors (404, 405, 413, ...) and any unexpected
    exception as OpenAI-style JSON bodies, never plain text."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = f"{error.reason}: {request.method} {request.path}"
        if error.status == 405:
            message += f" (allowed: {error.headers.get('Allow', '')})"
        kind = _ERROR_TYPES.get(error.status, "invalid_request_error")
        headers = {k: v for k, v in error.headers.items() if k in ("Allow", "Retry-After")}
        return HttpError(error.status, error_body(message, None, kind), headers).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, ascii(request.path))
        body = error_body("internal error; the server logged it", None, "server_error")
        return web.json_response(body, status=500)


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
        self.engine: BlendEngine | None = None
        self.worker: EngineWorker | None = None
        self.shadow: ShadowScorer | None = None
        self.inline: InlineProxy | None = None
        self.shared_calibration: SharedCalibration | None = None
        self.shadow_budget: ShadowBudget | None = None
        self.shadow_gate: ShadowGate | None = None
        self._shadow_blind: bool | None = None  # the pacing the gate was last given
        self.is_ready = False
        self.is_draining = False
        # Requests with a parsed body, not yet answered (what a drain waits for).
        self.num_active = 0
        # Requests past the queue check, not yet queued (their bodies being read or
        # parsed): each holds a place in the queue.
        self.num_reserved = 0
        self._parse_pool = serial_pool(PARSE_THREADS, "holeblend-parse")

    def _on_reload(self) -> None:
        self.metrics.config_reloads.inc()
        self.metrics.recompute_ratio.set(self.live.recompute_ratio)
        if self.shadow_budget is not None:
            current = self.live.current
            self.shadow_budget.set_floor(current.shadow_idle_samples, current.shadow_idle_seconds)

    # --- life cycle -------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[error_middleware])
        app.router.add_post("/v1/completions", self.completions, expect_handler=self._expect)
        app.router.add_post(
            "/v1/chat/completions", self.chat_completions, expect_handler=self._expect
        )
        app.router.add_get("/v1/models", self.models)
        # `.+`: a served name may hold slashes (`org/model`, as vLLM's are often named).
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_route)
        return app

    def load(self) -> None:
        """Load the model and warm it up (blocking: call it off the event loop)."""
        settings = self.live.startup
        store = LocalKVStore(
            settings.kv.tier_budget_bytes, admission=admission_policy(settings.kv.admission)
        )
        self.engine = BlendEngine.load(
            from_settings(settings), store, cache_dir=self.settings.cache_dir,
            num_threads=self.settings.torch_threads,
            # The model id every segment key and stored entry names: model.name with the
            # GGUF's identity (a fine-tune under the same file name is other weights).
            model_name=settings.model.name, max_model_len=settings.model.max_model_len,
        )  # fmt: skip
        self.engine.store = with_remote_tiers(self.engine, settings, store, self.metrics.registry)
        self.engine.warm_up()
        prompt = self.engine.build_prompt("Warm-up.", WARM_UP_DOCUMENTS, "Ready?")
        self.engine.generate(self.engine.prefill(prompt, Mode.FULL), 3)  # two decode steps
        self.metrics.kv_store_capacity_bytes.set(store.capacity_bytes)
        self.metrics.registry.register(AdmissionMetrics(store))
        self.engine.tokenizer.max_token_bytes  # noqa: B018 (computed once, here, off the loop)
        self.worker = EngineWorker(
            self.engine, self.live, self.metrics, self.settings.queue_size,
            self.settings.max_batch, self.settings.torch_threads,
            self.settings.decode_pool_bytes,
        )  # fmt: skip
        self._start_quality_proxies()
        self.worker.start()

    def _start_quality_proxies(self) -> None:
        """The inline proxy for every blended request (runtime/quality/inline_proxy.py) and the
        shadow for a sampled share of them within the token budget (runtime/quality/shadow.py);
        neither with `qualityProxies: false`."""
        settings = self.live.startup
        if not settings.quality_proxies:
            return
        worker = self.worker
        self.inline = InlineProxy(self.metrics.registry)
        if settings.lookup_server_url:
            # The deployment's pods share their calibration pairs through the lookup server.
            keyer = self.engine.keyer
            scope = calibration_scope(
                self.engine.config.model_id, self.engine.kv_dtype, 1, settings,
                model_dtype=keyer.system_kv_dtype or keyer.kv_dtype,
            )  # fmt: skip
            self.shared_calibration = SharedCalibration.to(
                settings.lookup_server_url, scope, pod_name(), self.inline
            ).start()
        self.shadow_budget = ShadowBudget(
            settings.shadow_budget,
            idle_samples=settings.shadow_idle_samples,
            idle_seconds=settings.shadow_idle_seconds,
        )
        worker.on_prefilled = self._on_prefilled
        # Shadow metrics are exported (zero) even when no shadow runs: the tuner reads them.
        metrics = ShadowMetrics(self.metrics.registry)
        if settings.shadow_sample_rate <= 0 or settings.shadow_budget <= 0:
            return
        # Blind until the inline proxy estimates what the engine serves (it has no
        # calibration yet): the shadow is then the tuner's only signal at saturation.
        gate = ShadowGate(
            lambda: worker.num_pending > 0, cooperative=True, on_unit=metrics.observe_unit
        )
        self.shadow_gate = gate
        self._pace_shadow(blind=True)
        self.shadow = ShadowScorer(
            self.engine.model, self.engine.tokenizer, settings.shadow_sample_rate,
            gate=gate, budget=self.shadow_budget, inline=self.inline, metrics=metrics,
        )  # fmt: skip
        worker.between_steps = gate.between_steps
        worker.on_answered = self._on_answered

    def _on_prefilled(self, prefill: Prefill) -> float | None:
        """Compute thread, after each prefill: the budget counts its prompt tokens; a
        blended one's inline statistic is observed (and returned for the shadow)."""
        self.shadow_budget.add_user_tokens(prefill.num_prompt_tokens)
        if not is_blended(prefill) or prefill.reuse is None:
            return None
        statistic = residual_deviation(
            prefill.prompt, prefill.reuse, prefill.deviation, prefill.selected_positions
        )
        estimates = self.inline.observe(prefill.ratio, statistic)
        self._pace_shadow(blind=estimates is None)
        return statistic

    def _pace_shadow(self, *, blind: bool) -> None:
        """The gate's share and catch-up slice for whether the inline proxy is blind (set
        on a change only, not on every prefill)."""
        if self.shadow_gate is None or blind == self._shadow_blind:
            return
        share = serving_time_share(self.live.startup.shadow_budget, blind=blind)
        self.shadow_gate.set_time_share(share, serving_catch_up_s(blind=blind))
        self.metrics.shadow_time_share.set(share)
        self._shadow_blind = blind

    def _on_answered(self, answered: Answered) -> None:
        """Compute thread, as a request that blended ends (still counted as pending): it is
        offered to the shadow, with the idle floor open to it when no other is pending."""
        self.shadow.offer(
            ShadowRequest(
                answered.prompt, answered.answer, answered.ratio,
                stopped_at_eos=answered.stopped_at_eos, max_tokens=answered.max_tokens,
                inline_statistic=answered.inline_statistic, stop=answered.stop,
            ),
            idle=self.worker.num_pending <= 1,
        )  # fmt: skip

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

    def close(self) -> None:
        """Stop the parse threads (after the listener closed)."""
        self._parse_pool.shutdown(wait=True, cancel_futures=True)

    # --- plain routes -----------------------------------------------------------------

    async def healthz(self, _: web.Request) -> web.Response:
        if self.worker is not None and self.worker.has_died:
            return web.json_response({"status": "the compute thread ended"}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, _: web.Request) -> web.Response:
        if self.worker is not None and self.worker.has_died:
            return web.json_response({"status": "the compute thread ended"}, status=503)
        if self.is_ready and not self.is_draining:
            return web.json_response({"status": "ready"})
        state = "draining" if self.is_draining else "loading"
        return web.json_response({"status": state}, status=503)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve-model route (the `openai` package's `models.retrieve`)."""
        name = request.match_info["model"]
        if name != self.model_name:
            message = f"the model {name!r} does not exist; this server has {self.model_name!r}"
            return HttpError(404, error_body(message, "model", "not_found_error")).response()
        return web.json_response(self._model_object())

    def _model_object(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "holeblend"}

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
        outcome, active, reserved = "error", False, False
        try:
            self._check_open()
            self._check_room()
            self.num_reserved += 1
            reserved = True
            body = await self._read_body(request)
            rag, prompt, max_tokens = await asyncio.get_running_loop().run_in_executor(
                self._parse_pool, self._parse, body, parse
            )
            self._check_open()  # the drain may have begun while the body arrived
            self.num_active += 1
            active = True
            self.num_reserved -= 1  # the job takes the place it held
            reserved = False
            job, rag = self._submit(rag, prompt, max_tokens, arrived)
            outcome, response = await self._respond(request, job, rag)
            return response
        except HttpError as error:
            outcome = _outcome_of(error.status)
            return error.response()
        except (asyncio.CancelledError, ConnectionResetError):
            outcome = "cancelled"
            raise
        finally:
            self.num_active -= active
            self.num_reserved -= reserved
            self._count(outcome, arrived)

    async def _expect(self, request: web.Request) -> web.Response | None:
        """`Expect: 100-continue` (aiohttp calls this before the route): the final answer
        at once for a request that would be refused before its body is read (503, 429, or
        413 for the length it announces), else `100 Continue`. aiohttp's own handler sent
        100 before any check, so a client waiting for it sent its whole body for nothing.
        A refusal closes the connection: the client did not send the body it announced.
        An HTTP/1.0 client does not wait (nothing to answer); another expectation is 417."""
        if request.version != HttpVersion11:
            return None
        arrived = time.perf_counter()
        try:
            _check_expectation(request.headers[hdrs.EXPECT])
            self._check_open()
            self._check_room()
            if (request.content_length or 0) > MAX_BODY_BYTES:
                raise _too_large_error()
        except HttpError as error:
            self._count(_outcome_of(error.status), arrived)
            error.close = True
            return error.response()
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the access log's response size counts the answer only
        return None

    def _count(self, outcome: str, arrived: float) -> None:
        mode = str(self.worker.mode) if self.worker else "unknown"
        self.metrics.requests.labels(mode, outcome).inc()
        if outcome == "ok":
            self.metrics.request_duration.labels(mode).observe(time.perf_counter() - arrived)

    def _check_open(self) -> None:
        """503 while loading or draining, and once the compute thread has died: a request
        queued then would wait out its timeout for a thread that never takes it."""
        if self.worker is not None and self.worker.has_died:
            message = str(ComputeThreadEnded())
        elif self.is_draining or not self.is_ready:
            message = "shutting down" if self.is_draining else "the model is still loading"
        else:
            return
        raise _unavailable_error(message)

    def _check_room(self) -> None:
        """429 at once while the queue is full: the body of a request that would be refused
        is neither read nor tokenized (under overload that work took the CPU the compute
        thread needs, and held every such body, for nothing). The requests let in whose
        bodies are still being read or parsed count as queued: a burst that arrives while
        the queue is empty would otherwise all pass, each body held and parsed before its
        429 at `_submit`, which checks again. Without a worker (not started) there is no
        queue to be full."""
        if self.worker is None:
            return
        try:
            self.worker.check_room(self.num_reserved)
        except QueueFull as full:
            raise _queue_full_error(full) from None

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body within `body_timeout` (408) and `MAX_BODY_BYTES` (413); a body
        that cannot be decoded is a 400."""
        timeout = self.settings.body_timeout
        try:
            async with asyncio.timeout(timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large_error() from None
        except TimeoutError:
            message = f"the body did not arrive within the server's body timeout of {timeout} s"
            raise HttpError(408, error_body(message, None), close=True) from None
        except web.RequestPayloadError as error:
            # The client's body is broken (e.g. not in the Content-Encoding it names):
            # its fault, not the server's.
            cause = getattr(error.__cause__, "message", None) or str(error)
            message = f"the body cannot be read: {cause}"
            # Nothing more to read: aiohttp would otherwise read the broken rest after the
            # answer, hit the error again and log it as an unhandled exception.
            request.content.feed_eof()
            raise HttpError(400, error_body(message, None), close=True) from None

    def _parse(self, body: bytes, parse: Callable) -> tuple[RagRequest, SegmentedPrompt, int]:
        """Body -> request, tokenized prompt and max_tokens (on a parse thread)."""
        try:
            rag = parse(_json(body), self.engine.blend_config.separator, self._is_control)
            if rag.model != self.model_name:
                message = (
                    f"the model {rag.model!r} does not exist; this server has {self.model_name!r}"
                )
                raise BadRequest("model", message, status=404)
            return rag, *self._prompt(rag)
        except BadRequest as error:
            kind = _ERROR_TYPES.get(error.status, "invalid_request_error")
            raise HttpError(error.status, error_body(str(error), error.param, kind)) from None

    def _submit(self, rag: RagRequest, prompt, max_tokens: int, arrived: float):
        deadline = arrived + self.settings.request_timeout
        loop = asyncio.get_running_loop()
        job = Job(
            prompt, max_tokens, arrived, deadline, loop, ignore_eos=rag.ignore_eos, stop=rag.stop
        )
        try:
            self.worker.submit(job)
        except QueueFull as full:
            raise _queue_full_error(full) from None
        return job, rag

    def _is_control(self, text: str) -> bool:
        return self.engine.tokenizer.token_to_id(text) is not None

    def _prompt(self, rag: RagRequest) -> tuple[SegmentedPrompt, int]:
        field = "prompt" if rag.kind == "completion" else "messages"
        context = self.engine.config.context_length
        num_chars = len(rag.system or "") + len(rag.question) + sum(map(len, rag.documents))
        # Each token covers at most max_token_bytes bytes, each character at least one.
        at_least = -(-num_chars // self.engine.tokenizer.max_token_bytes)
        if at_least >= context:
            message = (
                f"{num_chars} characters of text are at least {at_least} tokens, over the "
                f"model context of {context} tokens"
            )
            raise BadRequest(field, message)
        try:
            prompt = self.engine.build_prompt(rag.system, rag.documents, rag.question)
        except ValueError as error:
            # The engine's message names the piece it refuses ("documents[0]: ...",
            # "question: ..."): the field it came from is the param, and the message keeps
            # only the rest.
            param, _, rest = str(error).partition(": ")
            fields = {"system": rag.system_field, "question": rag.question_field}
            if (param.startswith("documents") or param in fields) and rest:
                raise BadRequest(fields.get(param, param), rest) from None
            raise BadRequest(field, str(error)) from None
        max_tokens = rag.max_tokens or self.settings.default_max_tokens
        if prompt.num_tokens >= context:
            message = f"{prompt.num_tokens} prompt tokens reach the model context of {context}"
            raise BadRequest(field, message)
        if rag.max_tokens and prompt.num_tokens + max_tokens > context:
            message = (
                f"{prompt.num_tokens} prompt tokens + {max_tokens} exceed the model context "
                f"of {context}; ask for at most {context - prompt.num_tokens}"
            )
            raise BadRequest(rag.max_tokens_field, message)
        return prompt, min(max_tokens, context - prompt.num_tokens)

    async def _respond(self, request: web.Request, job: Job, rag: RagRequest):
        writer = ResponseWriter(rag, self.model_name)
        try:
            if rag.stream:
                return await self._stream(request, job, rag, writer)
            return await self._whole(job, rag, writer)
        finally:
            # No effect once finished; stops a job whose client left or timed out, and
            # gives a waiting one's queue place back at once.
            self.worker.cancel(job)

    async def _events(self, job: Job):
        """The job's events until Finished, or until the route marked its answer stopped (a
        stop sequence reached): that answer stands, whatever the compute thread reports
        for the tokens it decoded past it (an error, a deadline passed). TimeoutError past
        the deadline."""
        while True:
            remaining = job.deadline - time.perf_counter()
            async with asyncio.timeout(max(remaining, 0) + 1.0):
                event = await job.events.get()
            if isinstance(event, ComputeThreadEnded):  # queued or running when it ended
                raise _unavailable_error(str(event))
            if isinstance(event, Exception):
                message = f"the engine failed: {event}"
                raise HttpError(500, error_body(message, None, "server_error"))
            if isinstance(event, PrefillDone):
                self.metrics.ttft.labels(event.mode).observe(event.ttft_s)
            yield event
            if isinstance(event, Finished) or job.stopped.is_set():
                return

    async def _whole(self, job: Job, rag: RagRequest, writer: ResponseWriter):
        text = IncrementalText(self.engine.tokenizer.decode, rag.stop)
        prefill = finished = None
        try:
            async for event in self._events(job):
                if isinstance(event, PrefillDone):
                    prefill = event
                elif isinstance(event, int):
                    text.add(event)
                    if text.stopped:
                        job.stopped.set()
                else:
                    finished = event
        except TimeoutError:
            finished = Finished("timeout")
        text.end()
        num_tokens = _num_completion_tokens(text, finished)
        if text.stopped:
            finished = Finished("stop")
        if finished.reason in ("timeout", "cancelled"):
            raise _timeout_error(self.settings.request_timeout)
        self._count_completion_tokens(prefill, num_tokens)
        body = writer.whole(text.text, finished.reason, usage(prefill, num_tokens))
        return "ok", web.json_response(body)

    async def _stream(self, request: web.Request, job: Job, rag: RagRequest, writer):
        """The answer as SSE chunks. Every write must end by the job's deadline plus
        `WRITE_GRACE_S`: a client that stops reading fills the socket's buffers, and its
        write would otherwise hold this handler, its pending place (what admission and a
        drain count) and its unsent tokens until it reads or leaves. Past that the
        connection is aborted and the request counts as a timeout."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            outcome = await self._stream_answer(response, job, rag, writer)
            await _by_deadline(job, response.write(sse("[DONE]")))
            await _by_deadline(job, response.write_eof())
        except ClientStalled:
            log.info("a streaming client took no data for too long; closing its connection")
            if request.transport is not None:
                request.transport.abort()
            outcome = "timeout"
        return outcome, response

    async def _stream_answer(self, response, job: Job, rag: RagRequest, writer) -> str:
        """The answer's chunks, its last chunk (or an error event) and the usage; the
        outcome. `ClientStalled` when a write does not end by the deadline."""

        async def send(data: dict) -> None:
            await _by_deadline(job, response.write(sse(data)))

        text = IncrementalText(self.engine.tokenizer.decode, rag.stop)
        prefill, finished, is_first = None, None, True
        try:
            async for event in self._events(job):
                if isinstance(event, PrefillDone):
                    prefill = event
                elif isinstance(event, int):
                    if delta := text.add(event):
                        await send(writer.chunk(delta, first=is_first))
                        is_first = False
                    if text.stopped:
                        job.stopped.set()
                elif event.reason in ("timeout", "cancelled"):
                    raise TimeoutError
                else:
                    finished = event
            rest = text.rest()
            finish = "stop" if text.stopped else finished.reason
            await send(writer.chunk(rest, finish, first=is_first))
            if rag.include_usage:
                num_tokens = _num_completion_tokens(text, finished)
                await send(writer.usage_chunk(usage(prefill, num_tokens)))
        except TimeoutError:
            await send(_timeout_error(self.settings.request_timeout).body)
            return "timeout"
        except HttpError as error:
            await send(error.body)
            return _outcome_of(error.status)
        finally:
            self._count_completion_tokens(prefill, _num_completion_tokens(text, finished))
        return "ok"

    def _count_completion_tokens(self, prefill: PrefillDone | None, num_tokens: int) -> None:
        """Count an answer's `usage.completion_tokens` as it ends: the compute thread may
        have decoded more past a stop sequence, before the answer's `stopped` reached it."""
        if prefill is not None:
            self.metrics.completion_tokens.labels(prefill.mode).inc(num_tokens)


def _num_completion_tokens(text: IncrementalText, finished: Finished | None) -> int:
    """The answer's tokens (`usage.completion_tokens`), counted as vLLM counts them: an
    answer that ended at the end-of-sequence token counts that token too (vLLM's output
    token ids hold it), one cut at a stop sequence ends with the token that completed it.
    The compute thread's "stop" is the end-of-sequence token unless the route saw a stop
    sequence (the thread's `stopped`); `finished` None: no end reported (a stop sequence,
    or the answer cut short)."""
    at_eos = finished is not None and finished.reason == "stop" and not text.stopped
    return len(text.token_ids) + at_eos


class ClientStalled(Exception):
    """A streaming client did not take its answer by the request's deadline plus
    `WRITE_GRACE_S`."""


async def _by_deadline(job: Job, write: Awaitable[None]) -> None:
    """Await `write` until the job's deadline plus `WRITE_GRACE_S`; `ClientStalled` past it."""
    remaining = job.deadline + WRITE_GRACE_S - time.perf_counter()
    try:
        async with asyncio.timeout(max(remaining, 0.0)):
            await write
    except TimeoutError:
        raise ClientStalled from None


def _json(body: bytes):
    """The parsed body; BadRequest for anything the JSON parser refuses (invalid UTF-8,
    nesting deeper than the parser's recursion limit, ...)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        message = str(error) if isinstance(error, ValueError) else "nested too deeply"
        raise BadRequest(None, f"the body is not valid JSON ({message})") from None


def _check_expectation(expect: str) -> None:
    if expect.lower() != "100-continue":
        message = f"the Expect header {expect!r} is not supported; only 100-continue is"
        raise HttpError(417, error_body(message, None))


def _unavailable_error(message: str) -> HttpError:
    return HttpError(503, error_body(message, None, "unavailable"), {"Retry-After": "5"})


def _too_large_error() -> HttpError:
    message = f"the body is over the server's limit of {MAX_BODY_BYTES} bytes"
    return HttpError(413, error_body(message, None), close=True)


def _queue_full_error(full: QueueFull) -> HttpError:
    body = error_body(str(full), None, "rate_limit_error")
    return HttpError(429, body, {"Retry-After": str(full.retry_after_s)})


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
            f"model.dtype: the blend engine computes in float32, got {dtype}; set auto or float32"
        )
