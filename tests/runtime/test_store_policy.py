"""Store policies on the real model, and the exact prefix that skips the blend."""

import pytest
import torch

from holeblend_runtime.kv.store import LocalKVStore
from holeblend_runtime.model.threads import serial_thread

HOLE = 2  # segment index of the second document


def test_in_context_stores_the_slices_the_request_computed(new_engine, rag_texts):
    engine = new_engine(store_policy="in-context")
    prompt = engine.build_prompt(*rag_texts)
    prefill = engine.prefill(prompt, "hole")
    assert prefill.reuse.mode == "full-miss"
    assert (prefill.num_stored_segments, prefill.num_queued_segments) == (5, 0)
    for segment, key in zip(prompt.segments, engine.segment_keys(prompt), strict=True):
        if key is None:
            continue
        entry = engine.store.get(key)
        assert entry.positions.tolist() == list(range(segment.start, segment.end))
        assert torch.equal(entry.k, prefill.k[:, :, segment.start : segment.end])
        assert torch.equal(entry.v, prefill.v[:, :, segment.start : segment.end])


def test_in_context_entries_are_reused_by_the_next_prompt(new_engine, rag_texts):
    system, documents, question = rag_texts
    engine = new_engine(store_policy="in-context")
    engine.prefill(engine.build_prompt(system, documents[::-1], question), "hole")
    prompt = engine.build_prompt(*rag_texts)
    prefill = engine.prefill(prompt, "hole", ratio=0.15)
    assert prefill.reuse.mode == "pure-hit" and prefill.num_stored_segments == 0
    full = engine.prefill(prompt, "full")
    assert prefill.logits.argmax() == full.logits.argmax()


def test_isolated_queues_and_the_worker_stores_canonical_kv(new_engine, rag_texts):
    engine = new_engine(store_policy="isolated")
    reference = new_engine()
    prompt = engine.build_prompt(*rag_texts)
    prefill = engine.prefill(prompt, "hole")
    assert (prefill.num_stored_segments, prefill.num_queued_segments) == (0, 5)
    assert engine.wait_for_stores(timeout=60)
    # As the worker computes: serially (runtime/model/threads.py); the float sums of two
    # threads differ from one's by up to ~2e-5 here.
    serial_thread(lambda: reference.cache_segments(prompt), "canonical").join()
    for key in filter(None, engine.segment_keys(prompt)):
        expected = reference.store.get(key)
        torch.testing.assert_close(engine.store.get(key).k, expected.k, atol=1e-5, rtol=0)
        assert torch.equal(engine.store.get(key).positions, expected.positions)
    assert engine.store_stats().num_stored == 5
    engine.close()


def test_isolated_stores_go_to_the_store_the_engine_was_given_last(new_engine, rag_texts):
    """holeblend-serve puts its remote tiers in front of the local store after loading the
    engine: background stores must reach them (the shared tier, the lookup server's
    announcements), not only the store the engine was built with."""
    engine = new_engine(store_policy="isolated")
    first = engine.store
    engine.store = LocalKVStore(1 << 30)
    prompt = engine.build_prompt(*rag_texts)
    assert engine.prefill(prompt, "hole").num_queued_segments == 5
    assert engine.wait_for_stores(timeout=60)
    keys = list(filter(None, engine.segment_keys(prompt)))
    assert all(engine.store.contains(key) for key in keys)
    assert not any(first.contains(key) for key in keys)
    engine.close()


def test_isolated_store_waits_while_the_engine_is_held_busy(new_engine, rag_texts):
    engine = new_engine(store_policy="isolated")
    prompt = engine.build_prompt(*rag_texts)
    with engine.busy():
        engine.prefill(prompt, "hole")
        assert not engine.wait_for_stores(timeout=0.5)
        assert len(engine.store) == 0
    assert engine.wait_for_stores(timeout=60) and len(engine.store) == 5
    engine.close()


def test_cached_system_prompt_alone_continues_on_the_causal_path(new_engine, rag_texts):
    engine = new_engine()
    prompt = engine.build_prompt(*rag_texts)
    engine.cache_segments(prompt, [0])
    prefill = engine.prefill(prompt, "hole", ratio=0.15)
    system = prompt.system
    assert prefill.reuse.reused_segments == (0,)
    assert prefill.num_exact_prefix_tokens == system.num_tokens
    assert prefill.recomputed_positions.tolist() == list(range(system.end, prompt.num_tokens))
    assert prefill.selected_positions.numel() == 0 and prefill.deviation.numel() == 0
    full = engine.prefill(prompt, "full")
    torch.testing.assert_close(prefill.logits, full.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(prefill.k, full.k, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["hole", "prefix"])
def test_system_and_first_document_are_an_exact_prefix(cached_engine, rag_texts, mode):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    prefill = engine.prefill(prompt, mode, ratio=0.0)
    first_document = prompt.segments[1]
    assert prefill.num_exact_prefix_tokens == prompt.system.num_tokens + first_document.num_tokens
    # Only the separator between them is computed inside the prefix.
    separator = prompt.separator_ranges[0]
    recomputed = prefill.recomputed_positions.tolist()
    inside = [p for p in recomputed if p < first_document.end]
    assert inside == list(range(*separator))
    full = engine.prefill(prompt, "full")
    end = first_document.end
    torch.testing.assert_close(prefill.k[:, :, :end], full.k[:, :, :end], atol=1e-4, rtol=0)
    if mode == "prefix":  # nothing reused after the prefix: exact continuation
        torch.testing.assert_close(prefill.logits, full.logits, atol=1e-4, rtol=0)


def test_a_first_document_cached_elsewhere_is_blended_not_exact(new_engine, rag_texts):
    system, documents, question = rag_texts
    engine = new_engine(store_policy="in-context")
    # Stored in context at its place in a prompt where it came second.
    engine.prefill(engine.build_prompt(system, [documents[1], documents[0]], question), "hole")
    prompt = engine.build_prompt(system, [documents[0]], question)
    prefill = engine.prefill(prompt, "hole", ratio=0.15)
    assert prefill.reuse.reused_segments == (0, 1)
    assert prefill.num_exact_prefix_tokens == prompt.system.num_tokens
    assert prefill.deviation.numel() == prompt.segments[1].num_tokens


def test_request_time_covers_the_call(new_engine, rag_texts):
    engine = new_engine()
    prefill = engine.prefill(engine.build_prompt(*rag_texts), "hole")
    assert 0 < prefill.ttft_s <= prefill.request_s
