"""The directory tier under the other processes that share it (vLLM's tensor-parallel
workers and its scheduler): a file another process evicts while this one lists or reads
the directory is gone, neither an error nor a corrupt file."""

import os

import torch

from holeblend_runtime.kv import directory
from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.kv.store import SegmentKV


def _entry(key: str, num_tokens: int = 64) -> SegmentKV:
    k = torch.randn(2, 2, num_tokens, 16)
    return SegmentKV(key, k, k.clone(), torch.arange(num_tokens, dtype=torch.int64), "m")


def test_a_file_evicted_between_the_listing_and_its_stat_does_not_fail_the_put(
    tmp_path, monkeypatch
):
    """Another worker evicts a file after this one listed the directory and before it read
    the file's time: the put goes on without it (it raised TypeError, ordering None
    against a time, and the tiered store then skipped the shared tier too)."""
    store = DirectoryKVStore(tmp_path, 1 << 30)
    for key in ("a1", "a2", "a3"):
        assert store.put(_entry(key))
    mtime = directory._mtime
    evicted: list[str] = []

    def evicted_meanwhile(path):
        if path.name == "a2.safetensors" and not evicted:
            path.unlink()  # the other process's eviction
            evicted.append(path.name)
        return mtime(path)

    monkeypatch.setattr(directory, "_mtime", evicted_meanwhile)
    assert store.put(_entry("a4"))
    assert evicted == ["a2.safetensors"]
    assert store.keys() == ["a1", "a3", "a4"]


def test_a_file_evicted_while_it_is_read_is_a_miss_not_a_corrupt_file(tmp_path, monkeypatch):
    """safetensors opens the file by name twice (its header, then torch's storage): one
    evicted in between is a miss, not counted or logged as corrupt; one replaced in between
    by another writer's new file is a miss too, and that new file stays."""
    store = DirectoryKVStore(tmp_path, 1 << 30)
    assert store.put(_entry("a1")) and store.put(_entry("a2"))
    from_file = torch.UntypedStorage.from_file
    other = DirectoryKVStore(tmp_path / "other", 1 << 30)
    assert other.put(_entry("a2", num_tokens=8))  # another version, of another size

    def evicted_meanwhile(filename, *args, **kwargs):
        if filename.endswith("a1.safetensors"):
            os.unlink(filename)
        elif filename.endswith("a2.safetensors"):
            os.replace(other.path("a2"), filename)
        return from_file(filename, *args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "from_file", evicted_meanwhile)
    assert store.get("a1") is None
    assert store.get("a2") is None
    assert store.num_corrupt == 0
    monkeypatch.setattr(torch.UntypedStorage, "from_file", from_file)
    found = store.get("a2")
    assert found is not None and found.num_tokens == 8

    # A file that is corrupt all along still is: removed, counted.
    store.path("a3").write_bytes(b"not a safetensors file")
    assert store.get("a3") is None and store.num_corrupt == 1 and not store.contains("a3")


def test_a_file_another_writer_evicts_first_counts_as_freed_not_as_a_reason_for_one_more(
    tmp_path, monkeypatch
):
    """Two tensor-parallel ranks make room at once and both start with the least recently
    used file: the one that finds it gone has its room all the same, and evicts no more
    (it evicted the next file too, so every concurrent put cost one segment more)."""
    probe = DirectoryKVStore(tmp_path / "probe", 1 << 30)
    probe.put(_entry("p0"))
    store = DirectoryKVStore(tmp_path / "kv", 3 * probe.num_bytes)
    for key in ("a1", "a2", "a3"):
        assert store.put(_entry(key))
    size = directory._size
    taken: list[str] = []

    def evicted_by_the_other_rank(path):
        num_bytes = size(path)
        if path.name == "a1.safetensors" and not taken:
            path.unlink()  # measured here, then the other rank's eviction removes it
            taken.append(path.name)
        return num_bytes

    monkeypatch.setattr(directory, "_size", evicted_by_the_other_rank)
    assert store.put(_entry("a4"))
    assert taken == ["a1.safetensors"]
    assert store.keys() == ["a2", "a3", "a4"]


def test_corrupt_files_are_exported_with_the_tiers_other_counters(tmp_path):
    from prometheus_client import CollectorRegistry

    from holeblend_runtime.kv.admission import AdmissionMetrics

    store = DirectoryKVStore(tmp_path, 1 << 30)
    store.path("bad").write_bytes(b"not a safetensors file")
    assert store.get("bad") is None
    registry = CollectorRegistry()
    registry.register(AdmissionMetrics(store))
    assert registry.get_sample_value("holeblend_kv_store_corrupt_total") == 1
    assert registry.get_sample_value("holeblend_kv_store_write_failures_total") == 0
