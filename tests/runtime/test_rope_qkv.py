"""RoPE of the packed QKV projection with the KV-cache writes in one kernel: the Triton
kernel against the torch reference, and the torch reference against the layer code's
textbook RoPE (`rope.apply_rope`).

The Triton kernel runs under Triton's interpreter here (TRITON_INTERPRET=1, set in
tests/runtime/conftest.py before anything imports Triton); on a GPU compiled.
"""

import pytest
import torch

from holeblend_kernels.rope_qkv import is_triton_supported, reference_rope_qkv, triton_rope_qkv
from holeblend_runtime.model.rope import apply_rope, rope_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (heads, kv_heads, head_dim): SmolLM2-135M, Llama-3-8B's GQA 4, no GQA, a small head.
SHAPES = [(9, 3, 64), (32, 8, 128), (4, 4, 16)]


def _inputs(heads, kv_heads, head_dim, positions, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(positions.shape[0], width, generator=generator).to(DEVICE, dtype)
    table = rope_table(positions.to(DEVICE), head_dim=head_dim, theta=5e5, dtype=dtype)
    return x, table


def _positions(num, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(3 * num + 5, generator=generator)[:num].sort().values


@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 17, 40])
def test_the_kernel_equals_the_reference_in_float32(heads, kv_heads, head_dim, num_tokens):
    positions = _positions(num_tokens)
    x, table = _inputs(heads, kv_heads, head_dim, positions, torch.float32)
    want = reference_rope_qkv(x, table.cos, table.sin, heads, kv_heads)
    got = triton_rope_qkv(x, table.cos, table.sin, heads, kv_heads)
    for name, a, b in zip("qkv", want, got, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=f"{name} differs")


@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_half_precision_the_kernel_rounds_once(heads, kv_heads, head_dim, dtype):
    """Torch rounds each step in the model's dtype, the kernel once from float32: both
    within a rounding of the float64 rotation."""
    positions = _positions(23)
    x, table = _inputs(heads, kv_heads, head_dim, positions, dtype)
    exact = reference_rope_qkv(x.double(), table.cos.double(), table.sin.double(), heads, kv_heads)
    got = triton_rope_qkv(x, table.cos, table.sin, heads, kv_heads)
    tolerance = {"atol": 2e-2, "rtol": 2e-2}
    for name, want, b in zip("qkv", exact, got, strict=True):
        torch.testing.assert_close(b.double(), want, **tolerance, msg=f"{name} differs")
    # V is copied, not computed: bit for bit.
    assert torch.equal(got[2], reference_rope_qkv(x, table.cos, table.sin, heads, kv_heads)[2])


@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_k_and_v_land_at_their_slots_and_nowhere_else(heads, kv_heads, head_dim):
    positions = _positions(19)
    x, table = _inputs(heads, kv_heads, head_dim, positions, torch.float32)
    slots = positions.to(DEVICE)
    num_slots = int(positions.max()) + 7
    outputs = []
    for rotate in (reference_rope_qkv, triton_rope_qkv):
        k_out = torch.full((kv_heads, num_slots, head_dim), 7.0, device=DEVICE)
        v_out = torch.full((kv_heads, num_slots, head_dim), 7.0, device=DEVICE)
        q, k, v = rotate(x, table.cos, table.sin, heads, kv_heads, k_out, v_out, slots)
        assert k is k_out and v is v_out
        outputs.append((q, k_out, v_out))
    (q_ref, k_ref, v_ref), (q, k_out, v_out) = outputs
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(v_out, v_ref)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert bool((k_out[:, untouched] == 7.0).all()) and bool((v_out[:, untouched] == 7.0).all())
    # Written slots hold this call's values (none of them is still the fill value).
    assert not bool((k_out[:, slots] == 7.0).all(-1).any())


