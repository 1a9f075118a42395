"""The blend's attention through vLLM's own CPU attention kernel (vLLM's CPU backend only).

The blend computes a sparse set of query positions (holes, selected tokens) against all
keys before them. On the CPU, `attention.attend` runs that as SDPA over chunks of queries
with a mask per chunk; vLLM's CPU kernel (`cpu_attention_with_kv_cache`, the one its own
prefill uses) is faster at the same work (measured in docs/vllm-connector.md). It takes
varlen batches of causal sequences over a paged cache, and a sparse causal query set is
exactly such a batch:

1. Per request (once, reused by every layer): the query positions are cut into runs of
   consecutive positions. A run [a, b) attends causally to keys 0..b-1: a sequence of
   length b whose last b-a tokens are the queries. Every run reads the same keys, so all
   share one block table over a scratch cache that this class owns (vLLM's paged cache is
   not touched). vLLM's scheduler metadata for the batch is built once.
2. Per layer: the layer's K/V [kv_heads, keys, head_dim] are written into the scratch
   cache with vLLM's own `cpu_attn_reshape_and_cache` (the ISA layout its kernel reads),
   and one kernel call attends every run.

`for_adapter` returns None where this does not apply (another backend, not the CPU, a
vLLM without these ops, alibi, sinks, a window, soft-capping, a quantized KV cache, or
`HOLEBLEND_ATTENTION` set to force one of ours); the adapter then uses `attention.attend`.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from holeblend_runtime.model.attention import BACKEND_ENV, AttentionPlan
from holeblend_runtime.vllm_connector import compat

log = logging.getLogger(__name__)


@dataclass
class _Batch:
    """One request's runs as vLLM's varlen batch, and its scratch cache."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slots: torch.Tensor


class PagedBlendAttention:
    """`attend(q, k, v, plan)` with vLLM's CPU attention kernel (module doc)."""

    def __init__(
        self,
        ops: Any,
        isa: str,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self._ops = ops
        self.isa = isa
        self.block_size = block_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.scale = head_dim**-0.5
        self.no_window = compat.no_window(ops.cpu_attention_with_kv_cache)
        # As vLLM's own metadata builder sets it.
        self.enable_kv_split = bool(_vllm_env("VLLM_CPU_ATTN_SPLIT_KV", False))
        # Batches of the plans in use (blends interleave across steps); freed with them.
        self._batches: weakref.WeakKeyDictionary[AttentionPlan, _Batch] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def for_adapter(cls, adapter: Any, block_size: int) -> PagedBlendAttention | None:
        """The kernel for `adapter`'s model when vLLM's CPU attention backend runs it."""
        if adapter.device.type != "cpu" or os.environ.get(BACKEND_ENV):
            return None  # HOLEBLEND_ATTENTION forces one of ours
        try:
            from vllm import _custom_ops as ops
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
        except ImportError:
            return None
        modules = adapter.attention_modules()
        if not all(isinstance(getattr(m, "impl", None), CPUAttentionBackendImpl) for m in modules):
            return None
        impl, config = modules[0].impl, adapter.config
        isas = {compat.cpu_isa(m, adapter.dtype, block_size, config.head_dim) for m in modules}
        if len(isas) != 1 or None in isas:
            return None
        (isa,) = isas
        if impl.alibi_slopes is not None or impl.sinks is not None:
            return None
        if not compat.window_off(impl.sliding_window) or impl.logits_soft_cap:
            return None
        if impl.kv_cache_dtype != "auto":
            return None
        log.info("holeblend: the blend attends with vLLM's CPU attention kernel (%s)", isa)
        return cls(
            ops, isa, block_size, config.num_heads, config.num_kv_heads, config.head_dim,
            adapter.dtype,
        )  # fmt: skip

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """q [heads, n, d]; k and v [kv_heads, slots >= plan.num_keys, d] -> [n, heads, d]."""
        batch = self._batches.get(plan)
        if batch is None:
            batch = self._batches[plan] = self._batch(plan)
        keys = slice(0, plan.num_keys)
        self._ops.cpu_attn_reshape_and_cache(
            k[:, keys].transpose(0, 1).contiguous(), v[:, keys].transpose(0, 1).contiguous(),
            batch.key_cache, batch.value_cache, batch.slots, self.isa,
        )  # fmt: skip
        queries = q.transpose(0, 1).contiguous()
        output = torch.empty_like(queries)
        self._ops.cpu_attention_with_kv_cache(
            query=queries, key_cache=batch.key_cache, value_cache=batch.value_cache,
            output=output, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
            scale=self.scale, causal=True, alibi_slopes=None, sliding_window=self.no_window,
            block_table=batch.block_table, softcap=0.0,
            scheduler_metadata=batch.scheduler_metadata, s_aux=None,
        )  # fmt: skip
        return output

    def _batch(self, plan: AttentionPlan) -> _Batch:
        positions = plan.positions.tolist()  # host memory on the CPU: free
        starts = [0] + [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
        ends = [*starts[1:], len(positions)]
        query_start_loc = torch.tensor([0, *ends], dtype=torch.int32)
        seq_lens = torch.tensor([positions[end - 1] + 1 for end in ends], dtype=torch.int32)
        num_blocks = -(-plan.num_keys // self.block_size)
        blocks = torch.arange(num_blocks, dtype=torch.int32)
        cache = torch.zeros(
            num_blocks, self.num_kv_heads, 2 * self.block_size, self.head_dim, dtype=self.dtype
        )
        key_cache, value_cache = cache.chunk(2, dim=2)
        metadata = self._ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(ends), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype,
            query_start_loc=query_start_loc, causal=True, sliding_window_size=-1,
            isa=self.isa, enable_kv_split=self.enable_kv_split,
        )  # fmt: skip
        return _Batch(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=blocks[None].expand(len(ends), -1).contiguous(),
            scheduler_metadata=metadata,
            key_cache=key_cache,
            value_cache=value_cache,
            slots=torch.arange(plan.num_keys, dtype=torch.int64),
        )


def _vllm_env(name: str, default: Any) -> Any:
    from vllm import envs

    return getattr(envs, name, default)
