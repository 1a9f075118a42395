"""The synthetic QA workload: deterministic, answers unique to one document, holes."""

import dataclasses
import random

import pytest

from holeblend_runtime.bench.runner import shuffled_first_pass_record
from holeblend_runtime.bench.workload import (
    SYSTEM,
    WorkloadConfig,
    approximate_token_count,
    first_pass_plan,
    first_pass_requests,
    generate_workload,
    hole_positions,
    new_neighbour_order,
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


def _predecessors(texts, group_size=None):
    """What each text follows in `texts` cut into groups of `group_size` (one group when
    None): the previous text, or SYSTEM at a group's start."""
    size = group_size or len(texts)
    return {t: SYSTEM if i % size == 0 else texts[i - 1] for i, t in enumerate(texts)}


def _kept_predecessors(prompts, stored):
    """(prompt, position) of every cached pass-2 document that follows what it followed
    when stored: in-context storage would find its own neighbour again (an exact prefix
    when both are the system prompt)."""
    return [
        (p, i)
        for p, qa in enumerate(prompts)
        for i, (text, before) in enumerate(_predecessors([d.text for d in qa.documents]).items())
        if i not in qa.hole_documents and text in stored and stored[text] == before
    ]


# (documents, distractors, seeds): 10 per prompt as make bench-quality, 40 as its large runs.
SIZES = [(10, 0, 40), (10, 30, 12)]


@pytest.mark.parametrize(("documents", "inflate", "seeds"), SIZES)
def test_regrouped_first_pass_stores_no_document_after_its_pass_two_predecessor(
    documents, inflate, seeds
):
    """A plain shuffle of the pooled documents kept a pass-2 predecessor for many seeds,
    sometimes the system prompt (the document was then an exact prefix, never blended)."""
    for seed in range(seeds):
        config = WorkloadConfig(
            seed=seed, num_questions=4, num_documents=documents, num_inflate=inflate
        )
        prompts = generate_workload(config)
        group_size = documents + inflate - 1
        first = first_pass_requests(prompts, seed=seed, group_size=group_size)
        sent = [t for request in first for t in request.documents]
        stored = _predecessors(sent, group_size)
        assert _kept_predecessors(prompts, stored) == [], f"seed {seed}"
        assert first_pass_requests(prompts, seed=seed, group_size=group_size) == first


@pytest.mark.parametrize(("documents", "inflate", "seeds"), SIZES)
def test_shuffled_first_pass_puts_no_document_after_its_pass_two_predecessor(
    documents, inflate, seeds
):
    """`--shuffle-first-pass` sends each prompt's documents in an order in which none
    follows what it follows in pass 2, the system prompt included, and the same order for
    the same seed."""
    for seed in range(seeds):
        config = WorkloadConfig(
            seed=seed, num_questions=4, num_documents=documents, num_inflate=inflate
        )
        prompts = generate_workload(config)
        for p, qa in enumerate(prompts):
            order = qa.document_texts(without_holes=True, shuffle_seed=seed)
            assert sorted(order) == sorted(qa.document_texts(without_holes=True))
            assert _kept_predecessors([qa], _predecessors(order)) == [], f"seed {seed} prompt {p}"
            assert qa.document_texts(without_holes=True, shuffle_seed=seed) == order


def test_first_pass_plan_says_how_its_order_was_drawn_and_what_it_could_not_avoid():
    """The record goes into the JSON's config: a normal workload needs no exception; a
    lone document that opens its prompt can only be stored after the system prompt."""
    prompts = generate_workload(CONFIG)
    requests, order = first_pass_plan(prompts, seed=3, group_size=6)
    assert requests == first_pass_requests(prompts, seed=3, group_size=6)
    assert order.method in ("shuffle", "search") and order.draws >= 1
    assert order.to_dict()["kept_predecessors"] == order.exact_prefixes == 0
    lone = generate_workload(WorkloadConfig(num_questions=1, num_documents=1, holes="none"))
    _, order = first_pass_plan(lone, seed=0, group_size=1)
    assert (order.method, order.kept_predecessors, order.exact_prefixes) == ("impossible", 1, 1)
    assert lone[0].first_pass_order(0).method == "impossible"
    record = shuffled_first_pass_record([*prompts[:2], *lone], seed=0)
    assert set(record["order"][:2]) <= {"shuffle", "search"}
    assert (record["order"][2], record["kept_predecessors"], record["exact_prefixes"]) == (
        "impossible", 1, 1,
    )  # fmt: skip


def test_an_order_that_few_shuffles_find_is_found_by_the_search():
    """Eleven of twelve texts may not start a group and one must not follow another: a
    shuffle rarely meets that, the seeded search always does, or says none exists."""
    texts = [f"t{i}" for i in range(12)]
    forbidden = {t: {SYSTEM} for t in texts[:10]} | {"t10": {"t11"}, "t11": set()}
    for seed in range(20):
        order = new_neighbour_order(texts, forbidden, 6, random.Random(seed))
        assert sorted(order.texts) == sorted(texts) and order.kept_predecessors == 0
        assert order.texts[0] in ("t10", "t11") and order.texts[6] in ("t10", "t11")
        assert order == new_neighbour_order(texts, forbidden, 6, random.Random(seed))
    forbidden["t10"].add(SYSTEM)
    order = new_neighbour_order(texts, forbidden, 6, random.Random(0))
    assert order.method == "impossible" and order.kept_predecessors == 1
