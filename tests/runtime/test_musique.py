"""The MuSiQue loader and its two-pass workload (no model involved)."""

import json

import pytest

from holeblend_runtime.bench.cli import bench_config, parse_args, quality_workload
from holeblend_runtime.bench.musique import (
    bundled_musique_path,
    load_musique,
    musique_workload,
)
from holeblend_runtime.bench.runner import BenchConfig, BenchRunner, Request, regrouped_first_pass
from holeblend_runtime.bench.workload import WorkloadConfig, first_pass_requests
from holeblend_runtime.quality.scores import answer_words


def _item(number: int, passages: int = 10) -> dict:
    return {
        "question": f"Where was author {number} educated?",
        "answers": [f"College {number}", f"the college of {number}"],
        "ctxs": [
            {"title": "", "text": f"Passage {number}.{p} about a town and its people."}
            for p in range(passages)
        ],
    }


def _write(tmp_path, data) -> object:
    path = tmp_path / "musique.json"
    path.write_text(json.dumps(data))
    return path


def test_the_bundled_copy_loads_with_its_attribution_beside_it():
    path = bundled_musique_path()
    items = load_musique(path)
    assert len(items) == 100
    assert all(len(item.passages) == 10 and item.answers for item in items)
    assert items[0].answers == ("Exeter College",)
    attribution = (path.parent / "README.md").read_text()
    assert "Trivedi" in attribution and "CC BY 4.0" in attribution
    assert "YaoJiayi/CacheBlend" in attribution


def test_a_good_file_keeps_questions_answers_and_passages(tmp_path):
    data = [_item(0), _item(1)]
    data[1]["ctxs"][0]["title"] = "Exeter"
    items = load_musique(_write(tmp_path, data))
    assert [item.question for item in items] == [d["question"] for d in data]
    assert items[0].answers == ("College 0", "the college of 0")
    assert items[0].passages[3].text == "Passage 0.3 about a town and its people."
    assert items[1].passages[0].prompt_text.startswith("Exeter: Passage 1.0")
    assert items[0].passages[0].prompt_text == items[0].passages[0].text


def _broken(change):
    data = [_item(0), _item(1)]
    change(data[1])
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"question": "q"}, "non-empty JSON list"),
        ([], "non-empty JSON list"),
        (["text"], "item 0: expected an object"),
        (_broken(lambda d: d.pop("question")), "item 1: field 'question'"),
        (_broken(lambda d: d.update(question="  ")), "item 1: field 'question'"),
        (_broken(lambda d: d.update(answers=[])), "item 1: field 'answers'"),
        (_broken(lambda d: d.update(answers="College")), "item 1: field 'answers'"),
        (_broken(lambda d: d.update(answers=["", "x"])), "item 1: field 'answers'"),
        (_broken(lambda d: d.pop("ctxs")), "item 1: field 'ctxs' must be"),
        (_broken(lambda d: d.update(ctxs=[])), "item 1: field 'ctxs' must be"),
        (_broken(lambda d: d["ctxs"].__setitem__(4, "text")), r"item 1: field 'ctxs\[4\]'"),
        (_broken(lambda d: d["ctxs"][2].pop("text")), r"item 1: field 'ctxs\[2\]'.text"),
        (_broken(lambda d: d["ctxs"][2].update(title=3)), r"item 1: field 'ctxs\[2\]'.title"),
    ],
)
def test_malformed_files_name_the_item_and_field(tmp_path, data, message):
    with pytest.raises(ValueError, match=message):
        load_musique(_write(tmp_path, data))


def test_unreadable_and_invalid_json_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_musique(tmp_path / "missing.json")
    path = tmp_path / "bad.json"
    path.write_text("[{")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        load_musique(path)


def _prompts(tmp_path, seed=0, holes="middle", count=4):
    items = load_musique(_write(tmp_path, [_item(n) for n in range(6)]))
    return items, musique_workload(items, seed=seed, num_questions=count, holes=holes)


def test_pass_two_sends_the_passages_in_a_new_seeded_order(tmp_path):
    items, prompts = _prompts(tmp_path)
    for item, prompt in zip(items, prompts, strict=False):
        texts = [d.text for d in prompt.documents]
        assert sorted(texts) == sorted(p.text for p in item.passages)
        assert texts != [p.text for p in item.passages]
    _, again = _prompts(tmp_path)
    _, other = _prompts(tmp_path, seed=1)
    assert again == prompts and other != prompts


def test_pass_one_regroups_the_passages_and_never_caches_a_hole(tmp_path):
    _, prompts = _prompts(tmp_path, holes="2,7")
    first = first_pass_requests(prompts, seed=0, group_size=8)
    sent = [text for request in first for text in request.documents]
    holes = {p.documents[i].text for p in prompts for i in p.hole_documents}
    assert all(p.hole_documents == (2, 7) for p in prompts)
    assert not holes & set(sent)
    # Every other passage is cached exactly once ...
    others = {d.text for p in prompts for d in p.documents} - holes
    assert sorted(sent) == sorted(others)
    assert all(len(request.documents) == 8 for request in first)
    for prompt in prompts:
        order = [d.text for d in prompt.documents if d.text not in holes]
        # ... and pass 2 finds it in a new order next to new neighbours: no pass-1 group
        # holds a pass-2 prompt's cached passages in its order.
        for request in first:
            assert [t for t in request.documents if t in order] != order
    mixed = [{t.split(".")[0] for t in request.documents} for request in first]
    assert any(len(authors) > 1 for authors in mixed)


