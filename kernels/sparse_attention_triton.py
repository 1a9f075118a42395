"""The Triton kernel behind `sparse_attention.triton_attention` (imports Triton).

Grid: (query blocks, heads). Each program loads its queries' positions, reads keys
0..(its largest position), without a mask below its smallest position (rounded down to a
key block) and with the causal mask above, in FlashAttention-2's online softmax.
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
    k = tl.load(k_base + keys[None, :] * stride_kn, mask=is_key[None, :], other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
    scores = tl.dot(q, k, input_precision=PRECISION) * scale
    if IS_MASKED:
        scores = tl.where(keys[None, :] <= pos[:, None], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    p = tl.math.exp2(scores - new_max[:, None])
    correction = tl.math.exp2(row_max - new_max)
    row_sum = row_sum * correction + tl.sum(p, axis=1)
    v = tl.load(v_base + keys[:, None] * stride_vn, mask=is_key[:, None], other=0.0)
    if DOT_FP32:
        v = v.to(tl.float32)
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, new_max, row_sum


# One compiled kernel per (dtype, head size): the query count is not specialized on.
@triton.jit(do_not_specialize=["num_queries"])
def sparse_causal_attention_kernel(
    Q, K, V, Out, Positions,
    sm_scale, num_queries,
    stride_qh, stride_qn, stride_kh, stride_kn,
    stride_vh, stride_vn, stride_oh, stride_on,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    is_row = rows < num_queries
    # Padding rows take position 0: they read key 0 only, and are never stored.
    pos = tl.load(Positions + rows, mask=is_row, other=0).to(tl.int32)
    q = tl.load(
        Q + head * stride_qh + rows[:, None] * stride_qn + dims[None, :],
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
    acc = acc / row_sum[:, None]
    tl.store(
        Out + head * stride_oh + rows[:, None] * stride_on + dims[None, :],
        acc.to(Out.dtype.element_ty),
        mask=is_row[:, None],
    )
