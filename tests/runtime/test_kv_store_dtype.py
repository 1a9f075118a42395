"""kv.storeDtype: the tiers hold segment KV in a narrower dtype than the model's, the engine
converts on store and on load, and segment keys name the stored dtype."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from holeblend_contract import blend_settings as contract
from holeblend_runtime.blend.config import BlendConfig, from_settings, stored_kv_dtype
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.kv.directory import DirectoryKVStore
from holeblend_runtime.kv.store import LocalKVStore, SegmentKV, finite_flags, narrowed, widened
from holeblend_runtime.kv.tiers import (
    KVLayout,
    TierSettings,
    blob_to_kv,
    kv_to_blob,
    open_tiered_store,
)
from holeblend_runtime.lookup_server.processes import RedisProcess

HOLE = 2  # the second document (segment 0 is the system prompt)


def _segments(engine, prompt):
    keys = engine.segment_keys(prompt)
    return [(i, key) for i, key in enumerate(keys) if key is not None]


def _documents(engine, prompt):
    """`_segments` less the system prompt's (index 0), which is held in the model's dtype."""
    return [(i, key) for i, key in _segments(engine, prompt) if i != 0]


def _document_bytes(engine, prompt) -> int:
    """The K/V bytes of the prompt's documents in the engine's store."""
    entries = [engine.store.get(key) for _, key in _documents(engine, prompt)]
    return sum(kv.k.nbytes + kv.v.nbytes for kv in entries)


def test_the_system_prompt_is_held_in_the_models_dtype_under_its_own_key(new_engine, rag_texts):
    """One small segment, every prompt's exact prefix: rounded, it would be exact nowhere."""
    wide = new_engine()
    prompt = wide.build_prompt(*rag_texts)
    wide.cache_segments(prompt)
    system_key = wide.segment_keys(prompt)[0]
    for dtype in ("bfloat16", "float16", "float8_e4m3fn"):
        narrow = new_engine(kv_store_dtype=dtype)
        narrow.cache_segments(prompt)
        keys = narrow.segment_keys(prompt)
        # The same key (and KV) as under auto; documents' keys name the narrow dtype.
        assert keys[0] == system_key
        assert set(keys[1:]).isdisjoint(k for k in wide.segment_keys(prompt)[1:] if k)
        system = narrow.store.get(system_key)
        assert system.k.dtype == system.v.dtype == torch.float32, dtype
        torch.testing.assert_close(system.k, wide.store.get(system_key).k, atol=0, rtol=0)
        documents = [narrow.store.get(key) for _, key in _documents(narrow, prompt)]
        assert {kv.k.dtype for kv in documents} == {getattr(torch, dtype)}
        # A hole blend takes it as the exact prefix; the first document, rounded, is blended.
        narrow.store.remove(keys[HOLE])
        blended = narrow.prefill(prompt, "hole", ratio=0.15)
        assert blended.num_exact_prefix_tokens == prompt.system.num_tokens, dtype
        assert blended.deviation.numel() == blended.num_reused_tokens - prompt.system.num_tokens


def test_the_store_holds_the_named_dtype_at_half_the_bytes(new_engine, rag_texts):
    wide, narrow = new_engine(), new_engine(kv_store_dtype="bfloat16")
    prompt = wide.build_prompt(*rag_texts)
    assert wide.cache_segments(prompt) == narrow.cache_segments(prompt) > 0
    for (_, wide_key), (_, narrow_key) in zip(
        _documents(wide, prompt), _documents(narrow, prompt), strict=True
    ):
        full, half = wide.store.get(wide_key), narrow.store.get(narrow_key)
        assert full.k.dtype == torch.float32 and half.k.dtype == half.v.dtype == torch.bfloat16
        # The same KV, rounded: bfloat16 keeps 8 significant bits.
        torch.testing.assert_close(half.k.float(), full.k, rtol=2**-8, atol=1e-6)
    assert _document_bytes(narrow, prompt) == _document_bytes(wide, prompt) // 2


