"""Scaled RoPE read from a GGUF: Llama 3.1's `rope_freqs.weight`, linear scaling, and the
scaling types the engine does not implement (refused at load)."""

import math

import gguf
import numpy as np
import pytest
import torch

from holeblend_runtime.model.gguf import load_model_files
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.rope import RopeCache, RopeTable, apply_rope, rerotate, rope_table

THETA = 500000.0
HEAD_DIM = 32
POSITIONS = torch.tensor([0, 1, 7, 1000, 8191, 30000])


def _write_tiny_llama(path, *, rope_freqs=None, scaling_type=None, scaling_factor=None, extra=()):
    """A one-layer Llama GGUF (2 heads of HEAD_DIM, random weights, a 4-token vocabulary)
    with the given RoPE scaling, as llama.cpp's converter writes it."""
    hidden, ffn, vocab = 2 * HEAD_DIM, 96, 4
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(THETA)
    if scaling_type is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling_type))
    if scaling_factor is not None:
        writer.add_rope_scaling_factor(scaling_factor)
    for key, value in extra:
        writer.add_uint32(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab", "<|end|>"])
    writer.add_token_types([1, 1, 1, 3])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(3)
    rng = np.random.default_rng(0)

    def tensor(name, *shape):
        writer.add_tensor(name, rng.normal(0, 0.02, shape).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for name, shape in {
        "attn_q": (hidden, hidden), "attn_k": (HEAD_DIM, hidden), "attn_v": (HEAD_DIM, hidden),
        "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }.items():  # fmt: skip
        tensor(f"blk.0.{name}.weight", *shape)
    for name in ("attn_norm", "ffn_norm"):
        writer.add_tensor(f"blk.0.{name}.weight", np.ones(hidden, dtype=np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _loaded_model(tmp_path, **scaling):
    """The tiny GGUF loaded as the engine loads a model, in float64 (exact angles)."""
    files = load_model_files(_write_tiny_llama(tmp_path / "tiny.gguf", **scaling), tmp_path)
    return Llama(files.config, files.weights, dtype=torch.float64)


def _base_inverse_frequencies():
    """Plain RoPE's: theta^(-2i / head_dim)."""
    exponents = torch.arange(0, HEAD_DIM, 2, dtype=torch.float64)
    return 1.0 / THETA ** (exponents / HEAD_DIM)


def _assert_table_is(table, positions, inv_freq, atol=1e-9):
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    torch.testing.assert_close(table.cos, angles.cos(), atol=atol, rtol=0)
    torch.testing.assert_close(table.sin, angles.sin(), atol=atol, rtol=0)


def _llama3_inverse_frequencies(factor=8.0, low=1.0, high=4.0, original_context=8192):
    """Llama 3.1's published RoPE scaling of the inverse frequencies: long wavelengths
    divided by `factor`, short ones kept, a smooth blend between."""
    scaled = []
    for inv_freq in _base_inverse_frequencies().tolist():
        wavelength = 2 * math.pi / inv_freq
        if wavelength < original_context / high:
            scaled.append(inv_freq)
        elif wavelength > original_context / low:
            scaled.append(inv_freq / factor)
        else:
            smooth = (original_context / wavelength - low) / (high - low)
            scaled.append((1 - smooth) * inv_freq / factor + smooth * inv_freq)
    return torch.tensor(scaled, dtype=torch.float64)


def _llama_cpp_rope_freqs(factor=8.0, low=1.0, high=4.0, original_context=8192):
    """`rope_freqs.weight` as llama.cpp's converter computes it for a "llama3" model: one
    divisor per rotary pair."""
    freqs = []
    for inv_freq in _base_inverse_frequencies().tolist():
        wavelength = 2 * math.pi / inv_freq
        if wavelength < original_context / high:
            freqs.append(1.0)
        elif wavelength > original_context / low:
            freqs.append(factor)
        else:
            smooth = (original_context / wavelength - low) / (high - low)
            freqs.append(1 / ((1 - smooth) / factor + smooth))
    return freqs


def test_rope_freqs_tensor_divides_the_inverse_frequencies(tmp_path):
    factors = np.linspace(1.0, 6.0, HEAD_DIM // 2, dtype=np.float32)
    model = _loaded_model(tmp_path, rope_freqs=factors)
    want = _base_inverse_frequencies() / torch.from_numpy(factors).to(torch.float64)
    _assert_table_is(model.rope(POSITIONS), POSITIONS, want)
    _assert_table_is(model.rope_upto(100), torch.arange(100), want)
    # The converted model's cache gives the same config back.
    again = load_model_files(tmp_path / "tiny.gguf", tmp_path)
    assert again.config == model.config


def test_llama3_scaling_matches_the_published_formula(tmp_path):
    reference = _llama3_inverse_frequencies()
    base = _base_inverse_frequencies()
    # The formula divides some frequencies by 8, keeps some, blends at least one.
    assert (reference == base).any() and torch.isclose(reference, base / 8).any()
    assert ((reference < base) & ~torch.isclose(reference, base / 8)).any()
    model = _loaded_model(tmp_path, rope_freqs=_llama_cpp_rope_freqs())
    # The file holds the factors in float32 (6e-8 relative): angles up to ~16 rad of the
    # blended pair move by up to ~1e-6.
    _assert_table_is(model.rope(POSITIONS), POSITIONS, reference, atol=2e-6)


def test_linear_scaling_divides_positions(tmp_path):
    model = _loaded_model(tmp_path, scaling_type="linear", scaling_factor=4.0)
    _assert_table_is(model.rope(POSITIONS), POSITIONS / 4, _base_inverse_frequencies())


def test_scaling_type_none_leaves_rope_unscaled_whatever_the_factor(tmp_path):
    """llama.cpp never scales a model whose scaling type is "none" (the factor is read but
    not applied): the engine's angles are plain RoPE's, not positions divided by 4."""
    model = _loaded_model(tmp_path, scaling_type="none", scaling_factor=4.0)
    assert model.config.rope_divisors is None
    _assert_table_is(model.rope(POSITIONS), POSITIONS, _base_inverse_frequencies())


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_unimplemented_scaling_types_are_refused_at_load(tmp_path, kind):
    path = _write_tiny_llama(tmp_path / "tiny.gguf", scaling_type=kind, scaling_factor=4.0)
    with pytest.raises(ValueError, match=rf"llama\.rope\.scaling\.type: .*'{kind}'"):
        load_model_files(path, tmp_path)


def test_rope_freqs_of_the_wrong_length_are_refused(tmp_path):
    path = _write_tiny_llama(tmp_path / "tiny.gguf", rope_freqs=[2.0] * (HEAD_DIM // 2 - 1))
    with pytest.raises(ValueError, match="rope_freq_factors"):
        load_model_files(path, tmp_path)


@pytest.mark.parametrize(
    "key", ["attention.key_length", "attention.value_length", "rope.dimension_count"]
)
def test_heads_of_another_width_or_partly_rotated_are_refused_naming_the_key(tmp_path, key):
    """The engine's heads are embedding_length / head_count wide and fully rotated; a file
    that says otherwise is refused at load (the same width loads)."""
    same = _write_tiny_llama(tmp_path / "same.gguf", extra=[(f"llama.{key}", HEAD_DIM)])
    assert load_model_files(same, tmp_path).config.head_dim == HEAD_DIM
    other = _write_tiny_llama(tmp_path / "other.gguf", extra=[(f"llama.{key}", HEAD_DIM // 2)])
    with pytest.raises(ValueError, match=rf"llama\.{key}: {HEAD_DIM // 2} is not supported"):
        load_model_files(other, tmp_path)


def test_scaled_rerotation_equals_rotation_at_the_new_positions():
    """Cached K moved by re-rotation must match K rotated at its new positions under the
    same scaled frequencies (the blender's moved segments)."""
    divisors = _llama_cpp_rope_freqs()
    k = torch.randn(2, 5, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    start, end = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([900, 901, 902, 7000, 7001])

    def at(positions):
        table = rope_table(
            positions, head_dim=HEAD_DIM, theta=THETA, dtype=torch.float32, divisors=divisors
        )
        return apply_rope(k, table)

    moved = rerotate(at(start), start, end, theta=THETA, divisors=divisors)
    torch.testing.assert_close(moved, at(end), atol=2e-5, rtol=0)
    cache = RopeCache(
        head_dim=HEAD_DIM, theta=THETA, dtype=torch.float64, device="cpu",
        max_positions=8192, divisors=divisors,
    )  # fmt: skip
    table, rows = cache.offsets_table(end - start)
    _assert_table_is(
        RopeTable(table.cos[rows], table.sin[rows]),
        end - start,
        _llama3_inverse_frequencies(),
    )


def test_smollm2_rope_is_unscaled_and_unchanged(reference_engine):
    """SmolLM2 has no RoPE scaling: its tables are plain RoPE's, bit for bit."""
    model = reference_engine.model
    c = model.config
    exponents = torch.arange(0, c.head_dim, 2, dtype=torch.float64)
    inv_freq = 1.0 / c.rope_theta ** (exponents / c.head_dim)
    for positions, table in [
        (POSITIONS, model.rope(POSITIONS)),
        (torch.arange(64), model.rope_upto(64)),
    ]:
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        assert torch.equal(table.cos, angles.cos().to(model.dtype))
        assert torch.equal(table.sin, angles.sin().to(model.dtype))
