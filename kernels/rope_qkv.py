"""RoPE on a layer's packed Q/K/V projection, with K and V written into a KV cache: one
kernel launch instead of seven.

Input: `x` [tokens, (heads + 2 * kv_heads) * head_dim], the output of the stacked QKV
projection, and a RoPE table (cos and sin [tokens, head_dim], rotate-half convention,
both halves equal). Output: Q rotated, as a [heads, tokens, head_dim] view of a
token-major buffer (what the attention kernel and the output projection read without a
copy); K rotated and V written at cache slots `slots` of `k_out` / `v_out`
[kv_heads, slots, head_dim] (or, without `slots`, into new [kv_heads, tokens, head_dim]
tensors).

In torch that is a negation, a concatenation, two products and a sum for the rotation
and one index copy each for K and V, each a launch with its own host overhead; on a GPU
at a few thousand tokens the host, not the device, sets the pace of those layers.

Two implementations, equal within rounding (tests): `reference_rope_qkv` (plain torch,
any device) and `triton_rope_qkv` (CUDA, or the CPU under TRITON_INTERPRET=1). The
kernel rotates in float32 and rounds once; torch rounds each step in the model's dtype,
so in bfloat16 they differ in the last bit.

Triton is imported lazily: importing this module needs only torch.
"""

from __future__ import annotations

from typing import Any

import torch

# Tokens per program.
_BLOCK_T = 16


def reference_rope_qkv(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [heads, n, d], k, v): k and v are `k_out`/`v_out` when given (written at
    `slots`), else new [kv_heads, n, d] tensors."""
    head_dim = _check(x, cos, sin, num_heads, num_kv_heads, k_out, v_out, slots)
    qk, v = x.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
    qk = qk.view(-1, num_heads + num_kv_heads, head_dim).transpose(0, 1)
    half = head_dim // 2
    qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
    v = v.view(-1, num_kv_heads, head_dim).transpose(0, 1)
    q, k = qk[:num_heads], qk[num_heads:]
    if k_out is None or v_out is None or slots is None:
        return q, k, v
    # index_copy_ takes int64 indexes only; the kernel (and `_check`) take int32 too.
    index = slots.to(torch.int64)
    k_out.index_copy_(1, index, k)
    v_out.index_copy_(1, index, v)
    return q, k_out, v_out


def is_triton_supported(x: torch.Tensor, head_dim: int) -> bool:
    """Whether `triton_rope_qkv` takes this projection (a power-of-two head size of at
    least 16, a floating dtype)."""
    return (
        head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    )


def triton_rope_qkv(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference_rope_qkv` in one launch."""
    head_dim = _check(x, cos, sin, num_heads, num_kv_heads, k_out, v_out, slots)
    if not is_triton_supported(x, head_dim):
        raise ValueError(
            f"x: head_dim {head_dim} and dtype {x.dtype} need a power-of-two head_dim >= 16 "
            "and float16, bfloat16 or float32"
        )
    num_tokens = x.shape[0]
    # Token-major Q: [heads, n, d] as a view, so the output projection needs no copy.
    q = torch.empty(num_tokens, num_heads, head_dim, device=x.device, dtype=x.dtype)
    scatter = slots is not None
    if k_out is None or v_out is None or slots is None:
        shape = (num_kv_heads, num_tokens, head_dim)
        k_out = torch.empty(shape, device=x.device, dtype=x.dtype)
        v_out = torch.empty(shape, device=x.device, dtype=x.dtype)
        slots = q  # unread without SCATTER: any tensor argument will do
    else:
        # The kernel reads slots[i] at offset i: a strided view would scatter K/V into
        # other tokens' slots.
        slots = slots.contiguous()
    if num_tokens > 0:
        grid = (-(-num_tokens // _BLOCK_T), num_heads + 2 * num_kv_heads)
        _kernel()[grid](
            x, cos, sin, slots, q, k_out, v_out, num_tokens,
            x.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
            k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
            BLOCK_T=_BLOCK_T, SCATTER=scatter,
        )  # fmt: skip
    return q.transpose(0, 1), k_out, v_out


def _check(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_out: torch.Tensor | None,
    v_out: torch.Tensor | None,
    slots: torch.Tensor | None,
) -> int:
    """The head size; ValueError naming the argument whose shape does not fit."""
    if x.dim() != 2 or num_heads < 1 or num_kv_heads < 1:
        raise ValueError("x: expected [tokens, (heads + 2 * kv_heads) * head_dim]")
    head_dim, rest = divmod(x.shape[1], num_heads + 2 * num_kv_heads)
    if rest or head_dim % 2:
        raise ValueError(f"x: width {x.shape[1]} is not (heads + 2 * kv_heads) x an even head_dim")
    if x.stride(1) != 1:
        raise ValueError("x: rows must be contiguous")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (x.shape[0], head_dim) or table.stride(1) != 1:
            raise ValueError(f"{name}: expected a row-contiguous [{x.shape[0]}, {head_dim}] table")
    given = [t is not None for t in (k_out, v_out, slots)]
    if any(given) and not all(given):
        raise ValueError("k_out, v_out, slots: give all three or none")
    if k_out is not None and v_out is not None and slots is not None:
        for name, out in (("k_out", k_out), ("v_out", v_out)):
            if out.dim() != 3 or out.shape[0] != num_kv_heads or out.shape[2] != head_dim:
                raise ValueError(
                    f"{name}: expected [{num_kv_heads}, slots, {head_dim}], got {tuple(out.shape)}"
                )
            if out.stride(2) != 1 or out.dtype != x.dtype:
                raise ValueError(f"{name}: must be {x.dtype} with contiguous rows")
        if slots.shape != (x.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots: expected {x.shape[0]} integer slot indexes")
    return head_dim


def _kernel() -> Any:
    """Imported on first use: this module imports without Triton."""
    from holeblend_kernels.rope_qkv_triton import rope_qkv_kernel

    return rope_qkv_kernel
