"""Retry-After once the running request has outlived the recent mean (runtime/serve/worker.py,
`SlotEstimate`): the estimate used to fall to 1 s, so with answers of mixed lengths every
refused client came back each second until a place freed. It is now when a running request
ends at the latest (its tokens left at the recent decode-step time, or its deadline), and
never later than a running request's deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.worker import SlotEstimate
from tests.serve.conftest import in_process_server

# Long enough that no request of the test gets near it: only the token bound can show.
REQUEST_TIMEOUT_S = 3600.0


def test_a_job_past_the_mean_is_expected_when_a_running_job_ends_at_the_latest():
    slot = SlotEstimate(window=2, initial_s=4.0)
    slot.started(0.0, "a", deadline=1000.0)
    slot.started(1.0, "b", deadline=1000.0)
    assert slot.retry_after_s(1.0) == 3  # within the mean: the mean's rest
    slot.ends_by(40.0, "a")
    slot.ends_by(25.5, "b")
    assert slot.retry_after_s(10.0) == 16  # past it: "b" ends by 25.5 s at the latest
    slot.finished(12.0, "b")
    assert slot.retry_after_s(12.0) == 28  # "a" alone, by 40 s


def test_retry_after_is_never_later_than_a_running_jobs_deadline():
    slot = SlotEstimate(initial_s=60.0)
    slot.started(0.0, "a", deadline=3.0)
    assert slot.retry_after_s(0.5) == 3  # not the mean's 60 s: "a" ends at its deadline
    slot.ends_by(100.0, "a")  # a bound past the deadline leaves the deadline
    assert slot.retry_after_s(70.0) == 1  # past both: never 0


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("retry-after")
    with in_process_server(
        folder, queue_size=1, max_batch=1, request_timeout=REQUEST_TIMEOUT_S
    ) as server:
        yield server


async def test_a_request_longer_than_the_recent_ones_is_not_retried_every_second(in_process):
    """A fresh server expects 1 s per request; a long answer decodes past that, a second
    request waits and a third is refused: its Retry-After was 1, though the long answer
    had most of its tokens left. Now it is those tokens at the decode-step time."""
    server = in_process
    context = server.engine.config.context_length
    long = {"model": "smollm2", "prompt": "Count.", "stream": True, "ignore_eos": True}
    long["max_tokens"] = min(1500, context - 64)
    short = {"model": "smollm2", "prompt": "Which lake shrank?", "max_tokens": 2}
    async with TestClient(TestServer(server.app())) as client:
        streaming = await client.post("/v1/completions", json=long)
        assert streaming.status == 200
        chunk_times = []
        while len(chunk_times) < 3:  # three tokens: the decode steps have bounded its end
            line = await asyncio.wait_for(streaming.content.readline(), 30)
            if line.startswith(b"data: "):
                chunk_times.append(time.perf_counter())
        # Past the fresh server's 1 s mean (the request started before its first chunk).
        await asyncio.sleep(max(0.0, 1.2 - (time.perf_counter() - chunk_times[0])))
        waiting = asyncio.create_task(client.post("/v1/completions", json=short))
        for _ in range(1000):
            if server.worker.num_pending == 2:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the second request was never queued")
        refused = await client.post("/v1/completions", json=short)
        assert refused.status == 429, await refused.text()
        retry_after = int(refused.headers["Retry-After"])
        streaming.close()  # the long answer is cancelled: the waiting request is served
        assert (await asyncio.wait_for(waiting, 60)).status == 200
    assert 2 <= retry_after < REQUEST_TIMEOUT_S / 2, retry_after
