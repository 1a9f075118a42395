"""Greedy decoding of several sequences together: one forward pass per step for all of them.

A decode step of one sequence is one token through every layer: its matmuls read all the
weights (540 MB for SmolLM2-135M in float32) for a single row. Stacking the next token of
B sequences into hidden states [B, hidden] reads the weights once for the B rows, so B
answers advance for about the cost of one.

The sequences' KV caches are rows of one pool (`KVPool`: [layers, rows, kv_heads, slots,
head_dim]), so on the CPU attention is batched too: per layer the step computes Q, K and
V of all B tokens in one matmul, writes the B new K/V rows into the pool in one indexed
copy, runs one attention call for the B queries over their rows (each query sees its own
row's keys 0..position: a key mask per row, built once per step; the query heads of a KV
head read as that head's queries, so each KV head is read once), and runs the output
projection and the MLP for all B at once. One call instead of one per sequence: the whole
step takes 0.82x the time at 4 sequences of 1,400 keys (docs/accelerators.md, "One
attention call for the batch"). Other devices keep one unmasked call per sequence over
its row (`one_call_on`) until the masked call is measured there.

`DecodeSequence` is one sequence's state (a pool row); `decode_step` advances a list of
them by one token each.
The engine starts sequences from prefills in its own pool (`BlendEngine.start_decode`)
and wraps the step (`BlendEngine.decode_step`); the server's compute thread runs the
requests in flight as one batch (`holeblend_runtime.serve.worker`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from holeblend_runtime.model.attention import attend_one_query
from holeblend_runtime.model.llama import Llama

# Pool slots are allocated in multiples of this, so sequences of similar lengths fit
# without a reallocation each.
SLOT_QUANTUM = 256


class KVPool:
    """The KV buffers of sequences decoded together: K and V [layers, rows, kv_heads,
    slots, head_dim], one row per sequence (`add`, `release`).

    The pool grows when a sequence needs a row or slots it does not have, and shrinks
    when its live rows use at most a quarter of what it holds; both reallocate and copy the
    live rows, and happen only in `add` and `grow` (the decoding thread's calls): `release`,
    which a sequence's finalizer may call from any thread, only marks its row free. A
    finalizer may also run on the thread inside `add` or `grow` (a garbage collection pass
    triggered by one of their allocations; `lock` re-enters), so both change the live rows
    in place, never from a copy taken before an allocation. An idle pool keeps its buffers
    until the next `add` (which may shrink them) or `clear`. A step holds `lock`, so a
    sequence added from another thread never moves buffers under it.

    `max_rows` (None: no limit) caps the growth where the caller knows how many sequences
    decode at once at most (a server's batch): beyond it `add` refuses a sequence.

    `max_bytes` (None: no limit) is the byte budget of K and V together: `can_start` says
    whether a sequence would keep the pool within it once every live row and its own grew
    to their limits, and growth by half again adds no spare rows beyond it. `add` itself
    never refuses a sequence for it: the caller decides (a server runs a sequence over the
    budget alone rather than refusing its request).
    """

    def __init__(
        self, model: Llama, max_rows: int | None = None, max_bytes: int | None = None
    ) -> None:
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows: must be >= 1, got {max_rows}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes: must be >= 1, got {max_bytes}")
        self.model = model
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.lock = threading.RLock()
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        # Slots each live row holds (its tokens plus room for the next ones); absent: free.
        self._needs: dict[int, int] = {}
        # Slots each live row may grow to (`grow`): what `can_start` counts it at.
        self._limits: dict[int, int] = {}

    @property
    def num_rows(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def num_slots(self) -> int:
        return 0 if self.k is None else self.k.shape[3]

    @property
    def live_rows(self) -> list[int]:
        with self.lock:
            return sorted(self._needs)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of one row, K and V: layers x kv_heads x head_dim x 2 x the
        dtype's bytes (SmolLM2-135M in float32: 46,080)."""
        c = self.model.config
        itemsize = torch.empty((), dtype=self.model.dtype).element_size()
        return c.num_layers * c.num_kv_heads * c.head_dim * 2 * itemsize

    def can_start(self, num_tokens: int, max_new_tokens: int) -> bool:
        """Whether `start_sequence` of a prompt of `num_tokens` tokens and an answer of at
        most `max_new_tokens` keeps the pool within `max_bytes`: the pool as `add` would
        fit it (spare rows included), and as `grow` would fit it once every live row and
        the new one reached its limit. A sequence that needs no row always fits."""
        held, limit = _slots(num_tokens, max_new_tokens)
        if self.max_bytes is None or limit == 0:
            return True
        with self.lock:
            rows = max([self._free_row(), *self._needs]) + 1
            slots = _round_up(max([held, *self._needs.values()]), SLOT_QUANTUM)
            added = self._new_shape(rows, slots) or (self.num_rows, self.num_slots)
            grown = rows * _round_up(max([limit, *self._limits.values()]), SLOT_QUANTUM)
            return max(added[0] * added[1], grown) * self.slot_bytes <= self.max_bytes

    def add(
        self, k: torch.Tensor, v: torch.Tensor, num_slots: int, max_slots: int | None = None
    ) -> int:
        """A row of `num_slots` slots (up to `max_slots` with `grow`; None: `num_slots`)
        whose first tokens' K/V are k, v [layers, kv_heads, tokens, head_dim] (copied in);
        the row's index."""
        tokens = k.shape[2]
        if num_slots < tokens:
            raise ValueError(f"num_slots: {num_slots} is fewer than the {tokens} tokens given")
        with self.lock:
            row = self._free_row()
            rows = max([row, *self._needs]) + 1
            if self.max_rows is not None and rows > self.max_rows:
                raise RuntimeError(f"max_rows: all {self.max_rows} rows are in use")
            self._fit(rows, _round_up(max([num_slots, *self._needs.values()]), SLOT_QUANTUM))
            assert self.k is not None and self.v is not None
            self.k[:, row, :, :tokens] = k
            self.v[:, row, :, :tokens] = v
            # What a row's earlier sequence left there is read, masked, by later steps.
            self.k[:, row, :, tokens:] = 0
            self.v[:, row, :, tokens:] = 0
            self._needs[row] = num_slots
            self._limits[row] = max(num_slots, max_slots or 0)
            return row

    def grow(self, row: int, num_slots: int) -> None:
        """Live row `row` holds at least `num_slots` slots (its K/V kept, zeros after)."""
        with self.lock:
            if self._needs.get(row, num_slots) >= num_slots:
                return
            slots = _round_up(max([num_slots, *self._needs.values()]), SLOT_QUANTUM)
            self._fit(max(self._needs) + 1, slots)
            if row in self._needs:  # unless released meanwhile (see the class docstring)
                self._needs[row] = num_slots

    def release(self, row: int) -> None:
        """Row `row` is free (its sequence ended); its buffers stay until the next `add` or `grow`."""
        with self.lock:
            self._needs.pop(row, None)
            self._limits.pop(row, None)

    def clear(self) -> None:
        """Free the buffers; every row must have been released."""
        with self.lock:
            if self._needs:
                raise RuntimeError(f"rows {sorted(self._needs)} are still in use")
            self.k = self.v = None

    def _free_row(self) -> int:
        return next(r for r in range(len(self._needs) + 1) if r not in self._needs)

    def _new_shape(self, rows: int, slots: int) -> tuple[int, int] | None:
        """The rows and slots `_fit(rows, slots)` reallocates to; None when it keeps the
        buffers. Rows grow by half again, up to `max_rows` and to what `max_bytes` holds at
        `slots` (never below `rows`), so a batch filling up reallocates a few times, not
        once per sequence."""
        have_rows, have_slots = self.num_rows, self.num_slots
        if have_rows >= rows and have_slots >= slots and rows * slots * 4 > have_rows * have_slots:
            return None
        if have_rows < rows:
            grown = have_rows + (have_rows + 1) // 2
            if self.max_rows is not None:
                grown = min(grown, self.max_rows)
            if self.max_bytes is not None and slots > 0:
                grown = min(grown, self.max_bytes // (slots * self.slot_bytes))
            rows = max(rows, grown)
        return rows, slots

    def _fit(self, rows: int, slots: int) -> None:
        """Reallocate when the pool lacks rows or slots (`_new_shape`), or when its live
        rows need at most a quarter of what it holds."""
        have_slots = self.num_slots
        if (shape := self._new_shape(rows, slots)) is None:
            return
        rows, slots = shape
        c = self.model.config
        shape = (c.num_layers, rows, c.num_kv_heads, slots, c.head_dim)
        new_k = torch.empty(shape, device=self.model.device, dtype=self.model.dtype)
        new_v = torch.empty(shape, device=self.model.device, dtype=self.model.dtype)
        # A step reads every row of its span up to the longest sequence's keys, masked
        # where a row's sequence is shorter, and a masked NaN would still poison the row:
        # a live row is zero past what it holds (`add` does the same for a new one). A
        # free row's output is dropped, so its slots may hold anything.
        for row, need in list(self._needs.items()):
            kept = min(need, have_slots)
            new_k[:, row, :, :kept] = self.k[:, row, :, :kept]  # type: ignore[index]
            new_v[:, row, :, :kept] = self.v[:, row, :, :kept]  # type: ignore[index]
            new_k[:, row, :, kept:] = 0
            new_v[:, row, :, kept:] = 0
        self.k, self.v = new_k, new_v


def one_call_on(device: torch.device) -> bool:
    """Whether a step runs one masked attention call for a pool's rows on `device`: on
    the CPU (measured: docs/accelerators.md). Elsewhere one unmasked call per sequence,
    as before the pool, until measured there: with a mask, SDPA on CUDA may pick cuDNN,
    which plans every new key count (~1 s each), and a decode step's key count is new at
    every step."""
    return device.type == "cpu"


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def _slots(num_tokens: int, max_new_tokens: int) -> tuple[int, int]:
    """The slots a sequence's row holds at its start and may grow to (`start_sequence`):
    its prompt and room for every produced token but the last (which is never fed), held
    up to the next multiple of SLOT_QUANTUM at first; (0, 0) when it needs no row."""
    if max_new_tokens <= 1:  # nothing is ever fed
        return 0, 0
    limit = num_tokens + max_new_tokens - 1
    return min(limit, _round_up(num_tokens + 1, SLOT_QUANTUM)), limit


@dataclass(eq=False)
class DecodeSequence:
    """One sequence being decoded greedily: a row of a `KVPool` (none when nothing is
    ever fed to it: a one-token answer)."""

    pool: KVPool | None
    row: int
    # Tokens with KV in the cache so far: the slot the next token fed is written to.
    position: int
    # [vocab] logits of the next token (after the prompt, then after each token fed).
    logits: torch.Tensor
    # Most tokens the sequence may produce (its answer limit within the context).
    max_new_tokens: int
    # Slots of the row: the prompt and room for the tokens fed.
    num_slots: int = 0
    # Slots the pool holds for the row now: up to the next multiple of SLOT_QUANTUM, grown
    # by SLOT_QUANTUM as the answer reaches it (`decode_step`), so a large limit reserves
    # nothing up front.
    num_held: int = 0
    # Tokens produced so far (the caller counts them with `produced`).
    num_produced: int = 0
    _release: weakref.finalize | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.pool is not None:
            # The row goes back to the pool when the sequence is closed or dropped.
            self._release = weakref.finalize(self, self.pool.release, self.row)

    def close(self) -> None:
        """Give the row back to the pool (also done when the sequence is dropped)."""
        if self._release is not None:
            self._release()

    @property
    def k(self) -> torch.Tensor:
        """[layers, kv_heads, slots, head_dim]: this sequence's K (a view of its row)."""
        assert self.pool is not None and self.pool.k is not None
        return self.pool.k[:, self.row]

    @property
    def v(self) -> torch.Tensor:
        assert self.pool is not None and self.pool.v is not None
        return self.pool.v[:, self.row]

    def next_token(self) -> int:
        """The greedy choice after what has been fed so far."""
        return int(self.logits.argmax())

    def produced(self) -> None:
        self.num_produced += 1

    @property
    def is_at_limit(self) -> bool:
        return self.num_produced >= self.max_new_tokens

    @property
    def room(self) -> int:
        """Slots left in the row for tokens fed."""
        if self.pool is None or self._release is None or not self._release.alive:
            return 0
        return self.num_slots - self.position


def start_sequence(
    pool: KVPool,
    k: torch.Tensor,
    v: torch.Tensor,
    logits: torch.Tensor,
    max_new_tokens: int,
) -> DecodeSequence:
    """A sequence whose prompt's K/V are k, v [layers, kv_heads, tokens, head_dim], with
    room in `pool` for every produced token but the last (which is never fed).

    The pool holds the row's slots up to the next multiple of SLOT_QUANTUM at first, and
    more as the answer reaches them: every row of a pool has the longest row's slots, so a
    row sized for a large limit up front would make every row that long (8 rows of 8,192
    slots of SmolLM2-135M in float32: 3 GB) however short the answers turn out."""
    position = k.shape[2]
    num_held, num_slots = _slots(position, max_new_tokens)
    if num_slots == 0:
        return DecodeSequence(None, -1, position, logits, max_new_tokens)
    row = pool.add(k, v, num_held, num_slots)
    return DecodeSequence(pool, row, position, logits, max_new_tokens, num_slots, num_held=num_held)


def decode_step(model: Llama, sequences: Sequence[DecodeSequence], tokens: Sequence[int]) -> None:
    """Feed `tokens[i]` to `sequences[i]` in one batched forward pass: writes each token's
    K/V at its sequence's position, advances the position and sets the new logits. The
    sequences of one pool share one attention call per layer. A sequence at the end of
    its held slots first gets SLOT_QUANTUM more (`KVPool.grow`: the pool reallocates when
    the longest row outgrows it, once per SLOT_QUANTUM tokens).

    Call it under `torch.inference_mode()` when the pools were filled there."""
    if len(sequences) != len(tokens):
        raise ValueError(f"tokens: {len(tokens)} for {len(sequences)} sequences")
    if not sequences:
        return
    seen: set[DecodeSequence] = set()  # sequences compare by identity
    for i, sequence in enumerate(sequences):
        if sequence.room < 1:
            raise ValueError(f"sequences[{i}]: the KV cache is full at {sequence.position}")
        # Given twice, a sequence would advance two slots for the one written: later steps
        # would read the skipped slot's zeros as a key.
        if sequence in seen:
            raise ValueError(f"sequences[{i}]: given twice; feed each sequence one token a step")
        seen.add(sequence)
    groups: dict[KVPool, list[int]] = {}  # pools compare by identity
    for i, sequence in enumerate(sequences):
        assert sequence.pool is not None
        groups.setdefault(sequence.pool, []).append(i)
    locks = [pool.lock for pool in sorted(groups, key=id)]  # one order: no deadlock
    for lock in locks:
        lock.acquire()
    try:
        for sequence in sequences:
            if sequence.position >= sequence.num_held:
                num_held = min(sequence.num_slots, sequence.position + SLOT_QUANTUM)
                sequence.pool.grow(sequence.row, num_held)  # type: ignore[union-attr]
                sequence.num_held = num_held
        _step(model, sequences, tokens, list(groups.items()))
    finally:
        for lock in locks:
            lock.release()


def _step(
    model: Llama,
    sequences: Sequence[DecodeSequence],
    tokens: Sequence[int],
    groups: list[tuple[KVPool, list[int]]],
) -> None:
    device = model.device
    positions = torch.tensor([s.position for s in sequences], dtype=torch.int64, device=device)
    rope = model.rope(positions)
    h = model.embed(torch.tensor(list(tokens), dtype=torch.int64, device=device))
    batches = [
        _PoolBatch.of(model, pool, [sequences[i] for i in members], members, len(sequences))
        for pool, members in groups
    ]
    for layer in range(model.num_layers):
        q, k, v = model.qkv(layer, h, rope)  # q [heads, B, d]; k, v [kv_heads, B, d]
        outputs = [batch.attend(layer, q, k, v) for batch in batches]
        if len(batches) == 1 and batches[0].order is None:
            attn = outputs[0]
        else:
            attn = torch.empty_like(q)
            for batch, out in zip(batches, outputs, strict=True):
                attn[:, batch.indices] = out
        h = model.finish_layer(layer, h, attn)
    logits = model.logits(h)
    for row, sequence in enumerate(sequences):
        sequence.logits = logits[row]
        sequence.position += 1


@dataclass
class _PoolBatch:
    """The sequences of one pool in a step: their rows, the span of rows one attention
    call reads, and the key mask of that span (built once per step)."""

    pool: KVPool
    indices: list[int]  # the sequences' places in the step's batch
    # indices on the device; None when they are 0..B-1 (the step's whole batch, in order)
    order: torch.Tensor | None
    rows: torch.Tensor  # [n] pool rows, in the order of indices
    positions: torch.Tensor  # [n] the slot each new token's K/V goes to
    first_row: int
    span: int  # rows first_row .. first_row + span - 1 are read
    num_keys: int  # keys read per row: the longest sequence's, its new token included
    places: torch.Tensor | None  # [n] the sequences' rows within the span (None: all, in order)
    mask: torch.Tensor | None  # [span, 1, 1, num_keys] additive; None when every row sees all
    host_rows: list[int]  # rows and key counts, for one call per sequence
    host_ends: list[int]
    is_one_call: bool  # one attention call for the span, else one per sequence

    @classmethod
    def of(
        cls,
        model: Llama,
        pool: KVPool,
        members: list[DecodeSequence],
        indices: list[int],
        batch_size: int,
    ) -> _PoolBatch:
        device = model.device
        rows = [s.row for s in members]
        first, span = min(rows), max(rows) - min(rows) + 1
        ends = [s.position + 1 for s in members]
        num_keys = max(ends)
        contiguous = rows == list(range(first, first + span))
        # Rows of the span outside this batch (free, or decoding in another call) see
        # key 0 only: finite, read and dropped.
        row_ends = [1] * span
        for row, end in zip(rows, ends, strict=True):
            row_ends[row - first] = end
        mask = None
        is_one_call = span > 1 and one_call_on(device)
        if is_one_call and min(row_ends) < num_keys:
            visible = (
                torch.arange(num_keys, device=device)[None, :]
                < torch.tensor(row_ends, device=device)[:, None]
            )
            mask = torch.zeros(visible.shape, dtype=model.dtype, device=device)
            mask = mask.masked_fill_(~visible, float("-inf"))[:, None, None, :]
        return cls(
            pool=pool,
            indices=indices,
            order=None
            if indices == list(range(batch_size))
            else torch.tensor(indices, device=device),
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            positions=torch.tensor([s.position for s in members], dtype=torch.int64, device=device),
            first_row=first,
            span=span,
            num_keys=num_keys,
            places=None if contiguous else torch.tensor([r - first for r in rows], device=device),
            mask=mask,
            host_rows=rows,
            host_ends=ends,
            is_one_call=is_one_call,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the batch's new K/V rows and attend its queries: q [heads, B, d] (the
        whole step's), k, v [kv_heads, B, d] -> [heads, n, d] for this batch's sequences."""
        assert self.pool.k is not None and self.pool.v is not None
        pool_k, pool_v = self.pool.k[layer], self.pool.v[layer]  # [rows, kv_heads, slots, d]
        if self.order is not None:
            q, k, v = q[:, self.order], k[:, self.order], v[:, self.order]
        pool_k[self.rows, :, self.positions] = k.transpose(0, 1)
        pool_v[self.rows, :, self.positions] = v.transpose(0, 1)
        lo, hi, n = self.first_row, self.first_row + self.span, self.num_keys
        keys, values = pool_k[lo:hi, :, :n], pool_v[lo:hi, :, :n]
        if self.span == 1:
            return attend_one_query(q, keys[0], values[0])
        if not self.is_one_call:
            outputs = [
                attend_one_query(q[:, i : i + 1], pool_k[row, :, :end], pool_v[row, :, :end])
                for i, (row, end) in enumerate(zip(self.host_rows, self.host_ends, strict=True))
            ]
            return torch.cat(outputs, dim=1)
        heads, batch, d = q.shape
        kv_heads = keys.shape[1]
        # [B, heads, d] -> [B, kv_heads, group, d]: a KV head's query heads as its queries.
        grouped = q.transpose(0, 1).reshape(batch, kv_heads, heads // kv_heads, d)
        if self.places is not None:
            spread = grouped.new_zeros(self.span, *grouped.shape[1:])
            spread[self.places] = grouped
            grouped = spread
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=self.mask)
        if self.places is not None:
            out = out[self.places]
        return out.reshape(batch, heads, d).transpose(0, 1)
