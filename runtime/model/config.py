"""The shape of a Llama-family model, read once from GGUF metadata."""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_kv_heads: must divide num_heads")
        if self.head_dim * self.num_heads != self.hidden_size:
            raise ValueError("head_dim: head_dim x num_heads must equal hidden_size")

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        return cls(**data)
