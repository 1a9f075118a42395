"""`make closed-loop` outputs read against the issue's goals, run by run, with the offline
sweep's own uncertainty.

`python -m holeblend_devtools.closed_loop_report out/closed-loop.json [MORE.json ...]
[--json out/closed-loop-report.json]`

For every live run of every file:

- **The loop's goals**: settled (its last decision one of `closed_loop_sim.SETTLED`)
  within `GOAL_INTERVALS` tuner intervals (from the change in `workload-change`), at most
  `GOAL_DIRECTION_CHANGES` direction changes, never out of bounds. These are read from the
  run as `closed_loop_runs` wrote it.
- **Whether the final ratio meets the target**, by the offline sweep: its mean F1 proxy at
  the final ratio (linear between grid ratios, as `offline_f1_at_final`) with a 95 %
  interval from resampling the sweep's questions (each question keeps its scores at every
  ratio). The live stream sends other questions of the same workload than the sweep's
  (`SWEEP_QUESTIONS`, each scoring near 0 or 1), so the sweep's mean is an estimate of
  the workload's quality, not the quality itself: `meets` when the whole interval is at
  or above target - band, `below` when the whole interval is under it, `unresolved`
  otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy

from holeblend_devtools.closed_loop_sim import Workload, loop_goals

LEVEL = 0.95
RESAMPLES = 4000


def offline_interval(
    scores: dict,
    ratio: float,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(mean, low, high) of the sweep's F1 proxy at `ratio` (`scores`: per grid ratio, as a
    float or its string, each question's score; linear between grid ratios):
    a percentile bootstrap over the sweep's questions, each resampled with its scores at
    every ratio."""
    workload = Workload.of(scores)
    at_ratio = numpy.array([workload.quality(q, ratio) for q in range(len(workload.scores))])
    rng = random.Random(seed)
    count = len(at_ratio)
    means = sorted(
        float(at_ratio[[rng.randrange(count) for _ in range(count)]].mean())
        for _ in range(resamples)
    )
    tail = (1 - level) / 2
    low = means[int(tail * (resamples - 1))]
    high = means[int((1 - tail) * (resamples - 1))]
    return float(at_ratio.mean()), low, high


def verdict(run: dict, output: dict) -> dict:
    """One run's row: the loop's goals and the final ratio against the target, by the
    offline sweep with its interval (`final_vs_target`: meets, below or unresolved; None
    when the output kept no per-question scores or the run has no final ratio)."""
    tuning = output["tuning"]
    floor = tuning["target"] - tuning["band"]
    row = {
        "engine": run.get("engine", "serve"),
        "load": run.get("load", "paced"),
        "workload_seeds": output.get("workload_seeds"),
        "name": run["name"],
        "intervals_to_converge": run.get("intervals_to_converge"),
        "direction_changes": run["direction_changes"],
        "final_ratio": run.get("final_ratio"),
        "target_floor": round(floor, 3),
        "goals": loop_goals(run),
    }
    key = "offline_scores_changed" if run["name"] == "workload-change" else "offline_scores"
    scores = output.get(key)
    if not scores or run.get("final_ratio") is None:
        return row | {"offline_f1_at_final": None, "final_vs_target": None}
    mean, low, high = offline_interval(scores, run["final_ratio"])
    judged = "meets" if low >= floor else "below" if high < floor else "unresolved"
    return row | {
        "offline_f1_at_final": [round(mean, 3), round(low, 3), round(high, 3)],
        "final_vs_target": judged,
    }


def report(paths: Sequence[Path]) -> list[dict]:
    rows = []
    for path in paths:
        output = json.loads(path.read_text())
        rows += [{"file": path.name} | verdict(run, output) for run in output.get("runs", [])]
    return rows


def table(rows: Sequence[dict]) -> str:
    lines = [
        "| file | engine, load | scenario | intervals to converge | direction changes | "
        "loop goals | final ratio | offline F1 at final [95 %] | target - band | final vs target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        offline = row["offline_f1_at_final"]
        shown = "-" if offline is None else f"{offline[0]:.3f} [{offline[1]:.3f}, {offline[2]:.3f}]"
        converge = row["intervals_to_converge"]
        lines.append(
            f"| {row['file']} | {row['engine']}, {row['load']} | {row['name']} | "
            f"{'not settled' if converge is None else converge} | {row['direction_changes']} | "
            f"{'met' if row['goals']['met'] else 'not met'} | {row['final_ratio']} | {shown} | "
            f"{row['target_floor']} | {row['final_vs_target'] or '-'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("outputs", nargs="+", type=Path, help="closed_loop_runs --json files")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.outputs if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    rows = report(args.outputs)
    print(table(rows))
    met = sum(row["goals"]["met"] for row in rows)
    print(f"\nloop goals met in {met} of {len(rows)} runs", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
