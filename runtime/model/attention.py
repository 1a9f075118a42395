"""Causal attention for any set of query positions over a KV cache: the one dispatch point.

A query at position p sees cache slots 0..p: its true position, whatever other
positions are computed with it. Every part of the runtime that runs attention on part
of a prompt (full prefill, layers below the check layer, the check layer, the sparse
layers, the continuation after an exact prefix, the vLLM connector's blend) plans once
per request and then calls `attend` once per layer:

1. `plan_attention(positions, num_keys)` picks the backend for the device and does the
   per-request work (a mask, chunk bounds) once, so no layer reads device values on
   the host.
2. `attend(q, k, v, plan)` is one kernel launch per layer on an accelerator:
   - `triton` (CUDA): `holeblend_kernels.sparse_attention.triton_attention`, which reads
     the positions from a tensor and never recompiles for a new prompt length.
   - `sdpa` (Ascend through torch_npu, `meta`, any other device, and CUDA without
     Triton): one SDPA call with the visibility mask built once per request.
   - `chunked` (CPU): queries cut into chunks that each read keys only up to their last
     query, SDPA per chunk. On the CPU a call costs microseconds, and reading about half
     the keys of one masked call over the whole prompt is what counts (measured in
     docs/accelerators.md). Queries that are every position after a short cached prefix
     (the continuation after an exact prefix, the layers below the check layer, ratio
     1.0) instead run as SDPA's causal attention behind zero rows for the prefix: the
     padding rows are the shortest causal rows, and no mask is read (a layer's attention
     0.69-0.76x the chunks' time at 6,000 keys, 0.86-0.95x at 1,300-1,650:
     docs/accelerators.md).
   Plain causal prefill from position 0 (every query, every key) uses SDPA's own causal
   path; on CUDA restricted to FlashAttention / memory-efficient kernels (cuDNN's
   would build a plan, ~1 s, for every new prompt length). One query that sees every
   key (a decode step of one sequence) is `attend_one_query`: its query heads grouped by
   KV head, each KV head read once. The batched decode step groups the same way and runs
   one call for all its sequences' rows (`runtime/model/batch_decode.py`).

`HOLEBLEND_ATTENTION=triton|sdpa|chunked` forces a backend (tests, benchmarks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from holeblend_kernels.sparse_attention import is_triton_supported, triton_attention

TRITON = "triton"
SDPA = "sdpa"
CHUNKED = "chunked"
BACKENDS = (TRITON, SDPA, CHUNKED)
BACKEND_ENV = "HOLEBLEND_ATTENTION"
# Math last: for what neither fused kernel takes (float32 with GQA).
_CUDA_CAUSAL_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
# Queries per chunk of the CPU backend: fewer SDPA calls vs. fewer masked-out keys read.
DEFAULT_CHUNK_SIZE = 64
# The CPU backend pads a prefix of up to this share of the keys with zero query rows and
# runs plain causal attention (a longer prefix's rows would cost more than the mask saves).
MAX_PADDED_PREFIX_SHARE = 0.25


@dataclass(frozen=True, eq=False)
class QueryChunk:
    # Range [query_start, query_end) of rows in the query tensor.
    query_start: int
    query_end: int
    # Keys (cache slots 0..num_keys-1) the chunk reads: up to its last query's position.
    num_keys: int
    # Additive mask [queries, num_keys]; None when every query sees every key it reads.
    mask: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """How the queries of one request attend; built once, used by every layer."""

    backend: str
    # [queries] int64 on the model's device: each query row's position.
    positions: torch.Tensor
    # Cache slots any query reads (the last position + 1).
    num_keys: int
    # The queries are exactly positions 0..num_keys-1 (plain causal attention).
    is_causal: bool
    # `sdpa`: additive mask [queries, num_keys] (None when is_causal).
    mask: torch.Tensor | None = None
    # `chunked`: the chunks (empty when is_causal or padded).
    chunks: tuple[QueryChunk, ...] = ()
    # `chunked`: the queries are positions padded_rows..num_keys-1, attended as plain
    # causal attention behind this many zero query rows (0: not padded).
    padded_rows: int = 0


def plan_attention(
    positions: torch.Tensor,
    num_keys: int,
    dtype: torch.dtype = torch.float32,
    *,
    backend: str | None = None,
    head_dim: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ends_at_last_key: bool = True,
) -> AttentionPlan:
    """Plan for sorted, distinct `positions` < num_keys (on the model's device).

    `num_keys` is a host number the caller knows (the prompt length so far): the plan
    never reads `positions` on the host except on the CPU, where that costs nothing.
    `ends_at_last_key` says the last position is num_keys - 1 (a caller that cannot
    promise it, e.g. a blend without logits, passes False: a single query then gets a
    mask instead of every key).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
    backend = backend or select_backend(positions.device, dtype, head_dim)
    is_causal = positions.shape[0] == num_keys
    if positions.shape[0] == 1 and backend != TRITON and ends_at_last_key:
        # One query at the last position (a decode step) sees every key: no mask.
        return AttentionPlan(SDPA, positions, num_keys, is_causal)
    plan = AttentionPlan(backend, positions, num_keys, is_causal)
    if is_causal or backend == TRITON:
        return plan
    if backend == CHUNKED:
        start = num_keys - positions.shape[0]
        if start <= MAX_PADDED_PREFIX_SHARE * num_keys and _is_tail(positions, start):
            return replace(plan, padded_rows=start)
        return replace(plan, chunks=_chunks(positions, chunk_size, dtype))
    return replace(plan, mask=causal_mask(positions, num_keys, dtype))


def select_backend(
    device: torch.device, dtype: torch.dtype = torch.float32, head_dim: int | None = None
) -> str:
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}: expected one of {BACKENDS}, got {forced!r}")
        return forced
    if device.type == "cpu":
        return CHUNKED
    if device.type == "cuda" and has_triton() and _triton_takes(dtype, head_dim):
        return TRITON
    return SDPA


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """q [heads, n, d]; k and v [kv_heads, slots >= plan.num_keys, d] -> [heads, n, d]."""
    k, v = k[:, : plan.num_keys], v[:, : plan.num_keys]
    if plan.is_causal and q.device.type == "cuda":
        # FlashAttention's causal kernel: faster than ours on every query, and unlike
        # cuDNN's (torch's first pick for bf16) it builds no plan per new prompt length.
        with sdpa_kernel(_CUDA_CAUSAL_BACKENDS):
            return _sdpa(q, k, v, None, is_causal=True)
    if plan.backend == TRITON:
        return triton_attention(q, k, v, plan.positions)
    if plan.padded_rows:
        return _attend_padded(q, k, v, plan.padded_rows)
    if plan.chunks:
        return _attend_chunks(q, k, v, plan.chunks)
    if plan.mask is None and q.shape[1] == 1:
        return attend_one_query(q, k, v)
    # Plain causal, or the mask built once per request.
    return _sdpa(q, k, v, plan.mask, is_causal=plan.is_causal)


