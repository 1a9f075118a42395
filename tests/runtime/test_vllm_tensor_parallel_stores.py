"""Two tensor-parallel ranks of the connector's worker storing missing segments (computed in
canonical context: a forward with collectives), each a process with its own store shard
over a real process group (gloo, on the CPU): what fails on one rank must never leave the
other waiting in a collective, as for loads (test_vllm_tensor_parallel_loads.py, whose
model, store and ranks these reuse)."""

import errno
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_vllm_tensor_parallel_loads import (
    BLOCK,
    BROKEN_RANK,
    NUM_RANKS,
    _Attention,
    _engine,
    join_group,
    run_ranks,
    two_document_prompt,
)

from holeblend_runtime.blend.reuse import ReusePolicy
from holeblend_runtime.blend.segments import SegmentKind
from holeblend_runtime.vllm_connector.accounting import LoadSpec
from holeblend_runtime.vllm_connector.metadata import LoadRequest, StoreRequest
from holeblend_runtime.vllm_connector.planning import ReusePlanner
from holeblend_runtime.vllm_connector.store import shard_key
from holeblend_runtime.vllm_connector.worker import BlendWorker, PagedKVWriter


class _LookupFails:
    """A rank's store whose lookups raise EIO while `is_broken` (its node directory on a
    failing volume: `Path.is_file` raises); everything else is the real store's."""

    def __init__(self, store) -> None:
        self.store = store
        self.is_broken = False

    def contains_many(self, keys):
        if self.is_broken:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self.store.contains_many(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _stored(worker: BlendWorker, request: StoreRequest) -> dict:
    try:
        return {"failed": False, "stored": worker.store(request)}
    except Exception as error:
        return {"failed": True, "error": repr(error)}


def _rank(rank: int, kv_dir: str, rendezvous: str, results: "mp.Queue") -> None:
    join_group(rank, rendezvous)
    try:
        engine = _engine(kv_dir, rank)
        lookups = engine.store = _LookupFails(engine.store)
        prompt = two_document_prompt(engine)
        documents = [i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.DOCUMENT]
        hole = documents[0]  # not cached: a hole between the system prompt and the last one
        engine.cache_segments(prompt, [i for i in range(len(prompt.segments)) if i != hole])
        c = engine.config
        num_blocks = -(-prompt.num_tokens // BLOCK)
        caches = [torch.zeros(2, num_blocks, BLOCK, c.num_kv_heads, c.head_dim) for _ in range(3)]
        worker = BlendWorker(engine, PagedKVWriter([_Attention() for _ in caches], caches, BLOCK))
        dist.barrier()
        lookups.is_broken = rank == BROKEN_RANK
        results.put((rank, "lookup raised", _stored(worker, StoreRequest("a", prompt, (hole,)))))
        lookups.is_broken = False
        planner = ReusePlanner(
            engine.prompt_builder.separator_ids, engine.keyer, engine.store, ReusePolicy.HOLE
        )
        plan = planner.plan(prompt.token_ids)
        if rank == BROKEN_RANK:  # its hole's entry cannot be written: storing it raises
            os.mkdir(engine.store.inner.path(shard_key(plan.keys[hole], rank, NUM_RANKS)))
        load = LoadRequest(
            "b", plan.prompt, plan.keys, plan.reuse.reused_segments,
            LoadSpec(0, plan.num_covered_tokens), tuple(range(num_blocks)), 0.15,
        )  # fmt: skip
        worker.load(load)  # offers the hole it blended on rank 0 only
        results.put(
            (rank, "offered on one rank", _stored(worker, StoreRequest("b", prompt, (hole,))))
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> dict:
    """Each rank's outcome of each store, by (rank, case); fails if a rank hangs."""
    return run_ranks(_rank, tmp_path_factory.mktemp("tensor_parallel_stores"))


def test_a_store_whose_lookup_raises_on_one_rank_fails_on_every_rank(rank_results):
    raised = [rank_results[rank, "lookup raised"] for rank in range(NUM_RANKS)]
    assert [outcome["failed"] for outcome in raised] == [True, True], raised
    assert "Input/output error" in raised[BROKEN_RANK]["error"]
    assert "another tensor-parallel rank" in raised[1 - BROKEN_RANK]["error"]


def test_a_hole_one_rank_failed_to_store_from_its_blend_is_computed_on_every_rank(rank_results):
    """Rank 0 stored the hole from its blend, rank 1 could not: both compute it in its
    canonical context (their collectives pair up), rank 0 stores it, rank 1's write fails
    again, after the compute."""
    offered = [rank_results[rank, "offered on one rank"] for rank in range(NUM_RANKS)]
    assert offered[1 - BROKEN_RANK] == {"failed": False, "stored": 1}, offered
    assert offered[BROKEN_RANK]["failed"], offered
    assert "IsADirectoryError" in offered[BROKEN_RANK]["error"]
