"""The directory tier on a volume of bounded size (a pod's memory-backed emptyDir): a put
never takes the directory over its budget, and a volume that fills up first costs older
segments, not the request or the shared tier."""

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from prometheus_client import CollectorRegistry

from holeblend_runtime.kv import directory
from holeblend_runtime.kv.admission import AdmissionMetrics
from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.kv.store import SegmentKV


def _entry(key: str, num_tokens: int = 64) -> SegmentKV:
    k = torch.randn(2, 2, num_tokens, 16)
    return SegmentKV(key, k, k.clone(), torch.arange(num_tokens, dtype=torch.int64), "m")


def _file_bytes(store: DirectoryKVStore) -> int:
    return sum(p.stat().st_size for p in store.root.iterdir())


def test_a_put_makes_room_before_it_writes_so_the_directory_never_exceeds_its_budget(
    tmp_path, monkeypatch
):
    """The volume under the directory is sized for the budget: a put that wrote first and
    evicted after held one segment more than the budget on it, which a full tmpfs refuses."""
    probe = DirectoryKVStore(tmp_path / "probe", 1 << 30)
    probe.put(_entry("p0"))
    size = probe.num_bytes
    store = DirectoryKVStore(tmp_path / "kv", 3 * size)
    seen: list[int] = []
    replace = os.replace

    def replace_and_measure(source, target):
        replace(source, target)
        seen.append(_file_bytes(store))

    monkeypatch.setattr(directory.os, "replace", replace_and_measure)
    for i in range(8):
        assert store.put(_entry(f"k{i}"))
    assert len(seen) == 8 and max(seen) <= store.capacity_bytes, seen
    assert store.keys() == ["k5", "k6", "k7"]


def test_a_segment_whose_tensors_fit_the_budget_but_not_its_file_is_refused_and_evicts_nothing(
    tmp_path,
):
    """The budget counts files, header included: a segment sized by its tensors alone
    passed the check, emptied the directory to make room and was then removed itself."""
    big = _entry("big", num_tokens=256)
    store = DirectoryKVStore(tmp_path, big.num_bytes)
    for key in ("a1", "a2"):
        assert store.put(_entry(key, num_tokens=4))
    assert not store.put(big)
    assert sorted(store.keys()) == ["a1", "a2"] and not store.contains("big")


