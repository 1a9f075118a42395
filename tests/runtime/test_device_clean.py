"""The blend loop is device-clean: every tensor on the model's device, no host read of
device data once the per-request numbers are known.

The loop runs on the `meta` device, which has shapes but no data: reading a value on the
host (`int()`, `bool()`, `.tolist()`, `.item()`, `nonzero()`) raises there, and so does
mixing a host tensor into a device op. A change that adds either fails these tests on a
CPU-only machine, where a GPU would only have become slower.
"""

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from holeblend_runtime.blend.blender import Blender, CachedSpan, PrefixKV
from holeblend_runtime.blend.config import RANDOM, BlendConfig
from holeblend_runtime.blend.selection import num_to_select
from holeblend_runtime.kv.store import SegmentKV
from holeblend_runtime.model import batch_decode
from holeblend_runtime.model.config import ModelConfig
from holeblend_runtime.model.devices import host_int64
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import random_weights

CONFIG = ModelConfig(
    model_id="tiny", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=96, rope_theta=10000.0, rms_norm_eps=1e-5, vocab_size=100,
    context_length=512, bos_token_id=1, eos_token_id=2, add_bos_token=False,
    tie_word_embeddings=True,
)  # fmt: skip
NUM_TOKENS = 120
# An exact prefix of 20 tokens whose slots 8..10 (a separator) have no KV; cached
# documents at 20..50 (stored at other positions), 60..90 and 95..110; holes between.
PREFIX_END, FRESH_IN_PREFIX = 20, (8, 9, 10)
SPANS = ((20, 50, 3), (60, 90, 60), (95, 110, 0))
HOLES = ((50, 60), (90, 95))


def _host_kv(start: int, end: int, stored_at: int) -> SegmentKV:
    shape = (CONFIG.num_layers, CONFIG.num_kv_heads, end - start, CONFIG.head_dim)
    positions = torch.arange(stored_at, stored_at + end - start)
    return SegmentKV("k", torch.randn(shape), torch.randn(shape), positions, "tiny")


def _meta_blend(
    blend_config: BlendConfig,
    ratio: float,
    model: Llama | None = None,
    query: tuple[int, int] | None = None,
):
    model = model or Llama(CONFIG, random_weights(CONFIG), device="meta")
    blender = Blender(model, blend_config)
    spans = [CachedSpan(start, end, _host_kv(start, end, at)) for start, end, at in SPANS]
    k, v = model.new_kv(NUM_TOKENS)
    prefix = PrefixKV(k, v, PREFIX_END, FRESH_IN_PREFIX)
    token_ids = torch.randint(0, CONFIG.vocab_size, (NUM_TOKENS,)).to("meta")
    return blender.blend(token_ids, spans, ratio, HOLES, prefix=prefix, query=query)


def _num_cached() -> int:
    # The KV store's spans, every token but the prompt's last one (always computed).
    return sum(end - start for start, end, _ in SPANS) - (SPANS[-1][1] == NUM_TOKENS)


@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0])
def test_the_blend_loop_runs_on_the_meta_device(ratio):
    result = _meta_blend(BlendConfig(check_layer=1), ratio)
    num_selected = num_to_select(_num_cached(), ratio)
    num_uncached = NUM_TOKENS - PREFIX_END - _num_cached() + len(FRESH_IN_PREFIX)
    assert result.logits.device.type == "meta"
    assert result.recomputed.device.type == "meta"
    assert result.recomputed.shape == (num_selected + num_uncached,)
    assert result.deviation.shape == (_num_cached(),)


def test_per_section_random_selection_runs_on_the_meta_device():
    config = BlendConfig(check_layer=2, per_section=True, selection=RANDOM, seed=3)
    result = _meta_blend(config, 0.3)
    sections = [30, 30, 15]
    assert result.selected.shape == (sum(num_to_select(n, 0.3) for n in sections),)


