"""Batched greedy decoding (runtime/model/batch_decode.py) on the real model: several sequences
joining and leaving the batch at different steps decode what `generate` decodes for each
alone."""

from __future__ import annotations

import gc

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


def test_a_sequence_given_twice_in_one_step_is_refused(prefills):
    """Twice in one step, a sequence would advance two slots for the one K/V written, and
    later steps would read the skipped slot as a key."""
    engine, prefilled = prefills
    first, second = (engine.start_decode(p, 4) for p in prefilled[:2])
    positions = [first.position, second.position]
    with pytest.raises(ValueError, match=r"sequences\[2\]: given twice"):
        engine.decode_step([first, second, first], [5, 6, 7])
    assert [first.position, second.position] == positions


def _pooled_and_alone(engine, prefilled, limit=6):
    """Each prefill decoded in the engine's pool and, the same KV, in a pool of its own."""
    pooled = [engine.start_decode(p, limit) for p in prefilled]
    alone = []
    for p in prefilled:
        n = p.num_prompt_tokens
        own = batch_decode.KVPool(engine.model)
        alone.append(
            batch_decode.start_sequence(own, p.k[:, :, :n], p.v[:, :, :n], p.logits, limit)
        )
    return pooled, alone


def _step_both(engine, pooled, alone, steps):
    for _ in range(steps):
        tokens = [s.next_token() for s in alone]
        engine.decode_step(pooled, tokens)
        engine.decode_step(alone, tokens)  # one pool each: one call per sequence
        for p, a in zip(pooled, alone, strict=True):
            torch.testing.assert_close(p.logits, a.logits, atol=1e-4, rtol=0.0)


def test_one_attention_call_per_layer_for_the_pool_equals_one_per_sequence(prefills, monkeypatch):
    engine, prefilled = prefills
    assert batch_decode.one_call_on(engine.model.device)  # the CPU
    assert not batch_decode.one_call_on(torch.device("cuda"))
    pooled, alone = _pooled_and_alone(engine, prefilled)
    assert len({s.row for s in pooled}) == len(pooled) and all(s.row == 0 for s in alone)
    calls = []
    sdpa = batch_decode.F.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(batch_decode.F, "scaled_dot_product_attention", counting)
    engine.decode_step(pooled, [s.next_token() for s in pooled])
    assert calls == [len(pooled)] * engine.model.num_layers  # one call, the four rows
    monkeypatch.undo()
    for s in pooled:
        s.position -= 1  # the same token again, now beside the per-sequence pools
    _step_both(engine, pooled, alone, steps=3)


@pytest.mark.parametrize("one_call", [True, False])
def test_rows_left_free_or_outside_the_step_change_nothing(prefills, one_call, monkeypatch):
    """A step over rows 0 and 2 of a pool whose row 1 ended (its slots NaN) and whose
    row 3 decodes in another step: the same logits as each sequence in its own pool,
    with one attention call for the rows (the CPU's way) or one per sequence (other
    devices')."""
    monkeypatch.setattr(batch_decode, "one_call_on", lambda device: one_call)
    engine, prefilled = prefills
    pooled, alone = _pooled_and_alone(engine, prefilled)
    pool = engine.decode_pool
    ended = pooled[1]
    row = ended.row
    ended.close()
    assert row not in pool.live_rows and ended.room == 0
    with torch.inference_mode():  # the pool's buffers are inference tensors
        pool.k[:, row] = float("nan")
        pool.v[:, row] = float("nan")
    _step_both(engine, [pooled[2], pooled[0]], [alone[2], alone[0]], steps=3)  # out of order
    _step_both(engine, [pooled[3]], [alone[3]], steps=1)
    assert all(bool(torch.isfinite(s.logits).all()) for s in (pooled[0], pooled[2], pooled[3]))


