"""Batched greedy decoding (runtime/model/batch_decode.py) on the real model: several sequences
joining and leaving the batch at different steps decode what `generate` decodes for each
alone."""

from __future__ import annotations

import pytest
import torch

from holeblend_runtime.model import batch_decode

# Logits of the same token computed with a different number of rows in the matmuls (or by
# teacher forcing) differ by float32 rounding only: ~1e-5 here, well inside this bound.
LOGIT_ATOL = 1e-3
QUESTIONS = (
    "Who built the bridge?",
    "When did the museum open?",
    "Where was Tove Lind born?",
    "What did the council vote for in 1998?",
)


@pytest.fixture
def prefills(new_engine, rag_texts):
    """An engine and full prefills of prompts of four different lengths."""
    engine = new_engine()
    system, documents, _ = rag_texts
    prompts = [
        engine.build_prompt(system, documents[: i + 1], question)
        for i, question in enumerate(QUESTIONS)
    ]
    assert len({p.num_tokens for p in prompts}) == len(prompts)
    return engine, [engine.prefill(p, "full") for p in prompts]


def check_same_greedy_answer(engine, prefill, batched, batched_logits, alone):
    """`batched` equals `alone`, or the two part where full prefill's logits are a tie
    within float32 rounding (then a different argmax is no error). Either way the logits
    the batched steps produced match teacher forcing of the batched tokens."""
    if batched != alone:
        first = next(
            (i for i, (a, b) in enumerate(zip(batched, alone, strict=False)) if a != b),
            min(len(batched), len(alone)),
        )
        assert first < min(len(batched), len(alone)), (batched, alone)
        row = engine.score(prefill, alone[: first + 1])[first]
        gap = row[alone[first]] - row[batched[first]]
        assert abs(float(gap)) < LOGIT_ATOL, f"no tie at step {first}: gap {float(gap)}"
    if len(batched_logits):
        forced = engine.score(prefill, batched)[1 : 1 + len(batched_logits)]
        torch.testing.assert_close(torch.stack(batched_logits), forced, atol=LOGIT_ATOL, rtol=0.0)


def test_sequences_joining_and_leaving_decode_what_each_decodes_alone(prefills):
    engine, prefilled = prefills
    limits = [12, 5, 9, 6]
    joins = [0, 0, 1, 3]  # the step at which each sequence enters the batch
    alone = [engine.generate(p, n) for p, n in zip(prefilled, limits, strict=True)]
    assert [len(a) for a in alone] == limits  # no EOS: each leaves at its limit

    answers: list[list[int]] = [[] for _ in prefilled]
    logits: list[list[torch.Tensor]] = [[] for _ in prefilled]
    sequences: dict[int, batch_decode.DecodeSequence] = {}
    batch_sizes = []
    step = 0
    while step <= max(joins) or sequences:
        for i in [i for i, j in enumerate(joins) if j == step]:
            sequences[i] = engine.start_decode(prefilled[i], limits[i])
        for i, sequence in list(sequences.items()):  # each takes its next token
            token = sequence.next_token()
            if token == engine.config.eos_token_id:
                del sequences[i]
                continue
            answers[i].append(token)
            sequence.produced()
            if sequence.is_at_limit:
                del sequences[i]
        if sequences:
            batch_sizes.append(len(sequences))
            order = list(sequences)
            engine.decode_step([sequences[i] for i in order], [answers[i][-1] for i in order])
            for i in order:
                logits[i].append(sequences[i].logits.clone())
        step += 1

    assert max(batch_sizes) == 4 and min(batch_sizes) < 4  # all four met, some left
    for i, prefill in enumerate(prefilled):
        check_same_greedy_answer(engine, prefill, answers[i], logits[i], alone[i])


def test_generate_batch_equals_generate_one_at_a_time(prefills):
    engine, prefilled = prefills
    limits = [7, 2, 5, 1]
    batched = engine.generate_batch(prefilled, limits)
    for prefill, n, answer in zip(prefilled, limits, batched, strict=True):
        check_same_greedy_answer(engine, prefill, answer, [], engine.generate(prefill, n))
        assert len(answer) <= n


def test_a_step_is_one_forward_pass_for_the_whole_batch(prefills, monkeypatch):
    engine, prefilled = prefills
    sequences = [engine.start_decode(p, 4) for p in prefilled]
    rows = []
    original = engine.model.qkv

    def counting(layer, h, rope):
        rows.append(h.shape[0])
        return original(layer, h, rope)

    monkeypatch.setattr(engine.model, "qkv", counting)
    positions = [s.position for s in sequences]
    engine.decode_step(sequences, [s.next_token() for s in sequences])
    assert rows == [len(sequences)] * engine.model.num_layers
    assert [s.position for s in sequences] == [p + 1 for p in positions]
    assert all(s.logits.shape == (engine.config.vocab_size,) for s in sequences)


def test_bad_steps_are_refused(prefills):
    engine, prefilled = prefills
    sequence = engine.start_decode(prefilled[0], 2)  # room for one token fed
    with pytest.raises(ValueError, match="tokens: 2 for 1 sequences"):
        engine.decode_step([sequence], [1, 2])
    engine.decode_step([sequence], [sequence.next_token()])
    with pytest.raises(ValueError, match="KV cache is full"):
        engine.decode_step([sequence], [sequence.next_token()])
    with pytest.raises(ValueError, match="max_new_tokens: must be >= 1"):
        engine.start_decode(prefilled[0], 0)
