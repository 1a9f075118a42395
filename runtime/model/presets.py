"""Named model shapes with random weights, for timing at scale without downloading weights.

Speed depends on the shape (layers, widths, heads, vocabulary), not on the values, so a
benchmark on an accelerator can time a Llama-3-8B-shaped model built on the device in
seconds. Quality figures of such a model mean nothing: the benchmark marks its rows
with the preset's name, and the quality columns are only read for real weights.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from holeblend_runtime.model.config import ModelConfig

# The shapes of public checkpoints (their config.json), token ids of SmolLM2's tokenizer,
# which the benchmark uses to build prompts for every preset. Random weights have no
# trained length: the context is 32k, so that "8k" prompts of varying length and their
# answers fit.
_CONTEXT = 32768


def _random_llama(name: str, **shape: object) -> ModelConfig:
    return ModelConfig(
        model_id=f"random:{name}", rms_norm_eps=1e-5, context_length=_CONTEXT,
        bos_token_id=1, eos_token_id=2, add_bos_token=False, **shape,  # type: ignore[arg-type]
    )  # fmt: skip


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": _random_llama(
        "smollm2-135m", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
        head_dim=64, intermediate_size=1536, rope_theta=100000.0, vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "llama-3-8b": _random_llama(
        "llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=14336, rope_theta=500000.0, vocab_size=128256,
        tie_word_embeddings=False,
    ),
}  # fmt: skip


def preset_config(name: str, context_length: int | None = None) -> ModelConfig:
    """The preset's shape; `context_length` overrides how long a prompt it takes."""
    if name not in PRESETS:
        raise ValueError(f"model: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    config = PRESETS[name]
    return config if context_length is None else replace(config, context_length=context_length)


def random_weights(
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """GGUF-named weights of `config`'s shape, drawn on `device` (normal, std 0.02, as
    Llama initializes; norms 1), so an 8B shape never passes through host memory."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        weight = torch.empty(shape, device=device, dtype=dtype)
        return weight.normal_(0.0, 0.02, generator=generator)

    c = config
    ones = torch.ones(c.hidden_size, device=device, dtype=dtype)
    weights = {"token_embd.weight": draw(c.vocab_size, c.hidden_size), "output_norm.weight": ones}
    if not c.tie_word_embeddings:
        weights["output.weight"] = draw(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        block = {
            "attn_norm": ones,
            "attn_q": draw(c.hidden_size, c.hidden_size),
            "attn_k": draw(c.kv_width, c.hidden_size),
            "attn_v": draw(c.kv_width, c.hidden_size),
            "attn_output": draw(c.hidden_size, c.hidden_size),
            "ffn_norm": ones,
            "ffn_gate": draw(c.intermediate_size, c.hidden_size),
            "ffn_up": draw(c.intermediate_size, c.hidden_size),
            "ffn_down": draw(c.hidden_size, c.intermediate_size),
        }
        weights.update({f"blk.{i}.{name}.weight": w for name, w in block.items()})
    return weights
