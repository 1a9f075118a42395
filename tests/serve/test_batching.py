"""The compute thread's continuous batching (runtime/serve/worker.py) on the real model:
requests in flight decode together, each answer is what it would be alone, and a job that
ends, is cancelled or fails leaves the others as they were.

The worker runs in-process; every event a job gets is also logged, in the order the
compute thread emits them, so the interleaving is observable."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from holeblend_runtime.engine import BlendEngine, Mode
from holeblend_runtime.model.threads import serial_torch
from holeblend_runtime.serve import worker as worker_module
from holeblend_runtime.serve.live_config import LiveConfig
from holeblend_runtime.serve.metrics import ServeMetrics
from holeblend_runtime.serve.worker import (
    EngineWorker,
    Finished,
    Job,
    PrefillDone,
    QueueFull,
    SlotEstimate,
)
from tests.serve.conftest import example_settings_json

SYSTEM = "Answer from the documents."
DOCS = (
    "The Aral Sea was once the fourth largest lake in the world, fed by two great rivers.",
    "Lichens are partnerships of a fungus with algae, and they grow on bare rock slowly.",
    "The abacus is a counting frame with beads, used for arithmetic for many centuries.",
    "Basalt is a dark volcanic rock that forms when lava cools quickly at the surface.",
)
QUESTIONS = ("Which lake shrank?", "What are lichens?", "What is an abacus?", "What is basalt?")


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine.load(num_threads=1)


@pytest.fixture(scope="module")
def prompts(engine):
    return [
        engine.build_prompt(SYSTEM, DOCS[: i + 1], question) for i, question in enumerate(QUESTIONS)
    ]


@pytest.fixture(scope="module")
def alone(engine, prompts) -> Callable[[int, int], list[int]]:
    """alone(i, n): the first n greedy tokens of prompt i, decoded by itself."""
    memo: dict[int, list[int]] = {}

    def answer(i: int, n: int) -> list[int]:
        if i not in memo:
            prefill = engine.prefill(prompts[i], "full")
            memo[i] = list(engine.generate_stream(prefill, 12, ignore_eos=True))
        assert n <= len(memo[i])
        return memo[i][:n]

    return answer


@pytest.fixture
def make_worker(engine, tmp_path):
    """make_worker(max_batch) -> a started worker in full mode (the store plays no part)."""
    config = tmp_path / "blend.json"
    config.write_text(example_settings_json(mode="off"))
    workers = []

    def make(max_batch: int, queue_size: int = 8) -> EngineWorker:
        worker = EngineWorker(engine, LiveConfig(config), ServeMetrics(), queue_size, max_batch)
        worker.start()
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.stop()


class Logged(asyncio.Queue):
    """A job's event queue that also appends (name, event) to a shared log; `hook(job,
    event)` runs on each event (on the loop, as the server's routes do)."""

    def __init__(self, name: str, log: list, hook: Callable | None) -> None:
        super().__init__()
        self.name, self.log, self.hook = name, log, hook
        self.job: Job | None = None

    def put_nowait(self, item: object) -> None:
        self.log.append((self.name, item))
        if self.hook is not None:
            self.hook(self.job, item)
        super().put_nowait(item)


def run_jobs(worker: EngineWorker, prompts, specs: dict, after_submit=None) -> list:
    """Submit one job per spec at once: name -> (prompt index, max_tokens[, hook]); the
    shared event log once every job got Finished or an exception."""

    async def main() -> list:
        loop = asyncio.get_running_loop()
        log: list = []
        jobs = []
        for name, (index, max_tokens, *hook) in specs.items():
            events = Logged(name, log, hook[0] if hook else None)
            now = time.perf_counter()
            job = Job(prompts[index], max_tokens, now, now + 120, loop, True, events)
            events.job = job
            worker.submit(job)
            jobs.append(job)
        if after_submit is not None:
            await asyncio.to_thread(after_submit)
        for job in jobs:
            while True:
                event = await asyncio.wait_for(job.events.get(), 120)
                if isinstance(event, Finished | Exception):
                    break
        return log

    return asyncio.run(main())


def settles_to_zero(worker: EngineWorker) -> bool:
    """Whether num_pending reaches 0 (a job's count drops just after its Finished)."""
    deadline = time.monotonic() + 10
    while worker.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    return worker.num_pending == 0


def tokens_of(log: list, name: str) -> list[int]:
    return [event for owner, event in log if owner == name and isinstance(event, int)]


def end_of(log: list, name: str) -> object:
    ends = [e for owner, e in log if owner == name and isinstance(e, Finished | Exception)]
    assert len(ends) == 1, ends
    return ends[0]


def first_index(log: list, name: str, kind: type) -> int:
    return next(i for i, (owner, e) in enumerate(log) if owner == name and isinstance(e, kind))


def test_concurrent_requests_decode_together_and_answer_as_alone(make_worker, prompts, alone):
    worker = make_worker(max_batch=8)
    log = run_jobs(worker, prompts, {"a": (0, 8), "b": (1, 6)})
    for name, index, n in (("a", 0, 8), ("b", 1, 6)):
        assert tokens_of(log, name) == alone(index, n)
        assert end_of(log, name) == Finished("length")
    # Before either finished, both had tokens, and their tokens alternate.
    first_end = min(first_index(log, name, Finished) for name in "ab")
    before = [owner for owner, event in log[:first_end] if isinstance(event, int)]
    assert before.count("a") >= 3 and before.count("b") >= 3
    switches = sum(x != y for x, y in zip(before, before[1:], strict=False))
    assert switches >= 4, before
    assert settles_to_zero(worker)


def test_max_batch_one_serves_one_request_at_a_time(make_worker, prompts, alone):
    worker = make_worker(max_batch=1)
    log = run_jobs(worker, prompts, {"a": (0, 5), "b": (1, 5)})
    assert tokens_of(log, "a") == alone(0, 5) and tokens_of(log, "b") == alone(1, 5)
    # b's prefill begins only after a's whole answer.
    assert first_index(log, "a", Finished) < first_index(log, "b", PrefillDone)
    assert [owner for owner, _ in log] == ["a"] * 7 + ["b"] * 7


def cancel_after(n: int) -> Callable:
    """As the route does when the client goes away after n tokens."""
    seen = []

    def hook(job: Job, event: object) -> None:
        if isinstance(event, int):
            seen.append(event)
            if len(seen) >= n:
                job.cancelled.set()

    return hook


def stop_after(n: int) -> Callable:
    """As the route does when the answer's text reaches a stop sequence."""
    seen = []

    def hook(job: Job, event: object) -> None:
        if isinstance(event, int):
            seen.append(event)
            if len(seen) >= n:
                job.stopped.set()

    return hook


def test_a_cancelled_and_a_stopped_job_leave_the_others_unchanged(
    make_worker, engine, prompts, alone
):
    worker = make_worker(max_batch=8)
    specs = {
        "a": (0, 10),
        "cancelled": (1, 12, cancel_after(2)),
        "stopped": (2, 12, stop_after(3)),
        "d": (3, 9),
    }
    log = run_jobs(worker, prompts, specs)
    assert tokens_of(log, "a") == alone(0, 10) and end_of(log, "a") == Finished("length")
    assert tokens_of(log, "d") == alone(3, 9) and end_of(log, "d") == Finished("length")
    assert end_of(log, "cancelled") == Finished("cancelled")
    assert end_of(log, "stopped") == Finished("stop")
    for name, index in (("cancelled", 1), ("stopped", 2)):
        got = tokens_of(log, name)
        assert len(got) < 12 and got == alone(index, len(got))
    # Both ended while a and d were still decoding.
    last_early_end = max(first_index(log, n, Finished) for n in ("cancelled", "stopped"))
    assert last_early_end < min(first_index(log, n, Finished) for n in "ad")
    assert settles_to_zero(worker)
    assert engine.decode_pool.live_rows == []  # every job's KV row went back to the pool


def test_a_failing_prefill_fails_only_its_job(make_worker, engine, prompts, alone, monkeypatch):
    prefill = engine.prefill

    def failing(prompt, *args, **kwargs):
        if prompt is prompts[1]:
            raise RuntimeError("prefill broke")
        return prefill(prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "prefill", failing)
    worker = make_worker(max_batch=8)
    log = run_jobs(worker, prompts, {"a": (0, 6), "broken": (1, 6), "c": (2, 6)})
    assert str(end_of(log, "broken")) == "prefill broke" and tokens_of(log, "broken") == []
    for name, index in (("a", 0), ("c", 2)):
        assert tokens_of(log, name) == alone(index, 6)
        assert end_of(log, name) == Finished("length")
    assert settles_to_zero(worker)


def test_a_failing_decode_step_fails_its_jobs_and_the_worker_serves_on(
    make_worker, engine, prompts, alone, monkeypatch
):
    step = engine.decode_step
    calls = []

    def failing(sequences, tokens):
        calls.append(len(sequences))
        if len(calls) == 3:
            raise RuntimeError("step broke")
        step(sequences, tokens)

    monkeypatch.setattr(engine, "decode_step", failing)
    worker = make_worker(max_batch=8)
    log = run_jobs(worker, prompts, {"a": (0, 8), "b": (1, 8)})
    assert calls[2] == 2  # the failing step held both jobs
    for name, index in (("a", 0), ("b", 1)):
        assert str(end_of(log, name)) == "step broke"
        got = tokens_of(log, name)
        assert 1 <= len(got) < 8 and got == alone(index, len(got))
    assert settles_to_zero(worker)
    assert engine.decode_pool.live_rows == []  # the failed step's rows went back too
    log = run_jobs(worker, prompts, {"after": (2, 6)})
    assert tokens_of(log, "after") == alone(2, 6)
    assert end_of(log, "after") == Finished("length")
    assert settles_to_zero(worker)


@pytest.mark.parametrize("closed", ["before its prefill", "in a failing step", "while decoding"])
def test_a_job_whose_loop_is_closed_does_not_end_the_compute_thread(
    make_worker, engine, prompts, alone, monkeypatch, closed
):
    """Every emit to a closed loop raises ("Event loop is closed"). The error paths emitted
    the failure to the job again: that raised out of the compute thread, and the server
    stayed ready while serving nothing. The job now ends (its KV row back in the pool), the
    report nobody can receive is logged, and the next job is served."""
    gone = asyncio.new_event_loop()
    step = engine.decode_step

    def closing(sequences, tokens):
        if not gone.is_closed():
            gone.close()  # on the compute thread, between two of the job's events
            if closed == "in a failing step":
                raise RuntimeError("step broke")
        step(sequences, tokens)

    if closed == "before its prefill":
        gone.close()
    else:
        monkeypatch.setattr(engine, "decode_step", closing)
    worker = make_worker(max_batch=8)
    now = time.perf_counter()
    worker.submit(Job(prompts[0], 8, now, now + 120, gone, True))
    assert settles_to_zero(worker)
    assert engine.decode_pool.live_rows == []
    log = run_jobs(worker, prompts, {"next": (1, 6)})
    assert tokens_of(log, "next") == alone(1, 6)
    assert end_of(log, "next") == Finished("length")
    assert settles_to_zero(worker)


def test_stop_finishes_the_jobs_in_flight_and_refuses_new_ones(make_worker, prompts, alone):
    worker = make_worker(max_batch=2)
    stopped = threading.Event()

    def stop() -> None:
        worker.stop()
        stopped.set()

    # Three jobs, a batch of two: one waits in the queue when stop() is called.
    log = run_jobs(worker, prompts, {"a": (0, 6), "b": (1, 6), "c": (2, 6)}, after_submit=stop)
    assert stopped.is_set()
    for name, index in (("a", 0), ("b", 1), ("c", 2)):
        assert tokens_of(log, name) == alone(index, 6)
        assert end_of(log, name) == Finished("length")
    assert settles_to_zero(worker)
    with pytest.raises(RuntimeError, match="stopped"):
        worker.submit(Job(prompts[0], 1, 0.0, 1e9, asyncio.new_event_loop()))


def test_the_batch_holds_at_most_max_batch_jobs(make_worker, engine, prompts, monkeypatch):
    step = engine.decode_step
    sizes = []

    def counting(sequences, tokens):
        sizes.append(len(sequences))
        step(sequences, tokens)

    monkeypatch.setattr(engine, "decode_step", counting)
    worker = make_worker(max_batch=2)
    run_jobs(worker, prompts, {name: (i, 4) for i, name in enumerate("abcd")})
    assert max(sizes) == 2 and sum(sizes) == 4 * 3  # each job fed 3 of its 4 tokens


def test_the_decode_pool_holds_at_most_max_batch_rows(make_worker, engine, prompts):
    """The pool's rows grow by half again: four requests decoding together gave it five
    rows (a fifth row of the longest answer's slots, held for nothing), and after a shrink
    to seven rows an eighth request gave it eleven. The worker caps it at `max_batch`."""
    engine.decode_pool.clear()  # every row was given back: the earlier tests settled
    worker = make_worker(max_batch=4)
    log = run_jobs(worker, prompts, {name: (i, 4) for i, name in enumerate("abcd")})
    assert [end_of(log, name) for name in "abcd"] == [Finished("length")] * 4
    assert engine.decode_pool.num_rows == 4


def test_the_engine_thread_computes_with_its_own_thread_count(
    engine, prompts, tmp_path, monkeypatch
):
    """The worker's thread sets its torch threads itself (runtime/model/threads.py): a
    serial thread that left the process default at 1 before it started does not make the
    engine's forwards serial."""
    counts: list[int] = []
    prefill = engine.prefill

    def recording(prompt, *args, **kwargs):
        counts.append(torch.get_num_threads())
        return prefill(prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "prefill", recording)
    serial = threading.Thread(target=serial_torch)  # leaves the default at 1
    serial.start()
    serial.join()
    config = tmp_path / "blend.json"
    config.write_text(example_settings_json(mode="off"))
    worker = EngineWorker(engine, LiveConfig(config), ServeMetrics(), 8, 8, torch_threads=2)
    worker.start()
    try:
        log = run_jobs(worker, prompts, {"a": (0, 2)})
    finally:
        worker.stop()
    assert end_of(log, "a") == Finished("length")
    assert counts == [2]
    with pytest.raises(ValueError, match="torch_threads: must be >= 1, got 0"):
        EngineWorker(engine, LiveConfig(config), ServeMetrics(), 8, 8, torch_threads=0)


# --- the queue and the batch's memory, with a model-free engine --------------------------


class GatedSequence:
    """A decode sequence that never ends by itself (its job ends by cancellation)."""

    def __init__(self) -> None:
        self.closed = False

    def next_token(self) -> int:
        return 5

    def produced(self) -> None:
        pass

    @property
    def is_at_limit(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class GatedEngine:
    """An engine without a model: a prefill is instant and has real k/v tensors, and each
    decode step waits for one `steps.release()` (or for `run_free`)."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(context_length=8192, eos_token_id=2)
        self.steps = threading.Semaphore(0)
        self.decode_pool = SimpleNamespace(max_rows=None)  # the worker caps it at max_batch
        self.run_free = threading.Event()
        self.num_prefills = 0
        self.k_refs: list[weakref.ref] = []

    def busy(self):
        return contextlib.nullcontext()

    def prefill(self, prompt, mode, ratio=None):
        self.num_prefills += 1
        k, v = torch.zeros(2, 1, 10, 4), torch.zeros(2, 1, 10, 4)
        self.k_refs.append(weakref.ref(k))
        return SimpleNamespace(
            mode=Mode.FULL, reuse=None, ratio=1.0, num_prompt_tokens=10, num_reused_tokens=0,
            num_hole_tokens=0, num_recomputed_tokens=10, num_exact_prefix_tokens=0,
            selected_positions=torch.zeros(0), deviation=torch.zeros(0), k=k, v=v,
            logits=torch.zeros(8),
        )  # fmt: skip

    def start_decode(self, prefill, limit) -> GatedSequence:
        return GatedSequence()

    def decode_step(self, sequences, tokens) -> None:
        while not self.run_free.is_set() and not self.steps.acquire(timeout=0.01):
            pass


@pytest.fixture
def gated(tmp_path):
    """gated(queue_size, max_batch) -> (engine, started worker) on a `GatedEngine`; every
    decode step runs free at teardown, so the jobs left end as they are cancelled."""
    config = tmp_path / "blend.json"
    config.write_text(example_settings_json(mode="off"))
    made = []

    def make(queue_size: int, max_batch: int) -> tuple[GatedEngine, EngineWorker]:
        engine = GatedEngine()
        worker = EngineWorker(
            engine, LiveConfig(config), ServeMetrics(), queue_size, max_batch, torch_threads=1
        )
        worker.start()
        made.append((engine, worker))
        return engine, worker

    yield make
    for engine, worker in made:
        engine.run_free.set()
        worker.stop()


def new_job(loop: asyncio.AbstractEventLoop) -> Job:
    now = time.perf_counter()
    return Job(None, 1000, now, now + 120, loop)


async def first_event(job: Job, kind: type) -> object:
    while not isinstance(event := await asyncio.wait_for(job.events.get(), 10), kind):
        pass
    return event


def queue_depth(worker: EngineWorker) -> float:
    return worker.metrics.registry.get_sample_value("holeblend_queue_depth")


@pytest.mark.parametrize("how", ["cancel", "event"])
def test_cancelled_waiting_jobs_give_their_queue_places_back_before_the_thread_reaches_them(
    gated, how
):
    """A client that went away (or got its 504) while queued no longer counts against the
    queue bound: with the batch busy, the thread would reach its job only when the batch
    has room, and until then live clients would get 429 while nothing live waits. Through
    `cancel` (what the route calls) the place is free at once; a job whose `cancelled`
    event was set directly gives it back by the next `submit`."""
    engine, worker = gated(queue_size=2, max_batch=1)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        running = new_job(loop)
        worker.submit(running)
        await first_event(running, int)  # decoding, its steps held
        dead = [new_job(loop), new_job(loop)]
        for job in dead:
            worker.submit(job)
        assert queue_depth(worker) == 2
        for job in dead:
            worker.cancel(job) if how == "cancel" else job.cancelled.set()
        if how == "cancel":
            assert queue_depth(worker) == 0 and worker.num_pending == 1
        live = [new_job(loop), new_job(loop)]
        for job in live:
            worker.submit(job)  # QueueFull if the dead jobs still held the places
        assert queue_depth(worker) == 2 and worker.num_pending == 3
        with pytest.raises(QueueFull):
            worker.submit(new_job(loop))
        worker.cancel(running)
        engine.steps.release()
        for job in dead:
            assert await first_event(job, Finished) == Finished("cancelled")
        for job in live:
            await first_event(job, int)  # served in turn
            worker.cancel(job)
            engine.steps.release()
            assert await first_event(job, Finished) == Finished("cancelled")

    asyncio.run(main())
    assert engine.num_prefills == 3  # the dead jobs were dropped without compute
    assert settles_to_zero(worker) and queue_depth(worker) == 0


def test_jobs_dropped_before_compute_do_not_shorten_retry_after(gated, monkeypatch):
    """Retry-After estimates when a running job ends from recent job durations; a job
    dropped before compute took no time in the batch and must not count as a ~0 s job
    (Retry-After would drop to 1 s however long the running jobs have left)."""
    monkeypatch.setattr(worker_module, "SlotEstimate", partial(SlotEstimate, initial_s=60.0))
    engine, worker = gated(queue_size=1, max_batch=2)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        running = new_job(loop)
        worker.submit(running)
        await first_event(running, int)
        dead = new_job(loop)
        worker.submit(dead)
        dead.cancelled.set()
        engine.steps.release()  # after this step the thread takes (and drops) the dead job
        assert await first_event(dead, Finished) == Finished("cancelled")
        waiting = new_job(loop)
        worker.submit(waiting)  # the queue is full again
        with pytest.raises(QueueFull) as full:
            worker.submit(new_job(loop))
        for job in (running, waiting):
            worker.cancel(job)
        engine.run_free.set()
        for job in (running, waiting):
            assert await first_event(job, Finished) == Finished("cancelled")
        return full.value.retry_after_s

    assert asyncio.run(main()) >= 50  # 60 s expected, minus the running job's elapsed time


def test_a_decoding_job_does_not_keep_its_prefills_kv(gated):
    """Once decoding started the prompt's KV lives in the decode pool's row; the job keeps
    only the prefill's figures, not the Prefill with its k/v tensors (a second copy of the
    prompt's KV for the whole answer)."""
    engine, worker = gated(queue_size=2, max_batch=2)

    async def main() -> None:
        job = new_job(asyncio.get_running_loop())
        worker.submit(job)
        await first_event(job, int)  # prefilled, decoding, its steps held
        gc.collect()
        assert engine.k_refs[0]() is None, "the prefill's k tensor is still referenced"
        worker.cancel(job)
        engine.steps.release()
        assert await first_event(job, Finished) == Finished("cancelled")

    asyncio.run(main())


@pytest.mark.parametrize(
    ("reason", "offered"),
    [("stop", True), ("length", True), ("timeout", False), ("cancelled", False)],
)
def test_only_answers_that_ran_to_their_end_are_offered_to_the_shadow(reason, offered):
    """A request past its deadline ends with what it had, often nothing (the deadline
    passed during its prefill): it was offered, and full prefill's answer cut to it scored
    F1 1.0 for an empty one, flattering the proxy exactly when the pod is saturated."""
    seen: list = []
    worker = object.__new__(EngineWorker)  # `_end` needs only the hook
    worker.on_answered = seen.append
    running = SimpleNamespace(
        sequence=SimpleNamespace(close=lambda: None),
        job=SimpleNamespace(emit=lambda event: None, prompt="prompt", stop=("\n\n",)),
        blended=True, answer=[], ratio=0.15, limit=8, inline_statistic=None,
    )  # fmt: skip
    assert EngineWorker._end(worker, running, reason) is False
    assert len(seen) == (1 if offered else 0)
    # The shadow cuts both answers at the request's stop sequences.
    assert all(answered.stop == ("\n\n",) for answered in seen)


@pytest.mark.parametrize("how", ["cancel", "event"])
def test_a_cancelled_waiting_job_is_not_held_while_the_batch_is_busy(gated, how):
    """A job cancelled while queued gave its place back but stayed in the thread's queue,
    with its tokenized prompt, until the batch had room: clients that leave while queued
    (a short client timeout under load) piled up prompts for as long as the batch stayed
    full. It now leaves the queue at once, and still gets its one `Finished`."""
    engine, worker = gated(queue_size=2, max_batch=1)

    async def main() -> tuple[int, list]:
        loop = asyncio.get_running_loop()
        running = new_job(loop)
        worker.submit(running)
        await first_event(running, int)  # decoding, its steps held
        refs, queues = [], []
        for _ in range(5):
            now = time.perf_counter()
            job = Job(None, 1000, now, now + 120, loop)
            worker.submit(job)
            worker.cancel(job) if how == "cancel" else job.cancelled.set()
            worker.num_pending  # noqa: B018 (where a directly set event is seen)
            refs.append(weakref.ref(job))
            queues.append(job.events)
            del job
        gc.collect()
        num_held = sum(ref() is not None for ref in refs)
        worker.cancel(running)
        engine.steps.release()
        ends = [await asyncio.wait_for(events.get(), 10) for events in queues]
        assert await first_event(running, Finished) == Finished("cancelled")
        return num_held, ends

    num_held, ends = asyncio.run(main())
    assert num_held == 0
    assert ends == [Finished("cancelled")] * 5
    assert engine.num_prefills == 1
    assert settles_to_zero(worker) and queue_depth(worker) == 0


class _Escaped(BaseException):
    """What no handler of the compute thread catches."""


def _escape() -> None:
    raise _Escaped


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("when", ["taking a job", "decoding"])
def test_every_job_fails_at_once_when_something_escapes_the_compute_thread(gated, when):
    """Something escaped the compute thread: the job it had just taken still counted as
    queued, and it, the jobs decoding and those queued behind them waited out their
    deadline (a 504 after 120 s by default) while the probes and the route already said
    503. Each now gets the failure at once, nothing counts as queued or pending, and a job
    submitted after that gets it too."""
    engine, worker = gated(queue_size=4, max_batch=1)

    async def main() -> list:
        loop = asyncio.get_running_loop()
        jobs = []
        if when == "decoding":
            jobs.append(new_job(loop))
            worker.submit(jobs[0])
            await first_event(jobs[0], int)  # decoding, its steps held
        worker.between_steps = _escape
        for _ in range(2):
            jobs.append(new_job(loop))
            worker.submit(jobs[-1])
        engine.steps.release()
        errors = [await first_event(job, Exception) for job in jobs]
        deadline = time.monotonic() + 10
        while not worker.has_died:
            assert time.monotonic() < deadline, "the compute thread did not end"
            await asyncio.sleep(0.01)
        late = new_job(loop)
        worker.submit(late)
        return [*errors, await first_event(late, Exception)]

    errors = asyncio.run(main())
    assert len(errors) == (4 if when == "decoding" else 3)
    for error in errors:
        assert str(error) == "the compute thread ended; this server answers no more requests"
    assert worker.num_pending == 0 and queue_depth(worker) == 0
