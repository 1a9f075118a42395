"""The connector's scheduler side without vLLM: settings, keys, hole-aware planning."""

import logging
import os
import time

import pytest
import torch

from holeblend_contract.blend_settings import BlendSettings, ModelSettings
from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.keys import SegmentKeyer
from holeblend_runtime.blend.reuse import ReuseMode
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.vllm_connector.planning import ReusePlanner
from holeblend_runtime.vllm_connector.settings import RatioSource, load_settings

SEP = 9


def write_settings(path, ratio: float) -> None:
    settings = BlendSettings(model=ModelSettings(name="m"), recompute_ratio=ratio)
    path.write_text(settings.to_json())


class MemoryIndex:
    def __init__(self, keys=(), is_down=False):
        self.keys, self.is_down = set(keys), is_down

    def contains_many(self, keys) -> list[bool]:
        if self.is_down:
            raise ConnectionError("lookup server unreachable")
        return [key in self.keys for key in keys]


def planner(index, selection: str = "kDeviation") -> ReusePlanner:
    keyer = SegmentKeyer("model", "float32", BlendConfig(min_segment_tokens=2, selection=selection))
    return ReusePlanner([SEP], keyer, index)


PROMPT = [1, 2, 3, SEP, 10, 11, 12, SEP, 20, 21, 22, SEP, 30, 31, 32, SEP, 40, 41]


def cached_keys(plan_of_everything, indexes):
    return [plan_of_everything.keys[i] for i in indexes]


def test_a_missing_middle_document_is_a_hole_and_the_documents_after_it_are_reused():
    everything = planner(MemoryIndex()).plan(PROMPT)
    plan = planner(MemoryIndex(cached_keys(everything, [0, 1, 3]))).plan(PROMPT)
    assert plan.reuse.mode is ReuseMode.HOLE
    assert plan.reuse.hole_ranges == ((8, 11),)
    assert plan.num_covered_tokens == 15  # up to the end of the last reused document
    assert plan.missing_segments == (2,)


def test_a_full_hit_leaves_the_question_to_vllm():
    everything = planner(MemoryIndex()).plan(PROMPT)
    plan = planner(MemoryIndex(cached_keys(everything, [0, 1, 2, 3]))).plan(PROMPT)
    assert plan.reuse.mode is ReuseMode.PURE_HIT
    assert plan.num_covered_tokens < len(PROMPT)


def test_a_selection_that_reads_the_question_covers_it_but_not_the_last_token():
    everything = planner(MemoryIndex()).plan(PROMPT)
    cached = cached_keys(everything, [0, 1, 3])
    plan = planner(MemoryIndex(cached), "query:0.5+kDeviation").plan(PROMPT)
    assert plan.reuse.hole_ranges == ((8, 11),)
    assert plan.num_covered_tokens == len(PROMPT) - 1
    missed = planner(MemoryIndex(), "query").plan(PROMPT)
    assert missed.num_covered_tokens == 0  # a full miss covers nothing, question or not


def test_only_a_reused_document_makes_a_request_blended():
    everything = planner(MemoryIndex()).plan(PROMPT)
    system_only = planner(MemoryIndex(cached_keys(everything, [0]))).plan(PROMPT)
    with_documents = planner(MemoryIndex(cached_keys(everything, [0, 1, 3]))).plan(PROMPT)
    reused = system_only.reuse.num_reused_tokens
    assert system_only.num_covered_tokens > 0 and reused == 3
    # The system prompt at position 0 (held in the model's dtype whatever kv.storeDtype
    # says) is full prefill's KV: nothing to score.
    assert not system_only.is_blended(reused)
    assert with_documents.is_blended(with_documents.reuse.num_reused_tokens)
    assert not with_documents.is_blended(0)  # its load failed: vLLM computed it all
    assert not everything.is_blended(0)  # a full miss


def test_an_unreachable_index_plans_a_full_miss_and_says_so():
    plan = planner(MemoryIndex(is_down=True)).plan(PROMPT)
    assert plan.is_lookup_failed
    assert plan.num_covered_tokens == 0
    assert plan.reuse.mode is ReuseMode.FULL_MISS