def test_the_pool_reuses_rows_grows_and_shrinks_keeping_live_kv(new_engine):
    engine = new_engine()
    model, pool = engine.model, batch_decode.KVPool(engine.model)
    generator = torch.Generator().manual_seed(1)

    def kv(tokens):
        k, v = model.new_kv(tokens)
        return k.normal_(generator=generator), v.normal_(generator=generator)

    given = {}
    for tokens in (100, 300, 200):
        row = pool.add(*kv(tokens), num_slots=tokens + 10)
        given[row] = (pool.k[:, row, :, :tokens].clone(), tokens)
    assert sorted(given) == [0, 1, 2] and pool.num_slots == batch_decode.SLOT_QUANTUM * 2

    def live_kv_kept():
        for row in pool.live_rows:
            kept, tokens = given[row]
            torch.testing.assert_close(pool.k[:, row, :, :tokens], kept, atol=0, rtol=0)
            assert not pool.k[:, row, :, tokens:].any()  # beyond the prompt: zeros

    pool.release(1)
    row = pool.add(*kv(50), num_slots=60)  # the lowest free row, no reallocation
    assert row == 1 and pool.num_rows == 3
    given[1] = (pool.k[:, 1, :, :50].clone(), 50)
    live_kv_kept()
    row = pool.add(*kv(1000), num_slots=1100)  # more rows and slots: reallocated
    given[row] = (pool.k[:, row, :, :1000].clone(), 1000)
    assert row == 3 and pool.num_rows >= 4 and pool.num_slots == 1280
    live_kv_kept()
    for row in (1, 2, 3):
        pool.release(row)
    row = pool.add(*kv(40), num_slots=60)  # a quarter or less in use: shrunk
    given[row] = (pool.k[:, row, :, :40].clone(), 40)
    assert row == 1 and (pool.num_rows, pool.num_slots) == (2, batch_decode.SLOT_QUANTUM)
    live_kv_kept()
    with pytest.raises(RuntimeError, match=r"rows \[0, 1\] are still in use"):
        pool.clear()
    pool.release(0), pool.release(1)
    pool.clear()
    assert pool.k is None and pool.num_rows == 0
    with pytest.raises(ValueError, match="num_slots: 5 is fewer than the 10 tokens"):
        pool.add(*kv(10), num_slots=5)


def test_a_dropped_sequence_gives_its_row_back(prefills):
    engine, prefilled = prefills
    sequence = engine.start_decode(prefilled[0], 4)
    row = sequence.row
    assert row in engine.decode_pool.live_rows
    del sequence
    assert row not in engine.decode_pool.live_rows
    answers = engine.generate_batch(prefilled[:2], [3, 3])
    assert len(answers) == 2 and engine.decode_pool.live_rows == []


class _CollectingTensor(torch.Tensor):
    """A pool buffer whose first write runs a garbage collection pass, as an allocation
    inside that write may."""

    collected = False

    def __setitem__(self, index, value):
        if not _CollectingTensor.collected:
            _CollectingTensor.collected = True
            gc.collect()
        super().__setitem__(index, value)


@pytest.mark.parametrize("during", ["allocation", "copy"])
def test_a_row_freed_by_a_finalizer_inside_add_stays_free(new_engine, during, monkeypatch):
    """A dropped sequence in a reference cycle is finalized by whichever allocation runs
    the next garbage collection pass: here one inside `add`, on its own thread (the lock
    re-enters), while the new buffers are allocated or while the live rows are copied
    into them. Its row must end free, not live forever."""
    engine = new_engine()
    model, pool = engine.model, batch_decode.KVPool(engine.model)
    k, v = model.new_kv(10)
    kept = batch_decode.start_sequence(pool, k, v, torch.zeros(1), 4)
    dropped = batch_decode.start_sequence(pool, k, v, torch.zeros(1), 4)
    dropped.itself = dropped  # freed by a collection pass only
    empty = torch.empty
    collects = [True]

    def allocating(*args, **kwargs):
        if during == "allocation" and collects:
            collects.pop()
            gc.collect()
        tensor = empty(*args, **kwargs)
        return tensor.as_subclass(_CollectingTensor) if during == "copy" else tensor

    monkeypatch.setattr(_CollectingTensor, "collected", False)
    gc.disable()
    try:
        del dropped
        monkeypatch.setattr(torch, "empty", allocating)
        row = pool.add(k, v, num_slots=20)  # a third row: the pool reallocates
        monkeypatch.undo()
    finally:
        gc.enable()
    assert pool.live_rows == [kept.row, row] == [0, 2]
    assert pool.add(k, v, num_slots=20) == 1  # the freed row is taken again


