"""How the blender reuses cached KV: validated once, passed whole.

The defaults and the selection names are the blend settings contract's
(`holeblend_contract.blend_settings`); `from_settings` builds a config from a parsed
`blend.json`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from holeblend_contract import blend_settings as contract

# Names of the built-in token selection strategies (see blend/selection.py).
K_DEVIATION = contract.Selection.K_DEVIATION.value
V_DEVIATION = contract.Selection.V_DEVIATION.value
KV_DEVIATION = contract.Selection.KV_DEVIATION.value
SINKS = contract.Selection.SINKS.value
QUERY = contract.Selection.QUERY.value
RANDOM = contract.Selection.RANDOM.value
SELECTION_NAMES = tuple(s.value for s in contract.Selection)
DEFAULT_SELECTION = contract.DEFAULT_SELECTION
# Store policies: how a segment the request had to compute gets into the KV store
# (see kv/store_worker.py and docs/blending.md).
IN_CONTEXT = contract.StorePolicy.IN_CONTEXT.value
ISOLATED = contract.StorePolicy.ISOLATED.value
STORE_POLICIES = (IN_CONTEXT, ISOLATED)
# The dtypes the KV tiers may hold segment KV in; "auto": the model's KV dtype.
AUTO_DTYPE = contract.Dtype.AUTO.value
KV_STORE_DTYPES = tuple(d.value for d in contract.KVStoreDtype)
# LMCache's separator without its trailing space: with a leading space on every piece
# the pieces tokenize exactly as the whole prompt does (see docs/blending.md).
DEFAULT_SEPARATOR = contract.DEFAULT_SEPARATOR


@dataclass(frozen=True)
class BlendConfig:
    """Blending knobs; `ratio` may be overridden per request."""

    # Layer whose fresh K is compared with the cached K; layers up to it run in full.
    # At least 1: K at layer 0 depends only on the token and its position, so after
    # re-rotation its deviation is rounding noise and would pick tokens at random.
    check_layer: int = contract.DEFAULT_CHECK_LAYER
    # Share of the cached tokens recomputed in the layers after the check layer.
    ratio: float = contract.DEFAULT_RECOMPUTE_RATIO
    # Token selection: one strategy name (default kvDeviation) or a mix with budget shares,
    # "sinks:0.25+kDeviation" (see blend/selection.py and the contract's `parse_selection`).
    selection: str = DEFAULT_SELECTION
    # Later layers at which the recompute set is narrowed (gradual filtering): the check
    # layer picks (1 + len) times what the last filter layer keeps, each filter layer keeps
    # fewer by that layer's deviation; budget-neutral, so the last keeps less than the
    # budget (see docs/blending.md). Empty: one check layer.
    filter_layers: tuple[int, ...] = ()
    # Pick the top ratio share separately in each run of cached tokens between holes.
    per_section: bool = False
    separator: str = DEFAULT_SEPARATOR
    # Documents shorter than this are never cached (computed fresh every time).
    min_segment_tokens: int = contract.DEFAULT_MIN_SEGMENT_TOKENS
    # Cache a document at the positions right after the system prompt (True) or alone
    # from position 0 (False); after the system prompt roughly halves blending error.
    cache_after_system: bool = True
    # Seed of the random selection strategy (a fresh generator per request).
    seed: int = 0
    # "in-context": keep the KV the request computed for a missing segment, at its
    # positions in that prompt (free). "isolated": recompute it alone after the system
    # prompt in a low-priority background worker (exact for its key, costs a forward).
    store_policy: str = IN_CONTEXT
    # The dtype the KV tiers hold segment KV in (blend.json's kv.storeDtype): "auto" keeps
    # the model's (lossless); bfloat16 or float16 under a float32 model halve every tier's
    # bytes per segment, float8_e4m3fn quarters them (halves a 16-bit model's), for a
    # rounding of the reused KV. The engine converts on store and on load, and documents'
    # keys name this dtype (`stored_kv_dtype`; the system prompt stays in the model's).
    kv_store_dtype: str = AUTO_DTYPE

    def __post_init__(self) -> None:
        if self.check_layer < 1:
            raise ValueError(
                f"check_layer: must be >= 1, got {self.check_layer} (at layer 0 K depends "
                "only on the token and its position, so its deviation means nothing)"
            )
        check_ratio(self.ratio)
        try:
            contract.parse_selection(self.selection)
        except ValueError as error:
            raise ValueError(f"selection: {error}") from None
        try:
            contract.check_filter_layers(self.check_layer, self.filter_layers)
        except ValueError as error:
            raise ValueError(f"filter_layers: {error}") from None
        if self.store_policy not in STORE_POLICIES:
            raise ValueError(
                f"store_policy: expected one of {STORE_POLICIES}, got {self.store_policy!r}"
            )
        if self.kv_store_dtype not in KV_STORE_DTYPES:
            raise ValueError(
                f"kv_store_dtype: expected one of {KV_STORE_DTYPES}, got {self.kv_store_dtype!r}"
            )
        if not self.separator or self.separator.isspace():
            raise ValueError("separator: must contain a visible character")
        if self.min_segment_tokens < 1:
            raise ValueError(f"min_segment_tokens: must be >= 1, got {self.min_segment_tokens}")


def from_settings(settings: contract.BlendSettings) -> BlendConfig:
    """The blending knobs of a parsed `blend.json` (runtime-only knobs keep their defaults)."""
    return BlendConfig(
        check_layer=settings.check_layer,
        ratio=settings.recompute_ratio,
        selection=settings.selection,
        filter_layers=tuple(settings.filter_layers),
        separator=settings.separator,
        min_segment_tokens=settings.min_segment_tokens,
        cache_after_system=settings.segment_context is contract.SegmentContext.AFTER_SYSTEM,
        store_policy=settings.store_policy.value,
        kv_store_dtype=settings.kv.store_dtype.value,
    )


def stored_kv_dtype(model_dtype: str, config: BlendConfig) -> str:
    """The dtype name the KV tiers hold a model's segment KV in (`model_dtype`: the
    model's KV dtype, e.g. "float32"): what segment keys and blob headers name.

    Only a narrower dtype than the model's (in bytes) is a choice: another dtype of the
    same or more bytes would hold no more documents and only lose precision (bfloat16 for
    a float16 model) or range (float16 for a bfloat16 model), so it is refused, with the
    fix; that also keeps every load a widening conversion, exact for what was stored."""
    stored = config.kv_store_dtype
    if stored in (AUTO_DTYPE, model_dtype):
        return model_dtype
    if _itemsize(stored) >= _itemsize(model_dtype):
        raise ValueError(
            f"kv.storeDtype: {stored} under a {model_dtype} model would take as many bytes "
            f"per segment as {model_dtype} or more and round the KV; set it to auto (or to a "
            "narrower dtype than the model's: bfloat16, float16 or float8_e4m3fn under "
            "float32, float8_e4m3fn under float16 or bfloat16)"
        )
    return stored


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def check_ratio(ratio: float) -> float:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio: must be within [0, 1], got {ratio}")
    return ratio