@pytest.mark.parametrize("per_section", [False, True])
def test_mixed_selection_with_filter_layers_runs_on_the_meta_device(per_section):
    """The question's attention, V deviation, sinks and two filter layers: no host read."""
    config = BlendConfig(
        check_layer=1, selection="query:0.3+sinks:0.2+kvDeviation", filter_layers=(2, 3),
        per_section=per_section,
    )  # fmt: skip
    result = _meta_blend(config, 0.3, query=(110, NUM_TOKENS - 1))
    sections = [30, 30, 15] if per_section else [75]
    budget = sum(num_to_select(n, 0.3) for n in sections)
    # Budget-neutral filtering keeps fewer deviation picks than the budget at the end.
    assert result.selected.device.type == "meta"
    assert 0 < result.selected.shape[0] < budget


@pytest.mark.parametrize("check_layer", [1, 2, 3])
def test_the_layout_runs_once_every_full_layer_is_launched(check_layer):
    """The host lays out the blend (and queues the reused KV's load) after launching
    every layer below the check layer and before the check layer: the device computes
    all of them meanwhile (after only the first, it waited for the host at 2k tokens)."""
    model = Llama(CONFIG, random_weights(CONFIG), device="meta")
    blender = Blender(model, BlendConfig(check_layer=check_layer))
    events = []
    launch, lay_out = model.qkv_into, blender._layout

    def qkv_into(layer, *args):
        events.append(f"layer {layer}")
        return launch(layer, *args)

    def layout(*args):
        events.append("layout")
        return lay_out(*args)

    model.qkv_into, blender._layout = qkv_into, layout
    spans = [CachedSpan(start, end, _host_kv(start, end, at)) for start, end, at in SPANS]
    token_ids = torch.randint(0, CONFIG.vocab_size, (NUM_TOKENS,)).to("meta")
    blender.blend(token_ids, spans, 0.15, HOLES)
    assert events.index("layout") == check_layer
    assert events[:check_layer] == [f"layer {i}" for i in range(check_layer)]


def test_a_host_read_in_the_layer_loop_is_caught():
    """The check can fail: a layer that reads a device value on the host raises."""
    model = Llama(CONFIG, random_weights(CONFIG), device="meta")
    finish = model.finish_layer

    def finish_and_read(layer, h, attn):
        if float(h.abs().max()) > 1e4:  # a host read, as a debug check might add
            raise AssertionError("unreachable")
        return finish(layer, h, attn)

    model.finish_layer = finish_and_read
    with pytest.raises(RuntimeError, match="meta tensors"):
        _meta_blend(BlendConfig(check_layer=1), 0.15, model)


def test_a_host_tensor_mixed_into_the_layer_loop_is_caught():
    model = Llama(CONFIG, random_weights(CONFIG), device="meta")
    finish = model.finish_layer
    model.finish_layer = lambda layer, h, attn: finish(layer, h, attn) + torch.zeros(h.shape)
    with pytest.raises(RuntimeError, match="not on the expected device"):
        _meta_blend(BlendConfig(check_layer=1), 0.15, model)


