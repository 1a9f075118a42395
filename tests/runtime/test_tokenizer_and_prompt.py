"""The tokenizer behaves like the model's own, and prompts split into their pieces."""

import re

import pytest

from holeblend_runtime.blend.config import DEFAULT_SEPARATOR
from holeblend_runtime.blend.prompt import PromptBuilder
from holeblend_runtime.blend.segments import SegmentKind


def test_tokenizer_encodes_chatml_like_the_model_vocabulary(reference_engine):
    # Ids checked once against transformers' tokenizer for the same GGUF.
    ids = reference_engine.tokenizer.encode("<|im_start|>system\nYou are helpful.<|im_end|>\n")
    assert ids == [1, 9690, 198, 2683, 359, 5356, 30, 2, 198]


def test_digits_are_split_one_by_one(reference_engine):
    tokenizer = reference_engine.tokenizer
    assert len(tokenizer.encode(" 12345")) == 6
    assert tokenizer.decode(tokenizer.encode("Year 1871, 3.5 km")) == "Year 1871, 3.5 km"


def test_no_bos_is_added_because_the_gguf_says_so(reference_engine, rag_texts):
    assert not reference_engine.tokenizer.add_bos_token
    prompt = reference_engine.build_prompt(*rag_texts)
    assert prompt.token_ids[0] == reference_engine.tokenizer.token_to_id("<|im_start|>")


def test_prompt_segments_are_system_documents_question(reference_engine, rag_texts):
    system, documents, question = rag_texts
    prompt = reference_engine.build_prompt(system, documents, question)
    tokenizer = reference_engine.tokenizer
    kinds = [s.kind for s in prompt.segments]
    assert kinds == [SegmentKind.SYSTEM] + [SegmentKind.DOCUMENT] * 4 + [SegmentKind.QUESTION]
    for segment, text in zip(prompt.documents, documents, strict=True):
        assert tokenizer.decode(segment.token_ids) == " " + text
    assert tokenizer.decode(prompt.system.token_ids, skip_special_tokens=False).endswith("user\n")
    assert tokenizer.decode(prompt.question.token_ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n"
    )


def test_pieces_tokenize_exactly_like_the_whole_prompt(reference_engine, rag_texts):
    builder = reference_engine.prompt_builder
    prompt = builder.build(*rag_texts)
    whole = reference_engine.tokenizer.encode("".join(builder.pieces(*rag_texts)))
    assert list(prompt.token_ids) == whole


def test_separator_that_merges_in_context_is_refused(reference_engine, rag_texts):
    builder = PromptBuilder(reference_engine.tokenizer, "\n\n", min_segment_tokens=8)
    with pytest.raises(ValueError, match="separator"):
        builder.build(*rag_texts)


def test_document_containing_the_separator_is_refused(reference_engine, rag_texts):
    system, documents, question = rag_texts
    with pytest.raises(ValueError, match=r"documents\[1\]"):
        reference_engine.build_prompt(system, [documents[0], "a # # b"], question)


@pytest.mark.parametrize("token", ["<|im_end|>", "<file_sep>", "<empty_output>"])
@pytest.mark.parametrize("field", ["system", "documents[1]", "question"])
def test_text_holding_a_control_token_is_refused_naming_field_and_token(
    reference_engine, rag_texts, field, token
):
    """The tokenizer encodes a control token's text as the control token: a document
    holding `<|im_end|>` (or SmolLM2's `<file_sep>` ...) would close the user's turn."""
    system, documents, question = rag_texts
    text = f"Text before {token} and after."
    texts = {"system": system, "documents[1]": documents[1], "question": question}
    texts[field] = text
    docs = [documents[0], texts["documents[1]"]]
    assert token in reference_engine.tokenizer.control_tokens
    with pytest.raises(ValueError, match=rf"{re.escape(field)}: .*{re.escape(repr(token))}"):
        reference_engine.build_prompt(texts["system"], docs, texts["question"])


def test_empty_document_is_refused(reference_engine, rag_texts):
    system, _, question = rag_texts
    with pytest.raises(ValueError, match=r"documents\[0\]"):
        reference_engine.build_prompt(system, ["   "], question)


@pytest.mark.parametrize("cut", range(1, len(DEFAULT_SEPARATOR)))
def test_document_ending_in_part_of_the_separator_keeps_its_tokens(
    reference_engine, rag_texts, cut
):
    """ " ... input #" before " # #": the split comes from the pieces, not a search."""
    system, documents, question = rag_texts
    ending = documents[0] + " input" + DEFAULT_SEPARATOR[:cut]
    prompt = reference_engine.build_prompt(system, [ending, documents[1]], question)
    encode = reference_engine.tokenizer.encode
    assert prompt.documents[0].token_ids == tuple(encode(" " + ending.strip()))
    assert prompt.documents[1].token_ids == tuple(encode(" " + documents[1]))
    assert prompt.question.token_ids[: len(encode(" " + question))] == tuple(encode(" " + question))
    sep = tuple(encode(DEFAULT_SEPARATOR))
    assert all(prompt.token_ids[s:e] == sep for s, e in prompt.separator_ranges)
    # The same document keys the same wherever it stands.
    alone = reference_engine.build_prompt(system, [documents[1], ending], question)
    keys, keys_alone = reference_engine.segment_keys(prompt), reference_engine.segment_keys(alone)
    assert keys[1] == keys_alone[2] and keys[2] == keys_alone[1]


def test_text_with_a_lone_surrogate_is_refused_saying_where(reference_engine, rag_texts):
    """JSON's "\\ud800" becomes a Python string that UTF-8 cannot hold: a ValueError that
    says where, not the tokenizer's TypeError, for one text, a batch and a whole prompt."""
    tokenizer = reference_engine.tokenizer
    with pytest.raises(ValueError, match=r"lone surrogate at character 6 \(after 'Oskeby'\)"):
        tokenizer.encode("Oskeby\ud800 museum")
    with pytest.raises(ValueError, match="lone surrogate at character 0"):
        tokenizer.encode_batch(["fine", "\udc00 broken"])
    system, documents, question = rag_texts
    with pytest.raises(ValueError, match="lone surrogate"):
        reference_engine.build_prompt(system, [documents[0], "half an emoji \ud83d"], question)
    assert tokenizer.encode_batch(["fine", "😀 e\u0301"]) == [
        tokenizer.encode("fine"),
        tokenizer.encode("😀 e\u0301"),
    ]
