"""Per-segment KV storage: the entry type, the store protocol and a local LRU tier (with
frequency admission when asked: `holeblend_runtime.kv.admission`)."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from holeblend_runtime.kv.admission import FrequencyAdmission


@dataclass(frozen=True)
class SegmentKV:
    """The KV cache of one segment, for every layer."""

    # The segment key (see `segments.segment_key`).
    key: str
    # [num_layers, num_kv_heads, num_tokens, head_dim], K already rotated at `positions`.
    k: torch.Tensor
    # [num_layers, num_kv_heads, num_tokens, head_dim].
    v: torch.Tensor
    # [num_tokens] int64: the RoPE positions K was rotated at (needed to re-rotate).
    positions: torch.Tensor
    # The model the KV was computed with; a reader checks it before trusting the tensors.
    model_id: str
    # Whether every K and V value is finite, once a store has checked (LocalKVStore does
    # on every put, where the KV was computed: on an accelerator that is cheap, on the
    # host a reader would pay it per reuse); None: unchecked, the reader checks.
    is_finite: bool | None = None

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("key: must not be empty")
        if self.k.dim() != 4:
            raise ValueError(
                f"k: expected 4 dims [layers, heads, tokens, head_dim], got {tuple(self.k.shape)}"
            )
        if self.v.shape != self.k.shape:
            raise ValueError(f"v: shape {tuple(self.v.shape)} differs from k {tuple(self.k.shape)}")
        if self.v.dtype != self.k.dtype:
            raise ValueError(f"v: dtype {self.v.dtype} differs from k {self.k.dtype}")
        if self.positions.shape != (self.num_tokens,) or self.positions.dtype != torch.int64:
            raise ValueError(
                f"positions: expected int64 of shape ({self.num_tokens},), "
                f"got {self.positions.dtype} {tuple(self.positions.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def num_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.positions.nbytes


class KVStore(Protocol):
    def get(self, key: str) -> SegmentKV | None:
        """The entry, or None on a miss."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[SegmentKV | None]:
        """`get` of each key, in order; one round trip for a remote store."""
        ...

    def put(self, kv: SegmentKV) -> bool:
        """Store `kv`; False when the store will not hold it."""
        ...

    def contains(self, key: str) -> bool:
        """Whether `key` is stored, without counting as a use."""
        ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """`contains` of each key, in order; one round trip for a remote store."""
        ...


class LocalKVStore:
    """In-process KV store with a byte budget and least-recently-used eviction.

    `get` and `put` count as uses; `contains` does not, so a lookup that is never
    followed by a load does not keep an entry alive. Thread-safe: the engine stores
    segments off the request path.
    """

    def __init__(
        self,
        capacity_bytes: int,
        host_memory: bool = False,
        admission: FrequencyAdmission | None = None,
    ) -> None:
        """`host_memory`: keep entries in host memory (pinned when a CUDA device is
        present, so loads copy asynchronously) instead of wherever they were computed
        (an accelerator's memory, where loading them back costs almost nothing).
        `admission`: once full, admit only segments used more often than what they would
        evict (`holeblend_runtime.kv.admission`); None: admit every segment."""
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes: must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.host_memory = host_memory
        self.admission = admission
        self._entries: OrderedDict[str, SegmentKV] = OrderedDict()
        # Finiteness verdicts of stored entries not yet read (0-dim bool tensors where
        # the KV is); `get` reads one into the entry's `is_finite`.
        self._unsettled: dict[str, torch.Tensor] = {}
        self._num_bytes = 0
        self._num_evictions = 0
        self._num_refused = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_evictions(self) -> int:
        return self._num_evictions

    @property
    def num_refused(self) -> int:
        """Segments the admission rule kept out of the tier's main part (they left the
        window, or were refused, with the main part full of more used ones)."""
        return self._num_refused

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> SegmentKV | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                if key in self._unsettled:
                    kv = self._entries[key] = replace(kv, is_finite=bool(self._unsettled.pop(key)))
                self._entries.move_to_end(key)
                if self.admission is not None:
                    self.admission.record(key, len(self._entries), hit=True)
            return kv

    def get_many(self, keys: Sequence[str]) -> list[SegmentKV | None]:
        return [self.get(key) for key in keys]

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def put(self, kv: SegmentKV) -> bool:
        """Store `kv`, evicting least recently used entries (with admission: the windowed
        rule's choice); False if it exceeds the budget or the admission rule keeps it out."""
        if kv.num_bytes > self.capacity_bytes:
            return False
        # The verdict is always taken afresh (an entry copied with new tensors by
        # dataclasses.replace would carry its original's), where the KV is, and without
        # waiting for it: a flag the entry's first `get` reads, by then long computed
        # (a put right after a prefill would otherwise hold the host until the device
        # finished it, and leave the device idle while the host did the rest). A copy
        # into host memory waits for the device anyway: the verdict is read with it.
        flag = _finite_flag(kv)
        if self.host_memory:
            kv = replace(kv, k=_in_host_memory(kv.k), v=_in_host_memory(kv.v), is_finite=bool(flag))
        else:
            kv = replace(kv, is_finite=None)
        with self._lock:
            self._remove(kv.key)
            if self.admission is not None:
                self.admission.record(kv.key, len(self._entries))
                plan = self.admission.evictions(
                    [(key, e.num_bytes) for key, e in self._entries.items()],
                    self._num_bytes, (kv.key, kv.num_bytes), self.capacity_bytes,
                )  # fmt: skip
                if plan is None:
                    self._num_refused += 1
                    return False
                evicted, losers = plan
                for key in evicted:
                    self._num_evictions += self._remove(key)
                self._num_refused += len(losers)
            while self._num_bytes + kv.num_bytes > self.capacity_bytes:
                self._evict_oldest()
            self._entries[kv.key] = kv
            if kv.is_finite is None:
                self._unsettled[kv.key] = flag
            self._num_bytes += kv.num_bytes
            return True

    def remove(self, key: str) -> bool:
        """Drop `key`; False when it was not stored."""
        with self._lock:
            return self._remove(key)

    def keys(self) -> tuple[str, ...]:
        """Stored keys, least recently used first."""
        with self._lock:
            return tuple(self._entries)

    def _remove(self, key: str) -> bool:
        self._unsettled.pop(key, None)
        kv = self._entries.pop(key, None)
        if kv is None:
            return False
        self._num_bytes -= kv.num_bytes
        return True

    def _evict_oldest(self) -> None:
        key, kv = self._entries.popitem(last=False)
        self._unsettled.pop(key, None)
        self._num_bytes -= kv.num_bytes
        self._num_evictions += 1


