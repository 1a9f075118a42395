"""The GGUF is read into the right config, weights and tokenizer, and cached on disk."""

import dataclasses
import os
import re

import pytest
import torch

from holeblend_runtime.model.gguf import (
    cache_entry_dir,
    find_smollm2_gguf,
    load_model_files,
    prune_cache,
    unpermute_qk,
)
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import preset_config, random_weights
from holeblend_runtime.model.rope import apply_rope, rope_table


def test_config_comes_from_gguf_metadata(reference_engine):
    config = reference_engine.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_theta == 100000.0
    assert (config.vocab_size, config.context_length) == (49152, 8192)
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    assert config.tie_word_embeddings
    assert config.model_id.startswith("SmolLM2-135M-Instruct")


def test_cache_entry_changes_when_the_gguf_file_changes(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x" * 10)
    first = cache_entry_dir(gguf, tmp_path / "cache")
    os.utime(gguf, ns=(1, 1))
    assert cache_entry_dir(gguf, tmp_path / "cache") != first
    gguf.write_bytes(b"x" * 11)
    assert cache_entry_dir(gguf, tmp_path / "cache").name.split("-")[1] == "11"


def test_gguf_is_found_in_the_installed_wheel():
    path = find_smollm2_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Hugging Face Q/K rows."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, -1)
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_permutation():
    weight = torch.randn(3 * 64, 10)
    assert torch.equal(unpermute_qk(_llama_cpp_permute(weight, 3), 3), weight)


def test_unpermuted_weights_give_rotate_half_rope():
    """Interleaved-pair RoPE on permuted rows == rotate-half RoPE on un-permuted rows."""
    weight, x = torch.randn(64, 8), torch.randn(5, 8)
    table = rope_table(torch.arange(5), head_dim=64, theta=10000.0, dtype=torch.float32)
    permuted = x @ _llama_cpp_permute(weight, 1).T
    pairs = permuted.view(5, 32, 2)
    cos, sin = table.cos[:, :32], table.sin[:, :32]
    interleaved = torch.stack(
        [pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 0] * sin + pairs[..., 1] * cos], -1
    ).view(5, 64)
    rotate_half = apply_rope(x @ unpermute_qk(_llama_cpp_permute(weight, 1), 1).T, table)
    order = torch.cat([torch.arange(0, 64, 2), torch.arange(1, 64, 2)])
    torch.testing.assert_close(interleaved[:, order], rotate_half, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_damaged_weight_cache_is_rebuilt(tmp_path, reference_engine):
    files = load_model_files(cache_dir=tmp_path)
    entry = cache_entry_dir(find_smollm2_gguf(), tmp_path)
    weights = entry / "weights.safetensors"
    damaged = weights.read_bytes()[:1000]
    weights.unlink()  # a new file: `files` still maps the old one
    weights.write_bytes(damaged)
    # Entries of earlier installs of the same file (other mtimes): the rebuild keeps the
    # newest other one beside its own.
    stem_and_size, _, cache_format = entry.name.rsplit("-", 2)
    earlier = [_fake_entry(tmp_path, stem_and_size, i, suffix=f"-{cache_format}")
             for i in (1, 2)]  # fmt: skip
    rebuilt = load_model_files(cache_dir=tmp_path)
    assert entry.is_dir() and earlier[0].is_dir() and not earlier[1].exists()
    assert rebuilt.config == files.config == reference_engine.config
    assert weights.stat().st_size > 100_000_000
    torch.testing.assert_close(
        rebuilt.weights["blk.3.attn_k.weight"], files.weights["blk.3.attn_k.weight"]
    )


@pytest.mark.parametrize("lost", ["weights.safetensors", "tokenizer.json", "config.json"])
def test_a_cache_entry_missing_a_file_is_rebuilt(tmp_path, lost):
    """An entry folder left without one of its files (a removal cut short, a file deleted
    by hand) is rebuilt in place, not kept: the new entry could not be renamed onto it,
    and every load failed until someone removed the folder."""
    gguf = _write_one_layer_llama(tmp_path / "tiny.gguf")
    first = load_model_files(gguf, tmp_path / "cache")
    entry = cache_entry_dir(gguf, tmp_path / "cache")
    (entry / lost).unlink()
    rebuilt = load_model_files(gguf, tmp_path / "cache")
    assert (entry / lost).is_file() and rebuilt.config == first.config
    torch.testing.assert_close(rebuilt.weights, first.weights)


@pytest.mark.parametrize(
    "key",
    [
        "llama.block_count",
        "llama.context_length",
        "llama.attention.layer_norm_rms_epsilon",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.merges",
    ],
)
def test_a_gguf_missing_required_metadata_is_refused_naming_the_key(tmp_path, key):
    """A GGUF without a key the engine needs (not a whole llama.cpp conversion) is refused
    naming the key, not failed with a TypeError from deep in the reader."""
    gguf = _write_one_layer_llama(tmp_path / "tiny.gguf", without=key)
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}: missing from the GGUF"):
        load_model_files(gguf, tmp_path / "cache")
    assert load_model_files(_write_one_layer_llama(tmp_path / "whole.gguf"), tmp_path / "cache")


