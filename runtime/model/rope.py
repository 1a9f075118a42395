"""Rotary position embeddings (rotate-half convention) at explicit positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeTable:
    """cos and sin per (position, dim), shaped [num_positions, head_dim]."""

    cos: torch.Tensor
    sin: torch.Tensor


def rope_table(
    positions: torch.Tensor, *, head_dim: int, theta: float, dtype: torch.dtype
) -> RopeTable:
    """Angles in float64: at position 8000 float32 angles would be off by ~1e-3 rad,
    which would make re-rotation by a position difference visibly inexact."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = 1.0 / theta ** (exponents / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return RopeTable(angles.cos().to(dtype), angles.sin().to(dtype))


def apply_rope(x: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """Rotate x [..., num_positions, head_dim] by the table's angles."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * table.cos + rotated_half * table.sin


def rerotate(
    k: torch.Tensor,
    from_positions: torch.Tensor,
    to_positions: torch.Tensor,
    *,
    theta: float,
) -> torch.Tensor:
    """K rotated at `from_positions` -> K rotated at `to_positions`.

    Rotations compose, so rotating by the difference is exact up to rounding; K of
    shape [..., num_tokens, head_dim] on any device, the positions in host memory (the
    no-op check reads them there: no device sync).
    """
    if from_positions.shape != to_positions.shape:
        raise ValueError("to_positions: must have the shape of from_positions")
    delta = to_positions - from_positions
    if not bool(delta.any()):
        return k
    delta = delta.to(k.device, non_blocking=True)
    table = rope_table(delta, head_dim=k.shape[-1], theta=theta, dtype=k.dtype)
    return apply_rope(k, table)
