"""A seeded synthetic multi-document QA workload.

Every document describes one invented organisation through short fact sentences
(years, people, places, counts, dates), so each answer exists only in the prompt and the
model cannot know it beforehand. Each prompt asks one question whose gold answer occurs
in exactly one of its documents. Some documents are "holes": left out when the prompt is
first sent (pass 1), present when it is sent again (pass 2).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = (
    "You are a careful assistant. Answer the question using only the documents. "
    "Reply with the answer alone, in a few words."
)

_SYLLABLES = (
    "bra", "ken", "lor", "vas", "mir", "tol", "quen", "dar", "sel", "vok", "rin", "tha",
    "mor", "zel", "pan", "dru", "fen", "gal", "hes", "jor", "kal", "nim", "osk", "pel",
)  # fmt: skip
_FIRST_NAMES = (
    "Talia", "Oren", "Mirela", "Brannoc", "Isvet", "Corwen", "Anselma", "Dariel", "Fenna",
    "Gideor", "Halvara", "Joriel", "Kestra", "Lucan", "Merisol", "Nolwen", "Perrin",
    "Quilla", "Rhoswen", "Sabeth", "Teodric", "Ulma", "Varic", "Wenna", "Yselt", "Zorin",
)  # fmt: skip
_ORG_KINDS = (
    "Institute", "Trading Company", "Observatory", "Library", "Shipyard", "Orchestra",
    "Museum", "Brewery", "Foundry", "Seed Bank", "Weaving Guild", "Ferry Line",
)  # fmt: skip
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August",
    "September", "October", "November", "December",
)  # fmt: skip
_COLOURS = ("green", "silver", "crimson", "golden", "violet", "white", "rust", "blue")
_ANIMALS = ("heron", "fox", "otter", "lynx", "stag", "owl", "salmon", "badger", "wren")


@dataclass(frozen=True)
class _FactTemplate:
    # Statement and question; {e} is the organisation, {v} the value.
    sentence: str
    question: str
    # Which value generator fills {v}.
    value_kind: str


_FACT_TEMPLATES = (
    _FactTemplate("{e} was founded in {v}.", "In which year was {e} founded?", "year"),
    _FactTemplate("{e} was founded by {v}.", "Who founded {e}?", "person"),
    _FactTemplate(
        "The headquarters of {e} are in the town of {v}.",
        "In which town are the headquarters of {e}?",
        "place",
    ),
    _FactTemplate(
        "The main office of {e} stands on {v}.",
        "On which street does the main office of {e} stand?",
        "street",
    ),
    _FactTemplate("{e} employs {v} people.", "How many people does {e} employ?", "count"),
    _FactTemplate(
        "The current director of {e} is {v}.", "Who is the current director of {e}?", "person"
    ),
    _FactTemplate(
        "{e} opened its first branch on {v}.",
        "On which date did {e} open its first branch?",
        "date",
    ),
    _FactTemplate(
        "The yearly budget of {e} is {v} crowns.",
        "How many crowns is the yearly budget of {e}?",
        "count",
    ),
    _FactTemplate(
        "The oldest building of {e} has {v} floors.",
        "How many floors does the oldest building of {e} have?",
        "small_count",
    ),
    _FactTemplate("The emblem of {e} shows a {v}.", "What does the emblem of {e} show?", "emblem"),
    _FactTemplate(
        "{e} keeps a second office in the port of {v}.",
        "In which port does {e} keep a second office?",
        "place",
    ),
    _FactTemplate(
        "Every year {e} welcomes about {v} visitors.",
        "How many visitors does {e} welcome every year?",
        "count",
    ),
    _FactTemplate(
        "The chief archivist of {e} is {v}.", "Who is the chief archivist of {e}?", "person"
    ),
    _FactTemplate(
        "{e} moved into its present home in {v}.",
        "In which year did {e} move into its present home?",
        "year",
    ),
)


@dataclass(frozen=True)
class Fact:
    sentence: str
    question: str
    answer: str


@dataclass(frozen=True)
class Document:
    # The organisation the document is about.
    entity: str
    text: str
    facts: tuple[Fact, ...]
    # Whether only there to make the prompt longer (no question is asked about it).
    is_distractor: bool


@dataclass(frozen=True)
class QAPrompt:
    """One request: documents, one question and its gold answer."""

    system: str
    documents: tuple[Document, ...]
    question: str
    gold_answer: str
    # Index into `documents` of the document that holds the answer.
    answer_document: int
    # Indexes into `documents` left out in pass 1 (sorted).
    hole_documents: tuple[int, ...]
    # Further accepted answers besides `gold_answer` (F1 vs gold takes the best).
    gold_aliases: tuple[str, ...] = ()

    @property
    def gold_answers(self) -> tuple[str, ...]:
        """Every accepted answer, `gold_answer` first."""
        return (self.gold_answer, *self.gold_aliases)

    def document_texts(
        self, *, without_holes: bool, shuffle_seed: int | None = None
    ) -> tuple[str, ...]:
        """The documents' texts in prompt order, or, when a seed is given, in the seeded
        order of `first_pass_order` (no document after the one it follows in the prompt)."""
        if shuffle_seed is not None:
            return self.first_pass_order(shuffle_seed, without_holes=without_holes).texts
        skipped = set(self.hole_documents) if without_holes else set()
        return tuple(d.text for i, d in enumerate(self.documents) if i not in skipped)

    def first_pass_order(self, seed: int, *, without_holes: bool = True) -> NeighbourOrder:
        """The documents (holes left out when `without_holes`) in one seeded order in which
        none follows what it follows in the prompt, the system prompt counting as what the
        first document follows, so that none is found again after what it was stored
        after; `NeighbourOrder` says how it was drawn and what could not be avoided."""
        skipped = set(self.hole_documents) if without_holes else set()
        texts = [d.text for i, d in enumerate(self.documents) if i not in skipped]
        rng = random.Random(f"{seed}:{self.question}")
        return new_neighbour_order(texts, prompt_predecessors([self]), len(texts) or 1, rng)


# Stands for the system prompt where a document's predecessor is asked for.
SYSTEM = None

# Seeded shuffles `new_neighbour_order` draws before it searches.
MAX_DRAWS = 100
# Candidate checks the search may make per document squared (and at least this many).
SEARCH_STEPS = 1_000_000


@dataclass(frozen=True)
class NeighbourOrder:
    """A pass-1 order of documents and how it was drawn."""

    texts: tuple[str, ...]
    # "shuffle": the `draws`-th seeded shuffle keeps no predecessor. "search": no shuffle
    # did, a seeded exhaustive search found an order that does. "impossible": no order
    # exists, the shuffle keeping the fewest is used. "search-limit": the search ran out of
    # steps, the shuffle keeping the fewest is used.
    method: str
    # Seeded shuffles drawn.
    draws: int
    # Documents that follow in the order what they follow in a prompt (system prompt
    # included): 0 unless `method` is "impossible" or "search-limit".
    kept_predecessors: int
    # Of those, documents first after the system prompt both times: an exact prefix.
    exact_prefixes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "order": self.method,
            "draws": self.draws,
            "kept_predecessors": self.kept_predecessors,
            "exact_prefixes": self.exact_prefixes,
        }


def prompt_predecessors(prompts: Sequence[QAPrompt]) -> dict[str, set[str | None]]:
    """For every document text, what it follows in the prompts that hold it: the previous
    document's text, or `SYSTEM` for a prompt's first document."""
    before: dict[str, set[str | None]] = {}
    for qa in prompts:
        for i, document in enumerate(qa.documents):
            previous = SYSTEM if i == 0 else qa.documents[i - 1].text
            before.setdefault(document.text, set()).add(previous)
    return before


def new_neighbour_order(
    texts: Sequence[str],
    forbidden: Mapping[str, Collection[str | None]],
    group_size: int,
    rng: random.Random,
) -> NeighbourOrder:
    """`texts` in an order, cut into groups of `group_size` that each start after the
    system prompt (`SYSTEM`), in which no text follows one of its `forbidden` predecessors.

    Draws seeded shuffles (the first is a plain `rng.shuffle`) until one has no forbidden
    neighbour, at most `MAX_DRAWS`; then searches every order depth first (candidates in a
    seeded order), which finds one whenever one exists. Only when none exists (one
    document that must come first, say), or the search runs out of steps, is the shuffle
    with the fewest forbidden neighbours returned, and the result says so."""
    if group_size < 1:
        raise ValueError(f"group_size: must be >= 1, got {group_size}")
    order = list(texts)
    best: tuple[tuple[int, int], list[str]] | None = None
    for draw in range(1, MAX_DRAWS + 1):
        rng.shuffle(order)
        kept = _kept(order, forbidden, group_size)
        if kept[0] == 0:
            return NeighbourOrder(tuple(order), "shuffle", draw, 0, 0)
        if best is None or kept < best[0]:
            best = (kept, list(order))
    assert best is not None
    found, exhausted = _search(order, forbidden, group_size)
    if found is not None:
        return NeighbourOrder(tuple(found), "search", MAX_DRAWS, 0, 0)
    (kept_predecessors, exact_prefixes), fewest = best
    method = "impossible" if exhausted else "search-limit"
    return NeighbourOrder(tuple(fewest), method, MAX_DRAWS, kept_predecessors, exact_prefixes)


def _kept(
    order: Sequence[str], forbidden: Mapping[str, Collection[str | None]], group_size: int
) -> tuple[int, int]:
    """(texts after a forbidden predecessor, those of them first after the system prompt)."""
    kept = exact = 0
    for i, text in enumerate(order):
        first = i % group_size == 0
        if (SYSTEM if first else order[i - 1]) in forbidden.get(text, ()):
            kept += 1
            exact += first
    return kept, exact


def _search(
    texts: Sequence[str], forbidden: Mapping[str, Collection[str | None]], group_size: int
) -> tuple[list[str] | None, bool]:
    """Depth-first search over orders of `texts` (tried in the given order) for one with no
    forbidden neighbour: (the order or None, whether every order was tried)."""
    n = len(texts)
    budget = max(SEARCH_STEPS, 4 * n * n)
    order: list[str] = []
    chosen: list[int] = []
    used = [False] * n
    # Per depth: the next candidate index to try there.
    next_try = [0]
    steps = 0
    while len(order) < n:
        depth = len(order)
        previous = SYSTEM if depth % group_size == 0 else order[-1]
        i = next_try[depth]
        while i < n and (used[i] or previous in forbidden.get(texts[i], ())):
            i += 1
        steps += i - next_try[depth] + 1
        if steps > budget:
            return None, False
        if i < n:
            next_try[depth] = i + 1
            used[i] = True
            chosen.append(i)
            order.append(texts[i])
            next_try.append(0)
            continue
        next_try.pop()
        if not chosen:
            return None, True
        used[chosen.pop()] = False
        order.pop()
    return order, True


@dataclass(frozen=True)
class FirstPassRequest:
    """An earlier request that caches documents before the measured prompts reuse them."""

    system: str
    documents: tuple[str, ...]
    question: str


def first_pass_requests(
    prompts: Sequence[QAPrompt], seed: int, group_size: int
) -> tuple[FirstPassRequest, ...]:
    """`first_pass_plan`'s requests."""
    return first_pass_plan(prompts, seed, group_size)[0]