def test_float8_holds_a_quarter_of_the_bytes_and_a_hole_blend_reuses_it(new_engine, rag_texts):
    wide, narrow = new_engine(), new_engine(kv_store_dtype="float8_e4m3fn")
    prompt = wide.build_prompt(*rag_texts)
    assert narrow.kv_dtype == "float8_e4m3fn"
    assert wide.cache_segments(prompt) == narrow.cache_segments(prompt) > 0
    for (_, wide_key), (_, narrow_key) in zip(
        _documents(wide, prompt), _documents(narrow, prompt), strict=True
    ):
        full, quarter = wide.store.get(wide_key), narrow.store.get(narrow_key)
        assert quarter.k.dtype == quarter.v.dtype == torch.float8_e4m3fn
        # 3 mantissa bits: within 2^-4 of each value, or of the smallest normal (2^-6)
        # where float8 goes subnormal.
        for stored, exact in ((quarter.k, full.k), (quarter.v, full.v)):
            error = (stored.float() - exact).abs()
            assert bool((error <= 2**-4 * exact.abs() + 2**-10).all())
            assert error.max().item() > 0  # rounded: the KV did change
    assert _document_bytes(narrow, prompt) == _document_bytes(wide, prompt) // 4
    # The blend reuses every stored document, in the model's dtype.
    for engine in (wide, narrow):
        engine.store = LocalKVStore(1 << 30)
        engine.cache_segments(prompt, [i for i, _ in _segments(engine, prompt) if i != HOLE])
    expected = wide.prefill(prompt, "hole", ratio=0.15)
    actual = narrow.prefill(prompt, "hole", ratio=0.15)
    assert actual.num_rejected_segments == 0 and actual.logits.dtype == torch.float32
    assert actual.num_reused_tokens == expected.num_reused_tokens > 0
    assert 0 < (actual.logits - expected.logits).abs().max().item() < 2.0


def test_float8_marks_what_it_cannot_hold_as_nan_instead_of_saturating():
    values = torch.tensor([[1.5, -0.01, 448.0, 449.0, -1e4, float("inf"), float("nan")]])
    stored = narrowed(values, torch.float8_e4m3fn)
    assert stored.dtype == torch.float8_e4m3fn
    # torch's own conversion would read 449 and -1e4 back as 448 and -448.
    assert torch.equal(
        values.to(torch.float8_e4m3fn).float()[0, 3:5], torch.tensor([448.0, -448.0])
    )
    back = stored.float()[0]
    assert back[:3].tolist() == pytest.approx([1.5, -0.01, 448.0], rel=2**-4)
    assert back[3:].isnan().all()
    ok = narrowed(torch.ones(1, 1, 2, 4), torch.float8_e4m3fn)
    bad = narrowed(torch.full((1, 1, 2, 4), 1e3), torch.float8_e4m3fn)
    entries = [
        _entry("a", ok), _entry("b", bad), _entry("c", torch.ones(1, 1, 2, 4)),
    ]  # fmt: skip
    assert finite_flags(entries) == [True, False, True]


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_widening_float8_through_its_table_is_torchs_conversion_bit_for_bit(model_dtype):
    every_code = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    stored = every_code[torch.randint(0, 256, (2, 3, 40, 8))]  # non-contiguous below
    for tensor in (every_code, stored, stored.transpose(1, 2)):
        actual, expected = widened(tensor, model_dtype), tensor.to(model_dtype)
        assert actual.dtype == model_dtype and actual.shape == tensor.shape
        assert torch.equal(actual.isnan(), expected.isnan())
        assert torch.equal(actual.nan_to_num(), expected.nan_to_num())
    # In range, narrowing is torch's own conversion (the range check copies nothing).
    values = torch.randn(4, 64) * 50
    assert torch.equal(
        narrowed(values, torch.float8_e4m3fn).view(torch.uint8),
        values.to(torch.float8_e4m3fn).view(torch.uint8),
    )


