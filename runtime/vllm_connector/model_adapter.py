"""The blender's model interface (`holeblend_runtime.model.llama.Llama`'s layer functions) over
the modules of a model vLLM has loaded, so our blender runs vLLM's own weights.

Supported: vLLM's Llama, Qwen2 and Qwen3 families (decoder layers with `input_layernorm`,
`self_attn.{qkv_proj, o_proj, rotary_emb, attn}` (+ `q_norm`/`k_norm` for Qwen3),
`post_attention_layernorm`, `mlp`), plain rotate-half RoPE over the whole head
(re-rotating cached K by a position difference needs unscaled frequencies), and no sliding
window shorter than the context (the blend attends over the whole prompt). Anything else is
refused with the reason at start-up (the connector builds its blend when vLLM registers the
KV caches).

Tensor parallelism: each rank's adapter holds that rank's heads (vLLM's sharded modules;
their all-reduces run inside `o_proj` and the MLP), so the blend runs on every rank over
its head shard; the selection scores are summed over the ranks (`reduce_shards`) so that
every rank recomputes the same tokens.

Residual stream and attention are ours (`attention.attend`: each query at its true
position; on vLLM's CPU backend its own attention kernel over the same sparse causal
pattern, paged_attention.py); the norms, projections, MLP, embedding and logits are vLLM's modules, and RoPE
angles come from vLLM's own cos/sin cache, so a full recompute reproduces vLLM's prefill.
"""

from __future__ import annotations

from typing import Any

import torch

from holeblend_runtime.model.attention import AttentionPlan, attend
from holeblend_runtime.model.config import ModelConfig
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.rope import RopeTable, apply_rope
from holeblend_runtime.vllm_connector.paged_attention import PagedBlendAttention

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class VllmModelAdapter:
    """`Llama`'s interface (new_kv, rope, embed, qkv, qkv_into, attend_and_mlp, logits,
    forward)."""

    # The same code as the reference model: these only use the methods below.
    new_kv = Llama.new_kv
    forward = Llama.forward
    forward_at = Llama.forward_at

    def __init__(self, model: torch.nn.Module, model_id: str, context_length: int) -> None:
        _check_supported(model, context_length)
        self.model = model
        self.layers = list(model.model.layers)
        attention = self.layers[0].self_attn
        self.rotary = attention.rotary_emb
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.config = _model_config(model, attention, model_id, context_length)
        # Tensor-parallel ranks holding a shard of the heads each (vLLM shards evenly).
        self.num_shards = attention.total_num_heads // attention.num_heads
        # vLLM's CPU attention kernel for the blend's attention (paged_attention.py), set by
        # `use_paged_attention`; None: `attention.attend`.
        self.paged_attention: PagedBlendAttention | None = None

    def use_paged_attention(self, block_size: int) -> bool:
        """Attend with vLLM's own CPU kernel where it applies; whether it does."""
        self.paged_attention = PagedBlendAttention.for_adapter(self, block_size)
        return self.paged_attention is not None

    def reduce_shards(self, scores: torch.Tensor) -> torch.Tensor:
        """The sum of a per-token score over the tensor-parallel ranks (a collective:
        every rank calls it at the same point of the same blend)."""
        if self.num_shards == 1:
            return scores
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(scores)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def attention_layer_names(self) -> list[str]:
        """vLLM's name of each layer's attention module (the keys of its KV cache dict)."""
        return [layer.self_attn.attn.layer_name for layer in self.layers]

    def attention_modules(self) -> list[torch.nn.Module]:
        return [layer.self_attn.attn for layer in self.layers]

    def rope(self, positions: torch.Tensor) -> RopeTable:
        """cos and sin at `positions` from vLLM's own cache ([cos | sin] halves)."""
        cache = self.rotary.cos_sin_cache[positions.to(self.rotary.cos_sin_cache.device)]
        cos, sin = cache.to(device=self.device, dtype=self.dtype).chunk(2, dim=-1)
        return RopeTable(torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1))

    def rope_upto(self, num_positions: int) -> RopeTable:
        """`rope` of positions 0..num_positions-1."""
        return self.rope(torch.arange(num_positions, device=self.device))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(token_ids.to(self.device))

    def qkv(
        self, layer: int, h: torch.Tensor, rope: RopeTable
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q [heads, n, d], K and V [kv_heads, n, d]; Q and K rotated."""
        attention, c = self.layers[layer].self_attn, self.config
        x, _ = attention.qkv_proj(self.layers[layer].input_layernorm(h))
        q, k, v = x.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
        q = q.reshape(-1, c.num_heads, c.head_dim)
        k = k.reshape(-1, c.num_kv_heads, c.head_dim)
        if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
            q, k = attention.q_norm(q), attention.k_norm(k)
        q, k = q.transpose(0, 1), k.transpose(0, 1)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def qkv_into(
        self,
        layer: int,
        h: torch.Tensor,
        rope: RopeTable,
        k_out: torch.Tensor,
        v_out: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """`qkv`, K and V written into `k_out`/`v_out` at `slots`; returns Q."""
        q, k, v = self.qkv(layer, h, rope)
        k_out.index_copy_(1, slots, k)
        v_out.index_copy_(1, slots, v)
        return q

    def attend_and_mlp(
        self,
        layer: int,
        h: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        decoder = self.layers[layer]
        if self.paged_attention is not None:
            attn = self.paged_attention(q, k, v, plan).reshape(h.shape[0], -1)
        else:
            attn = attend(q, k, v, plan).transpose(0, 1).reshape(h.shape[0], -1)
        out, _ = decoder.self_attn.o_proj(attn)
        h = h + out
        return h + decoder.mlp(decoder.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model.model.norm(h))


def _check_supported(model: torch.nn.Module, context_length: int) -> None:
    """Refuse, with the reason, a model the blend cannot run: the architecture is checked
    first, as other architectures lay their modules out differently."""
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model: {name} is not supported by hole-mode blending; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for i, layer in enumerate(model.model.layers):
        window = getattr(layer.self_attn.attn, "sliding_window", None)
        if window is not None and window < context_length:
            raise ValueError(
                f"model: layer {i} attends within a sliding window of {window} tokens, "
                f"shorter than max_model_len {context_length}, and the blend attends over "
                f"the whole prompt; serve with --max-model-len {window} or lower"
            )
    attention = model.model.layers[0].self_attn
    rotary = attention.rotary_emb
    if type(rotary).__name__ != "RotaryEmbedding" or not rotary.is_neox_style:
        raise ValueError(
            f"model: {type(rotary).__name__} RoPE is not supported (cached K is re-rotated "
            "with plain rotate-half RoPE); use a model without RoPE scaling"
        )
    if rotary.rotary_dim != attention.head_dim:
        raise ValueError("model: partial rotary embeddings are not supported")


def _model_config(
    model: torch.nn.Module, attention: Any, model_id: str, context_length: int
) -> ModelConfig:
    hf = model.config
    eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, list) else hf.eos_token_id
    return ModelConfig(
        model_id=model_id,
        num_layers=len(model.model.layers),
        # The attention width (ModelConfig ties it to heads x head_dim; Qwen3 differs
        # from the residual width, which nothing here reads).
        hidden_size=attention.num_heads * attention.head_dim,
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        intermediate_size=int(getattr(hf, "intermediate_size", 1)),
        rope_theta=float(attention.rotary_emb.base),
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        vocab_size=int(hf.vocab_size),
        context_length=context_length,
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_id=int(eos if eos is not None else 0),
        add_bos_token=False,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )
