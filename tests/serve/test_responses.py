"""Stop sequences in `IncrementalText` and the queue's Retry-After estimate (no server)."""

import random

import pytest

from holeblend_runtime.model.gguf import load_model_files
from holeblend_runtime.model.tokenizer import TextTokenizer
from holeblend_runtime.serve.responses import IncrementalText
from holeblend_runtime.serve.worker import SlotEstimate

# A toy vocabulary: token i decodes to PIECES[i].
PIECES = ["Hel", "lo", " wor", "ld", "!", " E", "ND", " more", "\n"]


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def run(ids, stop=()):
    text = IncrementalText(decode, stop)
    deltas = [text.add(i) for i in ids]
    return deltas, text.rest(), text


def test_without_stop_every_token_is_sent_at_once():
    deltas, rest, text = run([0, 1, 2, 3])
    assert deltas == ["Hel", "lo", " wor", "ld"] and rest == "" and not text.stopped


def test_the_answer_ends_before_a_stop_sequence_that_spans_tokens():
    deltas, rest, text = run([0, 1, 2, 3, 4, 7], stop=["o wo"])
    assert "".join(deltas) + rest == "Hell" and text.stopped and text.text == "Hell"
    # Tokens after the stop are ignored, and count nothing.
    assert deltas[3:] == ["", "", ""] and len(text.token_ids) == 3


def test_a_tail_that_may_start_a_stop_sequence_is_held_back_then_sent():
    deltas, rest, text = run([0, 1, 2, 3, 5, 7], stop=[" END"])
    # " E" could begin " END": held back, then sent once " more" rules it out.
    assert deltas == ["Hel", "lo", " wor", "ld", "", " E more"]
    assert rest == "" and not text.stopped


def test_a_held_back_tail_is_flushed_at_the_end():
    deltas, rest, text = run([0, 5], stop=[" END"])
    assert deltas == ["Hel", ""] and rest == " E" and text.text == "Hel E"


def test_the_first_of_several_stop_sequences_wins():
    _, _, text = run([0, 1, 2, 3, 4, 5, 6], stop=[" END", "ld", "Hello world!"])
    assert text.text == "Hello wor"


@pytest.mark.parametrize("stop", [["\n"], ["!\n"]])
def test_stop_at_a_newline(stop):
    deltas, rest, text = run([0, 4, 8, 7], stop=stop)
    assert "".join(deltas) + rest == ("Hel!" if stop == ["\n"] else "Hel")


class WholeDecode:
    """What `IncrementalText` must produce, by definition: after every token, decode the
    whole answer; send nothing while it ends with U+FFFD; cut at the first stop sequence;
    hold back a tail that begins one; at the end, cut the whole answer at the first stop
    sequence."""

    def __init__(self, decode, stop) -> None:
        self.decode, self.stop, self.ids, self.sent, self.final = decode, tuple(stop), [], 0, None

    def add(self, token_id: int) -> str:
        if self.final is not None:
            return ""
        self.ids.append(token_id)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        found = [i for stop in self.stop if (i := text.find(stop)) >= 0]
        if found:
            self.final = text = text[: min(found)]
            end = len(text)
        else:
            end = len(text) - max(
                (k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0
            )
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent : end], end
        return delta

    def rest(self) -> str:
        if self.final is None:
            text = self.decode(self.ids)
            found = [i for stop in self.stop if (i := text.find(stop)) >= 0]
            self.final = text[: min(found)] if found else None
        text = self.final if self.final is not None else self.decode(self.ids)
        delta, self.sent = text[self.sent :], len(text)
        return delta


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    files = load_model_files()
    return TextTokenizer(files.tokenizer, files.config)


MULTI_BYTE = "naïve café — 東京の空 🙂👍🏽 “quotes” ∑x² ü\n\tend. Ελληνικά 한국어 🇺🇳"


