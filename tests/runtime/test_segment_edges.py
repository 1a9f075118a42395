"""Edge cases of segmenting and keying real prompts: short system prompts, separators
outside the documents."""

import pytest

from holeblend_runtime.blend.config import DEFAULT_SEPARATOR
from holeblend_runtime.blend.segments import SegmentKind


def test_a_system_prompt_shorter_than_min_segment_tokens_is_still_cached(new_engine, rag_texts):
    """One entry serves every prompt: left uncached, a short system prompt would end
    prefix reuse before the first document and cost hole mode its exact prefix."""
    _, documents, question = rag_texts
    engine = new_engine(min_segment_tokens=30)
    prompt = engine.build_prompt("Be brief.", documents[:2], question)
    assert prompt.system.num_tokens < 30 <= min(d.num_tokens for d in prompt.documents)
    engine.prefill(prompt, "prefix")
    second = engine.prefill(prompt, "prefix", ratio=0.15)
    assert second.reuse.reused_segments == (0, 1, 2)
    assert all(key is not None for key in engine.segment_keys(prompt)[:-1])


@pytest.mark.parametrize("field", ["system", "question"])
def test_the_separator_outside_the_documents_is_refused_naming_the_field(
    reference_engine, rag_texts, field
):
    """Split on the separator's tokens (the vLLM connector), such a prompt would have a
    document the builder did not make."""
    texts = dict(zip(("system", "documents", "question"), rag_texts, strict=True))
    texts[field] = f"Where is it{DEFAULT_SEPARATOR} which page?"
    with pytest.raises(ValueError, match=rf"^{field}: contains the separator"):
        reference_engine.build_prompt(**texts)


def test_a_question_ending_in_part_of_the_separator_is_kept(reference_engine, rag_texts):
    system, documents, _ = rag_texts
    prompt = reference_engine.build_prompt(system, documents, "Who painted it? #")
    assert prompt.question.kind is SegmentKind.QUESTION
    assert len(prompt.documents) == len(documents)
