"""Segment keys: the one definition of what names a segment's cached KV.

A key hashes the segment's tokens with the model, the KV dtype and, for documents cached
right after the system prompt (`BlendConfig.cache_after_system`), the tokens of that
context (system prompt and separator): KV computed after another system prompt is other
KV. The system prompt itself is cached alone from position 0. Segments shorter than
`min_segment_tokens` (and the question) are never cached: None.

Both engines key through `SegmentKeyer`: holeblend-serve's (`BlendEngine`) and the vLLM
connector's scheduler side, so a segment stored by one is found by the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.segments import SegmentedPrompt, segment_key


@dataclass(frozen=True)
class SegmentKeyer:
    model_id: str
    kv_dtype: str
    blend: BlendConfig

    def keys(self, prompt: SegmentedPrompt) -> list[str | None]:
        """One key per segment; None for segments that are never cached."""
        context_key = self._context_key(prompt)
        return [
            None
            if not segment.is_cacheable(self.blend.min_segment_tokens)
            else segment_key(
                segment.token_ids,
                model_id=self.model_id,
                kv_dtype=self.kv_dtype,
                context_key=None if segment is prompt.system else context_key,
            )
            for segment in prompt.segments
        ]

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
        return segment_key(context, model_id=self.model_id, kv_dtype=self.kv_dtype)
