"""The decode pool's byte budget (`--decode-pool-bytes`): every row of the pool has the
longest row's slots, so one long answer among short ones made every row long (8 rows of
8,192 slots of SmolLM2-135M in float32: 3 GB) and a pod with a memory limit was killed.
With a budget a request joins the batch only when the pool, grown for it and for every
answer in it to its limit, stays within the budget; else it waits first in line, and one
over the budget by itself runs alone.

The pool is checked directly on a tiny random model (real decode steps, real growth),
the worker on the real SmolLM2 model."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.model import batch_decode
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import preset_config, random_weights
from holeblend_runtime.serve.live_config import LiveConfig
from holeblend_runtime.serve.metrics import ServeMetrics
from holeblend_runtime.serve.settings import parse_settings
from holeblend_runtime.serve.worker import EngineWorker, Finished, Job, PrefillDone
from tests.serve.conftest import example_settings_json
from tests.serve.test_batching import Logged, end_of, first_index, settles_to_zero, tokens_of

QUANTUM = batch_decode.SLOT_QUANTUM


@pytest.fixture(scope="module")
def tiny() -> Llama:
    config = dataclasses.replace(
        preset_config("smollm2-135m"), num_layers=2, hidden_size=64, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=100,
        context_length=2048,
    )  # fmt: skip
    return Llama(config, random_weights(config))


def pool_bytes(pool: batch_decode.KVPool) -> int:
    return pool.num_rows * pool.num_slots * pool.slot_bytes


def test_a_slot_costs_layers_kv_heads_head_dim_two_and_the_dtype_bytes(tiny):
    pool = batch_decode.KVPool(tiny)
    k, v = tiny.new_kv(10)
    pool.add(k, v, num_slots=20)
    assert pool.slot_bytes == 2 * 2 * 16 * 2 * 4
    assert pool.k.nbytes + pool.v.nbytes == pool_bytes(pool)
    with pytest.raises(ValueError, match="max_bytes: must be >= 1, got 0"):
        batch_decode.KVPool(tiny, max_bytes=0)


def test_growth_by_half_again_adds_no_spare_rows_beyond_the_budget(tiny):
    """A fourth row grows a pool of three to five: with a budget of four rows the fifth
    would put it over, for a row nobody uses."""
    k, v = tiny.new_kv(10)
    free = batch_decode.KVPool(tiny)
    budgeted = batch_decode.KVPool(tiny, max_bytes=4 * QUANTUM * free.slot_bytes)
    sequences = []
    for pool in (free, budgeted):
        for _ in range(4):
            assert pool.can_start(10, 5)
            sequences.append(batch_decode.start_sequence(pool, k, v, torch.zeros(1), 5))
    assert free.num_rows == 5 and budgeted.num_rows == 4
    assert pool_bytes(budgeted) <= budgeted.max_bytes
    assert not budgeted.can_start(10, 5)  # a fifth row is over the budget


def test_can_start_counts_every_live_row_at_its_limit(tiny):
    """A short prompt with a long answer limit holds 256 slots now and 1,024 later: a
    second row beside it is judged at what the pool becomes when that answer grows."""
    pool = batch_decode.KVPool(tiny, max_bytes=2 * 2 * QUANTUM * tiny_slot_bytes(tiny))
    k, v = tiny.new_kv(20)
    assert pool.can_start(20, 1000)  # alone: 1 row x 1,024 slots
    long = batch_decode.start_sequence(pool, k, v, torch.zeros(1), 1000)
    assert pool.num_slots == QUANTUM
    assert not pool.can_start(20, 5)  # 2 rows x 1,024 slots once the answer grew
    assert pool.can_start(20, 1)  # a one-token answer needs no row
    long.close()
    assert pool.can_start(20, 5)
    assert batch_decode.KVPool(tiny).can_start(20, 10**6)  # no budget: always


def tiny_slot_bytes(model: Llama) -> int:
    return batch_decode.KVPool(model).slot_bytes


def decode_in_arrival_order(model, pool, arrivals) -> tuple[int, list[int]]:
    """Serve `arrivals` (prompt tokens, answer limit) as the worker does: the next one
    starts when the pool can take it or nothing decodes; then one step for all. The
    largest pool (bytes) seen while more than one row was live, and the start order."""
    generator = torch.Generator().manual_seed(7)
    waiting, going, started, largest = list(enumerate(arrivals)), [], [], 0
    logits = torch.zeros(model.config.vocab_size)
    with torch.inference_mode():
        while waiting or going:
            while waiting and (not going or pool.can_start(*waiting[0][1])):
                index, (tokens, limit) = waiting.pop(0)
                k, v = model.new_kv(tokens)
                k.normal_(generator=generator), v.normal_(generator=generator)
                going.append(batch_decode.start_sequence(pool, k, v, logits, limit))
                started.append(index)
                if len(pool.live_rows) > 1:
                    largest = max(largest, pool_bytes(pool))
            batch_decode.decode_step(model, going, [3] * len(going))
            if len(pool.live_rows) > 1:
                largest = max(largest, pool_bytes(pool))
            for sequence in going:
                sequence.produced()
                if sequence.room < 1:
                    sequence.close()
            going = [s for s in going if s.room >= 1]
    return largest, started


def test_long_and_short_requests_never_share_a_pool_over_the_budget(tiny):
    """Short requests, then one whose answer grows its row to 512 slots, more short ones,
    one with a long prompt (512 slots at once), one more short. Without a budget they all
    decode together in rows of 512 slots. With a budget of 3 rows x 256 slots each long
    one runs alone, the short ones after it wait until it is done, none passes it, and
    every one is served."""
    arrivals = [(30, 8), (40, 8), (230, 40), (30, 8), (50, 8), (300, 8), (10, 8)]
    budget = 3 * QUANTUM * tiny_slot_bytes(tiny)
    unbounded, _ = decode_in_arrival_order(tiny, batch_decode.KVPool(tiny, max_rows=8), arrivals)
    assert unbounded > budget  # what the budget prevents
    pool = batch_decode.KVPool(tiny, max_rows=8, max_bytes=budget)
    largest, started = decode_in_arrival_order(tiny, pool, arrivals)
    assert largest <= budget
    assert started == list(range(len(arrivals)))  # arrival order, every one served
    assert pool.live_rows == []


# --- the worker on the real model ----------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine.load(num_threads=1)


@pytest.fixture(scope="module")
def prompts(engine):
    system = "Answer from the documents."
    documents = (
        "The Aral Sea was once the fourth largest lake in the world, fed by two rivers.",
        "Lichens are partnerships of a fungus with algae, and they grow on bare rock.",
    )
    questions = ("Which lake shrank?", "What are lichens?", "Which lake?", "What grows?")
    return [engine.build_prompt(system, documents, question) for question in questions]


@pytest.fixture
def budgeted_worker(engine, tmp_path):
    """budgeted_worker(decode_pool_bytes) -> a started worker (batch of 4, full mode) and
    the rows x slots of every decode step's sequences at their limits."""
    config = tmp_path / "blend.json"
    config.write_text(example_settings_json(mode="off"))
    workers, steps = [], []
    step = engine.decode_step

    def recording(sequences, tokens):
        steps.append([s.num_slots for s in sequences])
        step(sequences, tokens)

    def make(decode_pool_bytes: int) -> EngineWorker:
        engine.decode_pool.clear()  # every row was given back: the earlier tests settled
        worker = EngineWorker(
            engine, LiveConfig(config), ServeMetrics(), 8, 4, torch_threads=1,
            decode_pool_bytes=decode_pool_bytes,
        )  # fmt: skip
        worker.start()
        workers.append(worker)
        return worker

    engine.decode_step = recording
    yield make, steps
    for worker in workers:
        worker.stop()
    del engine.decode_step
    engine.decode_pool.max_bytes = None