def dtype_name(dtype: torch.dtype) -> str:
    """The name blend.json, segment keys and blob headers use for a KV dtype ("float32")."""
    return str(dtype).removeprefix("torch.")


def _in_host_memory(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cpu" and (tensor.is_pinned() or not torch.cuda.is_available()):
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    return host.copy_(tensor)


def finite_flags(entries: Sequence[SegmentKV]) -> list[bool]:
    """Whether each entry's K and V are all finite. Entries on one device are checked
    together, where they are: the largest magnitude of every K and V in one
    multi-tensor kernel (NaN or inf if any value is), and one read per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, entry in enumerate(entries):
        by_device.setdefault(entry.k.device, []).append(i)
    flags = [True] * len(entries)
    for indexes in by_device.values():
        tensors = [t for i in indexes for t in (entries[i].k, entries[i].v)]
        checked = _finite_peaks(tensors).view(-1, 2).all(dim=1).tolist()
        for i, is_finite in zip(indexes, checked, strict=True):
            flags[i] = is_finite
    return flags


def _finite_flag(entry: SegmentKV) -> torch.Tensor:
    """Whether the entry's K and V are all finite: a 0-dim bool tensor where they are,
    not read (no wait for the device)."""
    return _finite_peaks([entry.k, entry.v]).all()


def _finite_peaks(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether each tensor's values are all finite, as one bool tensor (not read)."""
    wide = [i for i, t in enumerate(tensors) if t.dtype not in _FLOAT8]
    # The largest magnitude of each wide tensor (NaN or inf if any value is), one kernel.
    peaks = torch._foreach_norm([tensors[i] for i in wide], float("inf")) if wide else []
    if len(wide) == len(tensors):
        return torch.isfinite(torch.stack(peaks))
    by_index = dict(zip(wide, peaks, strict=True))
    # float8 has no reductions; its only non-finite value is NaN, the bits S1111111.
    return torch.stack(
        [
            torch.isfinite(by_index[i])
            if i in by_index
            else (t.view(torch.uint8) & 0x7F).ne(0x7F).all()
            for i, t in enumerate(tensors)
        ]
    )


# The float8 dtype a tier may hold KV in: no infinity, NaN is S1111111, finite to +-448.
_FLOAT8 = (torch.float8_e4m3fn,)


def narrowed(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in the narrower `dtype` a tier holds KV in. A value beyond the dtype's
    range becomes non-finite, so that the entry is refused on load and computed afresh:
    float16 and bfloat16 round it to inf themselves, while torch's conversion to
    float8_e4m3fn (no inf) would saturate it at +-448, a wrong value nobody could see."""
    if dtype in _FLOAT8:
        largest = torch.finfo(dtype).max
        if tensor.device.type != "cpu":  # no wait for the device: mark in place of reading
            tensor = tensor.masked_fill(tensor.abs() > largest, float("nan"))
        else:  # one pass reads the range; a copy only where a value is beyond it
            low, high = torch.aminmax(tensor)
            if not -largest <= low.item() <= high.item() <= largest:  # NaN: not either
                tensor = tensor.masked_fill(tensor.abs() > largest, float("nan"))
    return tensor.to(dtype)


def widened(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stored `tensor` back in the model's wider `dtype`, exactly. From float8 on the
    CPU through a table of its 256 values (a third of the time of torch's conversion
    there: 0.8 against 3.0 ms for a 200-token segment of SmolLM2 on 2 threads)."""
    if tensor.dtype not in _FLOAT8 or tensor.device.type != "cpu":
        return tensor.to(dtype)
    table = _float8_table(tensor.dtype, dtype)
    codes = tensor.contiguous().view(torch.uint8).reshape(-1).int()
    return torch.index_select(table, 0, codes).view(tensor.shape)


@functools.cache
def _float8_table(stored: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(stored).to(dtype)
