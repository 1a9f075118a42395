"""Shared runtime fixtures: the real model is loaded once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

# Triton kernels run under Triton's interpreter on a machine without a GPU; the variable is
# read when a kernel module is first imported (lazily, on first use).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.kv.store import LocalKVStore


@pytest.fixture(scope="session")
def reference_engine() -> BlendEngine:
    """SmolLM2-135M-Instruct with default blending; tests needing a clean store use new_engine.

    One thread: on a shared 2-core machine two torch threads spin against other processes
    and made this suite 4x slower (236 s vs 55 s measured); tests do not measure speed.
    """
    return BlendEngine.load(num_threads=1)


@pytest.fixture
def new_engine(reference_engine: BlendEngine) -> Callable[..., BlendEngine]:
    """Engines sharing the loaded model, each with its own empty store: new_engine(ratio=...)."""

    def make(**blend_fields: object) -> BlendEngine:
        store = LocalKVStore(1 << 30)
        blend = BlendConfig(**blend_fields)
        return BlendEngine(reference_engine.model, reference_engine.tokenizer, blend, store)

    return make


@pytest.fixture(scope="session")
def _segment_kv_memo() -> dict:
    """Segment key -> SegmentKV computed once per session (entries are never mutated)."""
    return {}


@pytest.fixture
def cached_engine(new_engine, _segment_kv_memo) -> Callable[..., tuple]:
    """cached_engine(texts, hole=None, **blend) -> (engine, prompt): a fresh engine whose
    store holds every cacheable segment of the prompt except segment index `hole`."""

    def make(texts: tuple, hole: int | None = None, **blend_fields: object) -> tuple:
        engine = new_engine(**blend_fields)
        prompt = engine.build_prompt(*texts)
        keys = engine.segment_keys(prompt)
        wanted = [i for i, key in enumerate(keys) if key is not None and i != hole]
        missing = [i for i in wanted if keys[i] not in _segment_kv_memo]
        engine.cache_segments(prompt, missing)
        _segment_kv_memo.update({keys[i]: engine.store.get(keys[i]) for i in missing})
        for i in wanted:
            engine.store.put(_segment_kv_memo[keys[i]])
        return engine, prompt

    return make


_SYSTEM = "You are a helpful assistant. Answer the question from the documents."
_DOCUMENTS = (
    "The Varn river bridge was built in 1871 by the engineer Ilse Marten. It has seven "
    "stone arches and carries the old mill road north to the market town of Oskeby.",
    "Oskeby museum opened in 1923 in a former grain store. Its collection holds maps, "
    "ship models and the painter Tove Lind's studies of the harbour at dawn.",
    "The council of Oskeby meets in the tower hall every second Tuesday. In 1998 it voted "
    "to rebuild the harbour wall after the great storm damaged the eastern quay.",
    "Tove Lind was born in 1889 on the island of Hessa. She studied in Copenhagen and "
    "returned to paint the fishing boats, the lighthouse and the winter ice on the bay.",
)
_QUESTION = "Who painted studies of the harbour at dawn?"


@pytest.fixture(scope="session")
def rag_texts() -> tuple[str, tuple[str, ...], str]:
    """(system, documents, question) of a small RAG prompt (~190 tokens, 4 documents)."""
    return _SYSTEM, _DOCUMENTS, _QUESTION
