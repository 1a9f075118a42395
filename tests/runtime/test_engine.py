"""The blend engine's modes, store behaviour, scoring and generation, bad input."""

import dataclasses

import pytest
import torch

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.segments import (
    Segment,
    SegmentedPrompt,
    SegmentKind,
    SegmentSplitter,
)
from holeblend_runtime.engine import BlendEngine

HOLE = 2  # segment index of the second document


def test_prefix_mode_recomputes_everything_after_the_first_miss(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    prefill = engine.prefill(prompt, "prefix", ratio=0.15)
    assert prefill.reuse.reused_segments == (0, 1)
    first_miss = prompt.segments[HOLE].start
    recomputed = set(prefill.recomputed_positions.tolist())
    assert set(range(first_miss, prompt.num_tokens)) <= recomputed
    assert (
        prefill.num_reused_tokens == prompt.segments[0].num_tokens + prompt.segments[1].num_tokens
    )


def test_hole_mode_reuses_every_cached_segment_after_the_miss(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    prefill = engine.prefill(prompt, "hole", ratio=0.15)
    hole = prompt.segments[HOLE]
    assert prefill.reuse.mode == "hole"
    assert prefill.reuse.reused_segments == (0, 1, 3, 4)
    assert prefill.reuse.hole_ranges == ((hole.start, hole.end),)
    assert prefill.num_hole_tokens == hole.num_tokens
    assert prefill.num_recomputed_tokens < prompt.num_tokens / 2


def test_missing_segments_are_stored_so_the_next_pass_is_a_pure_hit(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    first = engine.prefill(prompt, "hole", ratio=0.15)
    second = engine.prefill(prompt, "hole", ratio=0.15)
    assert first.num_stored_segments == 1
    assert second.reuse.mode == "pure-hit" and second.num_stored_segments == 0


def test_first_pass_on_an_empty_store_is_a_full_prefill_that_stores(new_engine, rag_texts):
    engine = new_engine()
    prompt = engine.build_prompt(*rag_texts)
    prefill = engine.prefill(prompt, "hole")
    full = engine.prefill(prompt, "full")
    assert prefill.reuse.mode == "full-miss"
    assert prefill.num_stored_segments == 5  # system + 4 documents
    torch.testing.assert_close(prefill.logits, full.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("store_policy", ["in-context", "isolated"])
def test_a_document_twice_in_one_prompt_is_stored_once_at_its_first_place(
    new_engine, rag_texts, store_policy
):
    """The same document first and last: one entry, the first copy's (computed right after
    the system prompt, so the next request takes it as exact prefix), counted once."""
    system, documents, question = rag_texts
    engine = new_engine(store_policy=store_policy)
    prompt = engine.build_prompt(system, [documents[0], documents[1], documents[0]], question)
    keys = engine.segment_keys(prompt)
    assert keys[1] == keys[3]
    first = engine.prefill(prompt, "hole")
    if store_policy == "isolated":
        assert first.num_queued_segments == 3
        assert engine.wait_for_stores(60)
    else:
        assert first.num_stored_segments == 3
    assert len(engine.store) == 3
    assert int(engine.store.get(keys[1]).positions[0]) == prompt.segments[1].start
    again = engine.prefill(prompt, "hole", ratio=0.15)
    start, stop = prompt.separator_ranges[0]  # computed with the tokens after the prefix
    assert again.num_exact_prefix_tokens == prompt.segments[1].end - (stop - start)


def test_a_document_twice_in_one_prompt_is_loaded_once_from_the_shared_tier(
    reference_engine, rag_texts
):
    """Pod B, its own tier empty, finds a document that its prompt holds twice in the
    shared tier: one Redis read of its blob, not one per copy (a blob is megabytes)."""
    from holeblend_runtime.kv.store import LocalKVStore
    from holeblend_runtime.kv.tiers import KVLayout, TierSettings, open_tiered_store
    from holeblend_runtime.lookup_server.processes import RedisProcess

    def pod(name: str, url: str) -> BlendEngine:
        engine = BlendEngine(reference_engine.model, reference_engine.tokenizer)
        layout = KVLayout.of(engine.config, engine.kv_dtype, "float32")
        settings = TierSettings(1 << 28, url, None, "ns/rag", name)
        engine.store = open_tiered_store(settings, layout, LocalKVStore(1 << 28))
        return engine

    system, documents, question = rag_texts
    with RedisProcess(maxmemory="256mb") as redis:
        a, b = pod("pod-a", redis.url), pod("pod-b", redis.url)
        prompt = a.build_prompt(system, [documents[1], documents[2], documents[1]], question)
        a.cache_segments(prompt)
        prefill = b.prefill(prompt, "hole", ratio=0.15)
        figures = b.store.figures()
        a.store.close()
        b.store.close()
    assert prefill.reuse.reused_segments == (0, 1, 2, 3)
    assert figures["shared_hits"] == 3  # the system prompt and two documents


def test_full_mode_leaves_the_store_alone(new_engine, rag_texts):
    engine = new_engine()
    prompt = engine.build_prompt(*rag_texts)
    engine.prefill(prompt, "full")
    assert len(engine.store) == 0


def test_generation_is_greedy_and_agrees_with_scoring(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    prefill = engine.prefill(prompt, "hole", ratio=0.15)
    tokens = engine.generate(prefill, max_new_tokens=6)
    logits = engine.score(prefill, tokens)
    assert len(tokens) >= 1 and logits.shape == (len(tokens), engine.config.vocab_size)
    assert torch.equal(logits[0], prefill.logits)
    assert logits.argmax(-1).tolist() == tokens


def test_generation_never_feeds_its_last_token(new_engine, rag_texts, monkeypatch):
    """An answer of n tokens costs n - 1 decode passes, as in the batched form: the last
    token is returned, never fed (a one-token answer runs no pass at all)."""
    engine = new_engine()
    prefill = engine.prefill(engine.build_prompt(*rag_texts), "full")
    longer = list(engine.generate_stream(prefill, 4, ignore_eos=True))
    forward, fed = engine.model.forward, []

    def counted(token_ids, *args, **kwargs):
        fed.append(token_ids.tolist())
        return forward(token_ids, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", counted)
    for n in (1, 3):
        fed.clear()
        tokens = list(engine.generate_stream(prefill, n, ignore_eos=True))
        assert tokens == longer[:n]
        assert fed == [[token] for token in tokens[:-1]]


def test_blending_at_ratio_one_generates_what_full_prefill_generates(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=HOLE)
    full = engine.generate(engine.prefill(prompt, "full"), max_new_tokens=8)
    blended = engine.generate(engine.prefill(prompt, "hole", ratio=1.0), max_new_tokens=8)
    assert len(full) == 8 and blended == full


# --- bad input ----------------------------------------------------------------------


def test_empty_prompt_is_refused(reference_engine):
    with pytest.raises(ValueError, match="empty"):
        reference_engine.prefill(SegmentedPrompt((), (), ()), "hole")
    with pytest.raises(ValueError, match="empty"):
        reference_engine.prompt_builder.splitter.split([])


def test_prompt_without_separator_is_refused(reference_engine):
    token_ids = reference_engine.tokenizer.encode("Just a question without documents.")
    with pytest.raises(ValueError, match="separator"):
        reference_engine.prompt_builder.splitter.split(token_ids)


def test_hand_built_prompt_without_separator_is_refused(reference_engine):
    token_ids = tuple(reference_engine.tokenizer.encode("Just a question without documents."))
    whole = Segment(SegmentKind.SYSTEM, None, 0, len(token_ids), token_ids)
    with pytest.raises(ValueError, match="separator"):
        reference_engine.prefill(SegmentedPrompt(token_ids, (whole,), ()), "hole")


def test_prompt_longer_than_the_context_is_refused(reference_engine, rag_texts):
    system, _, question = rag_texts
    prompt = reference_engine.build_prompt(system, ["word " * 8300], question)
    assert prompt.num_tokens > reference_engine.config.context_length
    for mode in ("full", "prefix", "hole"):
        with pytest.raises(ValueError, match="context"):
            reference_engine.prefill(prompt, mode)


@pytest.mark.parametrize("room", [0, 1, 2])
def test_generate_and_its_batched_form_agree_where_the_prompt_ends_the_context(
    new_engine, rag_texts, monkeypatch, room
):
    """A prompt `room` tokens short of the context: both decoding paths give the same
    answer, none when the prompt fills the context."""
    engine = new_engine()
    prompt = engine.build_prompt(*rag_texts)
    config = dataclasses.replace(engine.config, context_length=prompt.num_tokens + room)
    monkeypatch.setattr(engine.model, "config", config)
    prefill = engine.prefill(prompt, "full")
    one = list(engine.generate_stream(prefill, 8, ignore_eos=True))
    assert len(one) == room
    assert engine.generate_batch([prefill], 8, ignore_eos=True) == [one]


def _corrupt(kv, how, config):
    if how == "model":
        return dataclasses.replace(kv, model_id="another-model:1")
    if how == "dtype":
        return dataclasses.replace(kv, k=kv.k.double(), v=kv.v.double())
    if how == "layers":
        return dataclasses.replace(kv, k=kv.k[:-1].clone(), v=kv.v[:-1].clone())
    if how == "nan":
        k = kv.k.clone()
        k[5, 0, 3, 7] = float("nan")
        return dataclasses.replace(kv, k=k)
    if how == "positions":
        return dataclasses.replace(kv, positions=kv.positions + config.context_length)
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["model", "dtype", "layers", "nan", "positions"])
def test_corrupted_cached_kv_is_refused_and_computed_fresh(cached_engine, rag_texts, how):
    expected_engine, prompt = cached_engine(rag_texts, hole=HOLE)
    expected = expected_engine.prefill(prompt, "hole", ratio=0.15)
    engine, _ = cached_engine(rag_texts, hole=None)
    key = engine.segment_keys(prompt)[HOLE]
    engine.store.put(_corrupt(engine.store.get(key), how, engine.config))
    actual = engine.prefill(prompt, "hole", ratio=0.15)
    assert actual.num_rejected_segments == 1
    assert actual.reuse.hole_ranges == expected.reuse.hole_ranges
    torch.testing.assert_close(actual.logits, expected.logits, atol=1e-4, rtol=0)
    # The refused entry was replaced by a good one.
    assert engine.kv_problem(engine.store.get(key), key, prompt.segments[HOLE].num_tokens) is None


def test_a_bad_entry_of_a_document_held_twice_is_refused_once(new_engine, rag_texts):
    """One stored entry serves both copies of a document: refused, it counts once (as
    the store reads it once) and is replaced once."""
    system, documents, question = rag_texts
    engine = new_engine()
    prompt = engine.build_prompt(system, [documents[0], documents[1], documents[0]], question)
    engine.cache_segments(prompt)
    key = engine.segment_keys(prompt)[1]
    engine.store.put(_corrupt(engine.store.get(key), "nan", engine.config))
    prefill = engine.prefill(prompt, "hole", ratio=0.15)
    assert prefill.num_rejected_segments == 1
    assert engine.fetch(prompt, engine.segment_keys(prompt))[1] == 0


def test_entry_stored_under_another_key_is_refused(cached_engine, rag_texts):
    engine, prompt = cached_engine(rag_texts, hole=None)
    keys = engine.segment_keys(prompt)
    other = engine.store.get(keys[HOLE + 1])
    assert engine.kv_problem(other, keys[HOLE], other.num_tokens) is not None


@pytest.mark.parametrize("mode, ratio", [("half", 0.1), ("hole", 1.5), ("hole", -0.1)])
def test_bad_mode_or_ratio_is_refused(reference_engine, rag_texts, mode, ratio):
    prompt = reference_engine.build_prompt(*rag_texts)
    with pytest.raises(ValueError, match="mode|ratio"):
        reference_engine.prefill(prompt, mode, ratio)


@pytest.mark.parametrize(
    "field, value",
    [
        ("check_layer", -1),
        ("check_layer", 0),
        ("store_policy", "later"),
        ("ratio", 2.0),
        ("selection", "best"),
        ("separator", " "),
        ("min_segment_tokens", 0),
    ],
)
def test_blend_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        BlendConfig(**{field: value})


def test_check_layer_beyond_the_model_is_refused(reference_engine):
    with pytest.raises(ValueError, match="check_layer"):
        BlendEngine(reference_engine.model, reference_engine.tokenizer, BlendConfig(check_layer=30))


@pytest.mark.parametrize("how", ["cache_segments", "isolated store"])
def test_a_prompt_that_starts_with_the_separator_caches_its_documents_alone(
    new_engine, rag_texts, how
):
    """A prompt split from whole tokens (the vLLM connector's) may start with the
    separator: an empty system prompt. Documents cached alone from position 0 then have no
    context to compute first; each is stored as the model computes it by itself."""
    system, documents, question = rag_texts
    policy = "isolated" if how == "isolated store" else "in-context"
    engine = new_engine(cache_after_system=False, store_policy=policy)
    built = engine.build_prompt(system, documents[:1], question)
    splitter = SegmentSplitter(engine.prompt_builder.separator_ids, 1)
    prompt = splitter.split(built.token_ids[built.separator_ranges[0][0] :])
    assert prompt.system.num_tokens == 0
    document, key = prompt.segments[1], engine.segment_keys(prompt)[1]
    if how == "cache_segments":
        assert engine.cache_segments(prompt) == 1
    else:
        assert engine.prefill(prompt, "hole").num_queued_segments == 1
        assert engine.wait_for_stores(60)
        assert engine.store_stats().num_failed == 0
    stored = engine.store.get(key)
    assert stored is not None and stored.positions.tolist() == list(range(document.num_tokens))
    k, v = engine.model.new_kv(document.num_tokens)
    with torch.inference_mode():
        engine.model.forward(torch.tensor(document.token_ids), k, v, start=0)
    # The background store computes with its own thread count: float32 sums in another
    # order differ by ~2e-5 over 30 layers; computed in any context, K and V differ by far more.
    torch.testing.assert_close(stored.k, k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stored.v, v, atol=1e-4, rtol=1e-4)


def test_documents_below_min_segment_tokens_are_never_cached(new_engine, rag_texts):
    system, documents, question = rag_texts
    engine = new_engine(min_segment_tokens=20)
    prompt = engine.build_prompt(
        system, [documents[0], "Short note: the mill closed.", documents[1]], question
    )
    short = prompt.segments[2]
    assert short.num_tokens < 20 and engine.segment_keys(prompt)[2] is None
    engine.prefill(prompt, "hole")
    second = engine.prefill(prompt, "hole", ratio=0.15)
    assert second.reuse.hole_ranges == ((short.start, short.end),)
    assert second.reuse.reused_segments == (0, 1, 3)


def test_the_warm_up_runs_every_reuse_path_on_accelerators_and_stores_nothing(
    new_engine, monkeypatch
):
    """On an accelerator (bucketed sizes) the warm-up sends a synthetic prompt through the
    hole blend after an exact prefix (a hole, a moved document), prefix mode's causal
    continuation and a blend with no exact prefix; the store stays empty. On the CPU
    nothing runs."""
    from holeblend_runtime.blend.blender import RECOMPUTE_BUCKET, Blender

    engine = new_engine()
    blends, continued = [], []
    blend, continue_causal = engine.blender.blend_steps, engine._continue_causal

    def record_blend(token_ids, spans, ratio, hole_ranges, strategy, prefix, *args, **kw):
        moved = any(int(s.kv.positions[0]) != s.start for s in spans)
        blends.append((token_ids.shape[0], prefix is not None, bool(hole_ranges), moved))
        return (
            yield from blend(token_ids, spans, ratio, hole_ranges, strategy, prefix, *args, **kw)
        )

    def record_continue(token_ids, prefix, needs_logits=True):
        continued.append(token_ids.shape[0])
        return continue_causal(token_ids, prefix, needs_logits)

    monkeypatch.setattr(engine.blender, "blend_steps", record_blend)
    monkeypatch.setattr(engine, "_continue_causal", record_continue)
    engine.warm_up(max_tokens=3 * RECOMPUTE_BUCKET)
    assert blends == [] and continued == []  # the CPU: sizes are not bucketed

    monkeypatch.setattr(Blender, "_bucket", lambda self: RECOMPUTE_BUCKET)
    engine.warm_up(max_tokens=3 * RECOMPUTE_BUCKET)
    assert len(blends) == 2 and len(continued) == 1
    (length, *_), (_, *without_system) = blends
    assert 100 < length <= 3 * RECOMPUTE_BUCKET and continued == [length]
    # Hole mode after the exact prefix: holes and a moved document; then no exact prefix.
    assert blends[0][1:] == (True, True, True) and without_system == [False, True, True]
    assert list(engine.store.keys()) == []


def test_the_model_name_keys_the_same_weights_apart_and_round_trips(rag_texts):
    """blend.json's model.name joins the GGUF's identity (`stem:size`) in the model id: a
    fine-tune under the same file name, deployed under a new name, keys (and scopes its
    calibration) apart and never reuses the old weights' KV from a shared store; the same
    name finds what it stored (the stored entries' model id is the one checked on reuse)."""
    from holeblend_runtime.kv.store import LocalKVStore
    from holeblend_runtime.quality.shared_calibration import calibration_scope

    store = LocalKVStore(1 << 30)
    base = BlendEngine.load(store=store, num_threads=1, model_name="org/base")
    tuned = BlendEngine.load(store=store, num_threads=1, model_name="org/tuned")
    base_again = BlendEngine.load(store=store, num_threads=1, model_name="org/base")
    weights_id = BlendEngine.load(num_threads=1).config.model_id  # no settings: today's id
    assert base.config.model_id == f"org/base|{weights_id}"
    prompt = base.build_prompt(*rag_texts)
    assert base.segment_keys(prompt) == base_again.segment_keys(prompt)
    assert not set(base.segment_keys(prompt)) & set(tuned.segment_keys(prompt)) - {None}

    def scope(engine):
        return calibration_scope(engine.config.model_id, engine.kv_dtype, 1, engine.blend_config)

    assert scope(base) == scope(base_again) != scope(tuned)
    assert base.prefill(prompt, "hole").reuse.mode == "full-miss"
    reused = base_again.prefill(prompt, "hole")
    assert reused.reuse.mode == "pure-hit" and reused.num_rejected_segments == 0
    other = tuned.prefill(prompt, "hole")
    assert other.reuse.mode == "full-miss" and other.num_rejected_segments == 0
