"""Which cached tokens to recompute: a family of named selection strategies and mixes.

At the check layer the blender measures, for every cached token, what the strategies
score from (`CheckScores`); a `Selector` turns those scores into the `k` tokens to
recompute. Built-in strategies (the contract's names, `BlendConfig.selection`):

- `kDeviation`: CacheBlend's choice, the tokens whose K moved most once the prompt's
  context is present (squared distance of fresh and cached K at the check layer).
- `vDeviation`: the same with V, which carries what a token contributes to others.
- `kvDeviation`: K and V deviation, each divided by its mean over the section, summed.
- `sinks`: the first tokens of every reused segment (offset 0 of every segment, then
  offset 1, ...): a segment cached apart from its new neighbours has its own attention
  sinks at its start, which full prefill of the new prompt would not have (EPIC).
- `query`: the cached tokens the question attends to most at the check layer (softmax
  attention of the question's tokens, summed over heads and question tokens), i.e. what
  the answer will read (ProphetKV-style); without question tokens, K deviation.
- `random`: a baseline, reproducible from the config's seed.

A mix gives each strategy a share of the budget, `"sinks:0.25+kDeviation"`: the parts
pick in order, each among the tokens the earlier parts left. With filter layers
(gradual filtering) the deviation parts (`narrows`) pick several times their share at the
check layer and each filter layer keeps fewer of them, by the fresh-vs-cached deviation
at that layer; the other parts' picks are kept as they are (the blender sizes the stages
so that filtering computes as many token-layers as the budget at one width).

Everything a strategy reads is a device tensor; how many tokens each part picks is host
arithmetic (`Selector.split`), so a selection never reads a device value on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from holeblend_contract.blend_settings import parse_selection
from holeblend_runtime.blend.config import (
    K_DEVIATION,
    KV_DEVIATION,
    QUERY,
    RANDOM,
    SINKS,
    V_DEVIATION,
    BlendConfig,
)
from holeblend_runtime.model.devices import to_device

# What a strategy may need measured besides K deviation and segment offsets.
NEEDS_V = "v"
NEEDS_QUERY = "query"


@dataclass(frozen=True, eq=False)
class CheckScores:
    """What the check layer measured for the cached tokens of one section, in position
    order (device tensors of the same length)."""

    # Squared distance of fresh and cached K, summed over heads and dimensions.
    k_deviation: torch.Tensor
    # The same for V (None unless a strategy needs it).
    v_deviation: torch.Tensor | None = None
    # Attention the question's tokens pay each token (None: not measured or no question).
    attention: torch.Tensor | None = None
    # Offset of each token from the start of its reused segment (int64; None: unknown).
    segment_offset: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.k_deviation.shape[0]


class Strategy(Protocol):
    """One named way to score cached tokens: higher scores are recomputed first."""

    name: str
    # Measurements it needs beyond K deviation and offsets (NEEDS_V, NEEDS_QUERY).
    needs: frozenset[str]
    # Whether filter layers may narrow its picks by a later layer's deviation.
    narrows: bool

    def score(self, scores: CheckScores) -> torch.Tensor:
        """[num_tokens] float scores on the scores' device."""
        ...


class KDeviation:
    name, needs, narrows = K_DEVIATION, frozenset(), True

    def score(self, scores: CheckScores) -> torch.Tensor:
        return scores.k_deviation


class VDeviation:
    name, needs, narrows = V_DEVIATION, frozenset({NEEDS_V}), True

    def score(self, scores: CheckScores) -> torch.Tensor:
        return _required(scores.v_deviation, self.name, "v_deviation")


class KVDeviation:
    name, needs, narrows = KV_DEVIATION, frozenset({NEEDS_V}), True

    def score(self, scores: CheckScores) -> torch.Tensor:
        v = _required(scores.v_deviation, self.name, "v_deviation")
        return _normalized(scores.k_deviation) + _normalized(v)


class Sinks:
    name, needs, narrows = SINKS, frozenset(), False

    def score(self, scores: CheckScores) -> torch.Tensor:
        offset = _required(scores.segment_offset, self.name, "segment_offset")
        return -offset.float()


class Query:
    name, needs, narrows = QUERY, frozenset({NEEDS_QUERY}), False

    def score(self, scores: CheckScores) -> torch.Tensor:
        return scores.k_deviation if scores.attention is None else scores.attention


class Random:
    name, needs, narrows = RANDOM, frozenset(), False

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def score(self, scores: CheckScores) -> torch.Tensor:
        values = torch.rand(scores.num_tokens, generator=self._generator)
        return to_device(values, scores.k_deviation.device)


