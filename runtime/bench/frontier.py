"""The quality sweep's frontier plot: speedup over full prefill against quality.

One panel per quality measure (top-1 agreement, KL and answer F1 vs full prefill, F1 vs
gold), x = full prefill's mean TTFT over the row's (or call to return), one line per
(mode, selection) through its ratios, with the 95% intervals as error bars.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from holeblend_runtime.bench.runner import FULL

PANELS = (
    ("top1_vs_full", "top-1 agreement vs full"),
    ("kl_vs_full", "KL(full || blended), nats"),
    ("f1_vs_full", "answer F1 vs full"),
    ("f1_vs_gold", "answer F1 vs gold"),
)
X_KEYS = {"ttft": "speedup_vs_full", "request": "speedup_request_vs_full"}


def plot_frontier(rows: Sequence[dict[str, Any]], path: Path, title: str, x: str = "ttft") -> None:
    """Write the PNG; `rows` are quality rows of one measured pass."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "png: the frontier plot needs matplotlib (pip install matplotlib, or holeblend's "
            "dev extra)"
        ) from None
    if x not in X_KEYS:
        raise ValueError(f"x: expected one of {sorted(X_KEYS)}, got {x!r}")
    x_key = X_KEYS[x]
    blended = [r for r in rows if r["mode"] != FULL]
    if not blended:
        raise ValueError("rows: no blended rows to plot")
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in blended:
        lines.setdefault((row["mode"], row["selection"]), []).append(row)
    figure, grid = plt.subplots(2, 2, figsize=(11, 8.5))
    axes = list(grid.flat)
    for axis, (key, label) in zip(axes, PANELS, strict=True):
        for (mode, selection), points in sorted(lines.items()):
            points = sorted(points, key=lambda r: r[x_key])
            xs = [p[x_key] for p in points]
            ys = [p[key] for p in points]
            # No bar for a row without an interval (one prompt).
            cis = [p[f"{key}_ci"] or (p[key], p[key]) for p in points]
            errors = [
                [max(0.0, p[key] - ci[0]) for p, ci in zip(points, cis, strict=True)],
                [max(0.0, ci[1] - p[key]) for p, ci in zip(points, cis, strict=True)],
            ]
            name = selection if len({m for m, _ in lines}) == 1 else f"{mode} {selection}"
            axis.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=name)
            for p in points:
                axis.annotate(f"{p['ratio']:g}", (p[x_key], p[key]), fontsize=7,
                              textcoords="offset points", xytext=(3, 3))  # fmt: skip
        axis.set_xlabel(f"x full prefill ({'TTFT' if x == 'ttft' else 'call to return'})")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle(f"{title}\nlabels: recompute ratio; bars: 95% bootstrap intervals", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
