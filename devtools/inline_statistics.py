"""Which zero-cost statistic of a blend tells the tuner most about its shadow score?

`python -m holeblend_devtools.inline_statistics --json out/inline-statistics.json`

The inline proxy (runtime/quality/inline_proxy.py) maps a statistic of each blend to the
shadow F1 it expects, through an isotonic fit of (statistic, shadow score) pairs. This
measures candidate statistics on the closed loop's workloads, in this process, with the
engine's own blend and shadow scorer:

1. Three streams, each question sent as the live stream sends it (pass 1 without its hole
   documents and in another order, then the whole prompt in hole mode at each ratio of
   `--ratios`), every blended request scored against full prefill: the closed loop's
   workload (`--seed`, the calibration stream), the same workload with another generator
   seed (`--held-out-seed`) and the changed workload of the `workload-change` scenario
   (`--changed-seed`).
2. Per candidate: the Pearson correlation with the shadow F1 and top-1 per stream and
   ratio; and a pooled fit of every ratio's calibration pairs (what `InlineProxy` lent a
   ratio without pairs of its own until it lent only lower ratios' pairs), applied to the
   other streams' blends, its mean estimate per ratio against the mean shadow F1 there (`tracking`: mean absolute
   error over the ratios, and the share of blends inside the pairs' span, where the proxy
   answers at all). A statistic that tracks quality moves its estimate when the workload or
   the ratio moves the quality; one that does not reads the calibration's mean everywhere.

Candidates, each from the blend's check-layer deviation (both engines have it):
`share` (the deviation left in the tokens not recomputed, as a share of all compared
tokens' deviation: the statistic until this was measured), `mean` (the same deviation
left, per compared token: `residual_deviation`, today's) and `total` (the deviation left,
not divided).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from holeblend_devtools.closed_loop_runs import CHANGED, WORKLOAD, hole_requests
from holeblend_runtime.bench.workload import WorkloadConfig, generate_workload

RATIOS = (0.02, 0.05, 0.15, 0.3)
MAX_TOKENS = 8  # the closed loop's answers
BASELINE = "share"  # the statistic until this was measured
CANDIDATES: dict[str, Callable[[dict], float]] = {
    "share": lambda row: row["left"] / row["total"] if row["total"] > 0 else 0.0,
    "mean": lambda row: row["left"] / row["compared"],
    "total": lambda row: row["left"],
}


def collect(workload: WorkloadConfig, num_questions: int, ratios=RATIOS) -> list[dict]:
    """One row per blended hole request: its ratio, the deviation it left, and its shadow
    F1 and top-1 (scored as the engine scores: the answer's end included)."""
    from holeblend_runtime.engine import BlendEngine
    from holeblend_runtime.quality.inline_proxy import residual_deviation
    from holeblend_runtime.quality.shadow import ShadowRequest, ShadowScorer
    from holeblend_runtime.serve.worker import is_blended

    base = BlendEngine.load(num_threads=2)
    scorer = ShadowScorer(base.model, base.tokenizer, 1.0, cache_prompt=True)
    rows = []
    questions = generate_workload(workload)[:num_questions]
    for index, (prompt, answered) in enumerate(
        hole_requests(base, workload, questions, ratios, MAX_TOKENS)
    ):
        for ratio, prefill, answer in answered:
            if not is_blended(prefill):
                continue
            mean = residual_deviation(
                prompt, prefill.reuse, prefill.deviation, prefill.selected_positions
            )
            compared = int(prefill.deviation.numel())
            score = scorer.score(
                ShadowRequest(
                    prompt, tuple(answer), ratio,
                    stopped_at_eos=len(answer) < MAX_TOKENS, max_tokens=MAX_TOKENS,
                )
            )  # fmt: skip
            rows.append(
                {
                    "question": index,
                    "ratio": ratio,
                    "compared": compared,
                    "total": float(prefill.deviation.double().sum()),
                    "left": mean * compared,
                    "f1": score.f1,
                    "top1": score.top1,
                }
            )
        print(f"  question {index + 1}/{len(questions)}: {len(rows)} blends", flush=True)
    scorer.close()
    return rows


def correlations(rows: list[dict], statistic: Callable[[dict], float]) -> dict:
    """Pearson correlation with F1 and top-1, per ratio and over all ratios (None where
    either has no spread)."""

    def of(subset: list[dict]) -> dict:
        xs = [statistic(row) for row in subset]
        return {
            score: _pearson(xs, [row[score] for row in subset]) if len(subset) > 2 else None
            for score in ("f1", "top1")
        }

    per_ratio = {str(r): of([row for row in rows if row["ratio"] == r]) for r in _ratios(rows)}
    return {"all": of(rows), "per_ratio": per_ratio}


def tracking(calibration: list[dict], evaluated: list[dict], statistic) -> dict:
    """The pooled fit of `calibration`'s pairs applied to `evaluated`: per ratio the mean
    estimate (over blends inside the pairs' span) against the mean shadow F1."""
    estimated = _estimated(calibration, evaluated, statistic)
    per_ratio = {str(ratio): means for ratio, means in _per_ratio(estimated).items()}
    inside = sum(e is not None for _, e in estimated)
    return {
        "mean_abs_error": _tracking_error(estimated),
        "inside_span": inside / len(evaluated) if evaluated else None,
        "per_ratio": per_ratio,
    }


def error_difference(
    calibration: list[dict], evaluated: list[dict], statistic, baseline, resamples: int = 1000
) -> dict:
    """`statistic`'s tracking error minus `baseline`'s on the same blends, with a 95 %
    interval from resampling `evaluated`'s questions (the fits stay those of
    `calibration`; both statistics see the same resampled questions)."""
    ours = _estimated(calibration, evaluated, statistic)
    theirs = _estimated(calibration, evaluated, baseline)
    by_question: dict[int, list[int]] = {}
    for at, row in enumerate(evaluated):
        by_question.setdefault(row["question"], []).append(at)
    questions = sorted(by_question)
    rng = random.Random(0)
    differences = []
    for _ in range(resamples):
        picked = [i for q in rng.choices(questions, k=len(questions)) for i in by_question[q]]
        a = _tracking_error([ours[i] for i in picked])
        b = _tracking_error([theirs[i] for i in picked])
        if a is not None and b is not None:
            differences.append(a - b)
    differences.sort()
    point_a, point_b = _tracking_error(ours), _tracking_error(theirs)
    return {
        "difference": None if point_a is None or point_b is None else point_a - point_b,
        "interval_95": [
            differences[int(0.025 * (len(differences) - 1))],
            differences[int(0.975 * (len(differences) - 1))],
        ]
        if differences
        else None,
    }


def _estimated(calibration: list[dict], evaluated: list[dict], statistic) -> list[tuple]:
    """(row, the pooled fit's estimate or None outside the pairs' span) per evaluated row."""
    from holeblend_runtime.quality.inline_proxy import MIN_PAIRS, Calibration

    fit = Calibration(max_pairs=max(MIN_PAIRS, len(calibration)))
    for row in calibration:
        fit.add(statistic(row), row["f1"])
    return [(row, fit.estimate(statistic(row), extrapolate=False)) for row in evaluated]


def _per_ratio(estimated: list[tuple]) -> dict[float, dict]:
    """Per ratio (ascending): the mean estimate (None: no blend inside the span), the
    mean shadow F1 and the number of blends."""
    means = {}
    for ratio in sorted({row["ratio"] for row, _ in estimated}):
        subset = [(row, e) for row, e in estimated if row["ratio"] == ratio]
        known = [e for _, e in subset if e is not None]
        means[ratio] = {
            "estimate": statistics.fmean(known) if known else None,
            "shadow_f1": statistics.fmean(row["f1"] for row, _ in subset),
            "blends": len(subset),
        }
    return means


def _tracking_error(estimated: list[tuple]) -> float | None:
    """Mean over ratios of |mean estimate - mean shadow F1|."""
    errors = [
        abs(m["estimate"] - m["shadow_f1"])
        for m in _per_ratio(estimated).values()
        if m["estimate"] is not None
    ]
    return statistics.fmean(errors) if errors else None


def _pearson(xs: list[float], ys: list[float]) -> float | None:
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # a constant: no correlation to speak of
        return None


def _ratios(rows: list[dict]) -> list[float]:
    return sorted({row["ratio"] for row in rows})


def analyse(streams: dict[str, list[dict]]) -> dict:
    calibration = streams["calibration"]
    return {
        name: {
            "correlation": {
                stream: correlations(rows, statistic) for stream, rows in streams.items()
            },
            "tracking": {
                stream: tracking(calibration, rows, statistic)
                for stream, rows in streams.items()
                if stream != "calibration"
            },
            f"tracking_minus_{BASELINE}": {
                stream: error_difference(calibration, rows, statistic, CANDIDATES[BASELINE])
                for stream, rows in streams.items()
                if stream != "calibration"
            },
        }
        for name, statistic in CANDIDATES.items()
    }


def print_summary(result: dict) -> None:
    for name, found in result["candidates"].items():
        print(f"{name}:")
        for stream, corr in found["correlation"].items():
            per = " ".join(
                f"{r}:{c['f1']:+.2f}" if c["f1"] is not None else f"{r}:-"
                for r, c in corr["per_ratio"].items()
            )
            print(f"  corr F1 {stream:11s} {per}")
        for stream, track in found["tracking"].items():
            per = " ".join(
                f"{r}:{t['estimate']:.2f}/{t['shadow_f1']:.2f}"
                if t["estimate"] is not None
                else f"{r}:-/{t['shadow_f1']:.2f}"
                for r, t in track["per_ratio"].items()
            )
            error = track["mean_abs_error"]
            versus = found[f"tracking_minus_{BASELINE}"][stream]
            interval = versus["interval_95"] or [math.nan, math.nan]
            print(
                f"  tracking {stream:10s} |error| {error if error is None else round(error, 3)}"
                f" (minus {BASELINE}: {versus['difference']:+.3f}"
                f" [{interval[0]:+.3f}, {interval[1]:+.3f}])"
                f" inside {track['inside_span']:.2f}  {per}"
            )


def _earlier(path: Path) -> dict:
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"--rows-from {path}: not a readable JSON output ({error})") from None
    if (
        not isinstance(earlier, dict)
        or set(earlier.get("rows", {})) != {"calibration", "held_out", "changed"}
        or "config" not in earlier
    ):
        raise SystemExit(
            f"--rows-from {path}: no rows of the three streams; give a file this tool wrote"
        )
    return earlier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=60, help="per stream (default 60)")
    parser.add_argument("--seed", type=int, default=WORKLOAD.seed)
    parser.add_argument("--held-out-seed", type=int, default=5)
    parser.add_argument("--changed-seed", type=int, default=CHANGED.seed)
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    parser.add_argument("--json", type=Path, default=Path("out/inline-statistics.json"))
    parser.add_argument(
        "--rows-from",
        type=Path,
        help="an earlier output: analyse its rows again instead of collecting new ones",
    )
    args = parser.parse_args(argv)
    if args.questions < 3:
        parser.error(f"--questions: at least 3, got {args.questions}")
    try:
        ratios = tuple(float(r) for r in args.ratios.split(","))
    except ValueError:
        parser.error(f"--ratios: comma-separated numbers, got {args.ratios!r}")
    workloads = {
        "calibration": dataclasses.replace(WORKLOAD, seed=args.seed),
        "held_out": dataclasses.replace(WORKLOAD, seed=args.held_out_seed),
        "changed": dataclasses.replace(CHANGED, seed=args.changed_seed),
    }
    started = time.monotonic()
    if args.rows_from is not None:
        earlier = _earlier(args.rows_from)
        streams, config = earlier["rows"], earlier["config"]
    else:
        streams = {}
        for name, workload in workloads.items():
            print(f"{name}: seed {workload.seed}", flush=True)
            streams[name] = collect(workload, args.questions, ratios)
        config = {
            "questions": args.questions,
            "ratios": list(ratios),
            "max_tokens": MAX_TOKENS,
            "workloads": {name: dataclasses.asdict(w) for name, w in workloads.items()},
        }
    result = {
        "method": __doc__.split("\n\n")[1].strip(),
        "config": config,
        "candidates": analyse(streams),
        "rows": streams,
        "wall_s": time.monotonic() - started,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result)
    print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
