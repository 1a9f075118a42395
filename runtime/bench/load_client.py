"""The load benchmark's side of the wire: `holeblend-serve` processes and OpenAI clients.

- `ServeProcess` starts `holeblend-serve --config FILE --host 127.0.0.1 --port P`, waits
  for `GET /ready`, and stops it with SIGTERM (then SIGKILL) so that nothing outlives
  the run.
- `complete` sends one streaming `POST /v1/completions` with the RAG extension (a
  top-level `documents` list, `prompt` = the question) and times the first SSE chunk
  (TTFT) and the last (request time). A 429 is retried after its `Retry-After`; an error
  event in the stream, or a stream that ends before `data: [DONE]`, fails the request.
- `drive` sends a list of requests through `num_clients` closed-loop clients (each sends
  its next request when the previous one returned); every request comes back as an
  outcome, a failed one too.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from holeblend_runtime.bench.load_workload import LoadRequest

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it."""

    index: int
    # HTTP status of the last attempt; None when the connection failed.
    status: int | None
    # Seconds from first sending (rejected tries and their waits included) to the first
    # SSE chunk, and to the end of the stream.
    ttft_s: float | None
    request_s: float
    text: str
    # The `usage` object of the final chunk (None when the server sent none).
    usage: dict[str, Any] | None
    # 429 answers before the request was taken.
    num_rejected: int = 0
    error: str | None = None
    # A 429's Retry-After, seconds.
    retry_after_s: float | None = None
    # Inter-token latencies: the gaps between successive chunks with text.
    itls_s: tuple[float, ...] = ()

    @property
    def is_ok(self) -> bool:
        return self.status == 200 and self.error is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def serve_executable() -> str:
    """The `holeblend-serve` console script installed next to this interpreter."""
    script = Path(sys.executable).parent / "holeblend-serve"
    if not script.exists():
        raise ValueError(f"serve: {script} not found; install holeblend with its runtime extra")
    return str(script)


