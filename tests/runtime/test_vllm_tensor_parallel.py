"""Tensor parallelism in the connector without vLLM: one entry per rank under a key that
names the layout, the scheduler's all-ranks index, the same recompute set on every rank
(scores summed over the ranks) and the ranks' agreement on which segments they blend.

vLLM itself at TP 2 runs in tests/vllm/test_tensor_parallel.py (`make test-vllm`)."""

import types

import torch

from holeblend_runtime.blend.blender import Blender, CachedSpan
from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.kv.store import SegmentKV
from holeblend_runtime.model.config import ModelConfig
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import random_weights
from holeblend_runtime.vllm_connector.store import AllShardsIndex, ShardedKVStore, shard_key
from holeblend_runtime.vllm_connector.worker import BlendWorker

KEY = "ab12" * 16


def _entry(key: str, heads: int = 1) -> SegmentKV:
    shape = (2, heads, 3, 4)
    return SegmentKV(key, torch.randn(shape), torch.randn(shape), torch.arange(3), "m")


def test_each_rank_stores_and_reads_its_own_entry(tmp_path):
    tiers = DirectoryKVStore(tmp_path, 1 << 20)
    rank0, rank1 = ShardedKVStore(tiers, 0, 2), ShardedKVStore(tiers, 1, 2)
    stored = _entry(KEY)
    assert rank0.put(stored)
    assert rank0.contains(KEY) and not rank1.contains(KEY)
    got = rank0.get(KEY)
    # The engine sees the segment key; the tiers hold the rank's key.
    assert got is not None and got.key == KEY
    torch.testing.assert_close(got.k, stored.k)
    assert tiers.keys() == [shard_key(KEY, 0, 2)] == [f"{KEY}tp2r0"]
    assert rank1.get_many([KEY]) == [None]
    # Another layout never reads it: one rank (the plain key) or four ranks.
    assert not tiers.contains(KEY)
    assert ShardedKVStore(tiers, 0, 4).get(KEY) is None


def test_the_scheduler_counts_a_segment_cached_only_when_every_rank_stored_it(tmp_path):
    tiers = DirectoryKVStore(tmp_path, 1 << 20)
    other = "cd34" * 16
    ShardedKVStore(tiers, 0, 2).put(_entry(KEY))
    for rank in (0, 1):
        ShardedKVStore(tiers, rank, 2).put(_entry(other))
    assert AllShardsIndex(tiers, 2).contains_many([KEY, other, "ef56" * 16]) == [
        False,
        True,
        False,
    ]
    assert AllShardsIndex(tiers, 2).contains_many([]) == []


CONFIG = ModelConfig(
    model_id="tiny", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=96, rope_theta=10000.0, rms_norm_eps=1e-5, vocab_size=100,
    context_length=512, bos_token_id=1, eos_token_id=2, add_bos_token=False,
    tie_word_embeddings=True,
)  # fmt: skip


def test_the_recompute_set_follows_the_scores_summed_over_the_ranks():
    """What `reduce_shards` returns is what the selection ranks: a rank's own deviation
    (its heads only) never picks the tokens."""
    model = Llama(CONFIG, random_weights(CONFIG, seed=3))
    num_tokens, span = 60, (10, 50)
    k, v = model.new_kv(num_tokens)
    token_ids = torch.randint(0, CONFIG.vocab_size, (num_tokens,))
    model.forward(token_ids, k, v, start=0)
    stored = SegmentKV(
        "s", k[:, :, span[0] : span[1]].clone(), v[:, :, span[0] : span[1]].clone(),
        torch.arange(*span), "tiny",
    )  # fmt: skip
    spans = [CachedSpan(*span, stored)]
    # The other ranks' share: a large score on chosen cached tokens.
    chosen = torch.tensor([12, 20, 33, 41, 47])
    others = torch.zeros(span[1] - span[0])
    others[chosen - span[0]] = 1e6
    calls = []

    def reduce_shards(scores: torch.Tensor) -> torch.Tensor:
        calls.append(scores.shape[0])
        return scores + others

    model.reduce_shards = reduce_shards
    result = Blender(model, BlendConfig(check_layer=1, selection="kDeviation")).blend(
        token_ids, spans, ratio=len(chosen) / (span[1] - span[0])
    )
    assert calls == [span[1] - span[0]]
    assert sorted(result.selected.tolist()) == chosen.tolist()


def test_the_ranks_blend_only_segments_every_rank_could_load():
    """One rank's unusable entry is a hole on every rank (the flags are summed over the
    ranks); one rank gets its flags back without a device round trip."""
    other_ranks_missing = torch.tensor([0.0, 1.0, 0.0, 0.0])

    def two_ranks(missing: torch.Tensor) -> torch.Tensor:
        return missing + other_ranks_missing

    model = types.SimpleNamespace(num_shards=2, device=torch.device("cpu"), reduce_shards=two_ranks)
    worker = BlendWorker(types.SimpleNamespace(model=model), writer=None)
    assert worker._on_every_rank([True, True, False, True]) == [True, False, False, True]
    one = types.SimpleNamespace(device=torch.device("cpu"), reduce_shards=None)  # never called
    assert BlendWorker(types.SimpleNamespace(model=one), writer=None)._on_every_rank([True]) == [
        True
    ]