def test_a_prompt_without_separator_is_not_planned():
    assert planner(MemoryIndex()).plan([1, 2, 3]) is None


@pytest.mark.parametrize("store_dtype", ["auto", "bfloat16"])
def test_keys_match_the_reference_engines(store_dtype):
    engine = BlendEngine.load(blend=BlendConfig(kv_store_dtype=store_dtype))
    prompt = engine.build_prompt("Answer.", [" Doc one is here.", " Doc two is here."], " Q?")
    # As the connector's scheduler side builds it: from the model's dtype.
    keyer = SegmentKeyer.for_model(engine.config.model_id, "float32", engine.blend_config)
    assert keyer.keys(prompt) == engine.segment_keys(prompt)
    assert keyer.kv_dtype == engine.kv_dtype


def test_settings_come_from_blend_json_and_the_ratio_is_live(tmp_path):
    path = tmp_path / "blend.json"
    write_settings(path, 0.15)
    settings = load_settings({"holeblend_config": str(path), "kv_dir": str(tmp_path / "kv")})
    assert settings.blend.ratio == 0.15 and settings.mode == "hole"
    ratio = RatioSource(settings)
    assert ratio.ratio() == 0.15
    write_settings(path, 0.4)
    os.utime(path, ns=(1, 10**18))  # a new stamp even within the clock's resolution
    assert ratio.ratio() == 0.4
    path.write_text("{broken")
    os.utime(path, ns=(1, 2 * 10**18))
    assert ratio.ratio() == 0.4  # the last good value


def test_a_broken_settings_file_is_read_and_reported_once_not_at_every_step(tmp_path, caplog):
    """The scheduler asks for the ratio at every step: a file that does not parse keeps the
    last good values with one warning until it changes, not one warning (and one read) per
    step."""
    path = tmp_path / "blend.json"
    write_settings(path, 0.15)
    ratio = RatioSource(load_settings({"holeblend_config": str(path)}))
    assert ratio.ratio() == 0.15
    path.write_text("{broken")
    os.utime(path, ns=(1, 10**18))
    with caplog.at_level(logging.WARNING, logger="holeblend_runtime.vllm_connector.settings"):
        for _ in range(20):  # vLLM's steps
            assert ratio.ratio() == 0.15
            assert ratio.idle_floor() == (0, 60.0)
    assert len([r for r in caplog.records if "blend.json" in r.getMessage()]) == 1
    write_settings(path, 0.4)
    os.utime(path, ns=(1, 2 * 10**18))
    assert ratio.ratio() == 0.4  # fixed: read at once


def test_the_shadows_idle_floor_is_live_too(tmp_path):
    path = tmp_path / "blend.json"
    path.write_text(BlendSettings(model=ModelSettings(name="m")).to_json())
    settings = load_settings({"holeblend_config": str(path), "kv_dir": str(tmp_path / "kv")})
    live = RatioSource(settings)
    assert live.idle_floor() == (0, 60.0)  # a file without the keys: the budget alone
    floor = BlendSettings(model=ModelSettings(name="m"), shadow_idle_samples=4,
                          shadow_idle_seconds=45)  # fmt: skip
    path.write_text(floor.to_json())
    os.utime(path, ns=(1, 10**18))
    assert live.idle_floor() == (4, 45.0)
    assert load_settings({"holeblend_config": str(path)}).shadow_idle_samples == 4


def test_the_connector_settings_carry_the_model_name_its_keys_name(tmp_path):
    """blend.json's model.name reaches the connector (its keys' model id); no file: none."""
    path = tmp_path / "blend.json"
    path.write_text(BlendSettings(model=ModelSettings(name="org/tuned")).to_json())
    assert load_settings({"holeblend_config": str(path)}).model_name == "org/tuned"
    assert load_settings({}).model_name is None


