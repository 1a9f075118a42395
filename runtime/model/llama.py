"""A small Llama-family forward pass in plain torch, with explicit positions.

Attention runs one sequence at a time with tensors shaped [heads, tokens, head_dim];
the KV cache of a sequence is one K and one V tensor [layers, kv_heads, tokens, head_dim]
that callers allocate and the model writes into, so a prefill, a blend and a decode step
share the same layer code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from holeblend_kernels import rope_qkv
from holeblend_runtime.model.attention import AttentionPlan, attend, has_triton, plan_attention
from holeblend_runtime.model.config import ModelConfig
from holeblend_runtime.model.rope import RopeCache, RopeTable, rope_table


@dataclass(frozen=True, eq=False)
class LayerWeights:
    # Projections are [out, in] as the checkpoint has them, used as `x @ weight.T`; on the
    # CPU their storage is transposed (`Llama._matrix`).
    attn_norm: torch.Tensor
    # Q, K and V projections stacked: one matmul instead of three.
    qkv: torch.Tensor
    out: torch.Tensor
    ffn_norm: torch.Tensor
    # SwiGLU gate and up projections stacked.
    gate_up: torch.Tensor
    down: torch.Tensor


class Llama:
    """Weights plus the layer functions; no state besides the weights."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.embedding = self._weight(weights, "token_embd.weight")
        self.final_norm = self._weight(weights, "output_norm.weight")
        output_name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
        # Tied to the embedding, the CPU's transposed copy is a second tensor (113 MB for
        # SmolLM2-135M in float32): the embedding's lookups read rows.
        self.output = self._matrix(self._weight(weights, output_name, copied_later=True))
        self.layers = [self._layer(weights, i) for i in range(config.num_layers)]
        self.rope_cache = RopeCache(
            head_dim=config.head_dim, theta=config.rope_theta, dtype=dtype, device=self.device,
            max_positions=config.context_length, divisors=config.rope_divisors,
        )  # fmt: skip

    def _weight(
        self, weights: Mapping[str, torch.Tensor], name: str, copied_later: bool = False
    ) -> torch.Tensor:
        """`name` on the model's device and dtype. Owned on the CPU, never a view of the
        caller's tensor: the weight cache's tensors are read lazily from one mapped file,
        which stays mapped, its pages resident, while any of them lives (+540 MB for
        SmolLM2 when the norms alone kept it). `copied_later`: the caller copies it anyway
        (a projection, `_matrix` on the CPU)."""
        if name not in weights:
            raise ValueError(f"weights: missing tensor {name}")
        given = weights[name]
        weight = given.to(device=self.device, dtype=self.dtype)
        if copied_later or self.device.type != "cpu" or weight.data_ptr() != given.data_ptr():
            return weight
        return weight.clone()

    def _layer(self, weights: Mapping[str, torch.Tensor], i: int) -> LayerWeights:
        def get(name: str, copied_later: bool = True) -> torch.Tensor:
            return self._weight(weights, f"blk.{i}.{name}.weight", copied_later)

        return LayerWeights(
            attn_norm=get("attn_norm", copied_later=False),
            qkv=self._matrix(torch.cat([get("attn_q"), get("attn_k"), get("attn_v")])),
            out=self._matrix(get("attn_output")),
            ffn_norm=get("ffn_norm", copied_later=False),
            gate_up=self._matrix(torch.cat([get("ffn_gate"), get("ffn_up")])),
            down=self._matrix(get("ffn_down")),
        )

    def _matrix(self, weight: torch.Tensor) -> torch.Tensor:
        """A projection [out, in] for `x @ weight.T`. On the CPU its storage is transposed
        ([in, out] contiguous, the same shape and values): a decode step's few rows then
        take less time (the whole step 0.87x at 4 sequences), and a prefill's hundreds of
        rows as long as before (docs/accelerators.md, "Decode steps on the CPU").
        Accelerators keep the checkpoint's layout."""
        if self.device.type != "cpu":
            return weight.contiguous()
        return weight.T.contiguous().T

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def new_kv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers for a sequence of `num_tokens` (uninitialized: every slot is
        written before it is read)."""
        c = self.config
        shape = (c.num_layers, c.num_kv_heads, num_tokens, c.head_dim)
        return (
            torch.empty(shape, device=self.device, dtype=self.dtype),
            torch.empty(shape, device=self.device, dtype=self.dtype),
        )

    def rope(self, positions: torch.Tensor) -> RopeTable:
        c = self.config
        return rope_table(
            positions, head_dim=c.head_dim, theta=c.rope_theta, dtype=self.dtype,
            divisors=c.rope_divisors,
        )  # fmt: skip

    def rope_upto(self, num_positions: int) -> RopeTable:
        """`rope` of positions 0..num_positions-1, sliced from a table kept per model."""
        return self.rope_cache.upto(num_positions)

    def reduce_shards(self, scores: torch.Tensor) -> torch.Tensor:
        """The sum of a per-token score over the model's tensor-parallel shards (each
        holds some of the heads); one shard here, so the score itself."""
        return scores

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding[token_ids.to(self.device)]

    def qkv(
        self, layer: int, h: torch.Tensor, rope: RopeTable
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q [heads, n, d], K and V [kv_heads, n, d] of hidden states h [n, hidden]; Q, K rotated."""
        return self._rotate(self._project_qkv(layer, h), rope)

    def qkv_into(
        self,
        layer: int,
        h: torch.Tensor,
        rope: RopeTable,
        k_out: torch.Tensor,
        v_out: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """`qkv`, with K and V written into `k_out`/`v_out` [kv_heads, slots, d] at `slots`
        (on the model's device); returns Q."""
        q, _, _ = self._rotate(self._project_qkv(layer, h), rope, k_out, v_out, slots)
        return q

    def _project_qkv(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        w = self.layers[layer]
        return self._rms_norm(h, w.attn_norm) @ w.qkv.T

    def _rotate(
        self,
        x: torch.Tensor,
        rope: RopeTable,
        k_out: torch.Tensor | None = None,
        v_out: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE (and the cache writes) of the packed projection: one fused kernel on CUDA
        (seven launches in torch; at a few thousand tokens the GPU waits for the host)."""
        c = self.config
        rotate = self._rope_impl
        return rotate(x, rope.cos, rope.sin, c.num_heads, c.num_kv_heads, k_out, v_out, slots)

    @functools.cached_property
    def _rope_impl(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The fused kernel on CUDA when Triton takes the model's dtype and head size, else
        the torch reference: decided once per model, not once per layer call."""
        probe = torch.empty(0, 1, device="meta", dtype=self.dtype)
        if (
            self.device.type == "cuda"
            and has_triton()
            and rope_qkv.is_triton_supported(probe, self.config.head_dim)
        ):
            return rope_qkv.triton_rope_qkv
        return rope_qkv.reference_rope_qkv

    def attend_and_mlp(
        self,
        layer: int,
        h: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """The rest of the layer for the queries' rows of h: attention over (k, v), MLP
        (h is updated in place and returned)."""
        return self.finish_layer(layer, h, attend(q, k, v, plan))

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and MLP of attention output attn [heads, n, d],
        added into h in place (returned)."""
        w = self.layers[layer]
        # h is updated in place: the residual adds ride in the matmuls' epilogues (a GEMM
        # accumulating into h), two launches fewer per layer, which is what a short prompt
        # on a GPU waits for. Every caller passes a hidden state it no longer needs.
        h.addmm_(attn.transpose(0, 1).reshape(h.shape[0], -1), w.out.T)
        gate, up = (self._rms_norm(h, w.ffn_norm) @ w.gate_up.T).chunk(2, dim=-1)
        return h.addmm_(F.silu(gate) * up, w.down.T)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits for hidden states h [n, hidden] -> [n, vocab]."""
        return self._rms_norm(h, self.final_norm) @ self.output.T

    def forward(
        self,
        token_ids: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start: int,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run tokens at positions start.. after the cached slots [0, start).

        Writes their K/V into the cache buffers and returns their last hidden states.
        `before_layer(i)` runs before layer i (a background caller waits there while
        the machine is busy).
        """
        end = start + token_ids.shape[0]
        positions = torch.arange(start, end, device=self.device)
        return self.forward_at(token_ids, positions, end, k_cache, v_cache, before_layer)

    def forward_at(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        num_keys: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """`forward` of tokens at sorted `positions` (on the model's device), the last
        of them `num_keys - 1`; every other slot below `num_keys` holds KV already."""
        if num_keys > k_cache.shape[2]:
            raise ValueError(f"k_cache: holds {k_cache.shape[2]} slots, need {num_keys}")
        rope = self.rope(positions)
        plan = plan_attention(positions, num_keys, self.dtype, head_dim=self.config.head_dim)
        h = self.embed(token_ids)
        for layer in range(self.num_layers):
            if before_layer is not None:
                before_layer(layer)
            keys, values = k_cache[layer], v_cache[layer]
            q = self.qkv_into(layer, h, rope, keys, values, positions)
            h = self.attend_and_mlp(layer, h, q, keys, values, plan)
        return h

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * weight, fused on accelerators.
        return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
