"""Quality of a blended answer against full prefill and against the gold answer.

The 135M model is weak at extractive QA, so the main yardstick is the model's own
full-prefill behaviour: F1 between the two generated answers, and, teacher-forced on the
full-prefill answer, KL divergence and top-1 agreement of the next-token distributions.
All functions are pure: token lists or logits in, numbers out.
"""

from __future__ import annotations

import string
import unicodedata
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

import torch
import torch.nn.functional as F

_ARTICLES = frozenset({"a", "an", "the"})
_ASCII_PUNCTUATION = frozenset(string.punctuation)  # symbols such as "$" and "+" too
# Scripts written without spaces between words: each character is a word of its own
# (as MLQA and DuReader score Chinese). Han ideographs (and their extensions and
# compatibility forms), Hiragana and Katakana (full and half width).
_CJK_RANGES = (
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0x3400, 0x4DBF),  # Han extension A
    (0x4E00, 0x9FFF),  # Han
    (0xF900, 0xFAFF),  # Han compatibility
    (0xFF66, 0xFF9F),  # half-width Katakana
    (0x20000, 0x2FA1F),  # Han extensions B-F, compatibility supplement
)
# CJK punctuation ("、", "。", full-width forms) separates words where it stands: it is
# replaced by a space, so "olympics、2008" is two words. Elsewhere punctuation is deleted.
_SEPARATING_RANGES = ((0x3000, 0x303F), (0x30FB, 0x30FB), (0xFE30, 0xFE4F), (0xFF00, 0xFFEF))


def _is_punctuation(char: str) -> bool:
    return char in _ASCII_PUNCTUATION or unicodedata.category(char).startswith("P")


def _in(ranges: tuple[tuple[int, int], ...], char: str) -> bool:
    code = ord(char)
    return any(low <= code <= high for low, high in ranges)


def answer_words(text: str) -> list[str]:
    """SQuAD-style normalisation: lower case, no punctuation (ASCII's and every Unicode
    punctuation character), no articles; a Chinese or Japanese character is a word of its
    own. Punctuation other than CJK punctuation is removed, not turned into a space:
    commas inside numbers ("4,213") go away."""
    kept = []
    for char in text.lower():
        if _is_punctuation(char):
            kept.append(" " if _in(_SEPARATING_RANGES, char) else "")
        else:
            kept.append(f" {char} " if _in(_CJK_RANGES, char) else char)
    return [w for w in "".join(kept).split() if w not in _ARTICLES]


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
    # A token the reference rules out (logit -inf) adds nothing, whatever the candidate
    # gives it (0 log 0 is 0; kl_div's exp(-inf) * (-inf - x) is NaN).
    kl = kl.masked_fill(reference_log_probs == float("-inf"), 0.0)
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