@pytest.mark.parametrize("rotate", [reference_rope_qkv, triton_rope_qkv])
@pytest.mark.parametrize("layout", ["int32", "strided"])
def test_k_and_v_land_at_int32_and_strided_slots(rotate, layout):
    """Slots as `_check` accepts them: int32 (which `index_copy_` refuses), or a view with
    a step (which the kernel must not read as consecutive memory)."""
    heads, kv_heads, head_dim = 4, 2, 16
    positions = _positions(19)
    x, table = _inputs(heads, kv_heads, head_dim, positions, torch.float32)
    want_k = torch.zeros(kv_heads, 64, head_dim, device=DEVICE)
    want_v = torch.zeros_like(want_k)
    slots = positions.to(DEVICE)
    reference_rope_qkv(x, table.cos, table.sin, heads, kv_heads, want_k, want_v, slots)
    if layout == "int32":
        given = slots.to(torch.int32)
    else:
        given = torch.stack([slots, torch.zeros_like(slots)], dim=1)[:, 0]
        assert not given.is_contiguous()
    k_out, v_out = torch.zeros_like(want_k), torch.zeros_like(want_v)
    rotate(x, table.cos, table.sin, heads, kv_heads, k_out, v_out, given)
    torch.testing.assert_close(k_out, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(v_out, want_v)


def test_the_reference_is_the_layer_codes_rope():
    """The packed reference rotates exactly as `apply_rope` per head (what the blender's
    re-rotation of cached K composes with)."""
    heads, kv_heads, head_dim = 9, 3, 64
    positions = _positions(31)
    x, table = _inputs(heads, kv_heads, head_dim, positions, torch.float32)
    q, k, v = reference_rope_qkv(x, table.cos, table.sin, heads, kv_heads)
    split = x.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_raw, k_raw, v_raw = (
        part.reshape(-1, n, head_dim).transpose(0, 1)
        for part, n in zip(split, (heads, kv_heads, kv_heads), strict=True)
    )
    torch.testing.assert_close(q, apply_rope(q_raw, table), atol=0, rtol=0)
    torch.testing.assert_close(k, apply_rope(k_raw, table), atol=0, rtol=0)
    assert torch.equal(v, v_raw)


def test_q_is_token_major_for_the_output_projection():
    positions = _positions(12)
    x, table = _inputs(4, 2, 32, positions, torch.float32)
    q, _, _ = triton_rope_qkv(x, table.cos, table.sin, 4, 2)
    assert q.shape == (4, 12, 32)
    # [heads, n, d] over an [n, heads, d] buffer: transposed back it is contiguous.
    assert q.transpose(0, 1).is_contiguous()


def test_shapes_that_do_not_fit_are_refused_naming_the_argument():
    positions = _positions(5)
    x, table = _inputs(4, 2, 32, positions, torch.float32)
    with pytest.raises(ValueError, match="^x: width"):
        reference_rope_qkv(x[:, :-2].contiguous(), table.cos, table.sin, 4, 2)
    with pytest.raises(ValueError, match="^cos:"):
        triton_rope_qkv(x, table.cos[:3], table.sin, 4, 2)
    with pytest.raises(ValueError, match="^k_out, v_out, slots: give all three"):
        triton_rope_qkv(x, table.cos, table.sin, 4, 2, k_out=torch.empty(2, 9, 32))
    k_out = torch.empty(2, 9, 16, device=DEVICE)
    with pytest.raises(ValueError, match="^k_out: expected"):
        triton_rope_qkv(x, table.cos, table.sin, 4, 2, k_out, k_out, positions.to(DEVICE))
    assert not is_triton_supported(x, 48) and is_triton_supported(x, 32)


def test_the_kernel_addresses_rows_and_heads_past_two_to_the_31_elements():
    """Offsets are 64-bit: the third token's projection row and the third KV head of the
    cache start 2**31 elements into their tensors (a long prompt's projection, a large
    cache); 32-bit offsets would wrap to memory 2**31 elements before them."""
    heads, kv_heads, head_dim, span = 1, 3, 16, 2**30
    try:
        # Address space only: the pages the views do not touch are never allocated.
        memory = torch.empty(2**32 + 512, dtype=torch.float16, device=DEVICE)
    except RuntimeError:
        pytest.skip("cannot reserve 2**32 elements of address space")
    x = memory.as_strided((3, (heads + 2 * kv_heads) * head_dim), (span, 1), 2**31)
    x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(0)))
    k_out = memory.as_strided((kv_heads, 4, head_dim), (span, head_dim, 1), 2**31 + 128)
    v_out = memory.as_strided((kv_heads, 4, head_dim), (span, head_dim, 1), 2**31 + 256)
    k_out.zero_()
    v_out.zero_()
    positions = torch.tensor([3, 7, 9])
    _, table = _inputs(heads, kv_heads, head_dim, positions, torch.float16)
    slots = torch.tensor([2, 0, 3], device=DEVICE)
    want_k, want_v = torch.zeros_like(k_out), torch.zeros_like(v_out)
    want_q, _, _ = reference_rope_qkv(
        x.contiguous(), table.cos, table.sin, heads, kv_heads, want_k, want_v, slots
    )
    q, _, _ = triton_rope_qkv(x, table.cos, table.sin, heads, kv_heads, k_out, v_out, slots)
    torch.testing.assert_close(q, want_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_out, want_k, atol=2e-2, rtol=2e-2)
    assert torch.equal(v_out, want_v)
