"""Stop sequences in `IncrementalText` and the queue's Retry-After estimate (no server)."""

import pytest

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