def answers(tokenizer: TextTokenizer, seed: int) -> list[list[int]]:
    """Token sequences of several kinds: tokenized text rich in multi-byte characters,
    random vocabulary ids (special tokens, lone bytes that split a character), and text
    tokens interleaved with tokens that decode to part of a character."""
    rng = random.Random(seed)
    vocab = tokenizer._tokenizer.get_vocab_size(with_added_tokens=True)
    partial = [i for i in range(vocab) if tokenizer.decode([i]).endswith("\ufffd")]
    text = tokenizer.encode(MULTI_BYTE * 6)
    start = rng.randrange(len(text) // 2)
    mixed = [rng.choice(partial) if rng.random() < 0.3 else rng.choice(text) for _ in range(300)]
    return [
        text[start : start + 200],
        [rng.randrange(vocab) for _ in range(300)],
        mixed,
        [rng.choice(partial) for _ in range(100)],
    ]


def stops_for(text: str, rng: random.Random) -> list[tuple[str, ...]]:
    """No stop; stops cut from the answer's own text (so they span token boundaries and
    characters of several bytes); ones that never occur; several at once."""

    def cut() -> str:
        if not text:
            return "x"
        i = rng.randrange(len(text))
        return text[i : i + rng.randint(1, 8)]

    return [
        (),
        (cut(),),
        (cut(), "never here", cut()),
        ("🙂👍",),
        ("\ufffd",),
        (cut(), cut(), cut(), cut()),
    ]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_equals_decoding_the_whole_answer_after_every_token(tokenizer, seed):
    """Decoding a window of recent tokens gives, token for token, the deltas that decoding
    the whole answer each time gives (characters split across tokens, special tokens, lone
    bytes, stop sequences across token boundaries), and the same final text."""
    rng = random.Random(seed)
    for ids in answers(tokenizer, seed):
        whole = tokenizer.decode(ids)
        for stop in stops_for(whole, rng):
            text, expected = (
                IncrementalText(tokenizer.decode, stop),
                WholeDecode(tokenizer.decode, stop),
            )
            deltas = [text.add(i) for i in ids]
            assert deltas == [expected.add(i) for i in ids], (ids, stop)
            assert text.stopped == (expected.final is not None)
            rest = text.rest()
            assert rest == expected.rest()
            assert text.stopped == (expected.final is not None)
            sent = "".join(deltas) + rest
            if text.stopped:
                assert sent == text.text == expected.final and len(text.token_ids) == len(
                    expected.ids
                )
            else:
                assert sent == text.text == whole and text.token_ids == ids


def test_a_stop_sequence_completed_with_the_start_of_a_character_ends_the_answer(tokenizer):
    """SmolLM2 has tokens that decode to a space and the first byte of a character
    (" \\xe6"): while the text ends with it nothing is taken, nor searched for stop
    sequences. An answer that ended on one was sent whole, the stop sequence in it."""
    ids = tokenizer.encode("東京 東京")
    last = next(i for i, token in enumerate(ids) if tokenizer.decode([token]).startswith(" "))
    answer = ids[: last + 1]
    assert tokenizer.decode(answer) == "東京 \ufffd"  # the token that ends the answer
    text = IncrementalText(tokenizer.decode, (" ",))
    sent = "".join(text.add(i) for i in answer) + text.rest()
    assert sent == text.text == "東京" and text.stopped


def test_each_token_decodes_a_bounded_window_however_long_the_answer(tokenizer):
    """The text is built on the server's event loop once per token: decoding the whole
    answer each time would cost O(n) per token, O(n^2) per answer (seconds of loop time
    for a few thousand tokens)."""
    decoded = []

    def counting(ids):
        decoded.append(len(ids))
        return tokenizer.decode(ids)

    ids = tokenizer.encode(MULTI_BYTE * 200)[:3000]
    text = IncrementalText(counting, ("\n\nQuestion:",))
    for token in ids:
        text.add(token)
    assert max(decoded) <= 16 and sum(decoded) <= 10 * len(ids)


def test_retry_after_is_the_running_jobs_expected_rest():
    slot = SlotEstimate(window=4, initial_s=1.0)
    for start in (0.0, 10.0, 20.0):  # three jobs of 9 s each
        slot.started(start)
        slot.finished(start + 9.0)
    # Mean of (1, 9, 9, 9) = 7 s; the running job started 2 s ago: 5 s left.
    slot.started(100.0)
    assert slot.retry_after_s(102.0) == 5
    # Past its expected end: retry in a second, never 0.
    assert slot.retry_after_s(130.0) == 1
    slot.finished(130.0)  # a 30 s job joins the window: (9, 9, 9, 30) -> 14.25 s
    assert slot.retry_after_s(131.0) == 15


def test_retry_after_with_a_batch_counts_from_the_job_that_started_first():
    slot = SlotEstimate(window=2, initial_s=10.0)
    slot.started(0.0, "a")
    slot.started(4.0, "b")
    # Mean 10 s; "a" started 6 s ago: 4 s left (b's 2 s do not count).
    assert slot.retry_after_s(6.0) == 4
    slot.finished(7.0, "a")  # a 7 s job: mean (10, 7) = 8.5 s; "b" started 3.5 s ago
    assert slot.retry_after_s(7.5) == 5
    slot.finished(8.0, "b")
    slot.finished(9.0, "b")  # finished once: the second call changes nothing
    assert slot.retry_after_s(9.0) == 6  # mean (7, 4) = 5.5 s, nothing running
