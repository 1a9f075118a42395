"""Answer F1, KL, top-1 agreement and gold loss on small hand-made inputs."""

import math

import pytest
import torch

from holeblend_runtime.quality.scores import (
    answer_f1,
    answer_words,
    kl_divergence,
    mean_nll,
    top1_agreement,
)


def test_answer_words_normalises_case_punctuation_and_articles():
    assert answer_words("The Green Heron, in 4,213!") == ["green", "heron", "in", "4213"]


def test_unicode_punctuation_goes_away_as_ascii_punctuation_does():
    """Curly quotes, full-width stops and other Unicode punctuation would otherwise stay
    attached to the words, so two answers that differ only in them would share none."""
    assert answer_words("“Tokyo”, «Paris» — Berlin…") == ["tokyo", "paris", "berlin"]
    assert answer_f1(answer_words("“Tokyo”"), answer_words("Tokyo")) == 1.0


def test_each_chinese_or_japanese_character_is_a_word():
    """Chinese and Japanese have no spaces between words: split on whitespace alone, a
    whole answer is one word and F1 is exact match. Each character is a word of its own
    (as MLQA and DuReader score Chinese), so a full-width stop costs nothing and one
    different character costs only its share."""
    assert answer_words("東京は日本の首都です。") == list("東京は日本の首都です")
    assert (
        answer_f1(answer_words("東京は日本の首都です。"), answer_words("東京は日本の首都です"))
        == 1.0
    )
    assert answer_f1(answer_words("首都は東京です"), answer_words("首都は京都です")) == 6 / 7
    assert answer_words("北京 Olympics、2008年") == ["北", "京", "olympics", "2008", "年"]


def test_identical_answers_have_f1_one():
    assert answer_f1(["1873"], ["1873"]) == 1.0


def test_disjoint_answers_have_f1_zero():
    assert answer_f1(["1873"], ["1901"]) == 0.0


def test_partial_overlap_f1():
    # common 1 of 2 candidate tokens and 1 of 3 reference tokens: P=1/2, R=1/3.
    assert answer_f1(["talia", "x"], ["talia", "y", "z"]) == pytest.approx(
        2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3)
    )


def test_repeated_tokens_count_once_each():
    assert answer_f1(["a", "a", "b"], ["a", "b", "b"]) == pytest.approx(2 / 3)


def test_tokens_copied_from_the_question_are_skipped():
    question = answer_words("In which year was the Selfen Brewery founded?")
    candidate = answer_words("The Selfen Brewery was founded in 1873.")
    reference = answer_words("1873")
    assert answer_f1(candidate, reference) < 0.5
    assert answer_f1(candidate, reference, question) == 1.0


def test_answers_that_only_copy_the_question_agree_with_each_other_but_not_with_an_answer():
    question = ["who", "founded", "selfen"]
    assert answer_f1(["selfen", "founded"], ["founded"], question) == 1.0
    assert answer_f1(["selfen"], ["talia"], question) == 0.0


def test_f1_works_on_token_ids():
    assert answer_f1([5, 6, 7], [5, 6, 7, 8], question=[5]) == pytest.approx(
        2 * 1 * (2 / 3) / (1 + 2 / 3)
    )


def test_kl_of_identical_distributions_is_zero():
    logits = torch.randn(4, 10)
    assert torch.allclose(
        kl_divergence(logits, logits.clone()), torch.zeros(4, dtype=torch.float64)
    )


def test_kl_matches_the_hand_computed_value():
    p = torch.tensor([[0.5, 0.5]])
    q = torch.tensor([[0.9, 0.1]])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    kl = kl_divergence(p.log(), q.log())
    assert kl.shape == (1,)
    assert kl.item() == pytest.approx(expected)


def test_kl_is_reference_first_and_not_symmetric():
    p = torch.tensor([[0.5, 0.5]]).log()
    q = torch.tensor([[0.9, 0.1]]).log()
    assert kl_divergence(p, q).item() != pytest.approx(kl_divergence(q, p).item())


def test_kl_ignores_a_constant_shift_of_the_logits():
    logits = torch.randn(3, 7)
    assert kl_divergence(logits, logits + 5.0).abs().max().item() < 1e-9


def test_top1_agreement_counts_matching_argmax():
    reference = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])
    candidate = torch.tensor([[0.0, 5.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    assert top1_agreement(reference, candidate) == 0.5


def test_mean_nll_of_hand_made_distribution():
    logits = torch.tensor([[0.25, 0.75], [0.5, 0.5]]).log()
    expected = -(math.log(0.75) + math.log(0.5)) / 2
    assert mean_nll(logits, [1, 0]) == pytest.approx(expected)


def test_mean_nll_is_zero_for_a_certain_model():
    logits = torch.full((2, 5), -1e4)
    logits[0, 3] = 0.0
    logits[1, 1] = 0.0
    assert mean_nll(logits, [3, 1]) == pytest.approx(0.0, abs=1e-9)


def test_shape_mismatches_raise_naming_the_argument():
    with pytest.raises(ValueError, match="candidate_logits"):
        kl_divergence(torch.zeros(2, 3), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="reference_logits"):
        top1_agreement(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="reference_logits: need at least one"):
        top1_agreement(torch.zeros(0, 3), torch.zeros(0, 3))
    with pytest.raises(ValueError, match="logits"):
        mean_nll(torch.zeros(2, 3), [1])
    with pytest.raises(ValueError, match="target_ids"):
        mean_nll(torch.zeros(0, 3), [])
