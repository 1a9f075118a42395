"""A KV tier in a directory: one safetensors file per segment key, shared by processes.

vLLM runs its scheduler and its workers in different processes; both see the same
directory (on a pod, a memory-backed volume of its own), so the scheduler's lookup and the
worker's load agree without a server. Implements `KVStore`:

1. `put` writes to a temporary file (`.<key>.<random>.partial`) and renames it, so readers
   never see half a file. A writer killed meanwhile leaves its temporary file behind: the
   byte budget counts temporary files, and those older than `STALE_PARTIAL_S` (no writer
   takes that long; the writer is gone) are removed when a store opens the directory and
   after each `put`, earlier versions' (`tmp*.tmp`, safetensors' `.tmp*`) too. A writer
   that is still writing, in this process or another sharing the directory, keeps its
   file.
2. `get` reads the file once, header and tensors through one `safe_open`, and checks it; a file
   that cannot be parsed (a corrupt blob) is removed and reported as a miss, so serving
   falls back to computing the segment (a read-only directory keeps it; there a hit does
   not refresh the file's time, and is served all the same). A file removed by another
   writer's eviction after it was read is a hit all the same: the entry is in memory; one
   removed or replaced while it was read is a miss, not a corrupt file.
   Whether the values are finite is checked once, by `put`, and kept in the file's
   metadata (`SegmentKV.is_finite`), so readers do not scan every value on every reuse.
3. The byte budget is kept by removing the least recently used files (a hit refreshes
   the file's modification time) before each `put` writes (room for the new file) and
   after it (files other processes wrote meanwhile). A volume that fills up before the
   budget does (ENOSPC: a tmpfs smaller than the budget, or shared with other files)
   costs older segments until the new one fits; one that does not fit the emptied
   volume is not stored here (`num_write_failures`, which also counts the writes that
   raised: a directory removed or unwritable), and the caller goes on (the shared
   tier is still written). With
   an admission policy
   (`holeblend_runtime.kv.admission`), a `put` into a full directory first asks whether
   the segment may evict the files it would; a refused segment is not written. The policy
   counts the uses of the process that reads and writes (a vLLM pod's worker), not those
   of processes that only look up.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from fnmatch import fnmatch
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from holeblend_runtime.kv.admission import FrequencyAdmission
from holeblend_runtime.kv.store import SegmentKV, finite_flags

log = logging.getLogger(__name__)

_SUFFIX = ".safetensors"
# Whether every K and V value is finite, checked on `put` (files written before it lack it:
# their reader checks).
_FINITE_KEY = "is_finite"
_FINITE = {"true": True, "false": False}
_PARTIAL = ".partial"
# Seconds after which a temporary file is taken as left by a writer that died (a write
# of the largest segment takes well under a second on a tmpfs).
STALE_PARTIAL_S = 60.0
# A full volume (tmpfs at its size limit, a quota): evict and retry once, then skip the
# segment; any other write error is raised.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Room beyond a file's bytes its write needs on a volume (block rounding, metadata).
_SLACK_BYTES = 64 * 1024
# Temporary files of earlier versions: their own (`mkstemp`) and safetensors' `save_file`'s.
_LEGACY_TEMPORARY = ("tmp*.tmp", ".tmp*")


class DirectoryKVStore:
    """Byte-budgeted segment KV files under `root` (created if missing)."""

    def __init__(
        self,
        root: Path | str,
        capacity_bytes: int,
        admission: FrequencyAdmission | None = None,
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes: must be >= 1, got {capacity_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.admission = admission
        self.num_corrupt = 0
        # Segments the admission rule kept out.
        self.num_refused = 0
        # Segments not written because the volume was full even after evicting for them.
        self.num_write_failures = 0
        self._temporary_bytes(remove_stale=True)
        # Files held when last counted (the admission's halving period; no listing per hit).
        self._num_files = len(self) if admission is not None else 0

    def path(self, key: str) -> Path:
        if not key.isalnum():
            raise ValueError(f"key: expected a hex digest, got {key!r}")
        return self.root / f"{key}{_SUFFIX}"

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(key) for key in keys]

    def get(self, key: str) -> SegmentKV | None:
        path = self.path(key)
        identity = _identity(path)
        if identity is None:
            return None
        try:
            tensors, metadata = _read(path)
            kv = SegmentKV(
                metadata["key"], tensors["k"], tensors["v"], tensors["positions"],
                metadata["model_id"], is_finite=_FINITE.get(metadata.get(_FINITE_KEY, "")),
            )  # fmt: skip
        except FileNotFoundError:
            return None
        except Exception as error:  # any parse failure means the blob is unusable
            if _identity(path) != identity:
                # Removed or replaced by another process while it was read (safetensors
                # opens the file by name twice): a miss, and a replacement stays.
                return None
            log.warning("removing corrupt KV file %s: %s", path, error)
            self.num_corrupt += 1
            with contextlib.suppress(OSError):  # a read-only directory keeps it: a miss still
                path.unlink(missing_ok=True)
            return None
        # Evicted since it was read, or in a directory that cannot be written (read-only):
        # the hit stands, only its recency is not refreshed.
        with contextlib.suppress(OSError):
            os.utime(path)
        if self.admission is not None:
            self.admission.record(key, self._num_files, hit=True)
        return kv

    def get_many(self, keys: Sequence[str]) -> list[SegmentKV | None]:
        return [self.get(key) for key in keys]

    def put(self, kv: SegmentKV) -> bool:
        if kv.num_bytes > self.capacity_bytes:
            return False
        tensors = {"k": kv.k.contiguous(), "v": kv.v.contiguous(), "positions": kv.positions}
        # Checked here, where the entry is written (off the request's path behind an
        # AsyncKVStore), taken afresh like LocalKVStore's: a reader then trusts it.
        is_finite = finite_flags([kv])[0]
        metadata = {"key": kv.key, "model_id": kv.model_id, _FINITE_KEY: str(is_finite).lower()}
        data = save({n: t.detach().cpu() for n, t in tensors.items()}, metadata)
        if len(data) > self.capacity_bytes:
            # The tensors fit the budget, the file with its header does not: making room
            # would remove every other file and then the new one.
            return False
        evicted = self._admission_evictions(kv)
        if evicted is None:
            self.num_refused += 1
            return False
        # Room is made before the write, so the directory stays within its budget (the
        # volume under it is sized for the budget plus little more).
        try:
            for key in evicted:
                self.remove(key)
            self._evict(incoming=(kv.key, len(data)))
            is_written = self._write_making_room(kv.key, data)
        except OSError:
            # A directory that vanished or cannot be written: the caller's to handle (a
            # tiered store logs it and writes the shared tier), counted here all the same.
            self.num_write_failures += 1
            raise
        if not is_written:
            self.num_write_failures += 1
            log.warning(
                "KV directory %s is full; segment %s not stored here (files hold %d bytes of "
                "the budget's %d: the volume is smaller than the budget or shared with other "
                "files)",
                self.root, kv.key, self.num_bytes, self.capacity_bytes,
            )  # fmt: skip
            return False
        self._evict()
        return True

    def _write_making_room(self, key: str, data: bytes) -> bool:
        """Write `data` under `key`; while the volume is full (ENOSPC, a quota), remove the
        least recently used other segments (at least one per try, until the volume reports
        room for `data`) and write again. False when none is left to remove. Any other
        write error is raised."""
        while True:
            try:
                self._write(key, data)
                return True
            except OSError as error:
                if error.errno not in _FULL_ERRNOS:
                    raise
            if not self._free_volume(key, len(data)):
                return False

    def _free_volume(self, key: str, num_bytes: int) -> bool:
        """Remove least recently used segments other than `key`: at least one, then until
        the volume has `num_bytes` available (plus `_SLACK_BYTES` for block rounding).
        False when there was none to remove."""
        files = [p for p in self._files_by_age() if p.name != self.path(key).name]
        for i, path in enumerate(files):
            path.unlink(missing_ok=True)
            if i == len(files) - 1 or self._available_bytes() >= num_bytes + _SLACK_BYTES:
                return True
        return False

    def _available_bytes(self) -> int:
        stats = os.statvfs(self.root)
        return stats.f_bavail * stats.f_frsize

    def _write(self, key: str, data: bytes) -> None:
        """`data` under `key`'s file name through a temporary file (removed on failure)."""
        handle, temporary = tempfile.mkstemp(dir=self.root, prefix=f".{key}.", suffix=_PARTIAL)
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(temporary, self.path(key))
        finally:
            Path(temporary).unlink(missing_ok=True)

    def _admission_evictions(self, kv: SegmentKV) -> list[str] | None:
        """Count the use; the files the admission rule evicts for `kv` (their sizes less
        the new file's few header bytes; None: `kv` is refused). Without a rule, none:
        `_evict` removes the least recently used before the write."""
        if self.admission is None:
            return []
        entries = [(p.name.removesuffix(_SUFFIX), _size(p)) for p in self._files_by_age()]
        self._num_files = len(entries)
        self.admission.record(kv.key, len(entries))
        entries = [(key, size) for key, size in entries if key != kv.key]  # a replacement
        plan = self.admission.evictions(
            entries, sum(size for _, size in entries), (kv.key, kv.num_bytes),
            self.capacity_bytes,
        )  # fmt: skip
        if plan is None:
            return None
        evicted, losers = plan
        self.num_refused += len(losers)
        return evicted

    def remove(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        """Stored keys, least recently used first."""
        return [p.name.removesuffix(_SUFFIX) for p in self._files_by_age()]

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob(f"*{_SUFFIX}"))

    @property
    def num_bytes(self) -> int:
        """Bytes of the stored files and of the temporary files being written."""
        stored = sum(_size(p) for p in self.root.glob(f"*{_SUFFIX}"))
        return stored + self._temporary_bytes()

    def _files_by_age(self) -> list[Path]:
        # A file another process removes between the listing and its stat has no time: it
        # is left out before sorting (None does not order against a time).
        aged = [(p, _mtime(p)) for p in self.root.glob(f"*{_SUFFIX}")]
        files = [(p, mtime) for p, mtime in aged if mtime is not None]
        return [p for p, _ in sorted(files, key=lambda f: f[1])]

    def _evict(self, incoming: tuple[str, int] | None = None) -> None:
        """Remove stale temporary files, then the least recently used files until the
        stored files, the temporary files being written and `incoming` (a key about to be
        written and its file's bytes; the file it replaces does not count) fit the budget."""
        temporary = self._temporary_bytes(remove_stale=True)
        files = self._files_by_age()
        if incoming is not None:
            files = [p for p in files if p.name != self.path(incoming[0]).name]
        # Each file's size read once: one that another process removes meanwhile (its own
        # eviction) has freed its bytes, and is no reason to remove one more.
        sized = [(p, _size(p)) for p in files]
        total = temporary + sum(n for _, n in sized) + (incoming[1] if incoming else 0)
        for path, num_bytes in sized:
            if total <= self.capacity_bytes:
                break
            total -= num_bytes
            path.unlink(missing_ok=True)

    def _temporary_bytes(self, remove_stale: bool = False) -> int:
        """Bytes of the temporary files in the directory (one listing). With `remove_stale`,
        those last written over `STALE_PARTIAL_S` ago, left by writers killed during a
        `put`, are removed first and not counted."""
        oldest = time.time_ns() - int(STALE_PARTIAL_S * 1e9)
        total = 0
        with os.scandir(self.root) as entries:
            for entry in entries:
                if not _is_temporary(entry.name):
                    continue
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # renamed or removed meanwhile
                if not entry.is_file(follow_symlinks=False):
                    continue
                if remove_stale and stat.st_mtime_ns < oldest:
                    log.info("removing a temporary KV file a writer left: %s", entry.path)
                    Path(entry.path).unlink(missing_ok=True)
                    continue
                total += stat.st_size
        return total


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of one file, read through one `safe_open` handle
    (which opens the file by name twice, its header and then torch's storage: a file
    removed or replaced in between may fail to read; `get` tells that from a corrupt file)."""
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensors(), dict(handle.metadata() or {})


def _is_temporary(name: str) -> bool:
    return name.endswith(_PARTIAL) or any(fnmatch(name, p) for p in _LEGACY_TEMPORARY)


def _identity(path: Path) -> tuple[int, int] | None:
    """The file under `path` (device, inode); None when there is none."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