@dataclass
class ServeProcess:
    """One `holeblend-serve` on 127.0.0.1; use as a context manager."""

    config_path: Path
    log_path: Path
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    _process: subprocess.Popen | None = None

    def __enter__(self) -> ServeProcess:
        command = [serve_executable(), "--config", str(self.config_path)]
        command += ["--host", HOST, "--port", str(self.port)]
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=os.environ | self.env
            )
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"holeblend-serve exited early:\n{self._log_tail()}")
            if _get_status(self.port, "/ready") == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"holeblend-serve not ready after {timeout_s} s:\n{self._log_tail()}")

    def model_name(self) -> str:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=10)
        try:
            connection.request("GET", "/v1/models")
            return json.loads(connection.getresponse().read())["data"][0]["id"]
        finally:
            connection.close()

    def stop(self, grace_s: float = 30.0) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def completion_body(request: LoadRequest, model: str, max_tokens: int) -> dict[str, Any]:
    """The OpenAI completions body with the RAG extension; greedy, streamed with usage."""
    return {
        "model": model,
        "prompt": request.question,
        "documents": list(request.documents),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def parse_sse(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of `data:` lines, up to `data: [DONE]`. A stream that ends before
    it was cut short (a server whose process died closes its connections cleanly, and the
    HTTP client reads that as the end): ValueError, so that the request counts as failed."""
    for raw in lines:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)
    raise ValueError("stream: the connection closed before `data: [DONE]` (answer cut short)")


def complete(
    port: int, request: LoadRequest, model: str, max_tokens: int, timeout_s: float = 300.0
) -> Outcome:
    """One request until the server takes it: a 429 is retried after its Retry-After. The
    clock starts once, before the first attempt, so TTFT and request time include every
    rejection and wait, as the user waited them."""
    body = json.dumps(completion_body(request, model, max_tokens)).encode()
    num_rejected = 0
    started = time.perf_counter()
    while True:
        outcome = _attempt(port, request.index, body, timeout_s, started)
        if outcome.status != 429 or num_rejected >= 100:
            return _with_rejected(outcome, num_rejected)
        num_rejected += 1
        time.sleep(outcome.retry_after_s or 1.0)


def drive(
    port: int,
    requests: Sequence[LoadRequest],
    model: str,
    num_clients: int,
    max_tokens: int,
    timeout_s: float = 300.0,
) -> tuple[list[Outcome], float]:
    """Every request once, by `num_clients` closed-loop clients; outcomes and wall seconds."""
    if num_clients < 1:
        raise ValueError(f"clients: must be >= 1, got {num_clients}")
    todo: queue.SimpleQueue[LoadRequest] = queue.SimpleQueue()
    for request in requests:
        todo.put(request)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                request = todo.get_nowait()
            except queue.Empty:
                return
            sent = time.perf_counter()
            try:
                outcome = complete(port, request, model, max_tokens, timeout_s)
            except Exception as error:
                # A chunk of a shape nobody foresaw, say: a client that raised would end
                # here, its request missing from every count and the rest left to fewer
                # clients (with one client, never sent).
                outcome = Outcome(request.index, None, None, time.perf_counter() - sent, "",
                                  None, error=f"{type(error).__name__}: {error}")  # fmt: skip
            with lock:
                outcomes.append(outcome)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(num_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(outcomes, key=lambda o: o.index), time.perf_counter() - started


def _attempt(port: int, index: int, body: bytes, timeout_s: float, started: float) -> Outcome:
    """One try; its times count from `started`, when the request was first sent."""
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status == 429:
            retry_after = _seconds(response.getheader("Retry-After"))
            response.read()
            return Outcome(index, 429, None, time.perf_counter() - started, "", None,
                           retry_after_s=retry_after)  # fmt: skip
        if response.status != 200:
            detail = response.read().decode(errors="replace")[:300]
            return Outcome(index, response.status, None, time.perf_counter() - started, "",
                           None, error=detail)  # fmt: skip
        return _read_stream(index, response, started)
    except (OSError, http.client.HTTPException, ValueError) as error:
        return Outcome(index, None, None, time.perf_counter() - started, "", None,
                       error=f"{type(error).__name__}: {error}")  # fmt: skip
    finally:
        connection.close()


def _read_stream(index: int, response: http.client.HTTPResponse, started: float) -> Outcome:
    """The stream's timings and text. An error event (a server that gives up on a request
    after its 200 went out, at its timeout say, sends one) fails the request, and so does
    a stream without `data: [DONE]` (`parse_sse`)."""
    ttft_s, pieces, usage, itls, last, error = None, [], None, [], None, None
    for chunk in parse_sse(response):
        now = time.perf_counter()
        if not isinstance(chunk, dict):
            error = f"not a JSON object: {json.dumps(chunk)[:300]}"
            continue
        if "error" in chunk:
            error = f"error event: {json.dumps(chunk['error'])[:300]}"
            continue
        if ttft_s is None:
            ttft_s = now - started
        text = "".join(choice.get("text") or "" for choice in chunk.get("choices") or ())
        if text:
            if last is not None:
                itls.append(now - last)
            last = now
            pieces.append(text)
        usage = chunk.get("usage") or usage
    request_s = time.perf_counter() - started
    return Outcome(index, 200, ttft_s, request_s, "".join(pieces), usage, error=error,
                   itls_s=tuple(itls))  # fmt: skip


def _with_rejected(outcome: Outcome, num_rejected: int) -> Outcome:
    return replace(outcome, num_rejected=num_rejected, retry_after_s=None)


def _seconds(header: str | None) -> float:
    try:
        return min(max(float(header or 1.0), 0.05), 30.0)
    except ValueError:
        return 1.0


def _get_status(port: int, path: str) -> int | None:
    connection = http.client.HTTPConnection(HOST, port, timeout=2)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        connection.close()