def _write_one_layer_llama(path, without=None, byte_order="little", stored=None):
    """A one-layer Llama GGUF (random weights, a 4-token vocabulary): loads in moments.
    `without`: a metadata key left out; `byte_order`: "little" or "big" (the numbers of
    metadata and of F32/F16/F64 tensors swapped); `stored`: tensor name -> the GGML type it
    is written as (F32 by default; F16, F64 or a quantization)."""
    import gguf
    import numpy as np

    hidden, ffn, rng = 16, 32, np.random.default_rng(0)
    endianess = gguf.GGUFEndian[byte_order.upper()]
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    for key, add, value in [
        ("llama.block_count", writer.add_block_count, 1),
        ("llama.context_length", writer.add_context_length, 64),
        ("llama.embedding_length", writer.add_embedding_length, hidden),
        ("llama.feed_forward_length", writer.add_feed_forward_length, ffn),
        ("llama.attention.head_count", writer.add_head_count, 2),
        ("llama.attention.layer_norm_rms_epsilon", writer.add_layer_norm_rms_eps, 1e-5),
        ("tokenizer.ggml.model", writer.add_tokenizer_model, "gpt2"),
        ("tokenizer.ggml.tokens", writer.add_token_list, ["a", "b", "ab", "<|end|>"]),
        ("tokenizer.ggml.token_type", writer.add_token_types, [1, 1, 1, 3]),
        ("tokenizer.ggml.merges", writer.add_token_merges, ["a b"]),
        ("tokenizer.ggml.eos_token_id", writer.add_eos_token_id, 3),
    ]:
        if key != without:
            add(value)
    shapes = {"token_embd": (4, hidden), "output_norm": (hidden,)}
    for name, shape in {
        "attn_norm": (hidden,), "attn_q": (hidden, hidden), "attn_k": (hidden, hidden),
        "attn_v": (hidden, hidden), "attn_output": (hidden, hidden), "ffn_norm": (hidden,),
        "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn),
    }.items():  # fmt: skip
        shapes[f"blk.0.{name}"] = shape
    numbers = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
    for name, shape in shapes.items():
        values = rng.normal(0, 0.02, shape)
        kind = (stored or {}).get(f"{name}.weight", "F32")
        if kind in numbers:
            values = values.astype(numbers[kind])
        else:
            values = gguf.quants.quantize(
                values.astype(np.float32), gguf.GGMLQuantizationType[kind]
            )
        writer.add_tensor(f"{name}.weight", values, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_big_endian_gguf_loads_the_weights_a_little_endian_one_holds(tmp_path):
    """A GGUF written big-endian (llama.cpp's converter for s390x) holds its F32 and F16
    numbers byte-swapped: they load as the little-endian file's values, not as the swapped
    bytes read as native numbers."""
    stored = {"token_embd.weight": "F16"}
    little, big = (
        load_model_files(
            _write_one_layer_llama(tmp_path / f"{order}.gguf", byte_order=order, stored=stored),
            tmp_path / "cache",
        )
        for order in ("little", "big")
    )
    assert dataclasses.replace(big.config, model_id="") == dataclasses.replace(
        little.config, model_id=""
    )
    assert big.weights.keys() == little.weights.keys()
    for name, weight in little.weights.items():
        assert torch.equal(big.weights[name], weight), name


def test_a_quantized_tensor_of_a_big_endian_gguf_is_refused_naming_it(tmp_path):
    """Quantized blocks of a byte-swapped file hold swapped scales the reader cannot read:
    refused naming the tensor, its type and the conversion that fixes the file."""
    gguf = _write_one_layer_llama(
        tmp_path / "big.gguf", byte_order="big", stored={"blk.0.ffn_down.weight": "Q8_0"}
    )
    with pytest.raises(ValueError, match=r"^blk\.0\.ffn_down\.weight: a Q8_0 tensor .*endian"):
        load_model_files(gguf, tmp_path / "cache")
    little = _write_one_layer_llama(
        tmp_path / "little.gguf", stored={"blk.0.ffn_down.weight": "Q8_0"}
    )
    weights = load_model_files(little, tmp_path / "cache").weights
    assert weights["blk.0.ffn_down.weight"].shape == (16, 32)


def test_a_tensor_type_the_reader_cannot_dequantize_is_refused_naming_the_tensor(tmp_path):
    """A tensor of a type gguf does not dequantize (F64 here) is a ValueError naming the
    tensor and the type, not gguf's NotImplementedError naming neither the tensor nor a fix."""
    gguf = _write_one_layer_llama(tmp_path / "f64.gguf", stored={"blk.0.ffn_up.weight": "F64"})
    with pytest.raises(ValueError, match=r"^blk\.0\.ffn_up\.weight: tensor type F64 is not"):
        load_model_files(gguf, tmp_path / "cache")


def _fake_entry(cache: os.PathLike, prefix: str, age: int, suffix: str = "-v1"):
    """A cache folder named PREFIX-AGE+SUFFIX whose mtime is `age` hours ago."""
    from pathlib import Path

    path = Path(cache) / f"{prefix}-{age}{suffix}"
    path.mkdir(parents=True)
    (path / "weights.safetensors").write_bytes(b"w")
    stamp = 1_700_000_000 - age * 3600
    os.utime(path, (stamp, stamp))
    return path


def test_pruning_keeps_the_newest_entries_of_one_model_only(tmp_path):
    stem = "SmolLM2-135M-Instruct.Q4_1"
    mine = [_fake_entry(tmp_path, f"{stem}-98362432", age) for age in (3, 1, 2, 5)]
    # Another model whose name starts with this one's, another format, a file: untouched.
    other = _fake_entry(tmp_path, f"{stem}-extra-98362432", 9)
    old_format = _fake_entry(tmp_path, f"{stem}-98362432", 8, suffix="-v1x")
    dead_build = _fake_entry(tmp_path, f".{stem}-98362432-7-v1-abc", 0, suffix="")
    os.utime(dead_build, (1, 1))
    live_build = tmp_path / f".{stem}-98362432-6-v1-def"
    live_build.mkdir()
    removed = prune_cache(tmp_path, stem)
    assert sorted(p.name for p in removed) == sorted([mine[0].name, mine[3].name, dead_build.name])
    assert mine[1].is_dir() and mine[2].is_dir() and not mine[0].exists()
    assert other.is_dir() and old_format.is_dir() and live_build.is_dir()
    assert prune_cache(tmp_path, stem) == []


def test_cpu_projections_are_stored_transposed_with_the_checkpoints_values():
    """On the CPU each projection's storage is [in, out] (`x @ w.T` reads it contiguously,
    faster for a decode step's few rows); shapes, values and the forward are unchanged."""
    config = dataclasses.replace(
        preset_config("smollm2-135m"), num_layers=2, vocab_size=500, context_length=64
    )
    weights = random_weights(config)
    model = Llama(config, weights)
    checkpoint_layout = {
        "qkv": torch.cat([weights[f"blk.1.attn_{n}.weight"] for n in "qkv"]),
        "out": weights["blk.1.attn_output.weight"],
        "gate_up": torch.cat([weights["blk.1.ffn_gate.weight"], weights["blk.1.ffn_up.weight"]]),
        "down": weights["blk.1.ffn_down.weight"],
    }
    for name, expected in checkpoint_layout.items():
        stored = getattr(model.layers[1], name)
        assert stored.T.is_contiguous(), name
        assert torch.equal(stored, expected), name
    assert model.output.T.is_contiguous() and torch.equal(model.output, model.embedding)
    assert model.embedding.is_contiguous()  # lookups read rows

    # The same forward as with the checkpoint's layout.
    plain = Llama(config, weights)
    plain.layers = [
        dataclasses.replace(w, **{n: getattr(w, n).contiguous() for n in checkpoint_layout})
        for w in plain.layers
    ]
    plain.output = plain.output.contiguous()
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    logits = [
        m.logits(m.forward(ids, *m.new_kv(41), 0)) for m in (model, plain)
    ]  # fmt: skip
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_accelerators_keep_the_checkpoints_layout():
    config = dataclasses.replace(
        preset_config("smollm2-135m"), num_layers=1, vocab_size=500, context_length=64
    )
    model = Llama(config, random_weights(config), device="meta")
    assert model.layers[0].qkv.is_contiguous() and model.output.is_contiguous()
