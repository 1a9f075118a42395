"""The lookup server: the segment index behind a small HTTP/1.1 keep-alive server.

1. One asyncio event loop (uvloop when installed) owns the `SegmentIndex`. Each
   connection's bytes are parsed inline in `data_received`; a complete request is
   answered right there, so a lookup never waits in a queue or on another task.
2. `POST /v1` carries the msgpack wire format (`wire.py`); `GET /healthz` (alive),
   `GET /ready` (serving lookups; 503 while draining after SIGTERM), `GET /metrics` (Prometheus text) and `GET /stats`
   (the same as the `stats` operation, as JSON) are for probes and people.
3. Requests over the size limits, malformed frames, unknown operations and versions get
   a clear error reply; a connection whose framing is broken is answered and closed.
   Nothing a client sends stops the server from serving the others:
   - per connection, a request head must be complete `header_timeout_s` after its first
     byte, its body `body_timeout_s` after the head, a kept-alive connection with no
     request in progress is closed after `idle_timeout_s`, and one that does not read its
     replies is dropped after `write_timeout_s` (one `call_later` timer per connection);
   - request bytes buffered across all connections stay within `max_buffer_bytes`: a
     request's announced body is reserved when its head arrives, and one that does not
     fit is answered 503 and its connection closed. Large bodies, requests still waiting
     for their bytes or their turn, and replies left unread (every byte the kernel does
     not hold) may use only seven eighths of it, so lookups and heartbeats, which arrive
     whole, always find room; a connection whose unread replies do not fit there is
     aborted;
   - one connection gets at most `requests_per_turn` answers per event-loop turn, and
     none while its replies pile up unread (asyncio write flow control), so a client
     pipelining thousands of requests cannot delay the others' lookups;
   - at most `max_connections` are open at once: one more is answered 503 and closed, so
     a client that opens thousands of idle connections cannot take the process's file
     descriptors (the kept-alive connections of the others stay served).
4. A timer drops pods that stopped heartbeating, and moves the (acyclic, long-lived)
   index entries out of the cyclic garbage collector's reach (`gc.freeze`), after
   collecting the garbage made since the last time (`LookupServer.freeze_long_lived`).
5. Client-controlled text (pod names, request paths) is logged escaped (`log_text`), so a
   newline in it cannot forge a log line.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import resource
import signal
import time
import traceback
from dataclasses import dataclass, field

from holeblend_contract.dual_stack import EVERY_ADDRESS, every_address_socket
from holeblend_runtime.lookup_server import wire
from holeblend_runtime.lookup_server.calibration import CalibrationLimits, CalibrationPairs
from holeblend_runtime.lookup_server.index import IndexLimits, SegmentIndex
from holeblend_runtime.lookup_server.metrics import ServerMetrics

log = logging.getLogger(__name__)

# Bytes of one request head at most, its final blank line included.
MAX_HEADER_BYTES = 8192
# Replies queued for one client (beyond what the kernel holds) before the server stops
# reading and answering it until it has read them all. Queued replies count against the
# memory budget from their first byte, below this mark too.
WRITE_HIGH_WATER = 64 << 10
# Requests with bodies larger than this may not take the last eighth of the memory budget,
# so a flood of large half-sent admits cannot refuse the small lookups and heartbeats.
SMALL_BODY_BYTES = 64 << 10
# Seconds a connection closed after an error reply is still read (and the bytes dropped),
# so the client sees the reply rather than a reset; then it is aborted.
LINGER_S = 2.0
# File descriptors the process needs besides its client connections: the listener, the
# event loop's, the standard streams, and room for a few connections closing.
SPARE_FDS = 64
# Objects frozen since the last full collection, as a share of those it kept, that call
# for the next one: the rule CPython uses for its own full passes.
FULL_COLLECTION_GROWTH = 0.25
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(frozen=True)
class ServerConfig:
    # Address to listen on; "::" is every address, IPv6 and IPv4 (`every_address_socket`).
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
    # Seconds from a request's first byte until its head (request line and headers) must
    # be complete; then the client gets 408 and the connection is closed.
    header_timeout_s: float = 10.0
    # Seconds from the end of a request's head until its announced body must be complete.
    body_timeout_s: float = 30.0
    # Seconds a kept-alive connection with no request in progress stays open. Engines send
    # a heartbeat every 2 s on one connection and reconnect transparently on the other.
    idle_timeout_s: float = 60.0
    # Seconds a client may leave its replies unread (over the write high-water mark).
    write_timeout_s: float = 30.0
    # Request bytes buffered across all connections at most (announced bodies included).
    max_buffer_bytes: int = 64 << 20
    # Requests answered on one connection per event-loop turn before others get theirs.
    requests_per_turn: int = 16
    # Client connections open at once; one more is answered 503 and closed. An engine
    # process holds three (lookups, announcements, calibration pairs).
    max_connections: int = 4096
    # The shared calibration pairs of the quality proxies (`calibration.py`).
    calibration: CalibrationLimits = field(default_factory=CalibrationLimits)

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not 0 <= self.drain_s < math.inf:
            # NaN makes SIGTERM's handler fail (the server never exits), inf never exits.
            raise ValueError(f"drain_s: must be >= 0 and finite, got {self.drain_s}")
        largest = self.limits.max_body_bytes + MAX_HEADER_BYTES
        if self.large_body_budget < largest:
            raise ValueError(
                f"max_buffer_bytes: must hold one largest request in its first seven eighths, "
                f"got {self.max_buffer_bytes}: a max_body_bytes of {self.limits.max_body_bytes} "
                f"(and a {MAX_HEADER_BYTES}-byte head) needs {-(-largest * 8 // 7)}; set "
                "max_buffer_bytes to that or lower max_body_bytes"
            )
        if self.requests_per_turn < 1:
            raise ValueError(f"requests_per_turn: must be >= 1, got {self.requests_per_turn}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections: must be >= 1, got {self.max_connections}")

    @property
    def large_body_budget(self) -> int:
        """The share of `max_buffer_bytes` requests with large bodies may hold: seven
        eighths, so lookups and heartbeats always find room."""
        return self.max_buffer_bytes - self.max_buffer_bytes // 8


def log_text(value: object) -> str:
    """`value` quoted, with newlines and other control characters escaped: safe in a log line."""
    return ascii(str(value))


class _HttpError(Exception):
    """An error reply: `status`, the message as its text, and `code`, its label in
    `holeblend_lookup_errors_total` (a fixed word, never client text such as the path, so
    the metric's series stay few)."""

    def __init__(self, status: int, message: str, code: str = "bad_http") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class LookupServer:
    """Serves one `SegmentIndex`; `start` binds, `serve_forever` runs until `stop`."""

    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self.index = SegmentIndex(self.config.index)
        self.calibration = CalibrationPairs(self.config.calibration)
        self.metrics = ServerMetrics(self.stats)
        self._server: asyncio.AbstractServer | None = None
        self._stopped = asyncio.Event()
        self._sweeper: asyncio.Task | None = None
        self.is_draining = False
        # Open connections (closed at shutdown) and the request bytes they hold.
        self.connections: set[_Connection] = set()
        self.buffered_bytes = 0
        # Objects the last full collection kept (None: none ran), and objects frozen since.
        self._num_frozen_at_full: int | None = None
        self._num_frozen_since_full = 0

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        host, port = self.config.host, self.config.port
        if host == EVERY_ADDRESS:
            sock = every_address_socket(port)
            self._server = await loop.create_server(lambda: _Connection(self, loop), sock=sock)
        else:
            self._server = await loop.create_server(
                lambda: _Connection(self, loop), host, port, reuse_address=True
            )
        self._sweeper = asyncio.create_task(self._sweep_silent_pods())
        log.info("lookup server listening on %s:%d", self.config.host, self.port)

    async def serve_forever(self) -> None:
        await self._stopped.wait()
        assert self._server is not None
        self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        # Stalled clients (half-sent requests, unread replies) must not hold up the exit.
        for connection in list(self.connections):
            connection.abort()

    def stop(self) -> None:
        self._stopped.set()

    def drain(self) -> None:
        """Fail /ready now and stop after `drain_s`, still answering in between."""
        if self.is_draining:
            return
        self.is_draining = True
        asyncio.get_running_loop().call_later(self.config.drain_s, self.stop)

    async def _sweep_silent_pods(self) -> None:
        period = max(self.config.index.pod_timeout_s / 4, 0.05)
        while True:
            await asyncio.sleep(period)
            self.sweep_silent_pods()

    def sweep_silent_pods(self) -> None:
        for pod in self.index.drop_silent_pods():
            log.info("pod %s stopped heartbeating; its locations are dropped", log_text(pod))
        self.freeze_long_lived()

    def freeze_long_lived(self) -> None:
        """Keep the index entries out of the cyclic collector, whose full passes over
        300,000 entries took 166 ms here, a stall of every lookup, without keeping garbage.

        Index entries are long-lived and hold no reference cycles (refcounting frees them),
        but `gc.freeze` moves every object the collector tracks out of its reach for good:
        1. Collect first. The pass walks only what the last freeze left out (the objects
           made since), and frees the cyclic garbage among them (exceptions and their
           frames, finished futures) instead of freezing it.
        2. An object frozen alive may become cyclic garbage later (asyncio's own transports
           hold a cycle: without uvloop, every connection open across a sweep does).
           Once the objects frozen since the last full collection outnumber
           FULL_COLLECTION_GROWTH of those it kept, the next sweep unfreezes all before
           collecting: one stall per such growth of the heap, never one per sweep.
        """
        at_full = self._num_frozen_at_full
        if at_full is not None and self._num_frozen_since_full > FULL_COLLECTION_GROWTH * at_full:
            gc.unfreeze()
            self._num_frozen_at_full = None
        gc.collect()
        num_new = len(gc.get_objects(generation=2))  # after a collection, all unfrozen ones
        gc.freeze()
        if self._num_frozen_at_full is None:  # nothing was frozen: that pass was a full one
            self._num_frozen_at_full, self._num_frozen_since_full = num_new, 0
        else:
            self._num_frozen_since_full += num_new

    # --- request handling (inline on the loop) ----------------------------------------

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        """(status, content type, body) for one request."""
        if path == wire.RPC_PATH:
            if method != "POST":
                raise _HttpError(405, f"{path} takes POST", "method_not_allowed")
            return self._rpc(body)
        if method != "GET":
            raise _HttpError(405, f"{path} takes GET", "method_not_allowed")
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/ready":
            if self.is_draining:
                return 503, "text/plain", b"draining: shutting down\n"
            return 200, "text/plain", b"ready\n"
        if path == "/metrics":
            return 200, self.metrics.content_type, self.metrics.render()
        if path == "/stats":
            return 200, "application/json", json.dumps(self.stats()).encode()
        raise _HttpError(
            404, f"no such path {path!a}; the API is POST {wire.RPC_PATH}", "not_found"
        )

    def _rpc(self, body: bytes) -> tuple[int, str, bytes]:
        started = time.perf_counter()
        try:
            op, message = wire.decode_request(body, self.config.limits)
            reply = getattr(self, f"_op_{op}")(message)
        except wire.WireError as error:
            self.metrics.count_error(error.code)
            return error.http_status, wire.CONTENT_TYPE, wire.error_reply(error)
        # Encoding the reply is part of answering (most of it for a reply of many hits).
        payload = wire.encode({"ok": True, **reply})
        self.metrics.observe(op, time.perf_counter() - started)
        return 200, wire.CONTENT_TYPE, payload

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
        return {"stats": self.stats()}

    def stats(self) -> dict:
        """The index's counters and sizes and the shared calibration's."""
        return {**self.index.stats(), **self.calibration.stats()}

    def _op_pairs_add(self, message: dict) -> dict:
        limits = self.config.limits
        scope = wire.name_field(message, "scope", limits)
        pod = wire.name_field(message, "pod", limits)
        pairs = wire.pairs_field(message, limits)
        ids = wire.pair_ids_field(message, len(pairs))
        return {"added": self.calibration.add(scope, pod, pairs, ids)}

    def _op_pairs_get(self, message: dict) -> dict:
        limits = self.config.limits
        scope = wire.name_field(message, "scope", limits)
        pod = wire.name_field(message, "pod", limits)
        after = wire.count_field(message, "after")
        pairs, ids, last, more = self.calibration.read(scope, pod, after)
        epoch = self.calibration.epoch
        return {"pairs": pairs, "ids": ids, "last": last, "more": more, "epoch": epoch}


class _Connection(asyncio.Protocol):
    """HTTP/1.1 framing for one client connection: Content-Length bodies, keep-alive.

    One timer per connection enforces whichever deadline applies now (idle, head, body,
    unread replies, lingering close). Moving a deadline later only records it; the timer,
    when it fires early, re-arms itself for the recorded deadline. So the common request,
    complete in one read, costs no timer call.
    """

    def __init__(self, server: LookupServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.config = server.config
        self.loop = loop
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        # The parsed head of the request whose body is arriving:
        # (method, path, keep-alive, body start, frame end).
        self.head: tuple[str, str, bool, int, int] | None = None
        # Bytes of the server's memory budget this connection holds (requests, replies).
        self.charged = 0
        self.write_charged = 0
        self.reading_paused = False
        # Replies wait beyond what the kernel holds (charged against the budget); over
        # WRITE_HIGH_WATER, writing_paused: the connection is not read or answered meanwhile.
        self.replies_queued = False
        self.writing_paused = False
        self.turn_scheduled = False
        self.saw_eof = False
        # After an error reply: the bytes still arriving are dropped until the client closes.
        self.discarding = False
        # Closing (or closed, or discarding): no more requests are answered.
        self.closing = False
        # Deadlines (loop time) of the request in progress, set once per request.
        self.head_deadline: float | None = None
        self.body_deadline: float | None = None
        self.deadline = 0.0
        self.deadline_reason = "idle"
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0

    # --- asyncio callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.server.connections) >= self.config.max_connections:
            self._refuse()
            return
        # pause_writing as soon as a reply is queued, resume_writing once all are written:
        # the budget's charge for queued replies follows them from their first byte.
        self.transport.set_write_buffer_limits(0, 0)
        self.server.connections.add(self)
        self._arm(self.loop.time() + self.config.idle_timeout_s, "idle")

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._set_charge(0)
        self._set_write_charge(0)
        self.buffer = bytearray()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.transport = None
        self.closing = True

    def data_received(self, data: bytes) -> None:
        if self.discarding:
            return
        buffer = self.buffer
        buffer += data
        # The charge covers the buffer, or the whole frame once its head is parsed.
        if len(buffer) > self.charged and not self._charge(
            len(buffer), self.config.max_buffer_bytes
        ):
            return
        self._serve_turn()

    def eof_received(self) -> bool:
        self.saw_eof = True
        if self.closing or not self.buffer:
            if not self.closing:
                # The transport closes once the replies are written: a client that never
                # reads them must not hold the connection (and its replies) for good.
                self.closing = True
                self._arm(self.loop.time() + LINGER_S, "linger")
            return False  # close
        # Half-closed after pipelining: answer what is buffered, then close.
        self._schedule_turn()
        return True

    def pause_writing(self) -> None:
        """A reply is queued: `_write`, which queued it, charges it."""
        self.replies_queued = True

    def resume_writing(self) -> None:
        """Every queued reply is written: its charge goes, and a connection held back for
        its unread replies is read and answered again."""
        self.replies_queued = False
        self._set_write_charge(0)
        if self.writing_paused:
            self.writing_paused = False
            if not self.discarding:
                self._schedule_turn()

    def _refuse(self) -> None:
        """Over `max_connections`: answer 503 and close at once, without the linger of
        `_close_after_reply` (that would hold the descriptor the limit is there to save).
        The client has usually sent nothing yet, so it reads the reply."""
        assert self.transport is not None
        self.server.metrics.count_error("connection_limit")
        self.closing = self.discarding = True
        limit = self.config.max_connections
        message = f"server busy: {limit} connections are open, the most it takes; retry shortly\n"
        self._write(503, "text/plain", message.encode(), False, "Retry-After: 1\r\n")
        self.transport.close()

    # --- serving ------------------------------------------------------------------------

    def _serve_turn(self) -> None:
        """Answer up to `requests_per_turn` buffered requests, then let others have a turn."""
        for _ in range(self.config.requests_per_turn):
            if self.closing:
                return
            if self.writing_paused:
                self._release_answered()  # resume_writing schedules the next turn
                return
            if not self._answer_one():
                break
        else:
            # More may be buffered: answer it after the other connections had their turn.
            self._release_answered()
            if self._refuse_over_share():
                return
            self._schedule_turn()
            if not (self.closing or self.writing_paused):
                # A connection that closes keeps its linger deadline, and one whose replies
                # pile up unread (the last answer may have paused writing) its write deadline.
                self._arm(self.loop.time() + self.config.idle_timeout_s, "idle")
            return
        if self.closing:
            return
        head = self.head
        self._release_answered()
        if self.saw_eof:
            self._close()  # the client is done sending and no complete request is left
            return
        if self._refuse_over_share():
            return
        if self.reading_paused and not self.writing_paused:
            self.reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        now = self.loop.time()
        if head is not None:
            if self.body_deadline is None:
                self.body_deadline = now + self.config.body_timeout_s
            self._arm(self.body_deadline, "body")
        elif self.buffer:
            if self.head_deadline is None:
                self.head_deadline = now + self.config.header_timeout_s
            self._arm(self.head_deadline, "header")
        else:
            deadline = now + self.config.idle_timeout_s
            if self.timer is not None and deadline >= self.timer_at:
                self.deadline, self.deadline_reason = deadline, "idle"  # _arm's common case
            else:
                self._arm(deadline, "idle")

    def _schedule_turn(self) -> None:
        self._pause_reading()
        if not self.turn_scheduled:
            self.turn_scheduled = True
            self.loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self.turn_scheduled = False
        self._serve_turn()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            if not self.closing:
                self.transport.pause_reading()
            self.reading_paused = True

    def _answer_one(self) -> bool:
        """Answer one complete request from the buffer; False when more bytes are needed."""
        buffer = self.buffer
        head = self.head
        if head is None:
            head_end = buffer.find(b"\r\n\r\n", 0, MAX_HEADER_BYTES)
            try:
                if head_end < 0:
                    _check_partial_head(buffer)
                    return False
                method, path, length, keep_alive = _parse_head(bytes(buffer[:head_end]))
                limit = self.config.limits.max_body_bytes
                if length > limit:
                    raise _HttpError(413, f"body of {length} bytes exceeds {limit}")
            except _HttpError as error:
                self._fail(error)
                return False
            end = head_end + 4 + length
            if end > self.charged:
                config = self.config
                large = length > SMALL_BODY_BYTES
                budget = config.large_body_budget if large else config.max_buffer_bytes
                if not self._charge(max(end, len(buffer)), budget):
                    return False
            head = self.head = (method, path, keep_alive, head_end + 4, end)
        method, path, keep_alive, start, end = head
        if len(buffer) < end:
            return False
        body = bytes(buffer[start:end]) if end - start < 4096 else _copy(buffer, start, end)
        del buffer[:end]
        self.head = None
        self.head_deadline = self.body_deadline = None
        self._respond(method, path, body, keep_alive)
        return True

    def _respond(self, method: str, path: str, body: bytes, keep_alive: bool) -> None:
        try:
            status, content_type, payload = self.server.handle(method, path, body)
        except _HttpError as error:
            self.server.metrics.count_error(error.code)
            status, content_type, payload = error.status, "text/plain", f"{error}\n".encode()
        except Exception as error:  # a bug must cost one reply, never the server
            self.server.metrics.count_error("internal")
            # The request line and the error text are the client's: escaped, one line each.
            log.error(
                "lookup server: internal error on %s %s: %s\n%s",
                log_text(method),
                log_text(path),
                log_text(repr(error)),
                "".join(traceback.format_tb(error.__traceback__)).rstrip(),
            )
            status, content_type, payload = 500, "text/plain", b"internal error\n"
        self._write(status, content_type, payload, keep_alive)
        if not keep_alive:
            self._close()

    def _fail(self, error: _HttpError, extra_headers: str = "") -> None:
        """Broken framing, a timeout or no memory: answer, then close (after a linger)."""
        self.server.metrics.count_error(error.code)
        self._write(error.status, "text/plain", f"{error}\n".encode(), False, extra_headers)
        self._close_after_reply()

    def _write(
        self,
        status: int,
        content_type: str,
        payload: bytes,
        keep_alive: bool,
        extra_headers: str = "",
    ) -> None:
        assert self.transport is not None
        close = "" if keep_alive else "Connection: close\r\n"
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n"
            f"{close}{extra_headers}\r\n"
        )
        self.transport.write(head.encode() + payload)
        if self.replies_queued:
            self._charge_write(self.transport.get_write_buffer_size())

    # --- memory budget ------------------------------------------------------------------

    def _charge(self, needed: int, budget: int) -> bool:
        """Hold `needed` bytes of the budget; False (503 sent) when that would exceed `budget`."""
        server = self.server
        in_use = server.buffered_bytes - self.charged
        if in_use + needed <= budget:
            server.buffered_bytes = in_use + needed
            self.charged = needed
            return True
        self._refuse_over_budget(needed, in_use, budget)
        return False

    def _refuse_over_share(self) -> bool:
        """Refuse (503) a connection that holds request bytes between turns while the
        budget in use is past its seven-eighths share; True when refused.

        Waiting, for the rest of a request or for its turn to answer pipelined ones, the
        connection would hold part of the budget's last eighth: that is room for requests
        that arrive whole, answered in the read that brings them.
        """
        if not (self.charged and self.server.buffered_bytes > self.config.large_body_budget):
            return False
        in_use = self.server.buffered_bytes - self.charged
        self._refuse_over_budget(self.charged, in_use, self.config.large_body_budget)
        return True

    def _refuse_over_budget(self, needed: int, in_use: int, budget: int) -> None:
        limit = self.config.max_buffer_bytes
        share = "" if budget == limit else f", and requests not yet answered may hold only {budget}"
        self._fail(
            _HttpError(
                503,
                f"server busy: this request needs {needed} bytes of buffer and {in_use} of the "
                f"server's {limit}-byte request memory budget (--max-buffer-bytes) are in "
                f"use{share}; retry shortly",
                code="memory_budget",
            ),
            "Retry-After: 1\r\n",
        )

    def _set_charge(self, num_bytes: int) -> None:
        self.server.buffered_bytes += num_bytes - self.charged
        self.charged = num_bytes

    def _charge_write(self, num_bytes: int) -> None:
        """Charge the `num_bytes` of replies queued for this client (the kernel's buffers
        hold no more); past WRITE_HIGH_WATER it is not read or answered until it has read
        them all, and is dropped after `write_timeout_s`.

        Queued replies, small ones too, count: thousands of connections that never read
        would otherwise hold up to WRITE_HIGH_WATER each outside the budget. Like large
        bodies they may not take the last eighth of it, so clients that never read cannot
        lock the lookups and heartbeats of the others out: the client that hits the limit
        loses its connection and its unsent replies at once (`write_budget`) instead of
        holding them for the idle or write timeout.
        """
        in_use = self.server.buffered_bytes - self.write_charged
        if in_use + num_bytes > self.config.large_body_budget:
            self.server.metrics.count_error("write_budget")
            self.abort()
            return
        self._set_write_charge(num_bytes)
        if num_bytes > WRITE_HIGH_WATER and not self.writing_paused:
            self.writing_paused = True
            self._pause_reading()
            self._arm(self.loop.time() + self.config.write_timeout_s, "write")

    def _set_write_charge(self, num_bytes: int) -> None:
        """Queued replies count against the budget until they are written."""
        self.server.buffered_bytes += num_bytes - self.write_charged
        self.write_charged = num_bytes

    # --- deadlines and closing ------------------------------------------------------------

    def _arm(self, deadline: float, reason: str) -> None:
        self.deadline, self.deadline_reason = deadline, reason
        if self.timer is None or deadline < self.timer_at:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(deadline, self._on_timer)
            self.timer_at = deadline

    def _on_timer(self) -> None:
        self.timer = None
        if self.transport is None:
            return
        if self.loop.time() < self.deadline:
            self._arm(self.deadline, self.deadline_reason)  # moved later meanwhile
            return
        reason = self.deadline_reason
        if reason == "idle":
            self._close()
        elif reason in ("header", "body"):
            what, seconds = (
                ("request head", self.config.header_timeout_s)
                if reason == "header"
                else ("request body", self.config.body_timeout_s)
            )
            self._fail(
                _HttpError(408, f"{what} not complete within {seconds:g} s", f"{reason}_timeout")
            )
        else:  # "write": replies unread for write_timeout_s; "linger": closing took too long
            if reason == "write":
                self.server.metrics.count_error("write_timeout")
            self.abort()

    def _close(self) -> None:
        """Close once the replies are written; abort if that takes longer than LINGER_S."""
        assert self.transport is not None
        self._release()
        self.closing = True
        if not self.transport.is_closing():  # else aborted, or closing after the client's EOF
            self.transport.close()
        # Either way the replies must be written within LINGER_S: a closing transport whose
        # client reads nothing would otherwise hold the connection for good.
        self._arm(self.loop.time() + LINGER_S, "linger")

    def _close_after_reply(self) -> None:
        """After an error reply: stop sending, drop what still arrives, then close.

        Closing at once with unread bytes in the socket would send the client a reset,
        which can destroy the reply before the client reads it.
        """
        assert self.transport is not None
        self._release()
        self.discarding = self.closing = True
        if self.transport.is_closing():
            return  # aborted meanwhile (unread replies over their budget)
        if not self.transport.can_write_eof():
            self._close()
            return
        self.transport.write_eof()
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        self._arm(self.loop.time() + LINGER_S, "linger")

    def _release_answered(self) -> None:
        """Release what the answered requests held: the charge covers what is still buffered
        (or the whole frame of the request whose head is parsed)."""
        head = self.head
        self._set_charge(head[4] if head is not None else len(self.buffer))

    def _release(self) -> None:
        self.buffer = bytearray()
        self.head = None
        self._set_charge(0)

    def abort(self) -> None:
        if self.transport is not None:
            self._release()
            self.closing = True
            self.transport.abort()


def _copy(buffer: bytearray, start: int, end: int) -> bytes:
    """buffer[start:end] as bytes in one copy (slicing the bytearray first copies twice)."""
    with memoryview(buffer) as view:
        return bytes(view[start:end])


def _check_partial_head(buffer: bytearray) -> None:
    """Errors an incomplete head already shows: too long, or bare CR/LF line endings."""
    if len(buffer) >= MAX_HEADER_BYTES:
        raise _HttpError(413, f"request head over {MAX_HEADER_BYTES} bytes", "bad_http")
    # A CR at the very end may be the start of a CRLF still on its way.
    _check_line_endings(bytes(buffer[:-1] if buffer.endswith(b"\r") else buffer))


def _check_line_endings(head: bytes, num_crlf: int | None = None) -> None:
    if num_crlf is None:
        num_crlf = head.count(b"\r\n")
    if head.count(b"\n") != num_crlf or head.count(b"\r") != num_crlf:
        raise _HttpError(400, "request head lines must end with CRLF (\\r\\n), not a bare LF or CR")


def _parse_head(head: bytes) -> tuple[str, str, int, bool]:
    """(method, path, content length, keep-alive) of a request head."""
    lines = head.split(b"\r\n")
    _check_line_endings(head, len(lines) - 1)
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise _HttpError(400, "expected a request line 'METHOD PATH HTTP/1.1'")
    length, keep_alive = None, parts[2] == b"HTTP/1.1"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise _HttpError(400, "malformed header line")
        name = name.strip().lower()
        if name == b"content-length":
            value_length = _content_length(value)
            if length is not None and value_length != length:
                raise _HttpError(400, "Content-Length: repeated with different values")
            length = value_length
        elif name == b"connection":
            keep_alive = value.strip().lower() != b"close"
        elif name == b"transfer-encoding":
            raise _HttpError(400, "chunked bodies are not supported; send Content-Length")
    method, path = parts[0].decode("latin-1"), parts[1].decode("latin-1").split("?")[0]
    return method, path, length or 0, keep_alive


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


def fit_open_file_limit(max_connections: int) -> None:
    """Raise the soft limit on open files to hold `max_connections`, up to the hard limit.

    A container's soft limit may be 1024, below the default `max_connections`: the
    process would run out of descriptors, and stop accepting every client, before the
    limit refused one. Warns when the hard limit is too low as well.
    """
    needed = max_connections + SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        log.warning(
            "open-file limit %d holds fewer than max_connections %d (and %d spare): clients "
            "may be refused by the kernel before the server refuses them",
            hard,
            max_connections,
            SPARE_FDS,
        )
        needed = hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def run(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT."""
    fit_open_file_limit(config.max_connections)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    server = LookupServer(config)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.drain)  # Linux pods: always available
    try:
        try:
            loop.run_until_complete(server.start())
        except OSError as error:  # the port is taken, or the host no address of this machine
            raise SystemExit(
                f"holeblend-lookup: cannot listen on --host {config.host} --port {config.port}: "
                f"{error}; choose a free --port, and a --host this machine has (:: or 0.0.0.0 "
                "for every address)"
            ) from None
        print(f"holeblend-lookup: serving on {config.host}:{server.port}", flush=True)
        loop.run_until_complete(server.serve_forever())
    finally:
        loop.close()
