"""Causal attention over any set of query positions: every backend against the reference.

The Triton kernel runs under Triton's interpreter here (TRITON_INTERPRET=1, set in
tests/conftest.py before anything imports Triton); on a GPU the same tests run it
compiled.
"""

import pytest
import torch

from holeblend_kernels.sparse_attention import reference_attention, triton_attention
from holeblend_runtime.model.attention import (
    BACKEND_ENV,
    BACKENDS,
    CHUNKED,
    SDPA,
    TRITON,
    attend,
    attend_one_query,
    causal_mask,
    plan_attention,
    select_backend,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _written_out(q, k, v, positions):
    """Softmax attention written out: query i sees keys 0..positions[i]."""
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
    scores = q.double() @ k.double().transpose(1, 2) / q.shape[-1] ** 0.5
    hidden = torch.arange(k.shape[1], device=q.device)[None, :] > positions[:, None]
    return (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v.double()).to(q.dtype)


def _position_sets(num_keys, generator):
    """Named query position sets against `num_keys` keys (sorted, distinct, the last
    one num_keys - 1, as the runtime always computes the last token)."""
    last = torch.tensor([num_keys - 1])
    scattered = torch.randperm(num_keys - 1, generator=generator)[: num_keys // 3].sort().values
    prefix = num_keys // 2
    return {
        "empty": torch.empty(0, dtype=torch.int64),
        "one token": last,
        "all tokens": torch.arange(num_keys),
        "scattered": torch.cat([scattered, last]),
        "from mid-prompt": torch.cat(
            [
                torch.randperm(num_keys - 1 - prefix, generator=generator)[:9].sort().values
                + prefix,
                last,
            ]
        ),  # fmt: skip
        "after a prefix": torch.arange(prefix, num_keys),
        "after a short prefix": torch.arange(num_keys // 5, num_keys),
        "after one token": torch.arange(1, num_keys),
    }


def _inputs(heads, kv_heads, num_queries, num_keys, head_dim, dtype, generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    return (
        randn(heads, num_queries, head_dim),
        randn(kv_heads, num_keys, head_dim),
        randn(kv_heads, num_keys, head_dim),
    )


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_keys", [1, 67, 131])
def test_triton_kernel_equals_the_dense_mask_reference(group, num_keys):
    generator = torch.Generator().manual_seed(group * 1000 + num_keys)
    for name, positions in _position_sets(num_keys, generator).items():
        q, k, v = _inputs(2 * group, 2, positions.shape[0], num_keys, 16, torch.float32, generator)
        positions = positions.to(DEVICE)
        expected = reference_attention(q, k, v, positions)
        torch.testing.assert_close(
            triton_attention(q, k, v, positions), expected, atol=1e-5, rtol=1e-5, msg=name
        )
        torch.testing.assert_close(expected, _written_out(q, k, v, positions), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernel_in_half_precision_is_within_its_rounding(dtype):
    generator = torch.Generator().manual_seed(3)
    positions = _position_sets(100, generator)["scattered"].to(DEVICE)
    q, k, v = _inputs(8, 2, positions.shape[0], 100, 64, dtype, generator)
    expected = _written_out(q.float(), k.float(), v.float(), positions)
    got = triton_attention(q, k, v, positions)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_triton_kernel_takes_no_queries():
    q, k, v = torch.empty(4, 0, 16), torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    assert triton_attention(q, k, v, torch.empty(0, dtype=torch.int64)).shape == (4, 0, 16)


def test_triton_kernel_reads_strided_queries_as_the_model_lays_them_out():
    """Q comes from a [tokens, heads, dim] projection, transposed: not contiguous."""
    generator = torch.Generator().manual_seed(5)
    projected = torch.randn(30, 4, 32, generator=generator).to(DEVICE)
    q = projected.transpose(0, 1)
    k, v = (torch.randn(2, 50, 32, generator=generator).to(DEVICE) for _ in range(2))
    positions = torch.arange(20, 50, device=DEVICE)
    torch.testing.assert_close(
        triton_attention(q, k, v, positions), reference_attention(q, k, v, positions), atol=1e-5,
        rtol=1e-5,
    )  # fmt: skip


def test_triton_kernel_reads_strided_positions_by_their_strides():
    """Positions that are a view with a step (every other position of a set) are read as
    that view's values, not as the consecutive memory under it."""
    generator = torch.Generator().manual_seed(6)
    every = torch.arange(0, 60, device=DEVICE)
    positions = every[1::2]  # 1, 3, ..., 59: stride 2
    assert not positions.is_contiguous()
    q, k, v = _inputs(4, 2, positions.shape[0], 60, 16, torch.float32, generator)
    torch.testing.assert_close(
        triton_attention(q, k, v, positions), _written_out(q, k, v, positions), atol=1e-5,
        rtol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", [1, 3])
def test_every_backend_equals_the_reference_through_a_plan(backend, group):
    generator = torch.Generator().manual_seed(group)
    num_keys = 90
    for name, positions in _position_sets(num_keys, generator).items():
        q, k, v = _inputs(2 * group, 2, positions.shape[0], num_keys, 16, torch.float32, generator)
        positions = positions.to(DEVICE)
        # The plan may read keys only up to its num_keys: slots after it hold garbage.
        padded = [torch.cat([t, torch.full_like(t[:, :7], float("nan"))], 1) for t in (k, v)]
        plan = plan_attention(positions, num_keys, backend=backend, chunk_size=7)
        torch.testing.assert_close(
            attend(q, *padded, plan), _written_out(q, k, v, positions), atol=1e-5, rtol=1e-5,
            msg=f"{backend}: {name}",
        )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_query_never_reads_a_later_key(backend):
    q, k, v = (
        torch.randn(shape, device=DEVICE) for shape in [(3, 4, 16), (3, 50, 16), (3, 50, 16)]
    )
    positions = torch.tensor([3, 10, 11, 49], device=DEVICE)
    plan = plan_attention(positions, 50, backend=backend, chunk_size=2)
    before = attend(q, k, v, plan)
    k[:, 12:], v[:, 12:] = 1e3, 1e3
    after = attend(q, k, v, plan)
    torch.testing.assert_close(after[:, :3], before[:, :3])
    assert not torch.allclose(after[:, 3], before[:, 3])


def test_the_cpu_uses_chunks_and_plans_no_mask_for_plain_causal_attention(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend(torch.device("cpu")) == CHUNKED
    assert select_backend(torch.device("meta")) == SDPA
    plan = plan_attention(torch.arange(12), 12)
    assert plan.is_causal and plan.mask is None and not plan.chunks


@pytest.mark.parametrize("group", [1, 3])
def test_the_cpu_pads_a_short_prefix_and_chunks_a_long_one(group):
    """Every position after a prefix of at most a quarter of the keys: plain causal attention
    behind zero rows (no chunk, no mask), equal to the reference; a longer prefix, or a gap,
    keeps the chunks."""
    generator = torch.Generator().manual_seed(5)
    num_keys = 200
    for start in (1, 13, 50):
        positions = torch.arange(start, num_keys)
        plan = plan_attention(positions, num_keys, backend=CHUNKED, chunk_size=16)
        assert plan.padded_rows == start and not plan.chunks and plan.mask is None
        q, k, v = _inputs(2 * group, 2, positions.shape[0], num_keys, 16, torch.float32, generator)
        torch.testing.assert_close(
            attend(q, k, v, plan), _written_out(q, k, v, positions), atol=1e-5, rtol=1e-5
        )
    for positions in (
        torch.arange(51, num_keys),
        torch.cat([torch.arange(13, 90), torch.arange(91, num_keys)]),
    ):
        plan = plan_attention(positions, num_keys, backend=CHUNKED, chunk_size=16)
        assert plan.padded_rows == 0 and plan.chunks


def test_a_forced_backend_is_used_and_a_misspelled_one_refused(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, TRITON)
    assert select_backend(torch.device("cpu")) == TRITON
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        select_backend(torch.device("cpu"))


def test_a_single_query_reads_every_key_without_a_mask():
    plan = plan_attention(torch.tensor([19]), 20, backend=CHUNKED)
    assert plan.backend == SDPA and plan.mask is None and not plan.is_causal


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("num_keys", [1, 67, 1500])
def test_one_query_grouped_by_kv_head_equals_the_reference(group, num_keys):
    """A decode step's query heads read as their KV head's queries: head h still attends
    with KV head h // group, over every key, and the keys' slice of a longer cache
    buffer is read in place."""
    generator = torch.Generator().manual_seed(num_keys + group)
    q, k, v = _inputs(2 * group, 2, 1, num_keys + 5, 64, torch.float32, generator)
    k, v = k[:, :num_keys], v[:, :num_keys]
    expected = _written_out(q, k, v, torch.tensor([num_keys - 1], device=DEVICE))
    torch.testing.assert_close(attend_one_query(q, k, v), expected, atol=1e-5, rtol=0)
    # A row of a batched step's query tensor [heads, rows, d] (strided), through a plan.
    rows = torch.cat([torch.zeros_like(q), q, torch.zeros_like(q)], dim=1)[:, 1:2]
    plan = plan_attention(torch.tensor([num_keys - 1], device=DEVICE), num_keys)
    torch.testing.assert_close(attend(rows, k, v, plan), expected, atol=1e-5, rtol=0)


def test_causal_mask_follows_true_positions():
    visible = causal_mask(torch.tensor([1, 4, 5]), num_keys=7) == 0
    assert visible.tolist() == [
        [True, True, False, False, False, False, False],
        [True, True, True, True, True, False, False],
        [True, True, True, True, True, True, False],
    ]


def test_the_kernel_refuses_shapes_it_cannot_take():
    q, k = torch.randn(4, 3, 24), torch.randn(2, 5, 24)
    with pytest.raises(ValueError, match="head_dim"):
        triton_attention(q, k, k, torch.arange(2, 5))
    with pytest.raises(ValueError, match="positions"):
        reference_attention(q, k, k, torch.arange(2))


def test_triton_kernel_reads_positions_outside_the_keys_as_the_dense_mask_does():
    """A position past the last key sees every key (it reads no memory after them); one
    below 0 sees none, and its output is 0 (as SDPA's for a row without keys), not NaN."""
    generator = torch.Generator().manual_seed(7)
    q, k, v = _inputs(4, 2, 5, 70, 16, torch.float32, generator)
    positions = torch.tensor([-3, -1, 0, 69, 500], device=DEVICE)
    got = triton_attention(q, k, v, positions)
    assert torch.equal(got[:, :2], torch.zeros_like(got[:, :2]))
    expected = _written_out(q[:, 2:], k, v, positions[2:].clamp(max=69))
    torch.testing.assert_close(got[:, 2:], expected, atol=1e-5, rtol=1e-5)


def _far_apart(memory, shape, strides, offset):
    """A view of `memory` filled with random values (strides in elements)."""
    view = memory.as_strided(shape, strides, offset)
    view.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(offset)))
    return view


def test_triton_kernel_addresses_rows_and_heads_past_two_to_the_31_elements():
    """Offsets are 64-bit: the third query row and the third KV head start 2**31 elements
    into their tensors (a token-major Q of a long prompt, a large cache); 32-bit offsets
    would wrap to memory 2**31 elements before them."""
    span = 2**30
    try:
        # Address space only: the pages the views do not touch are never allocated.
        memory = torch.empty(2**32 + 512, dtype=torch.float16, device=DEVICE)
    except RuntimeError:
        pytest.skip("cannot reserve 2**32 elements of address space")
    q = _far_apart(memory, (3, 3, 16), (16, span, 1), 2**31)
    k = _far_apart(memory, (3, 5, 16), (span, 16, 1), 2**31 + 64)
    v = _far_apart(memory, (3, 5, 16), (span, 16, 1), 2**31 + 192)
    positions = torch.tensor([2, 3, 4], device=DEVICE)
    expected = _written_out(q.float(), k.float(), v.float(), positions)
    got = triton_attention(q, k, v, positions)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


class _SharedMemoryLimit:
    """The real kernel behind a launch check as a GPU makes it: a tiling whose pipelined
    K/V tiles and query tile need more shared memory than `limit` bytes is refused with
    Triton's OutOfResources (the interpreter has no such limit)."""

    def __init__(self, kernel, limit: int):
        self.kernel, self.limit, self.tried = kernel, limit, []

    def __getitem__(self, grid):
        def launch(*args, BLOCK_M, BLOCK_N, HEAD_DIM, num_stages, **kwargs):
            from triton.runtime.errors import OutOfResources

            size = args[0].element_size()
            shared = (BLOCK_M + num_stages * 2 * BLOCK_N) * HEAD_DIM * size
            self.tried.append((BLOCK_M, num_stages))
            if shared > self.limit:
                raise OutOfResources(shared, self.limit, "shared memory")
            self.kernel[grid](
                *args, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                num_stages=num_stages, **kwargs,
            )  # fmt: skip

        return launch


def test_triton_kernel_falls_back_to_a_tiling_the_shared_memory_holds(monkeypatch):
    """float32 at head size 128 with three stages needs 256 KiB, more than a Hopper SM's
    227: the launch takes fewer stages (then a smaller query tile) instead of failing, and
    keeps the tiling that compiled for the next call."""
    from holeblend_kernels import sparse_attention

    limit = _SharedMemoryLimit(sparse_attention._kernel(), 227 * 1024)
    monkeypatch.setattr(sparse_attention, "_kernel", lambda: limit)
    monkeypatch.setattr(sparse_attention, "_TILES", {}, raising=False)
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 5, 128, generator=generator).to(DEVICE)
    k, v = (torch.randn(1, 40, 128, generator=generator).to(DEVICE) for _ in range(2))
    positions = torch.tensor([3, 17, 20, 31, 39], device=DEVICE)
    out = triton_attention(q, k, v, positions)
    torch.testing.assert_close(out, _written_out(q, k, v, positions), atol=1e-4, rtol=1e-4)
    assert limit.tried == [(128, 3), (128, 2)]  # 3 stages: 256 KiB; 2: 192 KiB
    triton_attention(q, k, v, positions)
    assert limit.tried[2:] == [(128, 2)]  # kept, not tried again from the top
    limit.limit = 0  # no tiling fits: Triton's own error, not a silent wrong answer
    monkeypatch.setattr(sparse_attention, "_TILES", {}, raising=False)
    with pytest.raises(Exception, match="shared memory"):
        triton_attention(q, k, v, positions)