def _entry(key, k):
    return SegmentKV(key, k, k.clone(), torch.arange(k.shape[2]), "m")


def test_float8_entries_round_trip_through_a_blob_and_a_node_directory(tmp_path):
    k = narrowed(torch.randn(2, 3, 5, 8), torch.float8_e4m3fn)
    entry = _entry("ab12", k)
    back = blob_to_kv(kv_to_blob(entry))
    assert back.k.dtype == torch.float8_e4m3fn
    assert torch.equal(back.k.view(torch.uint8), k.view(torch.uint8))
    directory = DirectoryKVStore(tmp_path, 1 << 20)
    assert directory.put(entry)
    read = directory.get("ab12")
    assert read.is_finite is True and read.k.dtype == torch.float8_e4m3fn
    assert torch.equal(read.v.view(torch.uint8), entry.v.view(torch.uint8))


def test_keys_name_the_stored_dtype_and_auto_keeps_the_models(new_engine, rag_texts):
    auto, float32, bf16 = (
        new_engine(),
        new_engine(kv_store_dtype="float32"),
        new_engine(kv_store_dtype="bfloat16"),
    )
    prompt = auto.build_prompt(*rag_texts)
    assert auto.kv_dtype == float32.kv_dtype == "float32" and bf16.kv_dtype == "bfloat16"
    # auto names the model's dtype: caches stored before the setting existed still hit.
    assert auto.segment_keys(prompt) == float32.segment_keys(prompt)
    # Documents' keys name bfloat16; the system prompt's stays the model's dtype's.
    documents = auto.segment_keys(prompt)[1:]
    assert set(bf16.segment_keys(prompt)[1:]).isdisjoint(k for k in documents if k)
    assert bf16.segment_keys(prompt)[0] == auto.segment_keys(prompt)[0]


def test_a_hole_blend_on_bfloat16_kv_blends_every_reused_document(cached_engine, rag_texts):
    wide, prompt = cached_engine(rag_texts, hole=HOLE)
    narrow = BlendEngine(
        wide.model, wide.tokenizer, BlendConfig(kv_store_dtype="bfloat16"), LocalKVStore(1 << 30)
    )
    narrow.cache_segments(prompt, [i for i, _ in _segments(narrow, prompt) if i != HOLE])
    expected = wide.prefill(prompt, "hole", ratio=0.15)
    actual = narrow.prefill(prompt, "hole", ratio=0.15)
    assert actual.num_rejected_segments == 0
    assert actual.num_reused_tokens == expected.num_reused_tokens > 0
    assert actual.logits.dtype == torch.float32
    # Float32 KV is exact: the system prompt and first document are loaded as the exact
    # prefix. Rounded KV is not: the first document is blended like the others, its
    # tokens among the candidates for recompute (the system prompt is held in float32).
    assert expected.num_exact_prefix_tokens > prompt.system.num_tokens
    assert actual.num_exact_prefix_tokens == prompt.system.num_tokens
    assert not narrow.kv_is_exact
    assert actual.deviation.numel() == actual.num_reused_tokens - prompt.system.num_tokens
    # About as close to full prefill as the float32 blend (its pool is larger).
    full = torch.log_softmax(wide.prefill(prompt, "full").logits, -1)

    def kl(logits: torch.Tensor) -> float:
        return float((full.exp() * (full - torch.log_softmax(logits, -1))).sum())

    assert int(actual.logits.argmax()) == int(expected.logits.argmax())
    assert kl(actual.logits) <= 1.5 * kl(expected.logits) + 0.01