def attend_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query per head q [heads, 1, d] that sees every key of k, v [kv_heads, n, d] (a
    decode step) -> [heads, 1, d].

    The query heads that share a KV head become that head's queries ([kv_heads, group, d]):
    one position sees every key, so no mask tells them apart, and each KV head is read
    once instead of once per query head. On the CPU SDPA's GQA path took 1.5x the time at
    1,500 keys (docs/accelerators.md).
    """
    heads, _, d = q.shape
    kv_heads = k.shape[0]
    grouped = q.reshape(kv_heads, heads // kv_heads, d)
    # A batch dimension of 1: 3-D inputs fall back to a slower path on CPU.
    out = F.scaled_dot_product_attention(grouped[None], k[None], v[None])[0]
    return out.reshape(heads, 1, d)


def causal_mask(
    query_positions: torch.Tensor, num_keys: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive mask [queries, keys]: 0 where key j <= the query's position, else -inf.

    Additive, built once per request: SDPA would convert a boolean mask on every call.
    """
    keys = torch.arange(num_keys, device=query_positions.device)
    is_visible = keys[None, :] <= query_positions[:, None]
    mask = torch.zeros(is_visible.shape, dtype=dtype, device=query_positions.device)
    return mask.masked_fill_(~is_visible, float("-inf"))


def _chunks(positions: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> tuple[QueryChunk, ...]:
    # CPU only: the positions are host memory, reading them is free.
    host = positions.tolist()
    chunks = []
    for start in range(0, len(host), chunk_size):
        end = min(start + chunk_size, len(host))
        num_keys = host[end - 1] + 1
        # A chunk whose first query already sees every key it reads needs no mask.
        is_unmasked = host[start] + 1 >= num_keys
        mask = None if is_unmasked else causal_mask(positions[start:end], num_keys, dtype)
        chunks.append(QueryChunk(start, end, num_keys, mask))
    return tuple(chunks)


def _is_tail(positions: torch.Tensor, start: int) -> bool:
    """Whether sorted, distinct positions below num_keys, start = num_keys - their count,
    are start..num_keys-1 (CPU only: reading the first one is free). Never empty here: an
    empty set is plain causal at 0 keys, and past a quarter of the keys otherwise."""
    return int(positions[0]) == start


def _attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
    """Queries at positions rows..n-1 as plain causal attention behind `rows` zero query
    rows (their outputs dropped): query row i then sees keys 0..i, its true position."""
    padded = torch.cat([q.new_zeros(q.shape[0], rows, q.shape[2]), q], dim=1)
    return _sdpa(padded, k, v, None, is_causal=True)[:, rows:]


def _attend_chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: tuple[QueryChunk, ...]
) -> torch.Tensor:
    outputs = [
        _sdpa(q[:, c.query_start : c.query_end], k[:, : c.num_keys], v[:, : c.num_keys], c.mask)
        for c in chunks
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal=False
) -> torch.Tensor:
    # A batch dimension of 1: 3-D inputs fall back to a path 3-6x slower on CPU.
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=is_causal, enable_gqa=True
    )[0]


@cache
def has_triton() -> bool:
    """Whether Triton imports (its kernels then run on CUDA)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_takes(dtype: torch.dtype, head_dim: int | None) -> bool:
    probe = torch.empty(0, 0, head_dim or 64, dtype=dtype, device="meta")
    return is_triton_supported(probe)
