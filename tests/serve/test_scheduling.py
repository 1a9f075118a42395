"""The compute thread's schedule under sustained load (runtime/serve/worker.py), with a
model-free engine whose operations are logged in the order the thread runs them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from holeblend_runtime.engine import Mode
from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.live_config import LiveConfig
from holeblend_runtime.serve.metrics import ServeMetrics
from holeblend_runtime.serve.settings import ServeSettings
from holeblend_runtime.serve.worker import EngineWorker, Finished, Job
from tests.serve.conftest import example_settings_json


class LimitedSequence:
    """A decode sequence that ends at its token limit, never at end of sequence."""

    def __init__(self, limit: int) -> None:
        self.limit, self.num_produced = limit, 0

    def next_token(self) -> int:
        return 5

    def produced(self) -> None:
        self.num_produced += 1

    @property
    def is_at_limit(self) -> bool:
        return self.num_produced >= self.limit

    def close(self) -> None:
        pass


class LoggedEngine:
    """An engine without a model: prompts, prefills and decode steps are instant and
    appended to `log`; `on_prefill` runs in each prefill (on the compute thread), and a
    decode step waits while `steps_open` is clear."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(context_length=8192, eos_token_id=2)
        self.blend_config = SimpleNamespace(separator=" # #")
        self.tokenizer = SimpleNamespace(token_to_id=lambda text: None, max_token_bytes=16)
        self.log: list[str] = []
        self.decode_pool = SimpleNamespace(max_rows=None)  # the worker caps it at max_batch
        self.on_prefill = lambda: None
        self.steps_open = threading.Event()
        self.steps_open.set()

    def build_prompt(self, system, documents, question):
        self.log.append("build_prompt")
        return SimpleNamespace(num_tokens=10)

    def busy(self):
        return contextlib.nullcontext()

    def prefill(self, prompt, mode, ratio=None):
        self.log.append("prefill")
        self.on_prefill()
        return SimpleNamespace(
            mode=Mode.FULL, reuse=None, ratio=1.0, num_prompt_tokens=10, num_reused_tokens=0,
            num_hole_tokens=0, num_recomputed_tokens=10, num_exact_prefix_tokens=0,
            selected_positions=torch.zeros(0), deviation=torch.zeros(0),
        )  # fmt: skip

    def start_decode(self, prefill, limit) -> LimitedSequence:
        return LimitedSequence(limit)

    def decode_step(self, sequences, tokens) -> None:
        self.steps_open.wait(10)
        self.log.append("step")


@pytest.fixture
def logged(tmp_path):
    """logged(max_batch) -> (engine, started worker) on a `LoggedEngine`."""
    config = tmp_path / "blend.json"
    config.write_text(example_settings_json(mode="off"))
    made = []

    def make(max_batch: int, queue_size: int = 8) -> tuple[LoggedEngine, EngineWorker]:
        engine = LoggedEngine()
        worker = EngineWorker(
            engine, LiveConfig(config), ServeMetrics(), queue_size, max_batch, torch_threads=1
        )
        worker.start()
        made.append((engine, worker))
        return engine, worker

    yield make
    for engine, worker in made:
        engine.steps_open.set()
        worker.stop()


def new_job(loop: asyncio.AbstractEventLoop, max_tokens: int) -> Job:
    now = time.perf_counter()
    return Job(None, max_tokens, now, now + 120, loop)


async def finished(job: Job) -> Finished:
    while not isinstance(event := await asyncio.wait_for(job.events.get(), 10), Finished):
        pass
    return event


@pytest.mark.parametrize("max_batch", [2, 4])
def test_requests_that_end_at_their_prefill_do_not_starve_the_decoding_batch(logged, max_batch):
    """A request with max_tokens 1 (a classifier's yes/no) ends at its prefill and never
    fills a place in the batch. Prefill came first whenever one waited and the batch had
    room, so while such requests kept arriving no decode step ran: the requests decoding
    got no token until the arrivals paused, or their deadline passed. Between two decode
    steps the thread now prefills at most `max_batch` requests."""
    engine, worker = logged(max_batch)
    num_short = 20

    async def main() -> tuple[Finished, list[Finished]]:
        loop = asyncio.get_running_loop()
        short: list[Job] = []

        def arrive() -> None:  # one more short request arrives during each prefill
            if len(short) < num_short:
                short.append(new_job(loop, 1))
                worker.submit(short[-1])

        engine.on_prefill = arrive
        long = new_job(loop, 30)
        worker.submit(long)
        end = await finished(long)
        return end, [await finished(job) for job in short]

    long_end, short_ends = asyncio.run(main())
    assert long_end == Finished("length")
    assert short_ends == [Finished("length")] * num_short
    assert engine.log.count("prefill") == 1 + num_short
    runs = [len(list(run)) for kind, run in itertools.groupby(engine.log) if kind == "prefill"]
    assert max(runs) <= max_batch, engine.log


async def test_a_full_queue_refuses_a_request_before_its_body_is_read_and_tokenized(
    logged, tmp_path
):
    """Under overload every request is refused, but each one's body was read and its
    prompt tokenized first, on threads that take the CPU the compute thread needs, and
    with every such body held until then: the more clients sent, the slower the server
    served. A request that arrives with the queue full now gets its 429 at once."""
    engine, worker = logged(max_batch=1, queue_size=1)
    engine.steps_open.clear()
    config = tmp_path / "server" / "blend.json"
    config.parent.mkdir()
    config.write_text(example_settings_json(mode="off", qualityProxies=False))
    server = Server(ServeSettings(config, torch_threads=1))
    server.engine, server.worker, server.is_ready = engine, worker, True
    loop = asyncio.get_running_loop()
    running, waiting = new_job(loop, 1000), new_job(loop, 1000)
    worker.submit(running)
    while not isinstance(await asyncio.wait_for(running.events.get(), 10), int):
        pass  # decoding, its steps held
    worker.submit(waiting)
    body = {"model": server.model_name, "prompt": "Which lake shrank?", "max_tokens": 4}
    try:
        async with TestClient(TestServer(server.app())) as client:
            response = await client.post("/v1/completions", json=body)
            assert response.status == 429
            assert int(response.headers["Retry-After"]) >= 1
            assert (await response.json())["error"]["type"] == "rate_limit_error"
    finally:
        server.close()
    assert "build_prompt" not in engine.log
    for job in (running, waiting):
        worker.cancel(job)
    engine.steps_open.set()
    assert await finished(running) == Finished("cancelled")
