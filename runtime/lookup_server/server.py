"""The lookup server: the segment index behind a small HTTP/1.1 keep-alive server.

1. One asyncio event loop (uvloop when installed) owns the `SegmentIndex`. Each
   connection's bytes are parsed inline in `data_received`; a complete request is
   answered right there, so a lookup never waits in a queue or on another task.
2. `POST /v1` carries the msgpack wire format (`wire.py`); `GET /healthz` (alive),
   `GET /ready` (serving lookups; 503 while draining after SIGTERM), `GET /metrics` (Prometheus text) and `GET /stats`
   (the same as the `stats` operation, as JSON) are for probes and people.
3. Requests over the size limits, malformed frames, unknown operations and versions get
   a clear error reply; a connection whose framing is broken is answered and closed.
   Nothing a client sends stops the server from serving the others.
4. A timer drops pods that stopped heartbeating, and moves the (acyclic, long-lived)
   index entries out of the cyclic garbage collector's reach (`gc.freeze`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import time
from dataclasses import dataclass, field

from holeblend_runtime.lookup_server import wire
from holeblend_runtime.lookup_server.index import IndexLimits, SegmentIndex
from holeblend_runtime.lookup_server.metrics import ServerMetrics

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 8192
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    503: "Service Unavailable",
}


@dataclass(frozen=True)
class ServerConfig:
    # Address to listen on.
    host: str = "127.0.0.1"
    # Port to listen on (0: any free port, see `LookupServer.port`).
    port: int = 8100
    # Index capacity and pod timeout.
    index: IndexLimits = field(default_factory=IndexLimits)
    # Request size limits.
    limits: wire.Limits = field(default_factory=wire.Limits)
    # Seconds between SIGTERM and exit, with /ready failing, so the Service stops routing
    # to this pod before it goes.
    drain_s: float = 3.0


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LookupServer:
    """Serves one `SegmentIndex`; `start` binds, `serve_forever` runs until `stop`."""

    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self.index = SegmentIndex(self.config.index)
        self.metrics = ServerMetrics(self.index)
        self._server: asyncio.AbstractServer | None = None
        self._stopped = asyncio.Event()
        self._sweeper: asyncio.Task | None = None
        self.is_draining = False

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.config.host, self.config.port, reuse_address=True
        )
        self._sweeper = asyncio.create_task(self._sweep_silent_pods())
        log.info("lookup server listening on %s:%d", self.config.host, self.port)

    async def serve_forever(self) -> None:
        await self._stopped.wait()
        assert self._server is not None
        self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()

    def stop(self) -> None:
        self._stopped.set()

    def drain(self) -> None:
        """Fail /ready now and stop after `drain_s`, still answering in between."""
        self.is_draining = True
        asyncio.get_running_loop().call_later(self.config.drain_s, self.stop)

    async def _sweep_silent_pods(self) -> None:
        period = max(self.config.index.pod_timeout_s / 4, 0.05)
        while True:
            await asyncio.sleep(period)
            for pod in self.index.drop_silent_pods():
                log.info("pod %s stopped heartbeating; its locations are dropped", pod)
            # Index entries are long-lived and hold no reference cycles (refcounting frees
            # them): keep them out of the cyclic collector, whose full passes over 300,000
            # entries took 166 ms here, a stall of every lookup.
            gc.freeze()

    # --- request handling (inline on the loop) ----------------------------------------

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        """(status, content type, body) for one request."""
        if path == wire.RPC_PATH:
            if method != "POST":
                raise _HttpError(405, f"{path} takes POST")
            return self._rpc(body)
        if method != "GET":
            raise _HttpError(405, f"{path} takes GET")
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/ready":
            if self.is_draining:
                return 503, "text/plain", b"draining: shutting down\n"
            return 200, "text/plain", b"ready\n"
        if path == "/metrics":
            return 200, self.metrics.content_type, self.metrics.render()
        if path == "/stats":
            return 200, "application/json", json.dumps(self.index.stats()).encode()
        raise _HttpError(404, f"no such path {path}; the API is POST {wire.RPC_PATH}")

    def _rpc(self, body: bytes) -> tuple[int, str, bytes]:
        started = time.perf_counter()
        try:
            op, message = wire.decode_request(body, self.config.limits)
            reply = getattr(self, f"_op_{op}")(message)
        except wire.WireError as error:
            self.metrics.count_error(error.code)
            return error.http_status, wire.CONTENT_TYPE, wire.error_reply(error)
        self.metrics.observe(op, time.perf_counter() - started)
        return 200, wire.CONTENT_TYPE, wire.encode({"ok": True, **reply})

    def _op_lookup(self, message: dict) -> dict:
        limits = self.config.limits
        keys = wire.keys_field(message, limits)
        model = wire.name_field(message, "model", limits, optional=True)
        return {"hits": self.index.lookup(keys, model)}

    def _op_admit(self, message: dict) -> dict:
        pod = wire.name_field(message, "pod", self.config.limits)
        entries = wire.entries_field(message, self.config.limits)
        return {"admitted": self.index.admit(pod, entries)}

    def _op_evict(self, message: dict) -> dict:
        pod = wire.name_field(message, "pod", self.config.limits)
        keys = wire.keys_field(message, self.config.limits)
        shared = wire.flag_field(message, "shared")
        return {"evicted": self.index.evict(pod, keys, shared)}

    def _op_heartbeat(self, message: dict) -> dict:
        pod = wire.name_field(message, "pod", self.config.limits)
        return {"resync": self.index.heartbeat(pod)}

    def _op_resync(self, message: dict) -> dict:
        pod = wire.name_field(message, "pod", self.config.limits)
        entries = wire.entries_field(message, self.config.limits)
        reset = wire.flag_field(message, "reset")
        return {"admitted": self.index.resync(pod, entries, reset)}

    def _op_stats(self, message: dict) -> dict:
        return {"stats": self.index.stats()}


class _Connection(asyncio.Protocol):
    """HTTP/1.1 framing for one client connection: Content-Length bodies, keep-alive."""

    def __init__(self, server: LookupServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and not self.transport.is_closing():
            if not self._answer_one():
                return

    def _answer_one(self) -> bool:
        """Answer one complete request from the buffer; False when more bytes are needed."""
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            if len(self.buffer) > MAX_HEADER_BYTES:
                self._fail(_HttpError(413, f"request head over {MAX_HEADER_BYTES} bytes"))
            return False
        try:
            method, path, length, keep_alive = _parse_head(bytes(self.buffer[:head_end]))
            if length > self.server.config.limits.max_body_bytes:
                raise _HttpError(
                    413,
                    f"body of {length} bytes exceeds {self.server.config.limits.max_body_bytes}",
                )
        except _HttpError as error:
            self._fail(error)
            return False
        end = head_end + 4 + length
        if len(self.buffer) < end:
            return False
        body = bytes(self.buffer[head_end + 4 : end])
        del self.buffer[:end]
        self._respond(method, path, body, keep_alive)
        return True

    def _respond(self, method: str, path: str, body: bytes, keep_alive: bool) -> None:
        try:
            status, content_type, payload = self.server.handle(method, path, body)
        except _HttpError as error:
            status, content_type, payload = error.status, "text/plain", f"{error}\n".encode()
        except Exception:  # a bug must cost one reply, never the server
            log.exception("lookup server: internal error on %s %s", method, path)
            status, content_type, payload = 500, "text/plain", b"internal error\n"
        self._write(status, content_type, payload, keep_alive)

    def _fail(self, error: _HttpError) -> None:
        """Broken framing: answer, then close, since the stream cannot be resynchronised."""
        self.server.metrics.count_error("bad_http")
        self._write(error.status, "text/plain", f"{error}\n".encode(), keep_alive=False)

    def _write(self, status: int, content_type: str, payload: bytes, keep_alive: bool) -> None:
        assert self.transport is not None
        close = "" if keep_alive else "Connection: close\r\n"
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n{close}\r\n"
        )
        self.transport.write(head.encode() + payload)
        if not keep_alive:
            self.transport.close()


def _parse_head(head: bytes) -> tuple[str, str, int, bool]:
    """(method, path, content length, keep-alive) of a request head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise _HttpError(400, "expected a request line 'METHOD PATH HTTP/1.1'")
    length, keep_alive = 0, parts[2] == b"HTTP/1.1"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise _HttpError(400, "malformed header line")
        name = name.strip().lower()
        if name == b"content-length":
            length = _content_length(value)
        elif name == b"connection":
            keep_alive = value.strip().lower() != b"close"
        elif name == b"transfer-encoding":
            raise _HttpError(400, "chunked bodies are not supported; send Content-Length")
    return parts[0].decode("latin-1"), parts[1].decode("latin-1").split("?")[0], length, keep_alive


def _content_length(value: bytes) -> int:
    value = value.strip()
    if not value.isdigit() or len(value) > 12:
        raise _HttpError(400, "Content-Length: expected a non-negative integer")
    return int(value)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when it is installed (about twice the requests per second), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT."""
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    server = LookupServer(config)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.drain)  # Linux pods: always available
    try:
        loop.run_until_complete(server.start())
        print(f"holeblend-lookup: serving on {config.host}:{server.port}", flush=True)
        loop.run_until_complete(server.serve_forever())
    finally:
        loop.close()