def test_the_workers_directory_admits_as_blend_json_says_and_the_scheduler_never_refuses(
    tmp_path,
):
    from holeblend_contract.blend_settings import Admission, KVSettings
    from holeblend_runtime.kv.admission import FrequencyAdmission
    from holeblend_runtime.kv.tiers import KVLayout
    from holeblend_runtime.vllm_connector.store import open_store

    path = tmp_path / "blend.json"
    layout = KVLayout("m", "float32", 2, 1, 4)
    for admission, expected in ((None, FrequencyAdmission), (Admission.ALWAYS, type(None))):
        kv = KVSettings() if admission is None else KVSettings(admission=admission)
        path.write_text(BlendSettings(model=ModelSettings(name="m"), kv=kv).to_json())
        settings = load_settings({"holeblend_config": str(path), "kv_dir": str(tmp_path / "kv")})
        assert settings.kv_admission is (admission or Admission.FREQUENCY)
        assert isinstance(open_store(settings, layout, is_worker=True).admission, expected)
        assert open_store(settings, layout, is_worker=False).admission is None


def test_a_zero_local_budget_keeps_nothing_in_the_pods_directory_as_on_holeblend_serve(
    tmp_path,
):
    """blend.kv.localCpuBytes 0 is documented as no tier of the pod's own; the connector
    read it as its 4 GiB default and filled the pod's memory anyway."""
    from holeblend_contract.blend_settings import KVSettings
    from holeblend_runtime.kv.tiers import KVLayout
    from holeblend_runtime.vllm_connector.store import open_store

    path = tmp_path / "blend.json"
    path.write_text(
        BlendSettings(model=ModelSettings(name="m"), kv=KVSettings(local_cpu_bytes=0)).to_json()
    )
    settings = load_settings({"holeblend_config": str(path), "kv_dir": str(tmp_path / "kv")})
    store = open_store(settings, KVLayout("m", "float32", 2, 2, 8), is_worker=True)
    assert not store.put(_directory_entry("ab12", num_tokens=1))
    assert len(store) == 0 and store.num_bytes == 0


def test_a_newer_settings_format_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "blend.json"
    path.write_text('{"formatVersion": 99, "model": {"name": "m"}}')
    with pytest.raises(ValueError, match="formatVersion"):
        load_settings({"holeblend_config": str(path)})


def test_a_misspelt_connector_key_is_named_not_silently_left_at_its_default(caplog):
    with caplog.at_level(logging.WARNING, logger="holeblend_runtime.vllm_connector.settings"):
        settings = load_settings({"lookup_deadline": 40, "kv_dir": "/tmp/kv"})
    assert settings.lookup_deadline_s is None
    assert "ignoring lookup_deadline, not a key" in caplog.text
    assert "lookup_deadline_ms" in caplog.text  # the keys it reads, to compare with
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="holeblend_runtime.vllm_connector.settings"):
        load_settings({"kv_dir": "/tmp/kv", "blend_step_tokens": 64})
    assert caplog.text == ""


@pytest.mark.parametrize("key", ["holeblend_config", "kv_dir"])
def test_a_path_key_that_is_not_a_string_is_refused_naming_it(key):
    with pytest.raises(ValueError, match=f"{key}: expected a path"):
        load_settings({key: 5})


def test_a_corrupt_kv_file_is_a_miss_and_is_removed(tmp_path):
    engine = BlendEngine.load()
    store = DirectoryKVStore(tmp_path, 1 << 30)
    engine.store = store
    prompt = engine.build_prompt("Answer.", [" Doc one is here today."], " Q?")
    assert engine.cache_segments(prompt) >= 1
    key = store.keys()[0]
    assert store.get(key) is not None
    store.path(key).write_bytes(b"garbage")
    assert store.contains(key)
    assert store.get(key) is None
    assert not store.contains(key) and store.num_corrupt == 1