class _HostScalarCopies(TorchDispatchMode):
    """Records the ops that copy a host scalar to the device, a copy from pageable memory
    for which the host waits on a GPU (the meta device lets both pass: torch treats 0-dim
    host tensors as scalars):
    - a 0-dim host tensor given to an op on device tensors;
    - `index_put_` of a 0-dim value, i.e. Python's `x[index] = scalar` on a device tensor:
      on CUDA, torch builds the scalar on the host and copies it (on meta, where this test
      runs, it builds it on meta; `index_fill_` takes the scalar as a kernel argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type == "meta" for t in tensors)
        host_scalar = any(t.device.type == "cpu" and t.dim() == 0 for t in tensors)
        scalar_put = func is torch.ops.aten.index_put_.default and args[2].dim() == 0
        if on_device and (host_scalar or scalar_put):
            self.ops.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("selection", ["kDeviation", "query:0.3+sinks:0.2+kvDeviation"])
def test_no_host_scalar_is_copied_into_the_blend_loop(selection):
    config = BlendConfig(check_layer=1, selection=selection, filter_layers=(2,))
    with _HostScalarCopies() as recorder:
        _meta_blend(config, 0.3, query=(110, NUM_TOKENS - 1))
    assert recorder.ops == []


def test_a_host_scalar_copied_into_the_blend_loop_is_caught():
    model = Llama(CONFIG, random_weights(CONFIG), device="meta")
    finish = model.finish_layer

    def finish_with(write):
        def finish_and_write(layer, h, attn):
            h = finish(layer, h, attn)
            write(h)
            return h

        return finish_and_write

    rows = torch.zeros(2, dtype=torch.int64, device="meta")
    writes = {
        "a host tensor": lambda h: h.mul_(torch.tensor(1.0)),
        "a Python scalar through an index": lambda h: h.__setitem__(rows, 0.0),
    }
    for name, write in writes.items():
        model.finish_layer = finish_with(write)
        with _HostScalarCopies() as recorder:
            _meta_blend(BlendConfig(check_layer=1), 0.15, model)
        assert recorder.ops, name


def test_a_causal_continuation_at_explicit_positions_runs_on_the_meta_device():
    model = Llama(CONFIG, random_weights(CONFIG), device="meta")
    k, v = model.new_kv(NUM_TOKENS)
    positions = torch.cat([torch.tensor(FRESH_IN_PREFIX), torch.arange(PREFIX_END, NUM_TOKENS)])
    token_ids = torch.zeros(positions.shape[0], dtype=torch.int64, device="meta")
    h = model.forward_at(token_ids, positions.to("meta"), NUM_TOKENS, k, v)
    assert h.shape == (positions.shape[0], CONFIG.hidden_size) and h.device.type == "meta"


def test_reused_kv_from_host_memory_blends_as_kv_on_the_device():
    """On a GPU, host-resident KV arrives layer by layer on a side stream; the result
    must not differ from KV that was already on the device (on the CPU both are the
    same path, and the test checks the host store's copy)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Llama(CONFIG, random_weights(CONFIG), device=device)
    blender = Blender(model, BlendConfig(check_layer=1))
    host = [CachedSpan(start, end, _host_kv(start, end, at)) for start, end, at in SPANS]
    on_device = [
        CachedSpan(s.start, s.end, SegmentKV("k", s.kv.k.to(device), s.kv.v.to(device),
                                             s.kv.positions, "tiny"))
        for s in host
    ]  # fmt: skip
    token_ids = torch.randint(0, CONFIG.vocab_size, (NUM_TOKENS,)).to(device)
    a = blender.blend(token_ids, host, 0.2, HOLES)
    b = blender.blend(token_ids, on_device, 0.2, HOLES)
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)
    torch.testing.assert_close(a.k, b.k, atol=0, rtol=0)


def test_a_host_memory_store_keeps_entries_on_the_host():
    from holeblend_runtime.kv.store import LocalKVStore

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv = _host_kv(0, 5, 0)
    computed = SegmentKV("k", kv.k.to(device), kv.v.to(device), kv.positions, "tiny")
    store = LocalKVStore(1 << 20, host_memory=True)
    assert store.put(computed)
    stored = store.get("k")
    assert stored.k.device.type == "cpu" and stored.v.device.type == "cpu"
    assert stored.k.is_pinned() == torch.cuda.is_available()
    torch.testing.assert_close(stored.k, kv.k, atol=0, rtol=0)


def test_the_plain_sdpa_reference_forward_equals_full_prefill():
    """The benchmark's floor for full prefill computes the same logits."""
    from holeblend_runtime.bench.device_timing import plain_forward

    model = Llama(CONFIG, random_weights(CONFIG, seed=1))
    token_ids = torch.randint(0, CONFIG.vocab_size, (NUM_TOKENS,))
    k, v = model.new_kv(NUM_TOKENS)
    expected = model.logits(model.forward(token_ids, k, v, start=0)[-1:])[0]
    torch.testing.assert_close(plain_forward(model, token_ids), expected, atol=1e-5, rtol=0)


def test_on_accelerators_the_recompute_set_is_rounded_up_to_the_bucket():
    from holeblend_runtime.blend.blender import RECOMPUTE_BUCKET, _round_up_picks

    sections = (torch.arange(30), torch.arange(30, 40))
    picks = _round_up_picks((3, 1), sections, num_uncached=50, bucket=RECOMPUTE_BUCKET)
    assert sum(picks) + 50 == 64 and picks == (13, 1)
    # Not enough cached tokens: every one is picked.
    assert _round_up_picks((3, 1), sections, 20, 64) == (30, 10)
    assert _round_up_picks((3, 1), sections, 50, 1) == (3, 1)


