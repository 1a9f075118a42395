"""Input the engine refuses: token ids outside the vocabulary, answers and documents that
do not fit the model's context."""

import dataclasses

import pytest

from holeblend_runtime.blend.segments import SegmentedPrompt


def _shorten_context(engine, monkeypatch, context_length):
    """The shared model's context cut to `context_length` tokens for this test (the RoPE
    tables keep their full length, so a forward past the cut still runs)."""
    config = dataclasses.replace(engine.config, context_length=context_length)
    monkeypatch.setattr(engine.model, "config", config)


@pytest.fixture
def prefill(new_engine, rag_texts):
    engine = new_engine()
    return engine, engine.prefill(engine.build_prompt(*rag_texts), "full")


@pytest.mark.parametrize("where", [0, -1])
@pytest.mark.parametrize("bad", ["negative", "vocab size"])
def test_score_refuses_token_ids_outside_the_vocabulary(prefill, where, bad):
    engine, result = prefill
    vocab_size = engine.config.vocab_size
    bad_id = -1 if bad == "negative" else vocab_size
    token_ids = [1, 2, 3]
    token_ids[where] = bad_id
    with pytest.raises(ValueError, match=rf"token_ids: {bad_id} .*\[0, {vocab_size}\)"):
        engine.score(result, token_ids)


def test_score_too_long_names_the_prompt_and_the_answer_tokens_it_counted(prefill, monkeypatch):
    engine, result = prefill
    num_prompt = result.num_prompt_tokens
    _shorten_context(engine, monkeypatch, num_prompt + 2)
    engine.score(result, [1, 2, 3])  # the last token is never fed: it fits exactly
    with pytest.raises(ValueError) as refused:
        engine.score(result, [1, 2, 3, 4])
    message = str(refused.value)
    assert f"{num_prompt} prompt tokens" in message
    assert "3 of token_ids" in message
    assert f"context of {num_prompt + 2}" in message


def test_cache_segments_refuses_a_prompt_longer_than_the_context(
    new_engine, rag_texts, monkeypatch
):
    """Its documents would be stored at positions past the context, refused on every load."""
    engine = new_engine()
    system, documents, question = rag_texts
    prompt = engine.build_prompt(system, [" ".join(documents)], question)
    _shorten_context(engine, monkeypatch, prompt.segments[1].end - 1)
    with pytest.raises(ValueError, match=rf"prompt: {prompt.num_tokens} tokens .*context of"):
        engine.cache_segments(prompt)
    assert len(engine.store) == 0


@pytest.mark.parametrize("bad", ["negative", "vocab size"])
def test_prefill_and_cache_segments_refuse_prompt_ids_outside_the_vocabulary(
    new_engine, rag_texts, bad
):
    """A hand-built prompt with an id the embedding has no row for: a negative one would
    be read from the embedding's end and its KV stored under that id's key."""
    engine = new_engine()
    built = engine.build_prompt(*rag_texts)
    bad_id = -1 if bad == "negative" else engine.config.vocab_size
    token_ids = list(built.token_ids)
    token_ids[built.segments[1].start] = bad_id
    prompt = SegmentedPrompt.from_separators(token_ids, built.separator_ranges)
    for mode in ("full", "prefix", "hole"):
        with pytest.raises(ValueError, match=rf"prompt: token id {bad_id} .*vocabulary"):
            engine.prefill(prompt, mode)
    with pytest.raises(ValueError, match=rf"prompt: token id {bad_id} .*vocabulary"):
        engine.cache_segments(prompt)
    assert len(engine.store) == 0
