"""From per-segment hit flags to a reuse plan, for prefix and hole policies."""

import pytest

from holeblend_runtime.blend.reuse import ReuseMode, ReusePolicy, plan_reuse
from holeblend_runtime.blend.segments import SegmentedPrompt, SegmentSplitter

SEP = (900,)


def _prompt(*segment_lengths: int) -> SegmentedPrompt:
    """system, documents..., question with the given token counts (ids unique per segment)."""
    tokens: list[int] = []
    for number, length in enumerate(segment_lengths):
        if number:
            tokens.extend(SEP)
        tokens.extend(range(number * 100 + 1, number * 100 + 1 + length))
    return SegmentSplitter(SEP, 1).split(tokens)


# system(3) SEP d0(4) SEP d1(5) SEP d2(6) SEP question(2): 3+1+4+1+5+1+6+1+2 = 24 tokens.
FIVE = (3, 4, 5, 6, 2)


def _ranges(prompt: SegmentedPrompt, *indexes: int) -> tuple[tuple[int, int], ...]:
    return tuple((prompt.segments[i].start, prompt.segments[i].end) for i in indexes)


@pytest.mark.parametrize("policy", list(ReusePolicy))
def test_no_hits_is_a_full_miss(policy):
    prompt = _prompt(*FIVE)
    result = plan_reuse(prompt, [False] * 5, policy)
    assert result.mode is ReuseMode.FULL_MISS
    assert result.num_reused_tokens == 0
    assert result.reused_segments == () and result.hit_ranges == () and result.hole_ranges == ()
    assert result.tail_start == 0
    assert result.num_tail_tokens == result.num_prompt_tokens == 24


@pytest.mark.parametrize("policy", list(ReusePolicy))
def test_everything_but_the_question_cached_is_a_pure_hit(policy):
    prompt = _prompt(*FIVE)
    result = plan_reuse(prompt, [True, True, True, True, False], policy)
    assert result.mode is ReuseMode.PURE_HIT
    assert result.reused_segments == (0, 1, 2, 3)
    assert result.hit_ranges == _ranges(prompt, 0, 1, 2, 3)
    assert result.num_reused_tokens == 3 + 4 + 5 + 6
    assert result.hole_ranges == ()
    # The tail is the last separator and the question.
    assert result.tail_start == prompt.segments[3].end
    assert result.num_tail_tokens == 1 + 2


def test_prefix_policy_stops_at_the_first_miss():
    prompt = _prompt(*FIVE)
    result = plan_reuse(prompt, [True, True, False, True, False], ReusePolicy.PREFIX)
    assert result.mode is ReuseMode.PURE_HIT
    assert result.reused_segments == (0, 1)
    assert result.hole_ranges == ()
    # Everything after the first miss is recomputed, including the cached document 2.
    assert result.tail_start == prompt.segments[1].end
    assert result.num_reused_tokens == 3 + 4


def test_prefix_policy_with_uncached_system_prompt_reuses_nothing():
    prompt = _prompt(*FIVE)
    result = plan_reuse(prompt, [False, True, True, True, False], ReusePolicy.PREFIX)
    assert result.mode is ReuseMode.FULL_MISS
    assert result.reused_segments == ()


def test_hole_policy_reuses_every_cached_segment_after_a_miss():
    prompt = _prompt(*FIVE)
    result = plan_reuse(prompt, [True, True, False, True, False], ReusePolicy.HOLE)
    assert result.mode is ReuseMode.HOLE
    assert result.reused_segments == (0, 1, 3)
    assert result.hit_ranges == _ranges(prompt, 0, 1, 3)
    assert result.hole_ranges == _ranges(prompt, 2)
    assert result.num_hole_tokens == 5
    assert result.num_reused_tokens == 3 + 4 + 6
    assert result.tail_start == prompt.segments[3].end


def test_hole_policy_with_several_holes_and_a_missing_system_prompt():
    prompt = _prompt(3, 4, 5, 6, 7, 2)
    flags = [False, True, False, True, False, False]
    result = plan_reuse(prompt, flags, ReusePolicy.HOLE)
    assert result.mode is ReuseMode.HOLE
    assert result.reused_segments == (1, 3)
    assert result.hole_ranges == _ranges(prompt, 0, 2)
    # The miss after the last hit is part of the tail, not a hole.
    assert result.tail_start == prompt.segments[3].end


def test_hole_policy_with_trailing_misses_only_is_a_pure_hit():
    prompt = _prompt(*FIVE)
    result = plan_reuse(prompt, [True, True, False, False, False], ReusePolicy.HOLE)
    assert result.mode is ReuseMode.PURE_HIT
    assert result.hole_ranges == ()
    assert result.tail_start == prompt.segments[1].end


@pytest.mark.parametrize("policy", list(ReusePolicy))
@pytest.mark.parametrize(
    "flags",
    [
        [True, False, True, False, False],
        [False, True, True, False, False],
        [True, True, True, True, False],
        [False, False, False, True, False],
    ],
)
def test_every_token_is_in_exactly_one_place(policy, flags):
    prompt = _prompt(*FIVE)
    result = plan_reuse(prompt, flags, policy)
    owners = [0] * prompt.num_tokens
    ranges = [*result.hit_ranges, *result.hole_ranges, (result.tail_start, prompt.num_tokens)]
    ranges += [r for r in prompt.separator_ranges if r[1] <= result.tail_start]
    for start, end in ranges:
        for position in range(start, end):
            owners[position] += 1
    assert owners == [1] * prompt.num_tokens


def test_empty_document_is_neither_a_hole_nor_a_stop_for_prefix():
    prompt = SegmentSplitter(SEP, 1).split([1, 2, *SEP, *SEP, 10, 11, *SEP, 20])
    flags = [True, False, True, False]
    prefix = plan_reuse(prompt, flags, ReusePolicy.PREFIX)
    hole = plan_reuse(prompt, flags, ReusePolicy.HOLE)
    assert prefix.reused_segments == hole.reused_segments == (0, 2)
    assert prefix.mode is hole.mode is ReuseMode.PURE_HIT
    assert hole.hole_ranges == ()


def test_policy_may_be_given_as_string():
    prompt = _prompt(*FIVE)
    result = plan_reuse(prompt, [True, False, True, False, False], "hole")
    assert result.mode is ReuseMode.HOLE


def test_wrong_number_of_flags_raises():
    with pytest.raises(ValueError, match=r"hit_flags: expected one flag per segment \(5\)"):
        plan_reuse(_prompt(*FIVE), [True, False], ReusePolicy.HOLE)


def test_question_hit_raises():
    with pytest.raises(ValueError, match=r"hit_flags\[4\]: the question is never reused"):
        plan_reuse(_prompt(*FIVE), [True] * 5, ReusePolicy.HOLE)


def test_empty_segment_hit_raises():
    prompt = SegmentSplitter(SEP, 1).split([1, *SEP, *SEP, 20])
    with pytest.raises(ValueError, match=r"hit_flags\[1\]: an empty segment"):
        plan_reuse(prompt, [True, True, False], ReusePolicy.HOLE)


def test_unknown_policy_raises():
    with pytest.raises(ValueError, match="policy"):
        plan_reuse(_prompt(*FIVE), [False] * 5, "sometimes")
