"""A RAG request stream for the load benchmark: Zipf-popular documents from a corpus.

1. The corpus is made of the synthetic workload's documents (`workload.py`): invented
   organisations described by fact sentences, each one distinct.
2. Document rank r (from 0) is drawn with weight 1 / (r + 1) ** s; each request draws
   `documents_per_request` distinct documents that way and puts them in a random order.
   Popular documents recur (hits), often in a new place or next to a new neighbour
   (holes), and the long tail brings new ones (misses), as in production traffic.
3. Each request asks about one fact of one of its documents whose answer occurs in no
   other document of the request.
4. The first `num_warmup` requests warm the server's cache and code paths; they are sent
   but not measured.

Pure and seeded: the same config gives the same stream, for every mode's server.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from holeblend_runtime.bench.workload import (
    SYSTEM_PROMPT,
    Document,
    WorkloadConfig,
    approximate_token_count,
    generate_workload,
)


@dataclass(frozen=True)
class LoadWorkloadConfig:
    seed: int = 0
    # Distinct documents in the corpus.
    num_corpus_documents: int = 40
    documents_per_request: int = 6
    # Zipf exponent of document popularity (0: uniform).
    zipf_s: float = 1.1
    # Requests sent first and not measured.
    num_warmup: int = 8
    # Measured requests.
    num_requests: int = 32
    min_document_tokens: int = 100
    max_document_tokens: int = 140

    def __post_init__(self) -> None:
        for name in ("num_corpus_documents", "documents_per_request", "num_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup: must be >= 0, got {self.num_warmup}")
        if self.documents_per_request > self.num_corpus_documents:
            raise ValueError(
                "documents_per_request: must be <= num_corpus_documents "
                f"({self.documents_per_request} > {self.num_corpus_documents})"
            )
        if not 0 <= self.zipf_s < math.inf:
            raise ValueError(f"zipf_s: must be a number >= 0, got {self.zipf_s}")
        if self.zipf_s * math.log(self.num_corpus_documents) >= math.log(sys.float_info.max):
            # The last rank's weight is 1 / n ** s: n ** s past the largest float raises
            # OverflowError.
            raise ValueError(
                f"zipf_s: {self.zipf_s} is too steep for {self.num_corpus_documents} documents "
                f"({self.num_corpus_documents} ** {self.zipf_s} is past the largest float); "
                "lower --zipf"
            )


@dataclass(frozen=True)
class LoadRequest:
    # Position in the stream (warm-up requests first), the same for every mode.
    index: int
    is_warmup: bool
    system: str
    documents: tuple[str, ...]
    # Corpus ranks of the documents, in prompt order (0 = most popular).
    document_ranks: tuple[int, ...]
    question: str
    gold_answer: str


def make_corpus(
    config: LoadWorkloadConfig, count_tokens: Callable[[str], int] = approximate_token_count
) -> tuple[Document, ...]:
    """`num_corpus_documents` distinct documents; rank = position in the tuple."""
    per_prompt = 10
    prompts = generate_workload(
        WorkloadConfig(
            seed=config.seed,
            num_questions=-(-config.num_corpus_documents // per_prompt),
            num_documents=per_prompt,
            min_document_tokens=config.min_document_tokens,
            max_document_tokens=config.max_document_tokens,
            holes="none",
        ),
        count_tokens,
    )
    documents = [d for prompt in prompts for d in prompt.documents]
    return tuple(documents[: config.num_corpus_documents])


def generate_load_workload(
    config: LoadWorkloadConfig, count_tokens: Callable[[str], int] = approximate_token_count
) -> tuple[LoadRequest, ...]:
    """Warm-up requests, then measured ones; the same for the same config, every time."""
    corpus = make_corpus(config, count_tokens)
    rng = random.Random(f"load:{config.seed}")
    weights = [1.0 / (rank + 1) ** config.zipf_s for rank in range(len(corpus))]
    total = config.num_warmup + config.num_requests
    return tuple(
        _request(rng, corpus, weights, config.documents_per_request, i, i < config.num_warmup)
        for i in range(total)
    )


def zipf_sample(rng: random.Random, weights: Sequence[float], k: int) -> list[int]:
    """`k` distinct indexes, each draw weighted among those not drawn yet."""
    chosen: list[int] = []
    left = list(range(len(weights)))
    for _ in range(k):
        pick = rng.choices(range(len(left)), weights=[weights[i] for i in left])[0]
        chosen.append(left.pop(pick))
    return chosen


def _request(
    rng: random.Random,
    corpus: Sequence[Document],
    weights: Sequence[float],
    k: int,
    index: int,
    is_warmup: bool,
) -> LoadRequest:
    ranks = zipf_sample(rng, weights, k)
    rng.shuffle(ranks)
    documents = [corpus[r] for r in ranks]
    texts = tuple(d.text for d in documents)
    candidates = [
        fact
        for d in documents
        for fact in d.facts
        if sum(fact.answer in text for text in texts) == 1
    ]
    if not candidates:
        raise ValueError("seed: a request has no fact with an answer unique to its document")
    fact = rng.choice(candidates)
    return LoadRequest(
        index, is_warmup, SYSTEM_PROMPT, texts, tuple(ranks), fact.question, fact.answer
    )
