"""The blend's attention through vLLM's CPU kernel equals ours on every sparse causal pattern."""

import pytest
import torch

from holeblend_runtime.model.attention import CHUNKED, attend, plan_attention

ops = pytest.importorskip("vllm._custom_ops")
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from holeblend_runtime.vllm_connector.paged_attention import PagedBlendAttention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def kernel() -> PagedBlendAttention:
    isa = _get_attn_isa(torch.float32, BLOCK, HEAD_DIM, "auto")
    return PagedBlendAttention(ops, isa, BLOCK, HEADS, KV_HEADS, HEAD_DIM, torch.float32)


def positions_of(kind: str, num_keys: int, generator: torch.Generator) -> torch.Tensor:
    if kind == "causal":  # layers below the check layer: every position
        return torch.arange(num_keys)
    if kind == "last":  # one query at the end
        return torch.tensor([num_keys - 1])
    if kind == "one-early":  # one query before the end (a blend without logits)
        return torch.tensor([num_keys // 3])
    # A hole in the middle, scattered selected tokens, the tail: runs of every length.
    hole = torch.arange(num_keys // 3, num_keys // 2)
    scattered = torch.randint(0, num_keys, (num_keys // 6,), generator=generator)
    tail = torch.arange(max(0, num_keys - 5), num_keys)
    return torch.unique(torch.cat([hole, scattered, tail]))


@pytest.mark.parametrize("kind", ["causal", "last", "one-early", "sparse"])
@pytest.mark.parametrize("num_keys", [1, 37, 500])
def test_the_kernel_attends_as_our_attention_does(kind, num_keys):
    generator = torch.Generator().manual_seed(num_keys)
    positions = positions_of(kind, num_keys, generator)
    n = positions.shape[0]
    q = torch.randn(HEADS, n, HEAD_DIM, generator=generator)
    # More slots than keys, as the blend's buffers have: the extra ones must not be read.
    k = torch.randn(KV_HEADS, num_keys + 7, HEAD_DIM, generator=generator)
    v = torch.randn(KV_HEADS, num_keys + 7, HEAD_DIM, generator=generator)
    plan = plan_attention(positions, num_keys, backend=CHUNKED, ends_at_last_key=False)
    expected = attend(q, k, v, plan)
    paged = kernel()
    got = paged(q, k, v, plan)
    assert got.shape == (n, HEADS, HEAD_DIM)
    assert torch.allclose(got.transpose(0, 1), expected, atol=2e-5, rtol=1e-4)
    # Every layer of the same request reuses its batch; new K/V are read each time.
    k2, v2 = k * 0.5, v.flip(1)
    got2 = paged(q, k2, v2, plan)
    assert len(paged._batches) == 1
    assert torch.allclose(got2.transpose(0, 1), attend(q, k2, v2, plan), atol=2e-5, rtol=1e-4)


def test_a_batch_lives_as_long_as_its_plan():
    paged = kernel()
    plan = plan_attention(torch.tensor([3, 4, 9]), 10, backend=CHUNKED)
    q, k, v = torch.randn(HEADS, 3, HEAD_DIM), torch.randn(KV_HEADS, 10, HEAD_DIM), torch.randn(KV_HEADS, 10, HEAD_DIM)  # fmt: skip
    paged(q, k, v, plan)
    assert len(paged._batches) == 1
    del plan
    assert len(paged._batches) == 0