def first_pass_plan(
    prompts: Sequence[QAPrompt], seed: int, group_size: int
) -> tuple[tuple[FirstPassRequest, ...], NeighbourOrder]:
    """Pass 1 with new neighbours: every prompt's documents but the holes, pooled across
    prompts, put in a seeded order (`new_neighbour_order`) and sent in groups of
    `group_size`, so that pass 2 finds no document after what it was stored after (the
    system prompt counting: no document stored first in a group is first in a pass-2
    prompt, where it would be an exact prefix). The order's record says how it was drawn.

    A document text is sent once (texts shared by several prompts too), and never when it
    is a hole of any prompt: holes stay uncached. Each group asks the question of the
    prompt its first document came from."""
    if group_size < 1:
        raise ValueError(f"group_size: must be >= 1, got {group_size}")
    holes = {qa.documents[i].text for qa in prompts for i in qa.hole_documents}
    pool: dict[str, QAPrompt] = {}
    for qa in prompts:
        for document in qa.documents:
            if document.text not in holes:
                pool.setdefault(document.text, qa)
    rng = random.Random(f"{seed}:first-pass")
    order = new_neighbour_order(list(pool), prompt_predecessors(prompts), group_size, rng)
    texts = order.texts
    groups = [texts[i : i + group_size] for i in range(0, len(texts), group_size)]
    requests = tuple(
        FirstPassRequest(pool[group[0]].system, tuple(group), pool[group[0]].question)
        for group in groups
    )
    return requests, order


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    # Prompts in the workload; each asks one question.
    num_questions: int = 4
    # Documents per prompt that a question may be about.
    num_documents: int = 10
    # Extra distractor documents per prompt ("inflate"), placed at random positions.
    num_inflate: int = 0
    # Document length range in tokens (as counted by the caller's tokenizer).
    min_document_tokens: int = 124
    max_document_tokens: int = 181
    # Documents left out in pass 1: "middle", "none", or prompt positions like "2,5".
    holes: str = "middle"
    # Send pass 1's documents in a seeded random order in which none follows what it
    # follows in the prompt (the system prompt counting), so that pass 2 finds none of them
    # after what it was stored after (in-context storage then has no advantage from the
    # repeat; `QAPrompt.first_pass_order`).
    shuffle_first_pass: bool = False
    # Pass 1 pools every prompt's documents (holes left out), orders them (seeded) so that
    # none follows what it follows in a prompt and sends them in groups of a prompt's size
    # (`first_pass_plan`): new order and new neighbours.
    regroup_first_pass: bool = False

    def __post_init__(self) -> None:
        for name in ("num_questions", "num_documents", "min_document_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_inflate < 0:
            raise ValueError(f"num_inflate: must be >= 0, got {self.num_inflate}")
        if self.max_document_tokens < self.min_document_tokens:
            raise ValueError("max_document_tokens: must be >= min_document_tokens")
        hole_positions(self.holes, self.num_documents_per_prompt)

    @property
    def num_documents_per_prompt(self) -> int:
        return self.num_documents + self.num_inflate


def hole_positions(holes: str, num_documents: int) -> tuple[int, ...]:
    """Parse a hole spec into sorted document positions in the prompt."""
    spec = holes.strip().lower()
    if spec == "middle":
        return (num_documents // 2,)
    if spec == "none":
        return ()
    try:
        positions = sorted({int(part) for part in spec.split(",")})
    except ValueError:
        raise ValueError(
            f"holes: expected 'middle', 'none' or positions like '2,5', got {holes!r}"
        ) from None
    if positions[0] < 0 or positions[-1] >= num_documents:
        raise ValueError(f"holes: positions must lie in 0..{num_documents - 1}, got {holes!r}")
    return tuple(positions)


def approximate_token_count(text: str) -> int:
    """Rough token count for tests without a tokenizer: words, punctuation, single digits."""
    return len(re.findall(r"\d|[^\W\d]+|[^\w\s]", text))


def generate_workload(
    config: WorkloadConfig, count_tokens: Callable[[str], int] = approximate_token_count
) -> tuple[QAPrompt, ...]:
    """The same prompts for the same config and token counter, every time."""
    rng = random.Random(config.seed)
    used_entities: set[str] = set()
    return tuple(
        _generate_prompt(rng, config, count_tokens, used_entities)
        for _ in range(config.num_questions)
    )


def _generate_prompt(
    rng: random.Random,
    config: WorkloadConfig,
    count_tokens: Callable[[str], int],
    used_entities: set[str],
) -> QAPrompt:
    used_values: set[str] = set()
    is_distractor = [False] * config.num_documents + [True] * config.num_inflate
    rng.shuffle(is_distractor)
    documents = tuple(
        _generate_document(rng, config, count_tokens, used_entities, used_values, flag)
        for flag in is_distractor
    )
    answer_document = rng.choice([i for i, d in enumerate(documents) if not d.is_distractor])
    fact = _unique_fact(rng, documents, answer_document)
    return QAPrompt(
        system=SYSTEM_PROMPT,
        documents=documents,
        question=fact.question,
        gold_answer=fact.answer,
        answer_document=answer_document,
        hole_documents=hole_positions(config.holes, len(documents)),
    )


def _unique_fact(rng: random.Random, documents: tuple[Document, ...], index: int) -> Fact:
    # Values are unique per prompt, but one value can still be a substring of another
    # ("1873" inside "21873"): ask only about facts found in exactly one document.
    candidates = [
        fact
        for fact in documents[index].facts
        if sum(fact.answer in d.text for d in documents) == 1
    ]
    if not candidates:
        raise ValueError("documents: no fact with an answer unique to its document")
    return rng.choice(candidates)


def _generate_document(
    rng: random.Random,
    config: WorkloadConfig,
    count_tokens: Callable[[str], int],
    used_entities: set[str],
    used_values: set[str],
    is_distractor: bool,
) -> Document:
    entity = _unique(rng, _entity_name, used_entities)
    target = rng.randint(config.min_document_tokens, config.max_document_tokens)
    facts: list[Fact] = []
    # Distractors only need values fresh within themselves (no question is asked about
    # them, and the asked fact's answer is checked unique across the prompt): prompts of
    # thousands of tokens would exhaust the small value pools otherwise.
    values = set() if is_distractor else used_values
    for template in rng.sample(_FACT_TEMPLATES, len(_FACT_TEMPLATES)):
        fact = _make_fact(rng, template, entity, values)
        num_tokens = count_tokens(_join([*facts, fact]))
        if num_tokens > config.max_document_tokens:
            break
        facts.append(fact)
        if num_tokens >= target:
            break
    return Document(entity, _join(facts), tuple(facts), is_distractor)


def _make_fact(
    rng: random.Random, template: _FactTemplate, entity: str, used_values: set[str]
) -> Fact:
    value = _unique(rng, _VALUE_GENERATORS[template.value_kind], used_values)
    sentence = template.sentence.format(e=entity, v=value)
    return Fact(
        sentence=sentence[:1].upper() + sentence[1:],
        question=template.question.format(e=entity),
        answer=value,
    )


def _join(facts: list[Fact]) -> str:
    return " ".join(f.sentence for f in facts)


def _unique(rng: random.Random, generate: Callable[[random.Random], str], used: set[str]) -> str:
    for _ in range(1000):
        value = generate(rng)
        if value not in used:
            used.add(value)
            return value
    raise ValueError("seed: could not draw a fresh value after 1000 tries")


def _invented_word(rng: random.Random, num_syllables: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(num_syllables)).capitalize()


def _entity_name(rng: random.Random) -> str:
    return f"the {_invented_word(rng, 2)} {rng.choice(_ORG_KINDS)}"


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST_NAMES)} {_invented_word(rng, 2)}"


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {rng.randint(1820, 1990)}"


_VALUE_GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "year": lambda rng: str(rng.randint(1750, 1995)),
    "person": _person,
    "place": lambda rng: _invented_word(rng, 3),
    "street": lambda rng: f"{_invented_word(rng, 2)} Street",
    "count": lambda rng: f"{rng.randint(1200, 98000):,}",
    "small_count": lambda rng: str(rng.randint(3, 40)),
    "date": _date,
    "emblem": lambda rng: f"{rng.choice(_COLOURS)} {rng.choice(_ANIMALS)}",
}
