"""The model adapter refuses what the blend cannot run, naming the reason, before it reads
a module of the model. The models here are small torch modules laid out as vLLM's are."""

from __future__ import annotations

import types

import pytest
import torch

from holeblend_runtime.vllm_connector.model_adapter import VllmModelAdapter

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 8, 2


class RotaryEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.is_neox_style, self.rotary_dim, self.base = True, HEAD_DIM, 10000.0


class _Attention(torch.nn.Module):
    def __init__(self, sliding_window: int | None) -> None:
        super().__init__()
        self.total_num_heads = self.num_heads = HEADS
        self.num_kv_heads, self.head_dim = KV_HEADS, HEAD_DIM
        self.rotary_emb = RotaryEmbedding()
        self.attn = types.SimpleNamespace(layer_name="attn", sliding_window=sliding_window)


class _Layer(torch.nn.Module):
    def __init__(self, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = _Attention(sliding_window)
        self.input_layernorm = torch.nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM)


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, sliding_windows: tuple[int | None, ...] = (None,) * LAYERS) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(_Layer(w) for w in sliding_windows)
        self.config = types.SimpleNamespace(eos_token_id=2, vocab_size=32)


class OPTForCausalLM(torch.nn.Module):
    """Another layout: its layers are under `model.decoder`, not `model.layers`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.decoder = torch.nn.Module()
        self.model.decoder.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])


def test_a_supported_model_is_adapted():
    adapter = VllmModelAdapter(LlamaForCausalLM(), "m", context_length=128)
    assert (adapter.num_layers, adapter.config.num_heads) == (LAYERS, HEADS)


def test_a_model_of_another_architecture_is_refused_by_name_whatever_its_layout():
    with pytest.raises(
        ValueError, match="model: OPTForCausalLM is not supported.*LlamaForCausalLM"
    ):
        VllmModelAdapter(OPTForCausalLM(), "m", context_length=128)


def test_a_sliding_window_shorter_than_the_context_is_refused():
    # The blend attends over the whole prompt: a layer that attends within a window would
    # see other keys in vLLM's forward than in the blend.
    model = LlamaForCausalLM(sliding_windows=(None, 64))
    with pytest.raises(ValueError, match=r"model: layer 1 .*window of 64 .*--max-model-len 64"):
        VllmModelAdapter(model, "m", context_length=128)


def test_a_sliding_window_as_long_as_the_context_is_no_window():
    model = LlamaForCausalLM(sliding_windows=(128, 128))
    assert VllmModelAdapter(model, "m", context_length=128).num_layers == LAYERS
