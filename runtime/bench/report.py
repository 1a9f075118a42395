"""Per-request measurements -> one result row per (mode, ratio, pass), as a table or JSON."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy

# Column order of the table and key order of each JSON result; scripts read these names.
RESULT_KEYS = (
    "mode",
    "ratio",
    "pass",
    "store_policy",
    "selection",
    "num_prompts",
    "reused_share",
    "hole_share",
    "recomputed_share",
    "ttft_mean_s",
    "ttft_p90_s",
    "speedup_vs_full",
    "request_s_mean",
    "speedup_request_vs_full",
    "background_store_s_mean",
    "f1_vs_full",
    "top1_vs_full",
    "kl_vs_full",
    "gold_loss",
    "f1_vs_gold",
)


@dataclass(frozen=True)
class RequestMeasure:
    """One prompt sent once in one mode."""

    num_prompt_tokens: int
    num_reused_tokens: int
    num_hole_tokens: int
    num_recomputed_tokens: int
    # Time to the first token's logits, and call to return (lookup, blending and any
    # synchronous store): both from the start of building the prompt (tokenizing it).
    ttft_s: float
    request_s: float
    # Answer-token F1 of this answer against the full-prefill answer.
    f1_vs_full: float
    # Over the full-prefill answer's span, teacher-forced.
    top1_vs_full: float
    kl_vs_full: float
    # Mean NLL of the gold answer tokens, teacher-forced.
    gold_loss: float
    f1_vs_gold: float
    # CPU seconds the process spent building the prompt and in the call (all its
    # threads): steadier than wall time on a shared machine; 0 where not measured.
    request_cpu_s: float = 0.0
    # The check layer's deviation per compared cached token (how far the cached KV is from
    # this prompt's), and what the blend left of it unrecomputed (the inline proxy's
    # statistic); None where nothing was blended (full prefill, a full miss).
    deviation_mean: float | None = None
    residual_deviation: float | None = None
    # How sure this prefill is of the first answer token: log-probability of its most
    # likely token minus the second's (nats; small: an answer on a knife edge).
    first_token_margin: float | None = None


def summarize(
    mode: str,
    ratio: float | None,
    pass_number: int,
    measures: Sequence[RequestMeasure],
    full_ttft_mean_s: float,
    full_request_mean_s: float,
    store_policy: str | None = None,
    background_store_s: float = 0.0,
    selection: str | None = None,
) -> dict[str, Any]:
    """One result row; `ratio`, `store_policy` and `selection` are None for full prefill
    (nothing is reused, selected or stored). `background_store_s`: seconds the background store computed for
    these requests (isolated policy), spread over them in `background_store_s_mean`."""
    if not measures:
        raise ValueError("measures: need at least one request")
    num_tokens = sum(m.num_prompt_tokens for m in measures)
    ttfts = [m.ttft_s for m in measures]
    ttft_mean = statistics.fmean(ttfts)
    request_mean = statistics.fmean(m.request_s for m in measures)
    row = {
        "mode": mode,
        "ratio": ratio,
        "pass": pass_number,
        "store_policy": store_policy,
        "selection": selection,
        "num_prompts": len(measures),
        "reused_share": sum(m.num_reused_tokens for m in measures) / num_tokens,
        "hole_share": sum(m.num_hole_tokens for m in measures) / num_tokens,
        "recomputed_share": sum(m.num_recomputed_tokens for m in measures) / num_tokens,
        "ttft_mean_s": ttft_mean,
        "ttft_p90_s": percentile(ttfts, 0.9),
        "speedup_vs_full": full_ttft_mean_s / ttft_mean,
        "request_s_mean": request_mean,
        "speedup_request_vs_full": full_request_mean_s / request_mean,
        "background_store_s_mean": background_store_s / len(measures),
    }
    for name in ("f1_vs_full", "top1_vs_full", "kl_vs_full", "gold_loss", "f1_vs_gold"):
        row[name] = statistics.fmean(getattr(m, name) for m in measures)
    row["num_prompt_tokens_mean"] = num_tokens / len(measures)
    return row


def percentile(values: Sequence[float], share: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("values: need at least one value")
    return float(numpy.percentile(values, 100 * share))


def format_table(results: Sequence[dict[str, Any]], keys: Sequence[str] = RESULT_KEYS) -> str:
    headers = [_short_header(key) for key in keys]
    rows = [[_format_cell(result.get(key)) for key in keys] for result in results]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [_format_line(headers, widths), _format_line(["-" * w for w in widths], widths)]
    lines += [_format_line(row, widths) for row in rows]
    return "\n".join(lines)


def write_json(
    path: Path, model: str, config: dict[str, Any], results: Sequence[dict[str, Any]]
) -> None:
    """Write the document whole or not at all: through a file beside `path` renamed over
    it, so a failed write (a full disk, an interrupt) leaves any earlier file as it was.
    A NaN or infinite number (overflowed half-precision logits) is written as null:
    strict JSON readers refuse Python's NaN and Infinity."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"model": model, "config": config, "results": list(results)}
    text = json.dumps(_finite(document), indent=2, allow_nan=False) + "\n"
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float in it replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _short_header(key: str) -> str:
    key = key.replace("speedup_request_cpu_vs_full", "x_cpu")
    key = key.replace("speedup_request_vs_full", "x_req").replace("speedup_vs_full", "x_ttft")
    key = key.replace("background_store_s_mean", "bg_store_s").replace("store_policy", "store")
    return key.replace("_share", "").replace("_vs_full", "/full").replace("_vs_gold", "/gold")


def _format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list | tuple):
        # An interval [low, high].
        return "[" + ",".join(_format_cell(v) for v in value) + "]"
    return str(value)


def _format_line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(cell.rjust(width) for cell, width in zip(cells, widths, strict=True))
