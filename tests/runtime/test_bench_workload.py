"""The synthetic QA workload: deterministic, answers unique to one document, holes."""

import dataclasses

import pytest

from holeblend_runtime.bench.workload import (
    WorkloadConfig,
    approximate_token_count,
    first_pass_requests,
    generate_workload,
    hole_positions,
)

CONFIG = WorkloadConfig(seed=3, num_questions=6, num_documents=5, num_inflate=2)


def test_same_seed_gives_the_same_workload():
    assert generate_workload(CONFIG) == generate_workload(CONFIG)


def test_different_seed_gives_a_different_workload():
    other = dataclasses.replace(CONFIG, seed=4)
    assert generate_workload(CONFIG) != generate_workload(other)


def test_gold_answer_occurs_in_exactly_its_document():
    for prompt in generate_workload(CONFIG):
        holders = [i for i, d in enumerate(prompt.documents) if prompt.gold_answer in d.text]
        assert holders == [prompt.answer_document]
        assert prompt.gold_answer not in prompt.question
        assert prompt.gold_answer not in prompt.system


def test_question_is_about_a_fact_of_its_document():
    for prompt in generate_workload(CONFIG):
        document = prompt.documents[prompt.answer_document]
        assert (prompt.question, prompt.gold_answer) in {
            (f.question, f.answer) for f in document.facts
        }
        assert not document.is_distractor


def test_documents_and_distractors_are_counted_as_configured():
    for prompt in generate_workload(CONFIG):
        assert len(prompt.documents) == 7
        assert sum(d.is_distractor for d in prompt.documents) == 2


def test_documents_respect_the_token_range_and_are_all_distinct():
    config = dataclasses.replace(CONFIG, min_document_tokens=60, max_document_tokens=90)
    texts = [d.text for p in generate_workload(config) for d in p.documents]
    assert len(set(texts)) == len(texts)
    for text in texts:
        # At most the maximum; at least the minimum less one fact sentence.
        assert 40 <= approximate_token_count(text) <= 90


def test_token_counter_is_the_callers():
    config = dataclasses.replace(CONFIG, min_document_tokens=30, max_document_tokens=30)
    short = generate_workload(config, count_tokens=lambda text: 2 * len(text.split()))
    assert all(2 * len(d.text.split()) <= 30 for p in short for d in p.documents)


def test_middle_hole_is_left_out_of_pass_one():
    config = dataclasses.replace(CONFIG, holes="middle")
    for prompt in generate_workload(config):
        assert prompt.hole_documents == (3,)
        pass_one = prompt.document_texts(without_holes=True)
        assert prompt.documents[3].text not in pass_one
        assert len(pass_one) == 6
        assert len(prompt.document_texts(without_holes=False)) == 7


def test_multi_hole_positions():
    config = dataclasses.replace(CONFIG, holes="5,1")
    prompt = generate_workload(config)[0]
    assert prompt.hole_documents == (1, 5)
    assert prompt.document_texts(without_holes=True) == tuple(
        d.text for i, d in enumerate(prompt.documents) if i not in (1, 5)
    )


@pytest.mark.parametrize(
    ("spec", "num_documents", "expected"),
    [
        ("middle", 10, (5,)),
        ("middle", 1, (0,)),
        ("none", 4, ()),
        (" 2, 5 ", 6, (2, 5)),
        ("3,3", 4, (3,)),
    ],
)
def test_hole_positions_parse(spec, num_documents, expected):
    assert hole_positions(spec, num_documents) == expected


@pytest.mark.parametrize("spec", ["7", "-1", "two", "1,,2", ""])
def test_bad_hole_spec_raises_naming_holes(spec):
    with pytest.raises(ValueError, match="holes"):
        hole_positions(spec, 6)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_questions": 0}, "num_questions"),
        ({"num_documents": 0}, "num_documents"),
        ({"num_inflate": -1}, "num_inflate"),
        ({"min_document_tokens": 50, "max_document_tokens": 40}, "max_document_tokens"),
        ({"holes": "10"}, "holes"),
    ],
)
def test_config_validation_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        WorkloadConfig(**changes)


def test_regrouped_first_pass_mixes_prompts_and_leaves_every_hole_out():
    config = dataclasses.replace(CONFIG, holes="1,4")
    prompts = generate_workload(config)
    first = first_pass_requests(prompts, seed=config.seed, group_size=5)
    sent = [text for request in first for text in request.documents]
    holes = {p.documents[i].text for p in prompts for i in (1, 4)}
    assert sorted(sent) == sorted({d.text for p in prompts for d in p.documents} - holes)
    assert [len(r.documents) for r in first] == [5] * 6
    owners = [{i for i, p in enumerate(prompts) for d in p.documents if d.text in r.documents}
              for r in first]  # fmt: skip
    assert all(len(prompt_ids) > 1 for prompt_ids in owners)
    assert first_pass_requests(prompts, seed=config.seed, group_size=5) == first
    assert first_pass_requests(prompts, seed=config.seed + 1, group_size=5) != first
    with pytest.raises(ValueError, match="group_size"):
        first_pass_requests(prompts, seed=0, group_size=0)
