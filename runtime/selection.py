"""Which cached tokens to recompute: pluggable selection strategies.

A strategy sees the check-layer deviation of every cached token (fresh K vs cached K)
and returns the indexes of the `k` to recompute. New strategies implement the protocol
and are passed to the engine; the config names the built-in ones.
"""

from __future__ import annotations

from typing import Protocol

import torch

from holeblend_runtime.blend_config import K_DEVIATION, RANDOM, BlendConfig
from holeblend_runtime.devices import to_device


class SelectionStrategy(Protocol):
    name: str

    def select(self, deviation: torch.Tensor, k: int) -> torch.Tensor:
        """Indexes (int64) into `deviation` [num_cached] of `k` distinct tokens."""
        ...


class KDeviationTopK:
    """CacheBlend's choice: the tokens whose K moved most once context is present."""

    name = K_DEVIATION

    def select(self, deviation: torch.Tensor, k: int) -> torch.Tensor:
        return torch.topk(deviation, k, sorted=False).indices


class RandomSelection:
    """A baseline: k tokens uniformly at random, reproducible from the seed."""

    name = RANDOM

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def select(self, deviation: torch.Tensor, k: int) -> torch.Tensor:
        order = torch.randperm(deviation.shape[0], generator=self._generator)
        return to_device(order[:k], deviation.device)


def make_strategy(config: BlendConfig) -> SelectionStrategy:
    """A fresh strategy per request, so random selection repeats request by request."""
    if config.selection == RANDOM:
        return RandomSelection(config.seed)
    return KDeviationTopK()


def num_to_select(num_cached: int, ratio: float) -> int:
    return min(num_cached, round(ratio * num_cached))
