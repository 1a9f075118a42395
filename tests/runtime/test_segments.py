"""Splitting prompts on separator token ids and position-independent segment keys."""

import pytest

from holeblend_runtime.blend.segments import (
    Segment,
    SegmentKind,
    SegmentSplitter,
    segment_key,
)

SEP = (900, 901)


def _splitter(min_segment_tokens: int = 1) -> SegmentSplitter:
    return SegmentSplitter(SEP, min_segment_tokens)


def test_splits_system_documents_question_in_prompt_order():
    tokens = [1, 2, *SEP, 10, 11, 12, *SEP, 20, 21, *SEP, 30]
    prompt = _splitter().split(tokens)
    assert [s.kind for s in prompt.segments] == [
        SegmentKind.SYSTEM,
        SegmentKind.DOCUMENT,
        SegmentKind.DOCUMENT,
        SegmentKind.QUESTION,
    ]
    assert [s.token_ids for s in prompt.segments] == [(1, 2), (10, 11, 12), (20, 21), (30,)]
    assert [d.index for d in prompt.documents] == [0, 1]
    assert prompt.system.index is None and prompt.question.index is None
    assert prompt.separator_ranges == ((2, 4), (7, 9), (11, 13))


def test_segment_ranges_point_at_their_tokens():
    tokens = [5, *SEP, 6, 7, *SEP, 8, 9, 10]
    prompt = _splitter().split(tokens)
    for segment in prompt.segments:
        assert tuple(tokens[segment.start : segment.end]) == segment.token_ids
        assert segment.num_tokens == len(segment.token_ids)
    assert prompt.token_ids == tuple(tokens)


@pytest.mark.parametrize(
    "change",
    [
        {"token_ids": (20, 22)},  # another document's tokens: its KV stored under their key
        {"kind": SegmentKind.QUESTION},
        {"index": 0},
    ],
)
def test_a_hand_built_segment_that_is_not_the_prompt_s_is_refused(change):
    """The ranges alone do not make a prompt: keys hash a segment's own token ids and the
    engine caches by kind, so a segment must be the prompt's tokens, in its place."""
    import dataclasses

    from holeblend_runtime.blend.segments import SegmentedPrompt

    prompt = _splitter().split([1, 2, *SEP, 10, 11, *SEP, 20, 21, *SEP, 30])
    segments = list(prompt.segments)
    segments[2] = dataclasses.replace(segments[2], **change)
    with pytest.raises(ValueError, match=r"segments\[2\]"):
        SegmentedPrompt(prompt.token_ids, tuple(segments), prompt.separator_ranges)
    # The prompt as split, and the same ids in a list, are taken.
    SegmentedPrompt(list(prompt.token_ids), prompt.segments, prompt.separator_ranges)


def test_multi_token_separator_must_match_completely():
    # A lone first separator token is ordinary text, not a split point.
    tokens = [1, 900, 2, *SEP, 3, 901, 4, *SEP, 5]
    prompt = _splitter().split(tokens)
    assert [s.token_ids for s in prompt.segments] == [(1, 900, 2), (3, 901, 4), (5,)]


def test_single_token_separator():
    prompt = SegmentSplitter([7], 1).split([1, 7, 2, 3, 7, 4])
    assert [s.token_ids for s in prompt.segments] == [(1,), (2, 3), (4,)]


def test_overlapping_separator_occurrences_are_taken_left_to_right():
    # Separator (5, 5) in 5 5 5: the first two tokens match, the third is text.
    prompt = SegmentSplitter([5, 5], 1).split([1, 5, 5, 5, 2])
    assert prompt.separator_ranges == ((1, 3),)
    assert prompt.question.token_ids == (5, 2)


def test_separator_at_start_gives_empty_system_prompt():
    prompt = _splitter().split([*SEP, 10, *SEP, 20])
    assert prompt.system.token_ids == ()
    assert prompt.system.start == prompt.system.end == 0
    assert prompt.documents[0].token_ids == (10,)