def test_a_long_answer_limit_holds_slots_only_as_the_answer_grows(new_engine):
    """A limit of 5,000 tokens reserves no 5,000 slots up front: every row of a pool has
    the longest row's slots, so it would make all of them that long. The row grows by
    SLOT_QUANTUM when the answer reaches its end, its KV kept: the logits of decoding
    into one buffer of all the slots (`Llama.forward`, as `generate` does)."""
    engine = new_engine()
    model = engine.model
    generator = torch.Generator().manual_seed(2)
    prompt = batch_decode.SLOT_QUANTUM - 3
    tokens = torch.randint(model.config.vocab_size, (6,), generator=generator).tolist()
    with torch.inference_mode():
        k, v = model.new_kv(prompt + len(tokens))
        k.normal_(generator=generator), v.normal_(generator=generator)
        k[:, :, prompt:], v[:, :, prompt:] = 0, 0
        logits = torch.zeros(model.config.vocab_size)
        pool = batch_decode.KVPool(model)
        short = batch_decode.start_sequence(pool, k[:, :, :5], v[:, :, :5], logits, 3)
        long = batch_decode.start_sequence(pool, k[:, :, :prompt], v[:, :, :prompt], logits, 5000)
        assert pool.num_slots == batch_decode.SLOT_QUANTUM
        batch_decode.decode_step(model, [short], [tokens[0]])
        for position, token in enumerate(tokens, start=prompt):
            batch_decode.decode_step(model, [long], [token])
            h = model.forward(torch.tensor([token]), k, v, position)
            torch.testing.assert_close(long.logits, model.logits(h)[0], atol=1e-4, rtol=0.0)
    assert pool.num_slots == 2 * batch_decode.SLOT_QUANTUM and long.position == prompt + 6
    torch.testing.assert_close(pool.k[:, long.row, :, : long.position], k, atol=0, rtol=0)
    assert not pool.k[:, long.row, :, long.position :].any()
    assert not pool.k[:, short.row, :, short.position :].any()


def test_a_row_that_failed_to_grow_grows_at_the_next_step(new_engine, monkeypatch):
    """Out of memory while a row grows fails that step only: the next one grows the row
    and decodes, its KV kept."""
    engine = new_engine()
    model = engine.model
    prompt = batch_decode.SLOT_QUANTUM - 1
    with torch.inference_mode():
        k, v = model.new_kv(prompt)
        k.normal_(generator=torch.Generator().manual_seed(3))
        pool = batch_decode.KVPool(model)
        logits = torch.zeros(model.config.vocab_size)
        sequence = batch_decode.start_sequence(pool, k, v, logits, 5000)
        batch_decode.decode_step(model, [sequence], [4])  # the row's last slot held
        assert pool.num_slots == prompt + 1

        def out_of_memory(*args, **kwargs):
            raise RuntimeError("not enough memory")

        monkeypatch.setattr(torch, "empty", out_of_memory)
        with pytest.raises(RuntimeError, match="not enough memory"):
            batch_decode.decode_step(model, [sequence], [5])
        monkeypatch.undo()
        batch_decode.decode_step(model, [sequence], [5])
    assert sequence.position == prompt + 2 and pool.num_slots == 2 * batch_decode.SLOT_QUANTUM
    torch.testing.assert_close(pool.k[:, sequence.row, :, :prompt], k, atol=0, rtol=0)


def test_the_pool_grows_by_half_again_up_to_max_rows_and_no_further(new_engine):
    """Rows grow by half again, so a batch filling up reallocates a few times: a fourth
    sequence gave a pool of three rows five, and one shrunk to seven gave an eighth
    sequence eleven (8,192 slots of SmolLM2-135M in float32: 4.15 GB instead of 3.02 GB)
    though the server never decodes more than `--max-batch` at once. The growth now stops
    at `max_rows`, and a sequence beyond it is refused."""
    engine = new_engine()
    model = engine.model
    k, v = model.new_kv(10)
    capped, free = batch_decode.KVPool(model, max_rows=4), batch_decode.KVPool(model)
    for pool in (capped, free):
        for _ in range(4):
            pool.add(k, v, num_slots=20)
    assert free.num_rows == 5 and capped.num_rows == 4
    with pytest.raises(RuntimeError, match="max_rows: all 4 rows are in use"):
        capped.add(k, v, num_slots=20)
    assert capped.live_rows == [0, 1, 2, 3]
    roomy = batch_decode.KVPool(model, max_rows=8)
    for _ in range(4):
        roomy.add(k, v, num_slots=20)
    assert roomy.num_rows == 5  # by half again below the cap
    with pytest.raises(ValueError, match="max_rows: must be >= 1, got 0"):
        batch_decode.KVPool(model, max_rows=0)
