"""The Triton kernel behind `sparse_attention.triton_attention` (imports Triton).

Grid: (query blocks, heads). Each program loads its queries' positions, reads keys
0..(its largest position), without a mask below its smallest position (rounded down to a
key block) and with the causal mask above, in FlashAttention-2's online softmax.

Positions are clamped to -1..keys-1: past the last key a row reads every key, not the
memory after them; below 0 it reads none, and its output is 0. Offsets are 64-bit: a
token-major Q or a cache of a long prompt spans more than 2**31 elements.
"""

import triton
import triton.language as tl


@triton.jit
def attend_block(
    acc, row_max, row_sum, q, pos, start, num_keys, k_base, v_base, stride_kn, stride_vn,
    scale, BLOCK_N: tl.constexpr, IS_MASKED: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    keys = start + tl.arange(0, BLOCK_N)
    is_key = keys < num_keys
    k = tl.load(k_base + keys.to(tl.int64)[None, :] * stride_kn, mask=is_key[None, :], other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
    scores = tl.dot(q, k, input_precision=PRECISION) * scale
    if IS_MASKED:
        scores = tl.where(keys[None, :] <= pos[:, None], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    p = tl.math.exp2(scores - new_max[:, None])
    correction = tl.math.exp2(row_max - new_max)
    row_sum = row_sum * correction + tl.sum(p, axis=1)
    v = tl.load(v_base + keys.to(tl.int64)[:, None] * stride_vn, mask=is_key[:, None], other=0.0)
    if DOT_FP32:
        v = v.to(tl.float32)
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, new_max, row_sum


# One compiled kernel per (dtype, head size): the query count is not specialized on.
@triton.jit(do_not_specialize=["num_queries", "key_count"])
def sparse_causal_attention_kernel(
    Q, K, V, Out, Positions,
    sm_scale, num_queries, key_count,
    stride_qh, stride_qn, stride_kh, stride_kn,
    stride_vh, stride_vn, stride_oh, stride_on,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offsets = rows.to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    is_row = rows < num_queries
    # Padding rows take position 0: they read key 0 only, and are never stored.
    pos = tl.load(Positions + rows, mask=is_row, other=0)
    pos = tl.minimum(tl.maximum(pos, -1), key_count - 1).to(tl.int32)
    q = tl.load(
        Q + head * stride_qh + offsets[:, None] * stride_qn + dims[None, :],
        mask=is_row[:, None],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    # Keys below `num_open` are visible to every row: no mask. Keys up to
    # `num_keys` are visible to some.
    num_keys = tl.max(pos, axis=0) + 1
    first = tl.min(tl.where(is_row, pos, 2147483647), axis=0)
    num_open = (first + 1) // BLOCK_N * BLOCK_N
    k_base = K + kv_head * stride_kh + dims[:, None]
    v_base = V + kv_head * stride_vh + dims[None, :]
    scale = sm_scale * 1.4426950408889634  # exp2
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, num_open, BLOCK_N):
        acc, row_max, row_sum = attend_block(
            acc, row_max, row_sum, q, pos, start, num_keys, k_base, v_base,
            stride_kn, stride_vn, scale, BLOCK_N, False, PRECISION, DOT_FP32,
        )  # fmt: skip
    for start in range(num_open, num_keys, BLOCK_N):
        acc, row_max, row_sum = attend_block(
            acc, row_max, row_sum, q, pos, start, num_keys, k_base, v_base,
            stride_kn, stride_vn, scale, BLOCK_N, True, PRECISION, DOT_FP32,
        )  # fmt: skip
    # A row that saw no key (position -1) has a sum of 0 (or NaN): its output is 0.
    acc = tl.where(row_sum[:, None] > 0, acc / row_sum[:, None], 0.0)
    tl.store(
        Out + head * stride_oh + offsets[:, None] * stride_on + dims[None, :],
        acc.to(Out.dtype.element_ty),
        mask=is_row[:, None],
    )