def test_separator_at_end_gives_empty_question():
    prompt = _splitter().split([1, *SEP, 10, *SEP])
    assert prompt.question.token_ids == ()
    assert prompt.question.start == prompt.question.end == len(prompt.token_ids)


def test_adjacent_separators_give_an_empty_document_that_keeps_numbering():
    prompt = _splitter().split([1, *SEP, *SEP, 10, *SEP, 2])
    assert [d.token_ids for d in prompt.documents] == [(), (10,)]
    assert [d.index for d in prompt.documents] == [0, 1]


def test_only_one_separator_means_no_documents():
    prompt = _splitter().split([1, *SEP, 2])
    assert prompt.documents == ()
    assert prompt.system.token_ids == (1,) and prompt.question.token_ids == (2,)


def test_no_separator_raises_naming_the_separator():
    with pytest.raises(ValueError, match=r"no separator \[900, 901\]"):
        _splitter().split([1, 2, 3, 900])


def test_empty_prompt_raises():
    with pytest.raises(ValueError, match="token_ids: the prompt is empty"):
        _splitter().split([])


def test_splitter_rejects_empty_separator_and_bad_min_tokens():
    with pytest.raises(ValueError, match="separator_ids"):
        SegmentSplitter([], 1)
    with pytest.raises(ValueError, match="min_segment_tokens"):
        SegmentSplitter(SEP, 0)


def test_splitter_keeps_separator_ids_as_tuple():
    splitter = SegmentSplitter([3, 4], 2)
    assert splitter.separator_ids == (3, 4)


def test_min_segment_tokens_decides_what_is_cached():
    tokens = [1, 2, *SEP, 10, 11, 12, *SEP, 20, *SEP, 30, 31, 32, 33]
    splitter = _splitter(min_segment_tokens=2)
    prompt = splitter.split(tokens)
    cacheable = splitter.cacheable_segments(prompt)
    # System (2 tokens) and the 3-token document; the 1-token document is too short
    # and the question is never cached however long it is.
    assert [s.token_ids for s in cacheable] == [(1, 2), (10, 11, 12)]


def test_empty_segment_is_never_cacheable():
    segment = Segment(SegmentKind.DOCUMENT, 0, 4, 4, ())
    assert not segment.is_cacheable(1)


def test_same_tokens_at_different_positions_have_the_same_key():
    first = _splitter().split([1, *SEP, 10, 11, *SEP, 20, 21, *SEP, 3])
    second = _splitter().split([1, 1, 1, *SEP, 20, 21, *SEP, 10, 11, *SEP, 4])
    first_keys = {
        d.token_ids: segment_key(d.token_ids, model_id="m", kv_dtype="float32")
        for d in first.documents
    }
    for document in second.documents:
        key = segment_key(document.token_ids, model_id="m", kv_dtype="float32")
        assert first_keys[document.token_ids] == key
    assert first.documents[0].start != second.documents[1].start


def test_key_depends_on_tokens_model_dtype_and_context():
    base = segment_key([1, 2, 3], model_id="m", kv_dtype="float32")
    variants = [
        segment_key([1, 2, 4], model_id="m", kv_dtype="float32"),
        segment_key([3, 2, 1], model_id="m", kv_dtype="float32"),
        segment_key([1, 2, 3], model_id="other", kv_dtype="float32"),
        segment_key([1, 2, 3], model_id="m", kv_dtype="bfloat16"),
        segment_key([1, 2, 3], model_id="m", kv_dtype="float32", context_key="sys"),
        segment_key([1, 2, 3], model_id="m", kv_dtype="float32", context_key=""),
    ]
    assert len({base, *variants}) == len(variants) + 1
    assert base == segment_key((1, 2, 3), model_id="m", kv_dtype="float32")


def test_key_fields_cannot_bleed_into_each_other():
    assert segment_key([1], model_id="ab", kv_dtype="c") != segment_key(
        [1], model_id="a", kv_dtype="bc"
    )


