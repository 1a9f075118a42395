"""The shape of a Llama-family model, read once from GGUF metadata."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass and the tokenizer need to know about the model."""

    # Identity of the weights (file name and size); part of every segment key.
    model_id: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Width of the SwiGLU MLP.
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    # Longest prompt plus generation the model was trained for.
    context_length: int
    bos_token_id: int | None
    eos_token_id: int
    # Whether the tokenizer puts BOS in front of a prompt (SmolLM2: it does not).
    add_bos_token: bool
    # The output layer reuses the token embedding.
    tie_word_embeddings: bool
    # Llama 3.1's RoPE scaling as llama.cpp stores it (the `rope_freqs.weight` tensor):
    # one divisor per rotary pair's frequency (head_dim / 2 of them); None: none.
    rope_freq_factors: tuple[float, ...] | None = None
    # Linear RoPE scaling: positions are divided by this factor (1: none).
    rope_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_kv_heads: must divide num_heads")
        if self.head_dim * self.num_heads != self.hidden_size:
            raise ValueError("head_dim: head_dim x num_heads must equal hidden_size")
        factors = self.rope_freq_factors
        if factors is not None and len(factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors: must hold head_dim / 2 = {self.head_dim // 2} values, "
                f"got {len(factors)}"
            )
        if factors is not None and not all(0 < f < math.inf for f in factors):
            raise ValueError("rope_freq_factors: must all be finite and > 0")
        if not 0 < self.rope_scaling_factor < math.inf:
            raise ValueError(
                f"rope_scaling_factor: must be finite and > 0, got {self.rope_scaling_factor}"
            )

    @property
    def rope_divisors(self) -> tuple[float, ...] | None:
        """What each rotary pair's inverse frequency is divided by: the frequency factors
        times the linear factor (scaling positions by 1/factor scales every angle so);
        None where the model's RoPE is unscaled."""
        factors, linear = self.rope_freq_factors, self.rope_scaling_factor
        if factors is None and linear == 1.0:
            return None
        return tuple(f * linear for f in factors or (1.0,) * (self.head_dim // 2))

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        factors = data.get("rope_freq_factors")  # a list once through JSON
        return cls(**{**data, "rope_freq_factors": None if factors is None else tuple(factors)})
