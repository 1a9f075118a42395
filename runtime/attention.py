"""Causal attention for any sorted subset of query positions over a KV cache.

A query at position p sees cache slots 0..p: its true position, whatever other
positions are computed with it. (Aligning a causal mask to the bottom-right corner, as
varlen kernels do, is right only for a contiguous tail of queries, not for the sparse
recompute set of a blend.) Queries are cut into chunks; each chunk reads keys only up
to its last query's position, so sparse queries spread over a long prompt cost about
half of what one chunk over every key would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Queries per chunk: fewer SDPA calls vs. fewer masked-out keys read.
DEFAULT_CHUNK_SIZE = 64


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
class CausalPlan:
    """How the queries of one request attend; built once, used by every layer."""

    chunks: tuple[QueryChunk, ...]


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


def plan_causal(
    query_positions: torch.Tensor,
    num_keys: int,
    dtype: torch.dtype = torch.float32,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> CausalPlan | None:
    """Plan for sorted, distinct `query_positions` < num_keys; None means plain causal
    attention (the queries are exactly positions 0..num_keys-1)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
    num_queries = query_positions.shape[0]
    if num_queries == num_keys:
        return None
    chunks = []
    for start in range(0, num_queries, chunk_size):
        end = min(start + chunk_size, num_queries)
        chunks.append(_chunk(query_positions, start, end, dtype))
    return CausalPlan(tuple(chunks))


def _chunk(positions: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> QueryChunk:
    chunk_positions = positions[start:end]
    num_keys = int(chunk_positions[-1]) + 1
    first_key_hidden = int(chunk_positions[0]) + 1
    # A chunk whose first query already sees every key it reads needs no mask.
    is_unmasked = first_key_hidden >= num_keys
    mask = None if is_unmasked else causal_mask(chunk_positions, num_keys, dtype)
    return QueryChunk(start, end, num_keys, mask)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CausalPlan | None
) -> torch.Tensor:
    """q [heads, n, d], k and v [kv_heads, slots, d] -> [heads, n, d]."""
    if plan is None:
        return _sdpa(q, k, v, None, is_causal=True)
    outputs = [
        _sdpa(q[:, c.query_start : c.query_end], k[:, : c.num_keys], v[:, : c.num_keys], c.mask)
        for c in plan.chunks
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal=False
) -> torch.Tensor:
    # A batch dimension of 1: 3-D inputs fall back to a path 3-6x slower on CPU.
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=is_causal, enable_gqa=True
    )[0]