def test_the_directory_keeps_the_finiteness_verdict_of_put_and_the_engine_refuses_bad_kv(
    tmp_path,
):
    """Checked once where the entry is written; a reader trusts it (a file written without
    it is checked by the reader)."""
    from safetensors.torch import save_file

    from holeblend_runtime.kv.store import SegmentKV

    store = DirectoryKVStore(tmp_path, 1 << 30)
    k = torch.randn(2, 1, 3, 4)
    bad = k.clone()
    bad[1, 0, 2, 3] = float("nan")
    positions = torch.arange(3, dtype=torch.int64)
    assert store.put(SegmentKV("good", k, k.clone(), positions, "m"))
    assert store.put(SegmentKV("bad", bad, k.clone(), positions, "m"))
    assert store.get("good").is_finite is True and store.get("bad").is_finite is False
    # An older file, without the verdict: unknown, so the engine checks the values.
    tensors = {"k": bad, "v": k, "positions": positions}
    save_file(tensors, str(store.path("old")), {"key": "old", "model_id": "m"})
    assert store.get("old").is_finite is None

    engine = BlendEngine.load()
    c = engine.config
    shape = (c.num_layers, c.num_kv_heads, 3, c.head_dim)
    nan_k = torch.randn(shape)
    nan_k[0, 0, 0, 0] = float("inf")
    ok = torch.randn(shape)
    for key, kv_k in (("fresh", ok), ("stale", nan_k)):
        store.put(SegmentKV(key, kv_k, ok.clone(), positions, c.model_id))
    save_file({"k": nan_k, "v": ok, "positions": positions}, str(store.path("legacy")),
              {"key": "legacy", "model_id": c.model_id})  # fmt: skip
    for key, expected in (("fresh", None), ("stale", "non-finite values"), ("legacy", "non-finite values")):  # fmt: skip
        assert engine.kv_problem(store.get(key), key, 3) == expected


def _directory_entry(key: str, num_tokens: int = 16):
    from holeblend_runtime.kv.store import SegmentKV

    k = torch.randn(2, 2, num_tokens, 8)
    return SegmentKV(key, k, k.clone(), torch.arange(num_tokens, dtype=torch.int64), "m")


def _leave_temporary_file(path, size: int, age_s: float) -> None:
    """A temporary file as a writer leaves it, last written `age_s` seconds ago."""
    path.write_bytes(b"\0" * size)
    written = time.time_ns() - int(age_s * 1e9)
    os.utime(path, ns=(written, written))


def test_temporary_files_that_killed_writers_left_are_removed_and_a_live_writers_are_kept(
    tmp_path,
):
    """A worker killed during a put (OOM kill, pod deletion) leaves its full-size temporary
    file; on a tmpfs that is memory no budget sees. A store removes those old enough that
    no writer can still be writing them, those of earlier versions too (their own
    `tmp*.tmp` and safetensors' `.tmp*`), and keeps a fresh one: another rank sharing the
    directory may be writing it right now."""
    size = _directory_entry("x").num_bytes
    left = [tmp_path / ".ab12.k3j4h5.partial", tmp_path / "tmpq1w2e3.tmp", tmp_path / ".tmpZx9Yw8"]
    for path in left:
        _leave_temporary_file(path, size, age_s=3600)
    in_flight = tmp_path / ".cd34.m6n7b8.partial"
    _leave_temporary_file(in_flight, size, age_s=1)
    store = DirectoryKVStore(tmp_path, 1 << 30)
    assert [path for path in left if path.exists()] == []
    assert in_flight.exists()
    assert store.put(_directory_entry("ab12"))
    assert in_flight.exists() and len(store) == 1
    # What a put wrote is its file only: its temporary file is renamed, not left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == [in_flight.name, "ab12.safetensors"]


def test_the_byte_budget_counts_temporary_files_being_written(tmp_path):
    """The budget is the directory's bytes: a file another writer is writing, or one a
    killed writer left that is not old enough to remove yet, takes room that stored
    entries give up (least recently used first)."""
    probe = DirectoryKVStore(tmp_path / "probe", 1 << 20)
    probe.put(_directory_entry("a1"))
    size = probe.num_bytes  # one file, header included
    store = DirectoryKVStore(tmp_path / "kv", 3 * size + size // 2)
    for key in ("a1", "a2", "a3"):
        assert store.put(_directory_entry(key))
    assert store.num_bytes == 3 * size
    in_flight = store.root / ".b1.z8y7x6.partial"
    _leave_temporary_file(in_flight, size, age_s=1)
    assert store.num_bytes == 4 * size
    assert store.put(_directory_entry("a4"))
    assert store.keys() == ["a3", "a4"] and in_flight.exists()
    assert store.num_bytes == 3 * size <= store.capacity_bytes
