"""Greedy decoding of several sequences together: one forward pass per step for all of them.

A decode step of one sequence is one token through every layer: its matmuls read all the
weights (540 MB for SmolLM2-135M in float32) for a single row. Stacking the next token of
B sequences into hidden states [B, hidden] reads the weights once for the B rows, so B
answers advance for about the cost of one.

Each sequence keeps its own KV cache ([layers, kv_heads, slots, head_dim], as `Llama`
writes it) and its own position. Per layer the step computes Q, K and V of all B tokens
in one matmul, writes each sequence's new K/V into its cache at its position, runs
attention for each sequence over its own keys 0..position (one query at the last
position sees every key: no mask), stacks the B outputs and runs the output projection
and the MLP for all of them at once.

`DecodeSequence` is one sequence's state; `decode_step` advances a list of them by one
token each. The engine starts sequences from prefills (`BlendEngine.start_decode`)
and wraps the step (`BlendEngine.decode_step`); the server's compute thread runs the
requests in flight as one batch (`holeblend_runtime.serve.worker`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from holeblend_runtime.model.attention import attend_one_query
from holeblend_runtime.model.llama import Llama


@dataclass(eq=False)
class DecodeSequence:
    """One sequence being decoded greedily."""

    # [layers, kv_heads, slots, head_dim]: the prompt's KV and room for the answer.
    k: torch.Tensor
    v: torch.Tensor
    # Tokens with KV in the cache so far: the slot the next token fed is written to.
    position: int
    # [vocab] logits of the next token (after the prompt, then after each token fed).
    logits: torch.Tensor
    # Most tokens the sequence may produce (its answer limit within the context).
    max_new_tokens: int
    # Tokens produced so far (the caller counts them with `produced`).
    num_produced: int = 0

    def next_token(self) -> int:
        """The greedy choice after what has been fed so far."""
        return int(self.logits.argmax())

    def produced(self) -> None:
        self.num_produced += 1

    @property
    def is_at_limit(self) -> bool:
        return self.num_produced >= self.max_new_tokens

    @property
    def room(self) -> int:
        """Slots left in the cache buffers for tokens fed."""
        return self.k.shape[2] - self.position


def decode_step(model: Llama, sequences: Sequence[DecodeSequence], tokens: Sequence[int]) -> None:
    """Feed `tokens[i]` to `sequences[i]` in one batched forward pass: writes each token's
    K/V at its sequence's position, advances the position and sets the new logits.

    Call it under `torch.inference_mode()` when the caches were allocated there."""
    if len(sequences) != len(tokens):
        raise ValueError(f"tokens: {len(tokens)} for {len(sequences)} sequences")
    if not sequences:
        return
    for i, sequence in enumerate(sequences):
        if sequence.room < 1:
            raise ValueError(f"sequences[{i}]: the KV cache is full at {sequence.position}")
    device = model.device
    positions = torch.tensor([s.position for s in sequences], dtype=torch.int64, device=device)
    rope = model.rope(positions)
    h = model.embed(torch.tensor(list(tokens), dtype=torch.int64, device=device))
    for layer in range(model.num_layers):
        q, k, v = model.qkv(layer, h, rope)
        outputs = []
        for row, sequence in enumerate(sequences):
            keys, values = sequence.k[layer], sequence.v[layer]
            end = sequence.position + 1
            keys[:, sequence.position] = k[:, row]
            values[:, sequence.position] = v[:, row]
            outputs.append(attend_one_query(q[:, row : row + 1], keys[:, :end], values[:, :end]))
        attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        h = model.finish_layer(layer, h, attn)
    logits = model.logits(h)
    for row, sequence in enumerate(sequences):
        sequence.logits = logits[row]
        sequence.position += 1
