"""Writing K/V into a paged KV cache: the torch reference, dispatched by device.

Layout "NHD" (vLLM's FlashAttention and vllm-ascend caches): one tensor
`[2, num_blocks, block_size, num_kv_heads, head_dim]` per layer, K at index 0 and V at 1;
slot s is block s // block_size, offset s % block_size. Backends that bring their own
cache-update op are called through it instead (see the connector's PagedKVWriter).
"""

from __future__ import annotations

import torch


def scatter_kv_nhd(
    cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """cache[0/1] at `slots` <- k / v, each [tokens, kv_heads, head_dim]."""
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(
            f"cache: expected [2, blocks, block_size, heads, dim], got {tuple(cache.shape)}"
        )
    if k.shape != v.shape or k.shape[0] != slots.shape[0]:
        raise ValueError(
            f"k: shape {tuple(k.shape)} does not match v or the {slots.shape[0]} slots"
        )
    flat = cache.view(2, -1, cache.shape[3], cache.shape[4])
    index = slots.to(device=cache.device, dtype=torch.int64)
    # index_copy_ is one kernel on CUDA and NPU (torch_npu implements it) as on CPU.
    flat[0].index_copy_(0, index, k.to(cache.dtype))
    flat[1].index_copy_(0, index, v.to(cache.dtype))