def run_with(worker, prompts, specs: dict, between_steps) -> list:
    """Submit one job per spec (name -> (prompt index, max_tokens)) in that order, with
    `between_steps(jobs)` run by the compute thread before every step; the shared event
    log once every job ended."""

    async def main() -> list:
        loop = asyncio.get_running_loop()
        log: list = []
        now = time.perf_counter()
        jobs = {
            name: Job(
                prompts[index], max_tokens, now, now + 120, loop, True, Logged(name, log, None)
            )
            for name, (index, max_tokens) in specs.items()
        }
        worker.between_steps = lambda: between_steps(jobs)
        for job in jobs.values():
            worker.submit(job)
        for job in jobs.values():
            while not isinstance(await asyncio.wait_for(job.events.get(), 120), Finished):
                pass
        return log

    return asyncio.run(main())


def test_a_request_that_would_put_the_pool_over_its_budget_waits_first_in_line(
    budgeted_worker, engine, prompts
):
    """A request with max_tokens 700 (one row of 1,024 slots once its answer grew)
    arrives behind a short one: together they would be 2 rows of 1,024 slots, over a
    budget of 4 rows x 256. It waits until the short one ended, then runs alone (it is
    stopped after three steps); the short requests behind it, which would fit beside the
    first, do not pass it, and decode together once it ended."""
    make, steps = budgeted_worker
    slot_bytes = engine.decode_pool.slot_bytes
    budget = 4 * QUANTUM * slot_bytes
    worker = make(budget)
    long_slots = prompts[1].num_tokens + 700 - 1

    def stop_long(jobs: dict) -> None:
        if sum(long_slots in sizes for sizes in steps) >= 2:
            jobs["long"].stopped.set()  # seen after its next step

    specs = {"first": (0, 4), "long": (1, 700), "second": (2, 4), "third": (3, 4)}
    log = run_with(worker, prompts, specs, stop_long)
    assert end_of(log, "long") == Finished("stop") and len(tokens_of(log, "long")) == 3
    for name in ("first", "second", "third"):
        assert end_of(log, name) == Finished("length") and len(tokens_of(log, name)) == 4
    assert first_index(log, "first", Finished) < first_index(log, "long", PrefillDone)
    assert first_index(log, "long", Finished) < first_index(log, "second", PrefillDone)
    assert [len(sizes) for sizes in steps] == [1, 1, 1, 1, 1, 1, 2, 2, 2]
    assert [long_slots in sizes for sizes in steps] == [False] * 3 + [True] * 3 + [False] * 3
    for sizes in steps:
        rows, slots = len(sizes), -(-max(sizes) // QUANTUM) * QUANTUM
        assert rows * slots * slot_bytes <= budget, steps
    assert settles_to_zero(worker) and engine.decode_pool.live_rows == []


def test_a_waiting_request_cancelled_first_in_line_lets_the_next_one_in(
    budgeted_worker, engine, prompts
):
    """The request waiting for room stays in the queue: cancelled there (its client
    left), it ends at once without compute and the one behind it joins the batch while
    the first still decodes."""
    make, steps = budgeted_worker
    worker = make(4 * QUANTUM * engine.decode_pool.slot_bytes)

    def cancel_long(jobs: dict) -> None:
        if steps:
            worker.cancel(jobs["long"])

    specs = {"first": (0, 6), "long": (1, 700), "next": (2, 4)}
    log = run_with(worker, prompts, specs, cancel_long)
    assert end_of(log, "long") == Finished("cancelled") and tokens_of(log, "long") == []
    assert not any(owner == "long" and isinstance(e, PrefillDone) for owner, e in log)
    assert end_of(log, "first") == Finished("length") and end_of(log, "next") == Finished("length")
    assert first_index(log, "next", PrefillDone) < first_index(log, "first", Finished)
    assert settles_to_zero(worker)


def test_the_budget_is_a_setting_named_in_its_errors(engine, tmp_path, capsys):
    assert parse_settings(["--config", "c"], {}).decode_pool_bytes is None
    given = ["--config", "c", "--decode-pool-bytes", "1000000"]
    assert parse_settings(given, {}).decode_pool_bytes == 1_000_000
    environ = {"HOLEBLEND_SERVE_DECODE_POOL_BYTES": "2000"}
    assert parse_settings(["--config", "c"], environ).decode_pool_bytes == 2000
    for argv, environ, message in (
        (["--decode-pool-bytes", "0"], {}, "--decode-pool-bytes: must be >= 1, got 0"),
        (["--decode-pool-bytes", "-5"], {}, "--decode-pool-bytes: must be >= 1, got -5"),
        (["--decode-pool-bytes", "3GB"], {}, "--decode-pool-bytes: invalid int value"),
        ([], {"HOLEBLEND_SERVE_DECODE_POOL_BYTES": "lots"}, "DECODE_POOL_BYTES: 'lots'"),
    ):
        with pytest.raises(SystemExit) as caught:
            parse_settings(["--config", "c", *argv], environ)
        assert caught.value.code == 2 and message in capsys.readouterr().err
    config = tmp_path / "blend.json"
    config.write_text(example_settings_json(mode="off"))
    with pytest.raises(ValueError, match="decode_pool_bytes: must be >= 1, got 0"):
        EngineWorker(engine, LiveConfig(config), ServeMetrics(), 8, 4, 1, decode_pool_bytes=0)