@pytest.mark.parametrize("store_dtype", ["bfloat16", "float8_e4m3fn"])
def test_ratio_one_reproduces_full_prefill_whatever_the_store_dtype(
    cached_engine, rag_texts, store_dtype
):
    wide, prompt = cached_engine(rag_texts, hole=HOLE)
    narrow = BlendEngine(
        wide.model, wide.tokenizer, BlendConfig(kv_store_dtype=store_dtype), LocalKVStore(1 << 30)
    )
    narrow.cache_segments(prompt, [i for i, _ in _segments(narrow, prompt) if i != HOLE])
    full = wide.prefill(prompt, "full")
    for engine in (wide, narrow):
        for mode in ("hole", "prefix"):
            # Ratio 1.0 recomputes everything after the exact prefix: on float32 KV the
            # system prompt and first document; on rounded KV the system prompt alone (held
            # in float32; a rounded document is not full prefill's), so the answer is full
            # prefill's.
            exact = engine.prefill(prompt, mode, ratio=1.0)
            assert exact.num_reused_tokens > 0 and exact.num_rejected_segments == 0
            torch.testing.assert_close(exact.logits, full.logits, atol=1e-4, rtol=0)
    exact_prefix = narrow.prefill(prompt, "hole", ratio=1.0).num_exact_prefix_tokens
    assert exact_prefix == prompt.system.num_tokens


def test_in_context_and_isolated_stores_both_write_the_stored_dtype(new_engine, rag_texts):
    for policy in ("in-context", "isolated"):
        engine = new_engine(kv_store_dtype="bfloat16", store_policy=policy)
        prompt = engine.build_prompt(*rag_texts)
        engine.prefill(prompt, "hole", ratio=0.15)  # every segment missing: stored
        assert engine.store_worker.drain(timeout=120)
        stored = [engine.store.get(key) for _, key in _segments(engine, prompt)]
        assert stored and all(kv is not None for kv in stored), policy
        assert [kv.k.dtype for kv in stored[:2]] == [torch.float32, torch.bfloat16], policy
        assert {kv.k.dtype for kv in stored[1:]} == {torch.bfloat16}, policy


def test_an_entry_of_another_dtype_is_refused_with_the_reason(new_engine, rag_texts):
    wide, narrow = new_engine(), new_engine(kv_store_dtype="bfloat16")
    prompt = wide.build_prompt(*rag_texts)
    wide.cache_segments(prompt)
    (_, wide_key), (index, narrow_key) = _segments(wide, prompt)[1], _segments(narrow, prompt)[1]
    # A float32 entry where a bfloat16 one belongs (written by hand, or by a bug).
    foreign = dataclasses.replace(wide.store.get(wide_key), key=narrow_key)
    problem = narrow.kv_problem(foreign, narrow_key, prompt.segments[index].num_tokens)
    assert problem == "dtype torch.float32, expected torch.bfloat16"
    narrow.store.put(foreign)
    entries, num_rejected = narrow.fetch(prompt, narrow.segment_keys(prompt))
    assert num_rejected == 1 and entries[index] is None


def test_fetch_hands_the_blend_the_models_dtype(new_engine, rag_texts):
    engine = new_engine(kv_store_dtype="float16")
    prompt = engine.build_prompt(*rag_texts)
    engine.cache_segments(prompt)
    entries, num_rejected = engine.fetch(prompt, engine.segment_keys(prompt))
    cached = [e for e in entries if e is not None]
    assert num_rejected == 0 and cached
    assert {e.k.dtype for e in cached} == {e.v.dtype for e in cached} == {torch.float32}


