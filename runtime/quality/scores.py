"""Quality of a blended answer against full prefill and against the gold answer.

The 135M model is weak at extractive QA, so the main yardstick is the model's own
full-prefill behaviour: F1 between the two generated answers, and, teacher-forced on the
full-prefill answer, KL divergence and top-1 agreement of the next-token distributions.
All functions are pure: token lists or logits in, numbers out.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

import torch
import torch.nn.functional as F

_ARTICLES = frozenset({"a", "an", "the"})
# Commas inside numbers ("4,213") go away with the rest of the punctuation.
_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation)}]")


def answer_words(text: str) -> list[str]:
    """SQuAD-style normalisation: lower case, no punctuation, no articles."""
    words = _PUNCTUATION.sub("", text.lower()).split()
    return [w for w in words if w not in _ARTICLES]


def answer_f1(
    candidate: Sequence[Hashable],
    reference: Sequence[Hashable],
    question: Iterable[Hashable] = (),
) -> float:
    """Token-overlap F1; tokens that also occur in the question are skipped.

    A model that merely repeats the question ("The X Institute was founded in ...")
    would otherwise score well against any answer that does the same.
    """
    copied = set(question)
    candidate_counts = Counter(t for t in candidate if t not in copied)
    reference_counts = Counter(t for t in reference if t not in copied)
    if not candidate_counts or not reference_counts:
        # Both empty: the answers agree on saying nothing new.
        return float(candidate_counts == reference_counts)
    num_common = sum((candidate_counts & reference_counts).values())
    if num_common == 0:
        return 0.0
    precision = num_common / sum(candidate_counts.values())
    recall = num_common / sum(reference_counts.values())
    return 2 * precision * recall / (precision + recall)


def kl_divergence(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) per position, in nats: `[n, vocab]` x2 -> `[n]`."""
    _check_same_shape(reference_logits, candidate_logits)
    reference_log_probs = F.log_softmax(reference_logits.double(), dim=-1)
    candidate_log_probs = F.log_softmax(candidate_logits.double(), dim=-1)
    kl = F.kl_div(candidate_log_probs, reference_log_probs, log_target=True, reduction="none")
    # Clamp tiny negative sums left by rounding.
    return kl.sum(dim=-1).clamp_min(0.0)


def top1_agreement(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> float:
    """Share of positions where both distributions put the same token first."""
    _check_same_shape(reference_logits, candidate_logits)
    if reference_logits.shape[0] == 0:
        raise ValueError("reference_logits: need at least one position")
    is_same = reference_logits.argmax(dim=-1) == candidate_logits.argmax(dim=-1)
    return is_same.double().mean().item()


def mean_nll(logits: torch.Tensor, target_ids: Sequence[int]) -> float:
    """Mean negative log-likelihood of `target_ids[i]` under `logits[i]`, in nats."""
    if logits.dim() != 2 or logits.shape[0] != len(target_ids):
        raise ValueError(
            f"logits: expected [{len(target_ids)}, vocab] for {len(target_ids)} targets, "
            f"got {tuple(logits.shape)}"
        )
    if not target_ids:
        raise ValueError("target_ids: need at least one token")
    targets = torch.tensor(list(target_ids), dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits.double(), targets).item()


def _check_same_shape(reference: torch.Tensor, candidate: torch.Tensor) -> None:
    if reference.dim() != 2:
        raise ValueError(f"reference_logits: expected [n, vocab], got {tuple(reference.shape)}")
    if candidate.shape != reference.shape:
        raise ValueError(
            f"candidate_logits: shape {tuple(candidate.shape)} differs from "
            f"reference {tuple(reference.shape)}"
        )