def test_the_warm_up_runs_one_layer_at_every_bucketed_size(monkeypatch):
    """On an accelerator every recompute-set size up to the limit is run once at start-up
    (device-clean: on `meta`); on the CPU nothing runs."""
    from holeblend_runtime.blend.blender import RECOMPUTE_BUCKET

    model = Llama(CONFIG, random_weights(CONFIG), device="meta")
    rows = []
    attend_and_mlp = model.attend_and_mlp

    def record(layer, h, q, k, v, plan):
        rows.append((layer, h.shape[0], plan.positions.shape[0], plan.is_causal))
        return attend_and_mlp(layer, h, q, k, v, plan)

    model.attend_and_mlp = record
    blender = Blender(model, BlendConfig())
    assert blender.warm_up(4 * RECOMPUTE_BUCKET + 10) == 0  # `meta` is not an accelerator
    assert rows == []
    monkeypatch.setattr(Blender, "_bucket", lambda self: RECOMPUTE_BUCKET)
    assert blender.warm_up(4 * RECOMPUTE_BUCKET + 10) == 4
    sizes = [RECOMPUTE_BUCKET * i for i in (1, 2, 3, 4)]
    # Queries at positions 1..m: the sparse kernel's plan, not plain causal attention.
    assert rows == [(0, m, m, False) for m in sizes]
    assert blender.warm_up(RECOMPUTE_BUCKET - 1) == 0


def _device_spans(device: str) -> list[CachedSpan]:
    spans = []
    for start, end, at in SPANS:
        kv = _host_kv(start, end, at)
        on_device = SegmentKV("k", kv.k.to(device), kv.v.to(device), kv.positions, "tiny")
        spans.append(CachedSpan(start, end, on_device))
    return spans


