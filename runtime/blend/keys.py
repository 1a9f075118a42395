"""Segment keys: the one definition of what names a segment's cached KV.

A key hashes the segment's tokens with the model, the dtype the tiers hold its KV in (and
the model's own where that is another: KV rounded from a float32 model's is not a bfloat16
model's) and, for documents cached right after the system prompt
(`BlendConfig.cache_after_system`), the tokens of that context (system prompt and
separator): KV computed after another system prompt is other KV. The system prompt itself
is cached alone from position 0, always in the model's own dtype (`system_kv_dtype`;
documents in `kv_dtype`, which a narrower `kv.storeDtype` rounds): one segment shared by
every prompt, the exact prefix of each.
Documents shorter than `min_segment_tokens` (and the question) are never cached: None.

Both engines key through `SegmentKeyer`: holeblend-serve's (`BlendEngine`) and the vLLM
connector's scheduler side, so a segment stored by one is found by the other.

The model a key names (`keyed_model_id`) is blend.json's `model.name` together with the
engine's own identity of the weights it loaded (vLLM: `path@revision`; holeblend-serve:
the GGUF's `stem:size`): new weights behind the same path or file name, deployed under a
new `model.name`, never reuse the old weights' KV. vLLM's adds `+rope-<digest>` of the
RoPE settings it runs the weights with when `--hf-overrides` make them other than the
checkpoint's own: K is stored rotated, so KV computed under another RoPE is other KV
(without such overrides the id, and every key, stays as before).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from holeblend_runtime.blend.config import BlendConfig, stored_kv_dtype
from holeblend_runtime.blend.segments import Segment, SegmentedPrompt, SegmentKind, segment_key

# Longest model id written out; a longer one is named by a hash (ids travel in stored
# entries' metadata, blob headers and lookup-server messages, which take 256 characters).
MAX_MODEL_ID_CHARS = 160
# Between the model's name and the weights' identity in a model id.
MODEL_ID_SEPARATOR = "|"


def keyed_model_id(name: str | None, weights_id: str) -> str:
    """The model id segment keys, stored entries and calibration scopes name: `name`
    (blend.json's `model.name`) and `weights_id` (the engine's identity of the weights it
    loaded) as `name|weights_id`; `weights_id` alone without a name (no settings file).
    Deterministic; `sha256-<32 hex>` of both when that would be long (a long weights path
    without a name too), when `name` holds the separator or a character a log line should
    not (the id stays unambiguous)."""
    if not weights_id:
        raise ValueError("weights_id: must not be empty")
    model_id = f"{name}{MODEL_ID_SEPARATOR}{weights_id}" if name else weights_id
    if (
        len(model_id) <= MAX_MODEL_ID_CHARS
        and MODEL_ID_SEPARATOR not in (name or "")
        and model_id.isprintable()
    ):
        return model_id
    digest = hashlib.sha256()
    for part in (name or "", weights_id):
        data = part.encode()
        digest.update(len(data).to_bytes(8, "big") + data)
    return f"sha256-{digest.hexdigest()[:32]}"


@dataclass(frozen=True)
class SegmentKeyer:
    model_id: str
    # The dtype the tiers hold documents' KV in.
    kv_dtype: str
    blend: BlendConfig
    # The system prompt's: the model's own (None: the same as documents').
    system_kv_dtype: str | None = None

    @classmethod
    def for_model(cls, model_id: str, model_dtype: str, blend: BlendConfig) -> SegmentKeyer:
        """The keyer of a model whose KV is `model_dtype` under `blend`'s kv.storeDtype:
        documents in `stored_kv_dtype`, the system prompt in the model's own."""
        return cls(model_id, stored_kv_dtype(model_dtype, blend), blend, model_dtype)

    def keys(self, prompt: SegmentedPrompt) -> list[str | None]:
        """One key per segment; None for segments that are never cached."""
        context_key = self._context_key(prompt)
        return [
            None
            if not segment.is_cacheable(self.blend.min_segment_tokens)
            else self._key(
                segment.token_ids,
                self.kv_dtype_of(segment),
                None if segment is prompt.system else context_key,
            )
            for segment in prompt.segments
        ]

    def kv_dtype_of(self, segment: Segment) -> str:
        """The dtype the tiers hold `segment`'s KV in (the one rule: the system prompt's in
        the model's own, documents' in `kv_dtype`)."""
        if segment.kind is SegmentKind.SYSTEM:
            return self.system_kv_dtype or self.kv_dtype
        return self.kv_dtype

    def _key(self, token_ids: Sequence[int], kv_dtype: str, context_key: str | None) -> str:
        return segment_key(
            token_ids,
            model_id=self.model_id,
            kv_dtype=self._kv_dtype_name(kv_dtype),
            context_key=context_key,
        )

    def _kv_dtype_name(self, kv_dtype: str) -> str:
        """The dtype a key names: `kv_dtype`, and the model's when that is another
        ("bfloat16<float32"). KV a float32 model computed and rounded to bfloat16 is not
        what a bfloat16 model computes, which would otherwise take it for its own exact KV
        (its first document as the exact prefix) from a tier both use."""
        model_dtype = self.system_kv_dtype or self.kv_dtype
        return kv_dtype if kv_dtype == model_dtype else f"{kv_dtype}<{model_dtype}"

    def document_offset(self, prompt: SegmentedPrompt) -> int:
        """Where a document starts when cached after the system prompt (0: alone)."""
        if not self.blend.cache_after_system:
            return 0
        return prompt.separator_ranges[0][1]

    def _context_key(self, prompt: SegmentedPrompt) -> str | None:
        """Documents cached after the system prompt are keyed by system + separator tokens."""
        if not self.blend.cache_after_system:
            return None
        context = prompt.token_ids[: self.document_offset(prompt)]
        return self._key(context, self.kv_dtype, None)