def test_a_full_volume_evicts_older_segments_once_then_gives_up_without_raising(
    tmp_path, monkeypatch
):
    """ENOSPC before the budget is reached (the volume is shared, or smaller than the
    budget): the put evicts the least recently used segments, one more per try, and writes
    again; a segment the emptied volume cannot hold is skipped and counted, nothing left
    behind; another write error is the caller's."""
    store = DirectoryKVStore(tmp_path, 1 << 30)
    for key in ("a1", "a2", "a3"):
        assert store.put(_entry(key))
    write = DirectoryKVStore._write
    volume_bytes = 2 * store.num_bytes // 3  # room for two segments
    attempts: list[str] = []

    def write_on_a_small_volume(self, key, data):
        attempts.append(key)
        if _file_bytes(self) + len(data) > volume_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(self, key, data)

    monkeypatch.setattr(DirectoryKVStore, "_write", write_on_a_small_volume)
    assert store.put(_entry("a4"))
    assert attempts == ["a4"] * 3 and store.keys() == ["a3", "a4"]
    assert store.num_write_failures == 0

    # A segment the volume cannot hold even emptied of the others: skipped, not raised.
    volume_bytes = store.num_bytes // 4
    assert not store.put(_entry("big", num_tokens=256))
    assert store.num_write_failures == 1 and not store.contains("big")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    # Exported with the store's other counters (a vLLM pod's /metrics).
    registry = CollectorRegistry()
    registry.register(AdmissionMetrics(store))
    assert registry.get_sample_value("holeblend_kv_store_write_failures_total") == 1
    assert registry.get_sample_value("holeblend_kv_store_corrupt_total") == 0

    def read_only(self, key, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(DirectoryKVStore, "_write", read_only)
    with pytest.raises(OSError, match="Read-only"):  # not a full volume: the caller decides
        store.put(_entry("a5"))


def test_a_write_that_raises_is_counted_with_the_full_volumes_failures(tmp_path):
    """A directory removed under the pod (a wiped volume) makes every put raise; a tiered
    store logs that and goes on to the shared tier, so the count is the one sign of it on
    /metrics (it stayed 0)."""
    from holeblend_runtime.kv.tiers import KVLayout, TieredKVStore

    store = DirectoryKVStore(tmp_path / "kv", 1 << 30)
    assert store.put(_entry("a1"))
    shutil.rmtree(store.root)
    with pytest.raises(FileNotFoundError):
        store.put(_entry("a2"))
    tiered = TieredKVStore(store, KVLayout("m", "float32", 2, 2, 16))
    assert not tiered.put(_entry("a3"))
    registry = CollectorRegistry()
    registry.register(AdmissionMetrics(store))
    assert registry.get_sample_value("holeblend_kv_store_write_failures_total") == 2


_ON_A_TMPFS = textwrap.dedent(
    """
    import sys, torch
    from holeblend_runtime.kv.directory import DirectoryKVStore
    from holeblend_runtime.kv.store import SegmentKV

    def entry(key, num_tokens=64):
        k = torch.randn(2, 2, num_tokens, 16)
        return SegmentKV(key, k, k.clone(), torch.arange(num_tokens), "m")

    root, volume = sys.argv[1], int(sys.argv[2])
    # The budget is three times the volume: the volume fills up first.
    store = DirectoryKVStore(root, 3 * volume)
    stored = [store.put(entry(f"k{i}")) for i in range(40)]
    assert all(stored), stored
    assert store.contains("k39") and store.get("k39") is not None
    held = len(store)
    # Within the budget, beyond the volume: not stored, and not raised.
    assert not store.put(entry("big", num_tokens=1024))
    print(held, store.num_write_failures, store.num_bytes <= volume)
    """
)


def test_on_a_real_tmpfs_smaller_than_the_budget_every_segment_is_stored(tmp_path):
    """A real size-limited tmpfs (the kernel's ENOSPC, as a pod's emptyDir gives it), in a
    user namespace of its own: forty segments through a volume that holds a few."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is missing")
    mount = tmp_path / "volume"
    mount.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(_ON_A_TMPFS)
    volume = 256 * 1024
    command = (
        f"mount -t tmpfs -o size={volume} tmpfs {mount} && "
        f"exec {sys.executable} {script} {mount} {volume}"
    )
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses user namespaces: {probe.stderr.decode().strip()}")
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    held, failures, fits = done.stdout.split()
    assert int(held) >= 2 and int(failures) == 1 and fits == "True"


_READ_ONLY = textwrap.dedent(
    """
    import subprocess, sys, torch
    from holeblend_runtime.kv.directory import DirectoryKVStore
    from holeblend_runtime.kv.store import SegmentKV

    root = sys.argv[1]
    k = torch.randn(2, 2, 8, 16)
    store = DirectoryKVStore(root, 1 << 24)
    assert store.put(SegmentKV("a1", k, k.clone(), torch.arange(8), "m"))
    (store.root / "bad.safetensors").write_bytes(b"not a safetensors file")
    subprocess.run(["mount", "-o", "remount,ro", root], check=True)
    found = store.get("a1")
    assert found is not None and torch.equal(found.k, k)
    assert store.get("bad") is None and store.num_corrupt == 1
    print("served")
    """
)


def test_a_read_only_directory_serves_its_segments_and_misses_its_corrupt_files(tmp_path):
    """A hit refreshes its file's time and a corrupt file is removed: on a read-only
    volume both raised EROFS out of `get`, failing the load instead of serving the
    segment (or computing it)."""
    mount = tmp_path / "kv"
    mount.mkdir()
    script = tmp_path / "read_only.py"
    script.write_text(_READ_ONLY)
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses user namespaces: {probe.stderr.decode().strip()}")
    command = f"mount -t tmpfs -o size=1m tmpfs {mount} && exec {sys.executable} {script} {mount}"
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["served"]
