"""Two tensor-parallel ranks of the connector's worker, each a process with its own store
shard, agreeing over a real process group (gloo, on the CPU) on every load: one rank's
failure must never leave the other waiting in a collective.

Each rank runs the reference model (a tiny random-weight Llama, every head on both ranks)
with `reduce_shards` all-reducing over the group, as `VllmModelAdapter.reduce_shards` does
over vLLM's tensor-parallel group; the loads go through `BlendWorker.load`, as
`start_load_kv` runs them."""

import dataclasses
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.reuse import ReusePolicy
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.model.gguf import load_model_files
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import random_weights
from holeblend_runtime.model.tokenizer import TextTokenizer
from holeblend_runtime.vllm_connector.accounting import LoadSpec
from holeblend_runtime.vllm_connector.metadata import LoadRequest
from holeblend_runtime.vllm_connector.planning import ReusePlanner
from holeblend_runtime.vllm_connector.store import ShardedKVStore, shard_key
from holeblend_runtime.vllm_connector.worker import BlendWorker, PagedKVWriter

NUM_RANKS = 2
BROKEN_RANK = 1
BLOCK = 16
# Seconds a rank waits in a collective before giving up, and the test for both ranks:
# far above what the run takes, so only a hang reaches them.
COLLECTIVE_TIMEOUT_S = 30
JOIN_TIMEOUT_S = 60


class _RankOfTwo(Llama):
    num_shards = NUM_RANKS

    def reduce_shards(self, scores: torch.Tensor) -> torch.Tensor:
        summed = scores.contiguous().clone()
        dist.all_reduce(summed)
        return summed


class _Attention:
    """An attention module without a cache-update op: the writer scatters with torch."""


def _engine(kv_dir: str, rank: int) -> BlendEngine:
    files = load_model_files()
    config = dataclasses.replace(
        files.config, model_id="tiny", num_layers=3, hidden_size=64, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=96,
    )  # fmt: skip
    model = _RankOfTwo(config, random_weights(config, seed=5))
    store = ShardedKVStore(DirectoryKVStore(kv_dir, 1 << 26), rank, NUM_RANKS)
    return BlendEngine(model, TextTokenizer(files.tokenizer, config), BlendConfig(), store)


def _outcome(worker: BlendWorker, load: LoadRequest) -> dict:
    try:
        return dataclasses.asdict(worker.load(load)) | {"failed": False}
    except Exception as error:
        return {"failed": True, "error": repr(error)}


def join_group(rank: int, rendezvous: str) -> None:
    """This process as rank `rank` of a gloo group of NUM_RANKS (one torch thread each)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=NUM_RANKS,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def two_document_prompt(engine: BlendEngine):
    return engine.build_prompt(
        "Answer from the documents.",
        ["The Varn bridge has seven stone arches. " * 3, "Oskeby museum opened in 1923. " * 3],
        "How many arches?",
    )


def _rank(rank: int, kv_dir: str, rendezvous: str, results: "mp.Queue") -> None:
    join_group(rank, rendezvous)
    try:
        engine = _engine(kv_dir, rank)
        prompt = two_document_prompt(engine)
        engine.cache_segments(prompt)
        planner = ReusePlanner(
            engine.prompt_builder.separator_ids, engine.keyer, engine.store, ReusePolicy.HOLE
        )
        plan = planner.plan(prompt.token_ids)
        c = engine.config
        num_blocks = -(-prompt.num_tokens // BLOCK)
        caches = [torch.zeros(2, num_blocks, BLOCK, c.num_kv_heads, c.head_dim) for _ in range(3)]
        writer = PagedKVWriter([_Attention() for _ in caches], caches, BLOCK)
        worker = BlendWorker(engine, writer)
        load = LoadRequest(
            "r", plan.prompt, plan.keys, plan.reuse.reused_segments,
            LoadSpec(0, plan.num_covered_tokens), tuple(range(num_blocks)), 0.15,
        )  # fmt: skip
        document = plan.reuse.reused_segments[-1]
        entry = engine.store.inner.path(shard_key(plan.keys[document], rank, NUM_RANKS))
        dist.barrier()
        if rank == BROKEN_RANK:  # its entry cannot even be looked at: reading it raises
            entry.unlink()
            os.symlink(entry.name, entry)
        results.put((rank, "raised", _outcome(worker, load)))
        if rank == BROKEN_RANK:  # now simply missing
            entry.unlink()
        results.put((rank, "missing", _outcome(worker, load)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> dict:
    """Each rank's outcome of each load, by (rank, case); fails if a rank hangs."""
    return run_ranks(_rank, tmp_path_factory.mktemp("tensor_parallel"))


def run_ranks(rank, root) -> dict:
    """`rank(rank_index, kv_dir, rendezvous_file, results)` on NUM_RANKS spawned processes;
    what they put in `results`, by (rank, case). Fails if a rank still runs after
    JOIN_TIMEOUT_S (the ranks hang) or one raised (their collectives did not pair up)."""
    results = mp.get_context("spawn").Queue()
    ranks = mp.spawn(
        rank,
        args=(str(root / "kv"), str(root / "rendezvous"), results),
        nprocs=NUM_RANKS,
        join=False,
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ranks.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() >= deadline:
                pytest.fail(f"a rank still runs after {JOIN_TIMEOUT_S} s: the ranks hang")
    except mp.ProcessRaisedException as error:
        pytest.fail(f"the ranks' collectives did not pair up; outcomes {_drain(results)}: {error}")
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
    return _drain(results)


def _drain(results: "mp.Queue") -> dict:
    found = {}
    while not results.empty():
        rank, case, outcome = results.get()
        found[rank, case] = outcome
    return found


def test_a_fetch_that_raises_on_one_rank_fails_the_load_on_every_rank(rank_results):
    raised = [rank_results[rank, "raised"] for rank in range(NUM_RANKS)]
    assert [outcome["failed"] for outcome in raised] == [True, True], raised
    assert "symbolic links" in raised[BROKEN_RANK]["error"]
    assert "another tensor-parallel rank" in raised[1 - BROKEN_RANK]["error"]


def test_an_entry_missing_on_one_rank_is_a_hole_on_every_rank(rank_results):
    """After the failed load the ranks' collectives still pair up: the next load blends on
    both, with the broken rank's missing entry computed fresh on both."""
    missing = [rank_results[rank, "missing"] for rank in range(NUM_RANKS)]
    assert [outcome["failed"] for outcome in missing] == [False, False], missing
    assert [outcome["num_rejected_segments"] for outcome in missing] == [1, 1]
    assert missing[0]["num_recomputed_tokens"] == missing[1]["num_recomputed_tokens"]
    assert missing[0]["num_reused_tokens"] == missing[1]["num_reused_tokens"] > 0
