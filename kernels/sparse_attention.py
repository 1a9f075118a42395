"""Causal attention for any set of query positions, one kernel launch per layer.

Query row i sits at prompt position `positions[i]` and attends to keys 0..positions[i]
(its true position, whatever other rows are computed with it; a varlen kernel's
bottom-right causal alignment is right only for a contiguous tail). GQA: query head h
reads KV head h // (heads / kv_heads). As the dense mask reads them, a position past the
last key sees every key, and one below 0 none (its output is 0, SDPA's for such a row).

Two implementations, equal within tolerance (tests):
- `reference_attention`: plain torch, one SDPA call with a dense mask built from the
  positions. Runs on any device torch supports (CPU, CUDA, Ascend through torch_npu,
  `meta`), but its mask costs memory proportional to queries x keys.
- `triton_attention`: a FlashAttention-style Triton kernel that reads the positions
  from a tensor, so the grid and every shape it compiles for depend only on the head
  size and dtype: a prompt of a new length launches the compiled kernel, it never
  recompiles. Each block of queries reads keys only up to its last visible one, and
  skips the mask for the keys all of its rows see.

Triton is imported lazily: importing this module needs only torch.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F

# Keys per inner step and queries per program: FlashAttention-2's usual Hopper tiles.
_BLOCK_N = 64
_BLOCK_M = {16: 128, 32: 128, 64: 128, 128: 128, 256: 64}
SUPPORTED_HEAD_DIMS = tuple(_BLOCK_M)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
    """q [heads, n, d], k and v [kv_heads, keys, d], positions [n] integer."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k, v: expected [heads, tokens, head_dim] tensors")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    if q.shape[2] != k.shape[2] or q.shape[0] % k.shape[0] != 0:
        raise ValueError(
            f"q: shape {tuple(q.shape)} does not fit k {tuple(k.shape)} "
            "(same head_dim, heads a multiple of kv_heads)"
        )
    if positions.shape != (q.shape[1],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions: expected integers of shape ({q.shape[1]},), "
            f"got {positions.dtype} {tuple(positions.shape)}"
        )


def visibility_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[queries, keys] bool: True where key j <= the query's position."""
    keys = torch.arange(num_keys, device=positions.device)
    return keys[None, :] <= positions[:, None]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One SDPA call; `mask` is `visibility_mask(positions, keys)` (or an additive
    equivalent) when the caller built it once for many layers."""
    check_inputs(q, k, v, positions)
    if mask is None:
        mask = visibility_mask(positions, k.shape[1])
    # A batch dimension of 1: 3-D inputs fall back to a path 3-6x slower on CPU.
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, enable_gqa=True
    )[0]


def is_triton_supported(q: torch.Tensor) -> bool:
    """Whether `triton_attention` takes this query tensor (head size and dtype)."""
    return q.shape[-1] in SUPPORTED_HEAD_DIMS and q.dtype in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
    )


def triton_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The Triton kernel: one launch for all heads and queries (CUDA, or the CPU under
    TRITON_INTERPRET=1). Returns [heads, n, d] in q's dtype (a view of a token-major
    buffer)."""
    check_inputs(q, k, v, positions)
    if not is_triton_supported(q):
        raise ValueError(
            f"q: head_dim {q.shape[-1]} and dtype {q.dtype} need head_dim in "
            f"{SUPPORTED_HEAD_DIMS} and float16, bfloat16 or float32"
        )
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # The kernel reads positions[i] at offset i: a strided view (a column, a slice with a
    # step) would be read as other rows' positions.
    positions = positions.contiguous()
    num_heads, num_queries, head_dim = q.shape
    # Token-major [n, heads, d] seen as [heads, n, d]: the output projection reads it as
    # [n, heads * d] without a copy.
    out = torch.empty(num_queries, num_heads, head_dim, device=q.device, dtype=q.dtype)
    out = out.transpose(0, 1)
    if num_queries == 0:
        return out
    from triton.runtime.errors import OutOfResources

    def launch(block_m: int, num_stages: int) -> None:
        grid = (triton_cdiv(num_queries, block_m), num_heads)
        _kernel()[grid](
            q, k, v, out, positions,
            1.0 / math.sqrt(head_dim), num_queries, k.shape[1],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            GROUP=num_heads // k.shape[0], HEAD_DIM=head_dim,
            BLOCK_M=block_m, BLOCK_N=_BLOCK_N,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            DOT_FP32=q.dtype == torch.float32 or _is_interpreted(),
            num_warps=8 if head_dim >= 128 else 4, num_stages=num_stages,
        )  # fmt: skip

    where = (head_dim, q.dtype, str(q.device))
    if where in _TILES:
        launch(*_TILES[where])
        return out
    *first, last = _tile_choices(head_dim)
    for tile in first:
        try:
            launch(*tile)
        except OutOfResources:
            continue
        _TILES[where] = tile
        return out
    launch(*last)
    _TILES[where] = last
    return out


# (head size, dtype, device) -> the (BLOCK_M, num_stages) that compiled there.
_TILES: dict[tuple, tuple[int, int]] = {}


def _tile_choices(head_dim: int) -> list[tuple[int, int]]:
    """(BLOCK_M, num_stages) to try in order, fastest first. The pipelined K/V tiles take
    num_stages x 2 x BLOCK_N x head_dim elements of shared memory beside the query tile:
    in float32 at head size 128 (or 256 in any dtype) three stages need more than a
    Hopper SM's 227 KiB, and Triton refuses the launch (OutOfResources) rather than spill.
    Fewer stages, then half the query tile, fit; the first that compiles is kept."""
    block_m = _BLOCK_M[head_dim]
    return [(block_m, 3), (block_m, 2), (block_m, 1), (max(block_m // 2, 16), 1)]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _is_interpreted() -> bool:
    """Under Triton's interpreter (3.9) a bfloat16 `tl.dot` returns garbage: the kernel
    then multiplies in float32 (on a GPU it never does)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernel() -> Any:
    """Imported on first use: this module imports without Triton."""
    from holeblend_kernels.sparse_attention_triton import sparse_causal_attention_kernel

    return sparse_causal_attention_kernel
