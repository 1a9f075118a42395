"""Segment keys: the one definition of what names a segment's cached KV.

A key hashes the segment's tokens with the model, the dtype the tiers hold its KV in and,
for documents cached right after the system prompt (`BlendConfig.cache_after_system`), the
tokens of that context (system prompt and separator): KV computed after another system
prompt is other KV. The system prompt itself is cached alone from position 0, always in
the model's own dtype (`system_kv_dtype`; documents in `kv_dtype`, which a narrower
`kv.storeDtype` rounds): one segment shared by every prompt, the exact prefix of each.
Segments shorter than `min_segment_tokens` (and the question) are never cached: None.

Both engines key through `SegmentKeyer`: holeblend-serve's (`BlendEngine`) and the vLLM
connector's scheduler side, so a segment stored by one is found by the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from holeblend_runtime.blend.config import BlendConfig, stored_kv_dtype
from holeblend_runtime.blend.segments import Segment, SegmentedPrompt, SegmentKind, segment_key


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
            token_ids, model_id=self.model_id, kv_dtype=kv_dtype, context_key=context_key
        )

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