def test_key_is_a_hex_digest():
    key = segment_key([1, 2], model_id="m", kv_dtype="float32")
    assert len(key) == 64
    int(key, 16)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"token_ids": [], "model_id": "m", "kv_dtype": "f"}, "token_ids"),
        ({"token_ids": [1], "model_id": "", "kv_dtype": "f"}, "model_id"),
        ({"token_ids": [1], "model_id": "m", "kv_dtype": ""}, "kv_dtype"),
    ],
)
def test_key_rejects_empty_inputs(kwargs, field):
    token_ids = kwargs.pop("token_ids")
    with pytest.raises(ValueError, match=field):
        segment_key(token_ids, **kwargs)


def test_the_model_id_names_the_model_and_its_weights():
    """`keyed_model_id`, both engines' one format: blend.json's model.name with the
    engine's identity of the weights; that identity alone without a name (no settings)."""
    from holeblend_runtime.blend.keys import MAX_MODEL_ID_CHARS, keyed_model_id

    assert keyed_model_id("org/base", "/models@main") == "org/base|/models@main"
    assert keyed_model_id(None, "/models@main") == "/models@main"
    assert keyed_model_id("", "stem:10") == "stem:10"
    assert keyed_model_id("org/base", "/models@main") != keyed_model_id("org/tuned", "/models@main")
    # Long, ambiguous or unprintable: a deterministic hash, short enough for the wire.
    named = [("x" * 250, "/models/a@main"), ("a|b", "c"), ("a", "b|c"), ("a\nb", "c")]
    ids = [keyed_model_id(name, weights) for name, weights in named]
    assert len(set(ids)) == len(ids)
    assert all(len(i) <= MAX_MODEL_ID_CHARS and i.isprintable() for i in ids)
    assert ids[1].startswith("sha256-") and ids[1] == keyed_model_id("a|b", "c")
    # Without a name, a weights path over the wire's limit is hashed too.
    long_path = keyed_model_id(None, "/models/" + "d" * 300 + "@main")
    assert long_path.startswith("sha256-") and len(long_path) <= MAX_MODEL_ID_CHARS
    assert long_path != keyed_model_id(None, "/models/" + "e" * 300 + "@main")
    with pytest.raises(ValueError, match="weights_id"):
        keyed_model_id("m", "")


@pytest.mark.parametrize("cache_after_system", [True, False])
def test_kv_rounded_from_another_model_dtype_is_keyed_apart(cache_after_system):
    """A float32 model's KV held in bfloat16 is not what a bfloat16 model computes: the
    bfloat16 model would take it for its own (its first document as an exact prefix).
    Where KV is held in the model's own dtype, keys keep their layout."""
    from holeblend_runtime.blend.config import BlendConfig
    from holeblend_runtime.blend.keys import SegmentKeyer

    prompt = _splitter().split([1, 2, *SEP, 10, 11, *SEP, 20, 21, *SEP, 30])

    def keyer(model_dtype: str, kv_store_dtype: str) -> SegmentKeyer:
        blend = BlendConfig(
            kv_store_dtype=kv_store_dtype,
            cache_after_system=cache_after_system,
            min_segment_tokens=1,
        )
        return SegmentKeyer.for_model("m", model_dtype, blend)

    rounded, native = keyer("float32", "bfloat16"), keyer("bfloat16", "auto")
    assert rounded.kv_dtype == native.kv_dtype == "bfloat16"
    rounded_keys, native_keys = rounded.keys(prompt), native.keys(prompt)
    for document in (1, 2):
        assert rounded_keys[document] != native_keys[document]
    assert rounded_keys == keyer("float32", "bfloat16").keys(prompt)
    context_key = None
    if cache_after_system:
        context = prompt.token_ids[: prompt.separator_ranges[0][1]]
        context_key = segment_key(context, model_id="m", kv_dtype="bfloat16")
    document = prompt.documents[0].token_ids
    expected = segment_key(document, model_id="m", kv_dtype="bfloat16", context_key=context_key)
    assert native_keys[1] == expected
