"""The Triton kernel behind `rope_qkv.triton_rope_qkv` (imports Triton).

Grid: (token blocks, heads + 2 * kv_heads). Program (b, h) takes head h of the packed
projection for its tokens: a Q head is rotated into Q, a K head rotated into K at the
token's cache slot, a V head copied into V at that slot. Rotation in float32:
out[:half] = x1 cos - x2 sin, out[half:] = x2 cos + x1 sin. Offsets are 64-bit: a long
prompt's projection, or a large cache, spans more than 2**31 elements.
"""

import triton
import triton.language as tl


# One compiled kernel per (dtype, heads, head size): the token count is not specialized on.
@triton.jit(do_not_specialize=["num_tokens"])
def rope_qkv_kernel(
    X, Cos, Sin, Slots, Q, K, V, num_tokens,
    stride_x, stride_cos, stride_sin, stride_qn, stride_qh,
    stride_kh, stride_kn, stride_vh, stride_vn,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_T: tl.constexpr, SCATTER: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    offsets = rows.to(tl.int64)
    dims = tl.arange(0, HALF)
    is_row = rows < num_tokens
    mask = is_row[:, None]
    source = X + offsets[:, None] * stride_x + head * (2 * HALF) + dims[None, :]
    x1 = tl.load(source, mask=mask, other=0.0)
    x2 = tl.load(source + HALF, mask=mask, other=0.0)
    slot = tl.load(Slots + rows, mask=is_row, other=0).to(tl.int64) if SCATTER else offsets
    if head < NUM_HEADS + NUM_KV_HEADS:
        cos = tl.load(Cos + offsets[:, None] * stride_cos + dims[None, :], mask=mask, other=0.0)
        sin = tl.load(Sin + offsets[:, None] * stride_sin + dims[None, :], mask=mask, other=0.0)
        cos, sin = cos.to(tl.float32), sin.to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        out1 = (a * cos - b * sin).to(Q.dtype.element_ty)
        out2 = (b * cos + a * sin).to(Q.dtype.element_ty)
        if head < NUM_HEADS:
            target = Q + offsets[:, None] * stride_qn + head * stride_qh + dims[None, :]
        else:
            kv_head = head - NUM_HEADS
            target = K + kv_head * stride_kh + slot[:, None] * stride_kn + dims[None, :]
        tl.store(target, out1, mask=mask)
        tl.store(target + HALF, out2, mask=mask)
    else:
        kv_head = head - NUM_HEADS - NUM_KV_HEADS
        target = V + kv_head * stride_vh + slot[:, None] * stride_vn + dims[None, :]
        tl.store(target, x1, mask=mask)
        tl.store(target + HALF, x2, mask=mask)