@pytest.mark.parametrize("check_layer", [1, 3])
def test_batched_span_copies_blend_exactly_as_one_copy_per_span(monkeypatch, check_layer):
    """On an accelerator the spans' KV is gathered in one copy per K and V (and the ids
    and indexes move in one packed copy); the blend must be bit-identical to the CPU's
    one copy per span, moved documents (re-rotation) included."""
    model = Llama(CONFIG, random_weights(CONFIG, seed=2))
    blender = Blender(model, BlendConfig(check_layer=check_layer))
    spans = _device_spans("cpu")
    token_ids = torch.randint(0, CONFIG.vocab_size, (NUM_TOKENS,))
    expected = blender.blend(token_ids, spans, 0.2, HOLES)
    calls = []

    def batched(self, spans):
        calls.append(len(spans))
        return True

    monkeypatch.setattr(Blender, "_batches_copies", batched)
    got = blender.blend(token_ids, spans, 0.2, HOLES)
    assert calls == [len(SPANS)]
    for a, b in ((got.k, expected.k), (got.v, expected.v), (got.logits, expected.logits)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert torch.equal(got.recomputed, expected.recomputed)


def test_batched_span_copies_run_on_the_meta_device(monkeypatch):
    monkeypatch.setattr(Blender, "_batches_copies", lambda self, spans: True)
    model = Llama(CONFIG, random_weights(CONFIG), device="meta")
    blender = Blender(model, BlendConfig(check_layer=1))
    k, v = model.new_kv(NUM_TOKENS)
    prefix = PrefixKV(k, v, PREFIX_END, FRESH_IN_PREFIX)
    # Token ids on the host, as the engine passes them: moved with the indexes.
    token_ids = torch.randint(0, CONFIG.vocab_size, (NUM_TOKENS,))
    result = blender.blend(token_ids, _device_spans("meta"), 0.15, HOLES, prefix=prefix)
    assert result.k.device.type == "meta" and result.logits.device.type == "meta"


def test_packed_moves_split_back_into_the_tensors_given():
    from holeblend_runtime.model.devices import _move_packed, to_device_many

    hosts = [torch.arange(5), torch.empty(0, dtype=torch.int64), torch.arange(6).view(2, 3) - 9]
    for moved in (_move_packed(hosts, torch.device("cpu"), pin=False),
                  to_device_many(hosts, torch.device("cpu"))):  # fmt: skip
        assert [tuple(t.shape) for t in moved] == [(5,), (0,), (2, 3)]
        for a, b in zip(moved, hosts, strict=True):
            assert torch.equal(a, b)
    assert to_device_many([], torch.device("meta")) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_cache_equals_the_table_computed_per_request(dtype):
    from holeblend_runtime.model.rope import RopeCache, rope_table

    cache = RopeCache(head_dim=16, theta=500000.0, dtype=dtype, device="cpu", max_positions=5000)
    for n in (1, 700, 3000, 5000):  # grows past its first size, capped at the maximum
        got = cache.upto(n)
        want = rope_table(torch.arange(n), head_dim=16, theta=500000.0, dtype=dtype)
        assert torch.equal(got.cos, want.cos) and torch.equal(got.sin, want.sin)
    for offsets in (torch.tensor([-1, 0, 1, 37, -37]), torch.tensor([-4999, 12, 4999])):
        table, rows = cache.offsets_table(offsets)  # the second grows the table
        want = rope_table(offsets, head_dim=16, theta=500000.0, dtype=dtype)
        assert torch.equal(table.cos[rows], want.cos) and torch.equal(table.sin[rows], want.sin)
    with pytest.raises(ValueError, match="exceed the table's 5000"):
        cache.upto(5001)


def test_offsets_beyond_the_rotation_table_are_rotated_by_a_table_of_their_own():
    """A span stored past the model context (a shape the engine refuses, but the blender
    takes what it is given) is re-rotated exactly as through the kept table."""
    from holeblend_runtime.model.rope import RopeCache

    model = Llama(CONFIG, random_weights(CONFIG, seed=4))
    far = [CachedSpan(start, end, _host_kv(start, end, at + 600)) for start, end, at in SPANS]
    token_ids = torch.randint(0, CONFIG.vocab_size, (NUM_TOKENS,))
    beyond = Blender(model, BlendConfig(check_layer=1))
    within = Blender(model, BlendConfig(check_layer=1))
    within._rotations = RopeCache(
        head_dim=CONFIG.head_dim, theta=CONFIG.rope_theta, dtype=model.dtype, device="cpu",
        max_positions=4096,
    )  # fmt: skip
    a = beyond.blend(token_ids, far, 0.2, HOLES)
    b = within.blend(token_ids, far, 0.2, HOLES)
    assert beyond._rotations._signed is None and within._rotations._signed is not None
    torch.testing.assert_close(a.k, b.k, atol=0, rtol=0)
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)


@pytest.mark.parametrize("values", [(), (7,), tuple(range(-3, 2500)), [2**62, -(2**62)]])
def test_host_int64_equals_torch_tensor_of_the_values(values):
    built = host_int64(values)
    assert built.dtype == torch.int64 and built.device.type == "cpu"
    assert torch.equal(built, torch.tensor(list(values), dtype=torch.int64))


@pytest.mark.parametrize("one_call", [True, False])
def test_a_batched_decode_step_runs_on_the_meta_device(one_call, monkeypatch):
    """The pooled step (rows out of order, a free row between live ones) takes no host
    read and mixes no host tensor, with one attention call for the rows (the CPU's) or
    one per sequence (other devices')."""
    monkeypatch.setattr(batch_decode, "one_call_on", lambda device: one_call)
    model = Llama(CONFIG, random_weights(CONFIG), device="meta")
    pool = batch_decode.KVPool(model)
    logits = torch.empty(CONFIG.vocab_size, device="meta")
    sequences = []
    for tokens in (30, 45, 60):
        k, v = model.new_kv(tokens)
        sequences.append(batch_decode.start_sequence(pool, k, v, logits, 4))
    sequences[1].close()
    live = [sequences[2], sequences[0]]
    batch_decode.decode_step(model, live, [5, 6])
    assert [s.position for s in live] == [61, 31]
    assert all(s.logits.device.type == "meta" for s in live)
    assert pool.k is not None and pool.k.device.type == "meta"