def test_the_setting_is_validated_and_read_from_blend_json():
    with pytest.raises(ValueError, match="kv_store_dtype: expected one of"):
        BlendConfig(kv_store_dtype="int8")
    settings = contract.BlendSettings.model_validate(
        {"model": {"name": "m"}, "kv": {"storeDtype": "bfloat16"}}
    )
    assert from_settings(settings).kv_store_dtype == "bfloat16"
    assert stored_kv_dtype("float32", from_settings(settings)) == "bfloat16"
    assert stored_kv_dtype("bfloat16", BlendConfig()) == "bfloat16"
    assert stored_kv_dtype("bfloat16", BlendConfig(kv_store_dtype="bfloat16")) == "bfloat16"
    for model in ("float32", "float16", "bfloat16"):  # float8 is narrower than each
        assert stored_kv_dtype(model, BlendConfig(kv_store_dtype="float8_e4m3fn")) == (
            "float8_e4m3fn"
        )
    # Not narrower than the model's: no bytes saved, precision or range lost.
    for model, stored in [("float16", "bfloat16"), ("bfloat16", "float16"), ("float16", "float32")]:
        with pytest.raises(ValueError, match=f"kv.storeDtype: {stored} under a {model} model"):
            stored_kv_dtype(model, BlendConfig(kv_store_dtype=stored))
    with pytest.raises(Exception, match="storeDtype"):
        contract.BlendSettings.model_validate({"model": {"name": "m"}, "kv": {"storeDtype": "x"}})


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn"])
def test_kv_that_overflows_the_stored_dtype_is_refused_on_load_and_computed_afresh(
    new_engine, rag_texts, dtype
):
    engine = new_engine(kv_store_dtype=dtype)
    prompt = engine.build_prompt(*rag_texts)
    engine.cache_segments(prompt)
    index, key = _segments(engine, prompt)[1]
    entry = engine.store.get(key).k.float()
    # A value past float16's largest (65,504; float8_e4m3fn's: 448): the narrowed copy
    # holds inf (float16) or NaN (float8, which torch would otherwise saturate at 448).
    huge = dataclasses.replace(engine.store.get(key), is_finite=None)
    k = entry.clone()
    k[3, 1, 2, 5] = 1e6
    wide = dataclasses.replace(huge, k=k, v=huge.v.float())
    engine.store.put(engine._to_stored(wide, prompt.segments[index]))
    entries, num_rejected = engine.fetch(prompt, engine.segment_keys(prompt))
    assert num_rejected == 1 and entries[index] is None
    result = engine.prefill(prompt, "hole", ratio=0.15)
    assert result.num_rejected_segments == 1 and result.num_stored_segments == 1
    assert finite_flags([engine.store.get(key)]) == [True]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_pod_reuses_narrow_blobs_another_pod_put_in_the_shared_tier(
    reference_engine, rag_texts, dtype
):
    """Two pods' engines over one real redis-server, both with kv.storeDtype `dtype`: the
    blobs name it (the header the readers expect), and pod B, its own tier empty, blends
    from what pod A stored (every document) as pod A itself does."""

    def pod(name: str, url: str) -> BlendEngine:
        blend = BlendConfig(kv_store_dtype=dtype)
        engine = BlendEngine(reference_engine.model, reference_engine.tokenizer, blend)
        layout = KVLayout.of(engine.config, engine.kv_dtype, "float32")
        settings = TierSettings(1 << 28, url, None, "ns/rag", name)
        engine.store = open_tiered_store(settings, layout, LocalKVStore(1 << 28))
        return engine

    with RedisProcess(maxmemory="256mb") as redis:
        a, b = pod("pod-a", redis.url), pod("pod-b", redis.url)
        assert a.store.layout.dtype == dtype and a.store.layout.other_dtypes == ("float32",)
        prompt = a.build_prompt(*rag_texts)
        a.cache_segments(prompt)
        expected = a.prefill(prompt, "hole", ratio=0.15)
        actual = b.prefill(prompt, "hole", ratio=0.15)
        figures = b.store.figures()
        a.store.close()
        b.store.close()
    assert actual.num_rejected_segments == 0 and figures["shared_bad_blobs"] == 0
    assert actual.num_reused_tokens == expected.num_reused_tokens > 0
    assert figures["shared_hits"] == len(_segments(a, prompt))
    torch.testing.assert_close(actual.logits, expected.logits, atol=1e-4, rtol=0)