def test_shared_passages_are_cached_once(tmp_path):
    data = [_item(0), _item(1)]
    data[1]["ctxs"][0]["text"] = data[0]["ctxs"][0]["text"]
    items = load_musique(_write(tmp_path, data))
    prompts = musique_workload(items, seed=0, num_questions=2, holes="none")
    sent = [t for r in first_pass_requests(prompts, seed=0, group_size=10) for t in r.documents]
    assert len(sent) == len(set(sent)) == 19


@pytest.mark.parametrize("count", [3, 6])
def test_regrouped_pass_one_stores_no_passage_after_its_pass_two_predecessor(tmp_path, count):
    """Ten-passage items as make bench-quality runs them: for every seed, no cached passage
    follows in pass 2 what it followed when stored, the system prompt counting (a plain
    shuffle kept one for most seeds, sometimes as an exact prefix)."""
    items = load_musique(_write(tmp_path, [_item(n) for n in range(6)]))
    for seed in range(60):
        prompts = musique_workload(items, seed=seed, num_questions=count, holes="middle")
        first = regrouped_first_pass(prompts, seed)
        stored = {}
        for request in first:
            stored |= {t: request.documents[i - 1] if i else None
                       for i, t in enumerate(request.documents)}  # fmt: skip
        kept = [
            (p, i)
            for p, qa in enumerate(prompts)
            for i, d in enumerate(qa.documents)
            if i not in qa.hole_documents
            and stored[d.text] == (qa.documents[i - 1].text if i else None)
        ]
        assert kept == [], f"seed {seed}: (prompt, position) kept their predecessor"
        assert regrouped_first_pass(prompts, seed) == first


def _gold_request(question: str, gold: str) -> Request:
    return Request(
        prompt=None,
        gold_ids=(),
        gold_words=(tuple(answer_words(gold)),),
        question_words=tuple(answer_words(question)),
    )


@pytest.mark.parametrize(
    ("question", "gold", "answer", "expected"),
    [
        # Bundled item 1: "County" is in the question and still part of the gold answer.
        ("In which county is Southern Maryland Electric Cooperative headquartered?",
         "Charles County", "Charles", 2 / 3),
        ("In which county is Southern Maryland Electric Cooperative headquartered?",
         "Charles County", "Kenton County", 0.5),
        ("In which county is Southern Maryland Electric Cooperative headquartered?",
         "Charles County", "County", 2 / 3),
        # Bundled item 11.
        ("What is the network which National Cycle Route 57 is part of an example of?",
         "national cycling route network", "National Cycle Network", 4 / 7),
    ],
)  # fmt: skip
def test_f1_vs_gold_counts_gold_words_that_also_occur_in_the_question(
    question, gold, answer, expected
):
    """F1 vs gold is the plain answer F1 MuSiQue and CacheBlend report: only F1 vs full
    prefill skips question words, so gold words found in the question still count."""
    request = _gold_request(question, gold)
    assert request.f1_vs_gold(answer_words(answer)) == pytest.approx(expected)


def test_gold_aliases_are_kept_and_f1_takes_the_best(tmp_path):
    _, prompts = _prompts(tmp_path)
    assert prompts[1].gold_answers == ("College 1", "the college of 1")

    class Engine:
        def build_prompt(self, system, documents, question):
            return (system, documents, question)

    class Tokenizer:
        def encode(self, text):
            return list(text.encode())

    config = BenchConfig(workload=WorkloadConfig(num_documents=10))
    runner = BenchRunner(lambda *_: Engine(), Tokenizer(), config)
    request: Request = runner.request(prompts[1], pass_number=2)
    assert request.f1_vs_gold(["college", "1"]) == 1.0
    assert request.f1_vs_gold(["college", "of", "1"]) == 1.0
    assert request.f1_vs_gold(["exeter"]) == 0.0


def test_start_takes_later_items_as_held_out_questions(tmp_path):
    items = load_musique(_write(tmp_path, [_item(n) for n in range(6)]))
    held_out = musique_workload(items, seed=0, num_questions=2, start=4)
    assert [p.question for p in held_out] == [items[4].question, items[5].question]
    with pytest.raises(ValueError, match="questions: .* from 4 on"):
        musique_workload(items, seed=0, num_questions=3, start=4)
    with pytest.raises(ValueError, match="musique_start"):
        musique_workload(items, seed=0, num_questions=1, start=6)


def test_too_many_questions_name_the_flag(tmp_path):
    items = load_musique(_write(tmp_path, [_item(0)]))
    with pytest.raises(ValueError, match="questions"):
        musique_workload(items, seed=0, num_questions=2)
    with pytest.raises(ValueError, match="holes"):
        musique_workload(items, seed=0, num_questions=1, holes="12")


def test_a_hole_spec_past_an_items_passages_names_the_item(tmp_path):
    """Items may differ in their number of passages: the error says which one is short."""
    items = load_musique(_write(tmp_path, [_item(0), _item(1, passages=3)]))
    with pytest.raises(ValueError, match=r"got '5' \(MuSiQue item 1 has 3 passages\)"):
        musique_workload(items, seed=0, num_questions=2, holes="5")


def test_holes_are_checked_against_the_files_passages_not_documents(tmp_path):
    """--documents does not apply to a MuSiQue run: a file of 14 passages per item takes a
    hole at position 12 although --documents stays at its default of 10."""
    path = _write(tmp_path, [_item(n, passages=14) for n in range(3)])
    args = parse_args(["--musique", str(path), "--questions", "2", "--holes", "12"])
    name, config, prompts, warm_up = quality_workload(args, bench_config(args), len)
    assert all(p.hole_documents == (12,) for p in [*prompts, warm_up])
    assert (config.workload.num_documents, config.workload.holes) == (14, "12")
