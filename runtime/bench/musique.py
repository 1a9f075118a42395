"""MuSiQue multi-hop questions as a two-pass reuse workload.

The file format is the 10-passage form the CacheBlend authors published (a JSON list of
items `{"question", "answers", "ctxs": [{"title", "text"}, ...]}`); a copy of the first
100 items ships with the bench (`data/musique_s_dev.json`, attribution in
`data/README.md`). `load_musique` reads any file in that format and names the item and
field of the first thing wrong with it.

Pass 2 sends each question with its passages in a new seeded order (not the file's);
the passages at the hole positions of that order are never cached. Pass 1 is
`workload.first_pass_requests`: the other passages of all questions pooled, put in a seeded
order in which none follows what it follows in a pass-2 prompt (the system prompt counting)
and sent in groups, so pass 2 finds every cached passage in a new place after a new
neighbour.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from holeblend_runtime.bench.workload import Document, QAPrompt, hole_positions

# The system prompt of the MuSiQue prompts (short answers, as the gold answers are).
MUSIQUE_SYSTEM_PROMPT = (
    "You are a careful assistant. Answer the question using only the passages; the answer "
    "may need facts from two or more of them. Reply with the answer alone, in a few words."
)


def bundled_musique_path() -> Path:
    """The MuSiQue copy that ships with the bench (100 items, 10 passages each)."""
    return Path(str(resources.files("holeblend_runtime.bench") / "data" / "musique_s_dev.json"))


@dataclass(frozen=True)
class Passage:
    title: str
    text: str

    @property
    def prompt_text(self) -> str:
        """The passage as it goes into a prompt: `title: text`, or the text alone."""
        return f"{self.title}: {self.text}" if self.title.strip() else self.text


@dataclass(frozen=True)
class MusiqueItem:
    question: str
    # Gold answers; any of them counts.
    answers: tuple[str, ...]
    passages: tuple[Passage, ...]


def load_musique(path: Path) -> tuple[MusiqueItem, ...]:
    """Read and validate a MuSiQue file; ValueError naming the file, item index and field."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"musique: cannot read {path}: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"musique: {path} is not valid JSON: {error}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(
            f"musique: {path} must hold a non-empty JSON list of items "
            '{"question", "answers", "ctxs"}'
        )
    return tuple(_item(entry, index, path) for index, entry in enumerate(data))


def _item(entry: Any, index: int, path: Path) -> MusiqueItem:
    where = f"musique: {path}: item {index}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object with question, answers and ctxs")
    question = entry.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: field 'question' must be a non-empty string")
    answers = entry.get("answers")
    if (
        not isinstance(answers, list)
        or not answers
        or not all(isinstance(a, str) and a.strip() for a in answers)
    ):
        raise ValueError(f"{where}: field 'answers' must be a non-empty list of non-empty strings")
    contexts = entry.get("ctxs")
    if not isinstance(contexts, list) or not contexts:
        raise ValueError(f"{where}: field 'ctxs' must be a non-empty list of passages")
    passages = []
    for number, context in enumerate(contexts):
        field = f"{where}: field 'ctxs[{number}]'"
        if not isinstance(context, dict):
            raise ValueError(f'{field}: expected an object {{"title", "text"}}')
        text, title = context.get("text"), context.get("title", "")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{field}.text: must be a non-empty string")
        if not isinstance(title, str):
            raise ValueError(f"{field}.title: must be a string (may be empty)")
        passages.append(Passage(title, text.strip()))
    return MusiqueItem(question.strip(), tuple(a.strip() for a in answers), tuple(passages))


def musique_workload(
    items: Sequence[MusiqueItem],
    *,
    seed: int,
    num_questions: int,
    holes: str = "middle",
    start: int = 0,
) -> tuple[QAPrompt, ...]:
    """Pass-2 prompts of `num_questions` items from index `start` on: passages in a new
    order (seeded per item), `holes` positions of that order left out of pass 1, every
    gold answer kept."""
    if not 0 <= start < len(items):
        raise ValueError(
            f"musique_start: the MuSiQue file has {len(items)} items, got start {start}; "
            f"pass --musique-start between 0 and {len(items) - 1}"
        )
    if not 1 <= num_questions <= len(items) - start:
        raise ValueError(
            f"questions: the MuSiQue file has {len(items) - start} items from {start} on, "
            f"got {num_questions}; pass --questions between 1 and {len(items) - start}"
        )
    return tuple(
        musique_prompt(item, seed=seed, index=start + offset, holes=holes)
        for offset, item in enumerate(items[start : start + num_questions])
    )


def musique_prompt(item: MusiqueItem, *, seed: int, index: int, holes: str) -> QAPrompt:
    order = list(range(len(item.passages)))
    random.Random(f"{seed}:musique:{index}").shuffle(order)
    documents = tuple(
        Document(
            entity=item.passages[i].title,
            text=item.passages[i].prompt_text,
            facts=(),
            is_distractor=False,
        )
        for i in order
    )
    holders = [i for i, d in enumerate(documents) if item.answers[0].lower() in d.text.lower()]
    try:
        holes_at = hole_positions(holes, len(documents))
    except ValueError as error:
        # Items may differ in their number of passages: say which one the spec misses.
        raise ValueError(f"{error} (MuSiQue item {index} has {len(documents)} passages)") from None
    return QAPrompt(
        system=MUSIQUE_SYSTEM_PROMPT,
        documents=documents,
        question=item.question,
        gold_answer=item.answers[0],
        # Multi-hop: the first passage naming the answer, or -1 when none does verbatim.
        answer_document=holders[0] if holders else -1,
        hole_documents=holes_at,
        gold_aliases=item.answers[1:],
    )
