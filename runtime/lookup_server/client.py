"""The runtime's client of the lookup server: fast, bounded, and never the reason a request fails.

1. `LookupConnection` speaks the wire format (`lookup_server/wire.py`) over one
   keep-alive HTTP/1.1 socket with a millisecond timeout; a failed exchange closes it.
2. `LookupClient` wraps calls in a budget: `timeout_ms` per attempt, at most `retries`
   more attempts, the wait for the connection (threads share it) included, and a
   circuit breaker that stops trying for `breaker_open_s` after `breaker_failures`
   consecutive failures. Only failures that say the server cannot
   serve count toward it (no connection, no reply in time, garbage or a reply over
   `max_reply_bytes`, a 502/503/504), not a call whose own deadline passed before it sent
   a byte; an error the server answered for one request (`bad_request`, `too_large`, ...) is
   that request's answer, and the server is up. A failed or skipped `lookup` answers
   "all miss" and counts it; serving goes on from the local tier and compute.
3. `Announcer` (a daemon thread) sends admits and evicts in batches off the request
   path, heartbeats, and re-announces everything the pod holds when the server asks
   (it restarted) and every `resync_s`. Admits are queued only after the segment is
   stored, so a location the server hands out was loadable when it was announced.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from holeblend_contract.blend_settings import parse_lookup_url
from holeblend_runtime.kv.circuit_breaker import CircuitBreaker
from holeblend_runtime.lookup_server import wire

log = logging.getLogger(__name__)

# Error codes that speak of the server rather than of the request: garbage on the socket
# (`bad_reply`, retried) and a plain-text 502, 503 or 504 (`unavailable`: the server's
# request memory is full, or a proxy in front of it has no server). They count toward the
# circuit breaker like a dead server; every other error reply answers the one request, and
# the server that sent it is up.
SERVER_ERRORS = frozenset({"bad_reply", "unavailable"})
# HTTP statuses of a plain-text reply coded `unavailable`.
UNAVAILABLE_STATUSES = (502, 503, 504)
# Codes of the refusals logged once per operation each. Any other code a server sends is
# logged once per operation as one (`other`): a server of another build, or a broken one
# with a new code in every reply, must not add a log line and a remembered code per call.
LOGGED_REFUSAL_CODES = frozenset({*wire.ERROR_CODES, "http_error"})
# Bytes of a reply's head at most, its final blank line included: the server's is under
# 200 bytes, and this is what it takes of a request's head (room for a proxy's headers).
# Bytes without a head's end past it are not an HTTP reply (another service at the port).
MAX_REPLY_HEAD_BYTES = 8192
# Bytes of a reply's body at most (`ClientConfig.max_reply_bytes`). The largest reply a
# server sends is a lookup's: per key at most 16 bytes and one name per pod holding the
# segment, 259 bytes at most (`wire.Limits.max_name_chars`; a pod's own name, host and
# pid, is under 80). 64 MiB holds 1024 keys (`max_keys`) each held by 250 pods of the
# longest names; a `pairs_get` reply is under 1 MiB, a `stats` reply under 1 KiB.
MAX_REPLY_BYTES = 64 << 20


@dataclass(frozen=True)
class Location:
    """Where a cached segment lives, as the lookup server knows it."""

    # Tokens in the segment.
    num_tokens: int
    # Whether the shared tier holds it.
    in_shared_tier: bool
    # Pods holding it in their local tier.
    pods: tuple[str, ...]


class LookupConnection:
    """One keep-alive connection; not thread-safe (`LookupClient` serialises calls)."""

    def __init__(
        self, host: str, port: int, timeout_s: float, max_reply_bytes: int = MAX_REPLY_BYTES
    ) -> None:
        self.address = (host, port)
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes
        self._sock: socket.socket | None = None
        # Name resolution has no timeout of its own and a broken cluster DNS can hang for
        # seconds: it runs on a helper thread, waited on only within the call's budget, and
        # its answer is kept (a Service's ClusterIP does not change) until a connect fails.
        self._resolver: ThreadPoolExecutor | None = None
        self._resolving: Future | None = None
        self._resolved: tuple | None = None
        self._is_shut_down = False
        self._head = (
            f"POST {wire.RPC_PATH} HTTP/1.1\r\nHost: {_host_header(host, port)}\r\n"
            f"Content-Type: {wire.CONTENT_TYPE}\r\n"
        )

    def call(self, message: dict, deadline: float | None = None) -> dict:
        """The reply map; OSError on transport failures, WireError on error replies. The
        attempt ends by `deadline` (the caller's budget) if that comes before its own."""
        body = wire.encode(message)
        try:
            return _decode_reply(*self._exchange(body, deadline))
        except BudgetSpent:
            raise  # nothing was sent: the connection is as good as before
        except (OSError, wire.WireError) as error:
            if not isinstance(error, wire.WireError) or error.code == "bad_reply":
                self.close()
            raise

    def _exchange(self, body: bytes, call_deadline: float | None) -> tuple[int, bytes]:
        # One attempt's budget covers all of it: name resolution, connect, send and reply
        # (each step waits for what is left, not for a budget of its own).
        deadline = time.monotonic() + self.timeout_s
        if call_deadline is not None:
            deadline = min(deadline, call_deadline)
        if self._sock is not None and _is_stale(self._sock):
            self.close()  # the server closed it (idle timeout, restart): connect anew
        sock = self._sock or self._connect(deadline)
        sock.settimeout(_left(deadline))
        sock.sendall(f"{self._head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        return self._read_reply(sock, deadline)

    def _connect(self, deadline: float) -> socket.socket:
        if self._is_shut_down:
            # A closed client is still called while its owner shuts down: a failed call
            # (all miss), never a new socket that nothing would close again, nor a
            # RuntimeError from the stopped resolver.
            raise ConnectionError("the lookup client is closed")
        family, address = self._resolve(deadline)
        timeout = _left(deadline)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
        except OSError:
            sock.close()
            self._resolved = None  # the Service may have moved: resolve again next time
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        return sock

    def _resolve(self, deadline: float) -> tuple:
        """(family, sockaddr) of the server; TimeoutError when DNS is slower than the budget."""
        if self._resolved is not None:
            return self._resolved
        host, port = self.address
        if _is_ip_literal(host):
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            self._resolved = (info[0], info[4])
            return self._resolved
        if self._resolving is None:
            self._resolver = self._resolver or ThreadPoolExecutor(1, "lookup-dns")
            self._resolving = self._resolver.submit(
                socket.getaddrinfo, host, port, type=socket.SOCK_STREAM
            )
        try:
            infos = self._resolving.result(timeout=_left(deadline))  # TimeoutError: an OSError
        except TimeoutError:
            raise  # still resolving: a later call picks the answer up
        except OSError:
            self._resolving = None  # failed: ask again next time
            raise
        self._resolving = None
        self._resolved = (infos[0][0], infos[0][4])
        return self._resolved

    def _read_reply(self, sock: socket.socket, deadline: float) -> tuple[int, bytes]:
        """The reply's status and body; the whole reply must arrive before `deadline`, not
        each read. The reply grows in place: a multi-megabyte reply (a lookup of many keys, a
        stats reply) would otherwise be copied whole on every read. A head or a body over
        its bound is refused without reading on (ConnectionError: whatever answers is not
        a lookup server that can serve), so a stream of bytes cannot fill the memory."""
        buffer = bytearray()
        scanned = 0  # bytes searched for the head's end already, less a partial "\r\n\r"
        while (head_end := buffer.find(b"\r\n\r\n", scanned, MAX_REPLY_HEAD_BYTES)) < 0:
            if len(buffer) >= MAX_REPLY_HEAD_BYTES:
                raise ConnectionError(
                    f"lookup server reply without the end of its head in its first "
                    f"{MAX_REPLY_HEAD_BYTES} bytes: is another service at its address?"
                )
            scanned = max(0, len(buffer) - 3)
            buffer += _recv(sock, deadline)
        status, length, closes = _reply_head(bytes(buffer[:head_end]))
        if length > self.max_reply_bytes:
            raise ConnectionError(
                f"lookup server reply of {length} bytes is over the client's max_reply_bytes "
                f"({self.max_reply_bytes}); raise it if the server's replies are that large"
            )
        end = head_end + 4 + length
        while len(buffer) < end:
            buffer += _recv(sock, deadline)
        if closes:
            self.close()
        return status, bytes(buffer[head_end + 4 : end])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def shutdown(self) -> None:
        """Close the socket and the resolver thread."""
        self.close()
        self._is_shut_down = True
        if self._resolver is not None:
            self._resolver.shutdown(wait=False, cancel_futures=True)


class BudgetSpent(TimeoutError):
    """The call's deadline passed before an attempt sent a byte: no failure of the
    server's (a slow caller must not open the breaker for a healthy server)."""


def _left(deadline: float) -> float:
    """Seconds left before `deadline`, asked before a step that precedes sending the
    request; BudgetSpent when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise BudgetSpent("the lookup's budget is spent")
    return left


def _is_stale(sock: socket.socket) -> bool:
    """Whether a kept-alive socket between calls can no longer carry a request: it is
    readable (the server closed it, or sent bytes nobody asked for). One non-blocking
    peek, a few microseconds: cheaper than a failed attempt and its retry."""
    sock.settimeout(0)  # a socket with a timeout would wait for readability first
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False  # nothing to read: still open
    except OSError:
        return True
    return True


def _host_header(host: str, port: int) -> str:
    """The Host header's value: host and port, an IPv6 address in brackets (RFC 7230 and
    3986: `Host: ::1` is not valid HTTP, and a proxy in front of the server may refuse it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _recv(sock: socket.socket, deadline: float) -> bytes:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("lookup server reply over the time budget")
    sock.settimeout(remaining)
    chunk = sock.recv(1 << 16)
    if not chunk:
        raise ConnectionError("lookup server closed the connection")
    return chunk


def _reply_head(head: bytes) -> tuple[int, int, bool]:
    """(status, content length, whether the server closes) of a reply head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ConnectionError(f"lookup server reply without a status line: {lines[0][:80]!a}")
    length, closes = None, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = _content_length(value)
        elif name == b"connection":
            closes = value.strip().lower() == b"close"
    if length is None:
        raise ConnectionError("lookup server reply without Content-Length")
    return int(parts[1]), length, closes


def _content_length(value: bytes) -> int:
    """Content-Length as an int; ConnectionError (a transport failure, as any garbage on
    the socket) when it is not one, never a ValueError into the request."""
    value = value.strip()
    if not value.isdigit():
        raise ConnectionError(f"lookup server reply with Content-Length {value[:20]!a}")
    return int(value)


def _decode_reply(status: int, body: bytes) -> dict:
    """The reply map; WireError for an error reply. The server answers what it refuses at
    the HTTP level (a full request memory, broken framing, an internal error) in plain
    text: that is coded by its status (`unavailable` or `http_error`), not taken for
    garbage (`bad_reply`) on a healthy connection."""
    try:
        return wire.decode_reply(body)
    except wire.WireError as error:
        if error.code != "bad_reply" or status == 200:
            raise
    code = "unavailable" if status in UNAVAILABLE_STATUSES else "http_error"
    text = body[:200].decode("utf-8", "replace").strip()
    raise wire.WireError(code, f"HTTP {status}: {text}", status) from None


@dataclass(frozen=True)
class ClientConfig:
    # Milliseconds one attempt may take (connect, send and the whole reply). One lookup per
    # prompt; 50 ms is small next to a prefill and rides out a loaded node's stalls.
    timeout_ms: float = 50.0
    # Further attempts after a failed one, within the same call.
    retries: int = 1
    # Consecutive failed calls that open the circuit breaker.
    breaker_failures: int = 3
    # Seconds the open breaker skips calls before one trial call.
    breaker_open_s: float = 2.0
    # Keys sent in one lookup request at most (the server's `--max-keys`): a longer lookup
    # goes in several requests, since the server refuses the whole of a longer one.
    max_keys: int = wire.Limits().max_keys
    # Bytes of one reply's body at most; a longer reply is refused as a failure of the
    # server (see `MAX_REPLY_BYTES`). Raise it with `max_keys`.
    max_reply_bytes: int = MAX_REPLY_BYTES

    def __post_init__(self) -> None:
        if not 0 < self.timeout_ms < math.inf:
            # An infinite budget is no budget: every call would raise OverflowError (from
            # the lock's or the socket's timeout) into the request that looked up.
            raise ValueError(f"timeout_ms: must be > 0 and finite, got {self.timeout_ms}")
        if self.retries < 0:
            raise ValueError(f"retries: must be >= 0, got {self.retries}")
        if self.breaker_failures < 1:
            raise ValueError(f"breaker_failures: must be >= 1, got {self.breaker_failures}")
        if not 0 <= self.breaker_open_s < math.inf:
            raise ValueError(f"breaker_open_s: must be >= 0 and finite, got {self.breaker_open_s}")
        if self.max_keys < 1:
            raise ValueError(f"max_keys: must be >= 1, got {self.max_keys}")
        if self.max_reply_bytes < 1:
            raise ValueError(f"max_reply_bytes: must be >= 1, got {self.max_reply_bytes}")


@dataclass
class ClientStats:
    """What the client did; exported as metrics by the engine's registry."""

    calls: int = 0
    # Calls that got no reply map: the server failed or refused them, or another thread's
    # call held the connection past this call's budget, or the caller's deadline was spent.
    failures: int = 0
    # Failed calls the server refused with an error reply (they do not count toward the
    # circuit breaker).
    refused: int = 0
    skipped_by_breaker: int = 0
    keys_looked_up: int = 0
    keys_hit: int = 0
    # Lookups answered "all miss": the server failed, the breaker was open, or the
    # connection stayed busy with another thread's call past the lookup's budget.
    degraded_lookups: int = 0
    counts_by_op: dict = field(default_factory=dict)


class LookupClient:
    """Thread-safe calls with timeouts, retries and a circuit breaker."""

    def __init__(
        self,
        url: str,
        config: ClientConfig | None = None,
        model: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or ClientConfig()
        self.model = model
        host, port = parse_lookup_url(url)
        self._connection = LookupConnection(
            host, port, self.config.timeout_ms / 1000, self.config.max_reply_bytes
        )
        self._lock = threading.Lock()
        # `stats` changes, made both under `_lock` (held over network calls) and without it.
        self._stats_lock = threading.Lock()
        self.breaker = CircuitBreaker(
            self.config.breaker_failures, self.config.breaker_open_s, clock
        )
        self.stats = ClientStats()
        self._refusals_logged: set[tuple[str, str]] = set()

    def lookup(self, keys: Sequence[str]) -> list[Location | None]:
        """One location per key; all None when the server cannot answer in budget. Keys
        beyond `config.max_keys` go in further requests (one refused request would
        otherwise make every key a miss, and count against the breaker), all within the
        one budget of a call: the caller waits no longer for many keys than for a few."""
        if not keys:
            return []
        hits: list[Location | None] = []
        size = self.config.max_keys
        deadline = time.monotonic() + self.budget_s
        for start in range(0, len(keys), size):
            message = {"op": "lookup", "keys": list(keys[start : start + size])}
            if self.model is not None:
                message["model"] = self.model
            reply = self.call(message, deadline)
            found = None if reply is None else _locations(reply, len(message["keys"]))
            if found is None:  # failed, or an answer that is not one location per key
                hits = [None] * len(keys)
                break
            hits.extend(found)
        with self._stats_lock:  # lookups run on several threads: no count is lost
            self.stats.keys_looked_up += len(keys)
            if found is None:
                self.stats.degraded_lookups += 1
            self.stats.keys_hit += sum(hit is not None for hit in hits)
        return hits

    @property
    def budget_s(self) -> float:
        """Seconds one call may take: every attempt's timeout."""
        return (self.config.retries + 1) * self.config.timeout_ms / 1000

    def call(self, message: dict, deadline: float | None = None) -> dict | None:
        """The reply, or None after the retries failed, while the breaker is open, or when
        the connection stayed busy with another thread's call (the engine's lookups and
        the store worker's `contains` share it) past this call's budget: every attempt's
        timeout, the wait for the connection included. `deadline` (monotonic time) ends
        it sooner when it comes first: the several requests of one lookup share one."""
        budget_deadline = time.monotonic() + self.budget_s
        deadline = budget_deadline if deadline is None else min(deadline, budget_deadline)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._count_call(message["op"], is_failed=True)  # not the server's failure
            return None
        try:
            if self.breaker.is_open:
                self.stats.skipped_by_breaker += 1
                return None
            return self._call_with_retries(message, deadline)
        finally:
            self._lock.release()

    def _count_call(self, op: str, is_failed: bool = False) -> None:
        with self._stats_lock:
            self.stats.calls += 1
            self.stats.counts_by_op[op] = self.stats.counts_by_op.get(op, 0) + 1
            self.stats.failures += int(is_failed)

    def _call_with_retries(self, message: dict, deadline: float) -> dict | None:
        op = message["op"]
        self._count_call(op)
        last_error: Exception = BudgetSpent("the call's deadline passed before an attempt")
        for _ in range(self.config.retries + 1):
            if time.monotonic() >= deadline:
                break  # no attempt could end in time: a socket and an address are kept
            try:
                reply = self._connection.call(message, deadline)
            except wire.WireError as error:
                last_error = error
                if error.code != "bad_reply":
                    break  # the server answered: trying again at once gives the same
                continue
            except BudgetSpent:
                break  # this attempt sent nothing: the failure is the one before, if any
            except OSError as error:
                last_error = error
                continue
            self.breaker.succeeded()
            return reply
        self._record_failure(op, last_error)
        return None

    def _record_failure(self, op: str, error: Exception) -> None:
        with self._stats_lock:
            self.stats.failures += 1
        if isinstance(error, BudgetSpent):
            self.breaker.not_tried()  # the server had no part in it
            return
        if isinstance(error, wire.WireError) and error.code not in SERVER_ERRORS:
            self._record_refusal(op, error)
            return
        if self.breaker.failed():
            log.warning("lookup server unreachable (%s: %s); treating lookups as misses", op, error)

    def _record_refusal(self, op: str, error: wire.WireError) -> None:
        """The server is up and refused this one request: that closes a half-open breaker
        as a reply does. Logged once per operation and code (a client bug would otherwise
        log on every lookup); codes no server of this build sends, once as one."""
        self.breaker.succeeded()
        self.stats.refused += 1
        code = error.code if error.code in LOGGED_REFUSAL_CODES else "other"
        if (op, code) not in self._refusals_logged:
            self._refusals_logged.add((op, code))
            log.warning("lookup server refused a %s request (%.300s); logged once", op, error)

    def close(self) -> None:
        """Close the connection; a later call fails (a lookup answers all miss) and
        connects no more."""
        with self._lock:
            self._connection.shutdown()


def _locations(reply: dict, num_keys: int) -> list[Location | None] | None:
    """One location per key from a lookup's reply; None when the reply is not that (a
    server of another build, a bug): the lookup then answers all-miss, never raises into
    the request that asked."""
    hits = reply.get("hits")
    if not isinstance(hits, list) or len(hits) != num_keys:
        log.warning("lookup reply without one location per key: %.200r", reply)
        return None
    try:
        return [_location(hit) for hit in hits]
    except (TypeError, ValueError, OverflowError) as error:
        log.warning("lookup reply with a malformed location (%s): %.200r", error, reply)
        return None


def _location(hit: list | None) -> Location | None:
    if hit is None:
        return None
    num_tokens, in_shared, pods = hit
    if not isinstance(pods, list) or not all(isinstance(pod, str) for pod in pods):
        raise TypeError("pods: expected a list of names")
    return Location(int(num_tokens), bool(in_shared), tuple(pods))


@dataclass(frozen=True)
class AnnouncerConfig:
    # Seconds between heartbeats.
    heartbeat_s: float = 2.0
    # Seconds between full re-announcements even when the server does not ask.
    resync_s: float = 60.0
    # Admits or evicts sent in one request at most; evicts also at most the client's
    # `max_keys` (the server refuses a longer list of keys whole).
    batch: int = 256
    # Queued announcements kept at most; older ones are dropped (a resync repairs that).
    max_pending: int = 65536

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < math.inf:
            raise ValueError(f"heartbeat_s: must be > 0 and finite, got {self.heartbeat_s}")
        if not self.resync_s > 0:
            raise ValueError(f"resync_s: must be > 0, got {self.resync_s}")
        max_entries = wire.Limits().max_entries
        if not 1 <= self.batch <= max_entries:
            raise ValueError(
                f"batch: must be in 1..{max_entries} (the entries the server takes in one "
                f"admit or resync), got {self.batch}"
            )
        if self.max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {self.max_pending}")


class Announcer:
    """Sends a pod's admits, evicts, heartbeats and resyncs from a daemon thread.

    `holdings` returns every entry the pod holds now (local and shared tiers); it is
    called for a full resync.
    """

    def __init__(
        self,
        client: LookupClient,
        pod: str,
        holdings: Callable[[], list[wire.Entry]],
        config: AnnouncerConfig | None = None,
    ) -> None:
        self.client = client
        self.pod = pod
        self.holdings = holdings
        self.config = config or AnnouncerConfig()
        self._pending: deque[tuple[str, object]] = deque()
        # Announcements taken from `_pending` and not yet answered (for `flush`).
        self._num_sending = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._needs_resync = True
        self._last_resync = 0.0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="lookup-announcer", daemon=True)

    def start(self) -> Announcer:
        self._thread.start()
        return self

    def admit(self, entry: wire.Entry) -> None:
        self._enqueue(("admit", entry))

    def evict(self, key: str, shared: bool = False) -> None:
        self._enqueue(("evict-shared" if shared else "evict", key))

    def request_resync(self) -> None:
        with self._cond:
            self._needs_resync = True
            self._cond.notify()

    def _enqueue(self, item: tuple[str, object]) -> None:
        with self._cond:
            if len(self._pending) >= self.config.max_pending:
                self._pending.popleft()
                self.num_dropped += 1
                self._needs_resync = True
            self._pending.append(item)
            self._cond.notify()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued announcements were sent (for tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._pending or self._num_sending) and time.monotonic() < deadline:
                self._cond.wait(0.01)
            return not (self._pending or self._num_sending)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.client.close()

    def _run(self) -> None:
        next_heartbeat = 0.0
        while True:
            with self._cond:
                if self._stopping:
                    return
                if not self._pending:
                    self._cond.wait(max(0.0, next_heartbeat - time.monotonic()))
                batch, self._pending = self._pending, deque()
                self._num_sending = len(batch)
            try:
                self._send(batch)
                if time.monotonic() >= next_heartbeat:
                    next_heartbeat = time.monotonic() + self.config.heartbeat_s
                    self._heartbeat()
            except Exception:  # the thread must outlive any one failure: a dead announcer
                # leaves the index forgetting this pod's segments for good
                log.exception("lookup announcer: announcement failed; resyncing later")
                self._needs_resync = True
            finally:
                with self._cond:
                    self._num_sending = 0
                    self._cond.notify_all()

    def _heartbeat(self) -> None:
        reply = self.client.call({"op": "heartbeat", "pod": self.pod})
        if reply is not None and reply.get("resync"):
            self._needs_resync = True
        due = time.monotonic() - self._last_resync >= self.config.resync_s
        if reply is not None and (self._needs_resync or due):
            self._resync()

    def _resync(self) -> None:
        """Announce everything the pod holds. The flag is cleared first: a resync asked for
        while this one runs (a dropped announcement, `request_resync`) runs after it."""
        with self._cond:
            self._needs_resync = False
        entries = [entry.to_wire() for entry in self.holdings()]
        chunks = [
            entries[i : i + self.config.batch] for i in range(0, len(entries), self.config.batch)
        ]
        for i, chunk in enumerate(chunks or [[]]):
            message = {"op": "resync", "pod": self.pod, "entries": chunk, "reset": i == 0}
            if self.client.call(message) is None:
                self._needs_resync = True  # try again on the next heartbeat
                return
        self._last_resync = time.monotonic()

    def _send(self, batch: deque[tuple[str, object]]) -> None:
        """Send runs of the same kind in order, so an evict after an admit stays last."""
        for kind, run in itertools.groupby(batch, key=lambda item: item[0]):
            values = [value for _, value in run]
            size = self.config.batch
            if kind != "admit":
                size = min(size, self.client.config.max_keys)
            for i in range(0, len(values), size):
                self._send_one(self._message(kind, values[i : i + size]))

    def _message(self, kind: str, values: list) -> dict:
        if kind == "admit":
            return {"op": "admit", "pod": self.pod, "entries": [e.to_wire() for e in values]}
        return {"op": "evict", "pod": self.pod, "keys": values, "shared": kind == "evict-shared"}

    def _send_one(self, message: dict) -> None:
        if self.client.call(message) is None:
            self._needs_resync = True  # lost announcements are repaired by a full resync
