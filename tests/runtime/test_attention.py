"""Causal attention over a sparse, sorted set of query positions."""

import pytest
import torch

from holeblend_runtime.attention import attend, causal_mask, plan_causal


def _reference(q, k, v, positions):
    """Softmax attention written out: query i sees keys 0..positions[i]."""
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    hidden = torch.arange(k.shape[1])[None, :] > positions[:, None]
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunked_sparse_attention_equals_the_written_out_reference(chunk_size):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape, generator=generator) for shape in [(6, 40, 16), (2, 90, 16), (2, 90, 16)]
    )
    positions = torch.randperm(90, generator=generator)[:40].sort().values
    plan = plan_causal(positions, 90, chunk_size=chunk_size)
    torch.testing.assert_close(
        attend(q, k, v, plan), _reference(q, k, v, positions), atol=1e-5, rtol=1e-5
    )


def test_a_query_never_reads_a_later_key():
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 50, 8), torch.randn(3, 50, 8)
    positions = torch.tensor([3, 10, 11, 30])
    plan = plan_causal(positions, 50, chunk_size=2)
    before = attend(q, k, v, plan)
    k[:, 12:], v[:, 12:] = 1e3, 1e3
    after = attend(q, k, v, plan)
    torch.testing.assert_close(after[:, :3], before[:, :3])
    assert not torch.allclose(after[:, 3], before[:, 3])


def test_all_positions_use_plain_causal_attention():
    assert plan_causal(torch.arange(12), 12) is None


def test_single_last_query_needs_no_mask():
    [chunk] = plan_causal(torch.tensor([19]), 20).chunks
    assert chunk.mask is None and chunk.num_keys == 20


def test_causal_mask_follows_true_positions():
    visible = causal_mask(torch.tensor([1, 4, 5]), num_keys=7) == 0
    assert visible.tolist() == [
        [True, True, False, False, False, False, False],
        [True, True, True, True, True, False, False],
        [True, True, True, True, True, True, False],
    ]
