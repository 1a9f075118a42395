"""Quality sweep rows: means with seeded bootstrap 95% intervals over prompts.

One row per (mode, ratio, selection, measured pass), plus full prefill's. Speedups are
full prefill's mean time over the row's on the same prompts in the same run; the interval
resamples prompts (full and blended together, so the pairing holds). Beside each quality
mean: the paired difference against the baseline selection (kDeviation when swept) at the
same mode and ratio, resampled over the same prompts, and the row's mean TTFT and call to
return over the baseline's. A row of one prompt has no intervals (None). Every row keeps
its per-prompt measurements.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy

from holeblend_contract.blend_settings import DEFAULT_CHECK_LAYER
from holeblend_runtime.bench.report import RequestMeasure
from holeblend_runtime.bench.runner import FULL, FULL_POINT, MeasureKey, parse_selection_entry
from holeblend_runtime.blend.config import K_DEVIATION

# Bootstrap resamples of the prompts; the intervals are percentile intervals.
NUM_RESAMPLES = 2000
LEVEL = 0.95
# Per-prompt quality measures that get a mean, an interval and a paired difference.
QUALITY_MEASURES = ("top1_vs_full", "kl_vs_full", "f1_vs_full", "f1_vs_gold", "gold_loss")
# The goals for a row (means): at least this call-to-return speedup with at least
# this top-1 agreement and F1 vs full, and at most this KL.
GOALS = {
    "speedup_request_vs_full": 2.5,
    "top1_vs_full": 0.97,
    "kl_vs_full": 0.03,
    "f1_vs_full": 0.8,
}
# Speedup keys over full prefill and the per-prompt time each is the ratio of means of.
SPEEDUPS = (
    ("speedup_vs_full", "ttft_s"),
    ("speedup_request_vs_full", "request_s"),
    ("speedup_request_cpu_vs_full", "request_cpu_s"),
)
# Time keys relative to the baseline selection: row's mean over the baseline's.
BASELINE_TIMES = (
    ("ttft_vs_baseline", "ttft_s"),
    ("request_s_vs_baseline", "request_s"),
    ("request_cpu_s_vs_baseline", "request_cpu_s"),
)
# Column order of the printed table (the JSON rows carry more).
QUALITY_TABLE_KEYS = (
    "mode",
    "ratio",
    "selection",
    "pass",
    "num_prompts",
    "speedup_vs_full",
    "speedup_request_vs_full",
    "speedup_request_cpu_vs_full",
    "top1_vs_full",
    "top1_vs_full_ci",
    "kl_vs_full",
    "f1_vs_full",
    "f1_vs_gold",
    "top1_vs_full_diff",
    "top1_vs_full_diff_ci",
    "ttft_vs_baseline",
    "meets_goals",
)


def bootstrap_interval(
    values: Sequence[float],
    seed: int,
    statistic: Callable[[numpy.ndarray], numpy.ndarray] | None = None,
    num_resamples: int = NUM_RESAMPLES,
    level: float = LEVEL,
) -> list[float]:
    """Percentile bootstrap interval `[low, high]` of `statistic` (default: the mean over
    axis 1) of `values` (1-D, or 2-D with prompts along axis 0), resampling prompts with
    a generator seeded by `seed`. One prompt gives the point itself."""
    data = numpy.asarray(values, dtype=numpy.float64)
    if data.shape[0] == 0:
        raise ValueError("values: need at least one prompt")
    if not 0 < level < 1:
        raise ValueError(f"level: must be in (0, 1), got {level}")
    statistic = statistic or _mean
    rng = numpy.random.default_rng(seed)
    indexes = rng.integers(0, data.shape[0], size=(num_resamples, data.shape[0]))
    estimates = statistic(data[indexes])
    tail = 100 * (1 - level) / 2
    low, high = numpy.percentile(estimates, [tail, 100 - tail])
    return [float(low), float(high)]


def ratio_of_means_interval(
    numerator: Sequence[float], denominator: Sequence[float], seed: int
) -> list[float]:
    """Interval of mean(numerator) / mean(denominator), resampling prompts in pairs."""
    if len(numerator) != len(denominator):
        raise ValueError(f"denominator: {len(denominator)} prompts, numerator has {len(numerator)}")
    pairs = numpy.stack([numerator, denominator], axis=1)
    return bootstrap_interval(pairs, seed, statistic=_ratio_of_means)


def quality_rows(
    measures: Mapping[MeasureKey, Sequence[RequestMeasure]],
    passes: Sequence[int],
    *,
    workload: str,
    seed: int,
    check_layer: int = DEFAULT_CHECK_LAYER,
) -> list[dict[str, Any]]:
    """Rows of a quality sweep from the runner's per-prompt measures (`run_measures`);
    `check_layer`: the run's (an entry's `#layer` overrides it in its row)."""
    rows = []
    for pass_number in passes:
        full = measures[(*FULL_POINT, pass_number)]
        points = [key[:4] for key in measures if key[4] == pass_number and key[0] != FULL]
        baseline = _baseline([point[3] for point in points])
        rows.append(
            _row(FULL_POINT, pass_number, full, full, None, None, workload, seed, check_layer)
        )
        for point in points:
            base_point = (*point[:3], baseline)
            rows.append(
                _row(
                    point,
                    pass_number,
                    measures[(*point, pass_number)],
                    full,
                    baseline,
                    measures[(*base_point, pass_number)],
                    workload,
                    seed,
                    check_layer,
                )
            )
    return rows


def _baseline(selections: Sequence[str | None]) -> str | None:
    names = [s for s in selections if s is not None]
    if not names:
        return None
    return K_DEVIATION if K_DEVIATION in names else names[0]


def _row(
    point: tuple[Any, ...],
    pass_number: int,
    rows: Sequence[RequestMeasure],
    full: Sequence[RequestMeasure],
    baseline: str | None,
    base: Sequence[RequestMeasure] | None,
    workload: str,
    seed: int,
    check_layer: int,
) -> dict[str, Any]:
    mode, ratio, policy, selection = point
    if len(rows) != len(full):
        raise ValueError(f"measures: {len(rows)} prompts for {point}, full prefill has {len(full)}")
    column = _columns(rows)
    full_column = _columns(full)
    num_tokens = sum(column["num_prompt_tokens"])
    entry = parse_selection_entry(selection) if selection else None
    filter_layers = None if entry is None else list(entry.filter_layers)
    if entry is not None and entry.check_layer is not None:
        check_layer = entry.check_layer
    row: dict[str, Any] = {
        "workload": workload,
        "seed": seed,
        "mode": mode,
        "ratio": ratio,
        "selection": selection,
        "filter_layers": filter_layers,
        # Full prefill checks nothing.
        "check_layer": None if entry is None else check_layer,
        "store_policy": policy,
        "pass": pass_number,
        "num_prompts": len(rows),
        "reused_share": sum(column["num_reused_tokens"]) / num_tokens,
        "hole_share": sum(column["num_hole_tokens"]) / num_tokens,
        "recomputed_share": sum(column["num_recomputed_tokens"]) / num_tokens,
        "ttft_mean_s": statistics.fmean(column["ttft_s"]),
        "request_s_mean": statistics.fmean(column["request_s"]),
        "request_cpu_s_mean": statistics.fmean(column["request_cpu_s"]),
    }
    for name, key in SPEEDUPS:
        row[name], row[f"{name}_ci"] = _ratio(full_column[key], column[key], seed)
    for name in QUALITY_MEASURES:
        row[name] = statistics.fmean(column[name])
        row[f"{name}_ci"] = bootstrap_interval(column[name], seed)
    row["baseline_selection"] = baseline
    if base is not None:
        base_column = _columns(base)
        for name in QUALITY_MEASURES:
            differences = [a - b for a, b in zip(column[name], base_column[name], strict=True)]
            row[f"{name}_diff"] = statistics.fmean(differences)
            row[f"{name}_diff_ci"] = bootstrap_interval(differences, seed)
        for name, key in BASELINE_TIMES:
            row[name], row[f"{name}_ci"] = _ratio(column[key], base_column[key], seed)
    if len(rows) < 2:
        # One prompt's bootstrap interval is the point itself: it says nothing of the spread.
        row.update({key: None for key in row if key.endswith("_ci")})
    row["meets_goals"] = None if mode == FULL else meets_goals(row)
    row["per_prompt"] = {
        "ttft_s": column["ttft_s"],
        "request_s": column["request_s"],
        "full_ttft_s": full_column["ttft_s"],
        "full_request_s": full_column["request_s"],
        "request_cpu_s": column["request_cpu_s"],
        "full_request_cpu_s": full_column["request_cpu_s"],
        **{name: column[name] for name in QUALITY_MEASURES},
        "num_prompt_tokens": column["num_prompt_tokens"],
        "num_recomputed_tokens": column["num_recomputed_tokens"],
        "deviation_mean": column["deviation_mean"],
        "residual_deviation": column["residual_deviation"],
        "first_token_margin": column["first_token_margin"],
    }
    return row


def meets_goals(row: Mapping[str, Any]) -> bool:
    """Whether the row's means meet GOALS (KL at most, the others at least)."""
    return all(
        row[key] <= goal if key == "kl_vs_full" else row[key] >= goal for key, goal in GOALS.items()
    )


def _ratio(
    numerator: Sequence[float], denominator: Sequence[float], seed: int
) -> tuple[float | None, list[float] | None]:
    """Ratio of means and its interval; None for times not measured (all zero)."""
    if not any(denominator):
        return None, None
    ratio = statistics.fmean(numerator) / statistics.fmean(denominator)
    return ratio, ratio_of_means_interval(numerator, denominator, seed)


def _columns(measures: Sequence[RequestMeasure]) -> dict[str, list[Any]]:
    names = RequestMeasure.__dataclass_fields__
    return {name: [getattr(m, name) for m in measures] for name in names}


def _mean(samples: numpy.ndarray) -> numpy.ndarray:
    return samples.mean(axis=1)


def _ratio_of_means(samples: numpy.ndarray) -> numpy.ndarray:
    means = samples.mean(axis=1)
    return means[:, 0] / means[:, 1]