class SelectionStrategy(Protocol):
    """What the blender asks of a selection (a `Selector` or any object like it)."""

    name: str
    needs: frozenset[str]

    def split(self, k: int, num_tokens: int) -> tuple[int, ...]:
        """Host counts per part for `k` tokens of `num_tokens`."""
        ...

    def narrowing(self) -> tuple[bool, ...]:
        """Per part: whether filter layers narrow its picks."""
        ...

    def select(self, scores: CheckScores, counts: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Per part, indexes (int64) into the scores' tokens: `counts[i]` distinct tokens,
        none picked by an earlier part."""
        ...

    def narrow_score(self, scores: CheckScores) -> torch.Tensor:
        """The scores filter layers narrow by (the first narrowing part's)."""
        ...


class Selector:
    """A mix of strategies with budget shares (one strategy: a share of 1)."""

    def __init__(self, parts: Sequence[tuple[Strategy, float]]) -> None:
        if not parts:
            raise ValueError("selection: needs at least one strategy")
        shares = [share for _, share in parts]
        # `split` gives k tokens in all only for shares that sum to 1 (the contract's
        # tolerance): under it the parts pick fewer, over it more than k, and a last part
        # that finds too few tokens left picks ones already taken.
        if any(not 0 <= share <= 1 for share in shares) or abs(sum(shares) - 1) > 1e-6:
            raise ValueError(
                f"selection: shares must each be in [0, 1] and sum to 1, got {shares}; "
                "build the selector with make_strategy or give the shares of the whole budget"
            )
        self.parts = tuple(parts)
        self.name = "+".join(
            s.name if len(parts) == 1 else f"{s.name}:{share:g}" for s, share in parts
        )
        self.needs = frozenset().union(*(s.needs for s, _ in parts))

    def split(self, k: int, num_tokens: int) -> tuple[int, ...]:
        if not 0 <= k <= num_tokens:
            raise ValueError(f"k: must be in 0..{num_tokens}, got {k}")
        # Largest remainders: the counts sum to k exactly, each near its share.
        exact = [share * k for _, share in self.parts]
        counts = [int(x) for x in exact]
        order = sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])
        for i in order[: k - sum(counts)]:
            counts[i] += 1
        return tuple(counts)

    def narrowing(self) -> tuple[bool, ...]:
        return tuple(s.narrows for s, _ in self.parts)

    def select(self, scores: CheckScores, counts: Sequence[int]) -> tuple[torch.Tensor, ...]:
        taken = torch.zeros(scores.num_tokens, dtype=torch.bool, device=scores.k_deviation.device)
        picks = []
        for (strategy, _), count in zip(self.parts, counts, strict=True):
            if count == 0:
                picks.append(torch.empty(0, dtype=torch.int64, device=taken.device))
                continue
            ranked = strategy.score(scores).float().masked_fill(taken, float("-inf"))
            chosen = torch.topk(ranked, count, sorted=False).indices
            # Not `taken[chosen] = True`: on CUDA that copies the scalar from the host, and
            # the host waits for the layers before the check (torch's sync debug mode, H200).
            taken.index_fill_(0, chosen, True)
            picks.append(chosen)
        return tuple(picks)

    def narrow_score(self, scores: CheckScores) -> torch.Tensor:
        for strategy, _ in self.parts:
            if strategy.narrows:
                return strategy.score(scores)
        return scores.k_deviation


def make_strategy(config: BlendConfig) -> Selector:
    """The selector `config.selection` names; a fresh one per request, so random
    selection repeats request by request."""
    parts = []
    for name, share in parse_selection(config.selection):
        strategy: Strategy = Random(config.seed) if name == RANDOM else _BY_NAME[name]()
        parts.append((strategy, share))
    return Selector(parts)


def needs(config: BlendConfig) -> frozenset[str]:
    """What the configured selection needs measured (e.g. NEEDS_QUERY: the vLLM
    connector then covers the question, so the blend sees it as holeblend-serve does)."""
    return frozenset().union(
        *(_BY_NAME[name].needs for name, _ in parse_selection(config.selection))
    )


def num_to_select(num_cached: int, ratio: float) -> int:
    return min(num_cached, round(ratio * num_cached))


_BY_NAME: dict[str, type] = {
    K_DEVIATION: KDeviation,
    V_DEVIATION: VDeviation,
    KV_DEVIATION: KVDeviation,
    SINKS: Sinks,
    QUERY: Query,
    RANDOM: Random,
}


def _normalized(values: torch.Tensor) -> torch.Tensor:
    return values / values.mean().clamp_min(torch.finfo(values.dtype).tiny)


def _required(value: torch.Tensor | None, strategy: str, field: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"selection {strategy!r}: the blender did not measure {field}")
    return value
