"""Rotary position embeddings (rotate-half convention) at explicit positions.

Scaled RoPE (Llama 3.1's frequency factors, linear position scaling) is plain RoPE with
each rotary pair's inverse frequency divided by its own divisor
(`ModelConfig.rope_divisors`). Every table here takes them: a model's rotation and a
re-rotation of its cached K must be given the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeTable:
    """cos and sin per (position, dim), shaped [num_positions, head_dim]."""

    cos: torch.Tensor
    sin: torch.Tensor


def inverse_frequencies(
    head_dim: int,
    theta: float,
    divisors: Sequence[float] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Each rotary pair's angle per position, [head_dim / 2] in float64: theta^(-2i /
    head_dim), divided by `divisors` where the model scales its RoPE (None: it does not)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
    inv_freq = 1.0 / theta ** (exponents / head_dim)
    if divisors is None:
        return inv_freq
    return inv_freq / torch.tensor(divisors, dtype=torch.float64, device=device)


def rope_table(
    positions: torch.Tensor,
    *,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    divisors: Sequence[float] | None = None,
) -> RopeTable:
    """Angles in float64: at position 8000 float32 angles would be off by ~1e-3 rad,
    which would make re-rotation by a position difference visibly inexact. `divisors`:
    `inverse_frequencies`'."""
    inv_freq = inverse_frequencies(head_dim, theta, divisors, positions.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return RopeTable(angles.cos().to(dtype), angles.sin().to(dtype))


class RopeCache:
    """`rope_table` computed once and kept on one device in one dtype: a prompt's table
    is a slice of a table of positions 0.., and a re-rotation's (by signed offsets) a
    gather from a table of positions -(n-1)..n-1, instead of the dozen small kernels
    (float64 angles, cos, sin, casts) each would launch per request. The values are
    `rope_table`'s, as an entry depends on its own position only. Both tables grow by
    doubling up to `max_positions`; a growth replaces a table in one assignment, so a
    reader on another thread sees the old table or the new one."""

    def __init__(
        self,
        *,
        head_dim: int,
        theta: float,
        dtype: torch.dtype,
        device: torch.device | str,
        max_positions: int,
        divisors: Sequence[float] | None = None,
    ) -> None:
        self.head_dim, self.theta, self.dtype = head_dim, theta, dtype
        self.divisors = divisors
        self.device, self.max_positions = torch.device(device), max_positions
        self._table: RopeTable | None = None
        self._signed: RopeTable | None = None

    def upto(self, num_positions: int) -> RopeTable:
        """The table of positions 0..num_positions-1 (views: read-only by contract)."""
        table = self._table
        if table is None or table.cos.shape[0] < num_positions:
            table = self._table = self._computed(0, self._size(num_positions))
        return RopeTable(table.cos[:num_positions], table.sin[:num_positions])

    def offsets_table(self, offsets: torch.Tensor) -> tuple[RopeTable, torch.Tensor] | None:
        """For signed position offsets (host int64): a table of offsets -(n-1)..n-1 and
        each offset's row in it (host), so that the re-rotation's table is one gather on
        the device (`cos[rows]`, `sin[rows]`); None when an offset reaches
        `max_positions` (the caller computes that table itself)."""
        bound = int(offsets.abs().max()) + 1 if offsets.numel() else 1
        if bound > self.max_positions:
            return None
        table = self._signed
        if table is None or table.cos.shape[0] < 2 * bound - 1:
            size = self._size(bound)
            table = self._signed = self._computed(1 - size, size)
        return table, offsets + table.cos.shape[0] // 2

    def _size(self, num_positions: int) -> int:
        if not 0 <= num_positions <= self.max_positions:
            raise ValueError(f"positions: {num_positions} exceed the table's {self.max_positions}")
        wanted = 1 << max(num_positions - 1, 0).bit_length()
        return min(self.max_positions, max(1024, wanted))

    def _computed(self, start: int, end: int) -> RopeTable:
        positions = torch.arange(start, end, device=self.device)
        return rope_table(
            positions, head_dim=self.head_dim, theta=self.theta, dtype=self.dtype,
            divisors=self.divisors,
        )  # fmt: skip


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
    divisors: Sequence[float] | None = None,
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
    table = rope_table(delta, head_dim=k.shape[-1], theta=theta, dtype=k.dtype, divisors=divisors)
    return apply_rope(k, table)
