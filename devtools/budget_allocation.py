"""Would a recompute budget spread unevenly over prompts buy quality at the same cost?

`python -m holeblend_devtools.budget_allocation out/quality.json [--ratio 0.15] [--json F]`

Input: a `holeblend-bench --quality` JSON with one hole-mode strategy at several ratios
(e.g. `--ratios 0.05,0.1,0.15,0.2,0.3,0.5`), whose rows carry per prompt its KL and top-1
against full prefill, the tokens it recomputed, the check layer's deviation per compared
cached token (`per_prompt.deviation_mean`) and the blended first token's margin
(`first_token_margin`). A prompt's quality and recomputed tokens at a ratio between the
measured ones are read by linear interpolation (an estimate, not a measurement).

Cost is counted as the blend computes: token-layers, i.e. every prompt token in the layers
up to the check layer plus the recomputed tokens (holes, separators and tail included) in
the layers after it (the model's `num_layers` and the row's `check_layer`). Every policy
spends at most what every prompt at `--ratio` spends, inside the measured ratios:

- `uniform`: `--ratio` for every prompt (what the engine does).
- `deviation^a`: each prompt's ratio proportional to its deviation to the power a (a
  prompt whose cached KV moved more gets more), scaled to the budget. The deviation is
  known at the check layer, before the later layers, so an engine could act on it.
- `escalate(low->high, n)`: every prompt is blended at the measured ratio `low`; the `n`
  prompts whose blended first token is least sure (smallest margin) are blended again at
  `high`, both blends paid in full (an engine that kept the check layer's state would pay
  less); `n` as large as the budget allows. Reported for the best (low, high) pair by
  mean KL. An engine could act on it: the margin is known once the first blend ends.
- `oracle`: an allocation that knows every prompt's measured curve beforehand (greedy over
  the measured steps, steepest KL drop per token-layer first; the best allocation is at
  least as good): no engine can make it, it shows what allocating could buy at all.

Per policy: mean KL and top-1, their paired difference against `uniform` with a 95 %
bootstrap interval over prompts, the share of the budget spent and the range of ratios.
Also the correlation with each prompt's KL at every ratio (Pearson and Spearman) of the
deviation, the blended first token's margin and full prefill's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy

EXPONENTS = (0.5, 1.0, 2.0)
RESAMPLES = 2000


def load_curves(document: dict[str, Any]) -> dict[str, numpy.ndarray]:
    """Per measured ratio (ascending) and prompt: KL, top-1, token-layers, the blended first
    token's margin; per prompt: deviation, full prefill's margin."""
    rows = [r for r in document["results"] if r["mode"] == "hole" and r["ratio"] is not None]
    selections = {r["selection"] for r in rows}
    if len(selections) != 1:
        raise ValueError(f"results: expected one hole-mode selection, got {sorted(selections)}")
    rows.sort(key=lambda r: r["ratio"])
    if len(rows) < 2:
        raise ValueError("results: need hole-mode rows at two ratios or more")
    deviation = rows[0]["per_prompt"].get("deviation_mean")
    if deviation is None or any(d is None for d in deviation):
        raise ValueError(
            "per_prompt.deviation_mean: missing; run holeblend-bench from a version that "
            "reports it, in hole mode"
        )
    recomputed = [r["per_prompt"].get("num_recomputed_tokens") for r in rows]
    if None in recomputed:
        raise ValueError(
            "per_prompt.num_recomputed_tokens: missing; run holeblend-bench from a version "
            "that reports it"
        )
    full_layers = rows[0]["check_layer"] + 1
    sparse_layers = rows[0]["model_shape"]["num_layers"] - full_layers
    tokens = numpy.array(rows[0]["per_prompt"]["num_prompt_tokens"], dtype=float)
    margins = [r["per_prompt"].get("first_token_margin") for r in rows]
    full = [r for r in document["results"] if r["mode"] == "full"]
    full_margin = full[0]["per_prompt"].get("first_token_margin") if full else None
    return {
        "ratios": numpy.array([r["ratio"] for r in rows], dtype=float),
        # Per measured ratio and prompt (None: not reported by the bench that wrote it).
        "margin": None if None in margins else numpy.array(margins, dtype=float),
        "full_margin": None if full_margin is None else numpy.array(full_margin, dtype=float),
        "kl": numpy.array([r["per_prompt"]["kl_vs_full"] for r in rows], dtype=float),
        "top1": numpy.array([r["per_prompt"]["top1_vs_full"] for r in rows], dtype=float),
        # Token-layers per measured ratio and prompt.
        "cost": numpy.array(recomputed, dtype=float) * sparse_layers + tokens * full_layers,
        "deviation": numpy.array(deviation, dtype=float),
    }


def at_ratios(curve: numpy.ndarray, ratios: numpy.ndarray, chosen: numpy.ndarray) -> numpy.ndarray:
    """Each prompt's measure at its chosen ratio (interpolated between measured ones)."""
    return numpy.array(
        [numpy.interp(chosen[p], ratios, curve[:, p]) for p in range(curve.shape[1])]
    )


def proportional(
    weights: numpy.ndarray, curves: dict[str, numpy.ndarray], budget: float
) -> numpy.ndarray:
    """Ratios proportional to `weights`, inside the measured ones, spending `budget`."""
    ratios, cost = curves["ratios"], curves["cost"]
    low, high = ratios[0], ratios[-1]
    scale_low, scale_high = 0.0, high / max(weights.min(), 1e-30)
    for _ in range(200):  # bisection on the scale: spending rises with it
        scale = (scale_low + scale_high) / 2
        if at_ratios(cost, ratios, numpy.clip(scale * weights, low, high)).sum() > budget:
            scale_high = scale
        else:
            scale_low = scale
    return numpy.clip(scale_low * weights, low, high)


def oracle(curves: dict[str, numpy.ndarray], budget: float) -> numpy.ndarray:
    """A measured-step allocation within `budget` that lowers the mean KL greedily."""
    ratios, kl, cost = curves["ratios"], curves["kl"], curves["cost"]
    prompts = numpy.arange(kl.shape[1])
    step = numpy.zeros(kl.shape[1], dtype=int)
    spent = float(cost[0].sum())
    while True:
        best, best_prompt, best_cost = 0.0, -1, 0.0
        for p in prompts[step + 1 < len(ratios)]:
            more = cost[step[p] + 1, p] - cost[step[p], p]
            gain = (kl[step[p], p] - kl[step[p] + 1, p]) / max(more, 1e-9)
            if gain > best and spent + more <= budget:
                best, best_prompt, best_cost = gain, p, more
        if best_prompt < 0:
            return ratios[step]
        spent += best_cost
        step[best_prompt] += 1


def escalation(
    curves: dict[str, numpy.ndarray], budget: float
) -> tuple[str, numpy.ndarray, numpy.ndarray, float, numpy.ndarray] | None:
    """The (low, high) escalation with the lowest mean KL within `budget`: its name, each
    prompt's KL and top-1 under it, the token-layers it spends (both blends of an escalated
    prompt counted) and its two ratios; None without margins or with no pair that fits."""
    ratios, kl, top1, cost = curves["ratios"], curves["kl"], curves["top1"], curves["cost"]
    margin = curves.get("margin")
    if margin is None:
        return None
    best = None
    for low in range(len(ratios)):
        for high in range(low + 1, len(ratios)):
            order = numpy.argsort(margin[low], kind="stable")  # least sure first
            spent = float(cost[low].sum())
            escalated = numpy.zeros(kl.shape[1], dtype=bool)
            for p in order:
                if spent + cost[high, p] > budget:
                    break
                spent += cost[high, p]
                escalated[p] = True
            if spent > budget or not escalated.any():  # nothing escalated: uniform at low
                continue
            chosen_kl = numpy.where(escalated, kl[high], kl[low])
            if best is None or chosen_kl.mean() < best[1].mean():
                chosen_top1 = numpy.where(escalated, top1[high], top1[low])
                name = f"escalate({ratios[low]:g}->{ratios[high]:g}, {int(escalated.sum())})"
                best = (name, chosen_kl, chosen_top1, spent, ratios[[low, high]])
    return best


def interval(differences: numpy.ndarray, seed: int = 0) -> list[float]:
    generator = numpy.random.default_rng(seed)
    picks = generator.integers(0, len(differences), (RESAMPLES, len(differences)))
    return [float(x) for x in numpy.percentile(differences[picks].mean(axis=1), [2.5, 97.5])]


def _correlation(a: numpy.ndarray, b: numpy.ndarray) -> float | None:
    """Pearson's correlation; None where either side has no spread."""
    if a.std() == 0 or b.std() == 0:
        return None
    return float(numpy.corrcoef(a, b)[0, 1])


def _ranks(values: numpy.ndarray) -> numpy.ndarray:
    return numpy.argsort(numpy.argsort(values)).astype(float)


def evaluate(document: dict[str, Any], ratio: float) -> dict[str, Any]:
    curves = load_curves(document)
    ratios, deviation = curves["ratios"], curves["deviation"]
    if not ratios[0] <= ratio <= ratios[-1]:
        raise ValueError(f"--ratio: {ratio} is outside the measured {ratios[0]}..{ratios[-1]}")
    uniform = numpy.full(len(deviation), ratio)
    budget = float(at_ratios(curves["cost"], ratios, uniform).sum())
    policies = {"uniform": uniform}
    for exponent in EXPONENTS:
        policies[f"deviation^{exponent:g}"] = proportional(deviation**exponent, curves, budget)
    policies["oracle"] = oracle(curves, budget)
    # Per policy: each prompt's KL, top-1, the tokens spent and the ratios it ran at.
    outcomes = {
        name: (
            at_ratios(curves["kl"], ratios, chosen),
            at_ratios(curves["top1"], ratios, chosen),
            float(at_ratios(curves["cost"], ratios, chosen).sum()),
            chosen,
        )
        for name, chosen in policies.items()
    }
    escalated = escalation(curves, budget)
    if escalated is not None:
        name, kl, top1, spent, low_high = escalated
        outcomes[name] = (kl, top1, spent, low_high)
    base_kl, base_top1 = outcomes["uniform"][:2]
    results = {}
    for name, (kl, top1, spent, chosen) in outcomes.items():
        results[name] = {
            "kl": float(kl.mean()),
            "top1": float(top1.mean()),
            "kl_diff": float((kl - base_kl).mean()),
            "kl_diff_ci": interval(kl - base_kl),
            "top1_diff": float((top1 - base_top1).mean()),
            "top1_diff_ci": interval(top1 - base_top1),
            "budget_spent": spent / budget,
            "ratio_range": [float(chosen.min()), float(chosen.max())],
        }
    # Per prompt (the same at every ratio) or per measured ratio and prompt.
    predictors = {
        "deviation": deviation,
        "full_margin": curves["full_margin"],
        "margin": curves["margin"],
    }
    correlation: dict[str, dict[str, float | None]] = {f"{r:g}": {} for r in ratios}
    for name, values in predictors.items():
        if values is None:
            continue
        values = numpy.broadcast_to(values, curves["kl"].shape)
        for i, r in enumerate(ratios):
            kl = curves["kl"][i]
            correlation[f"{r:g}"][f"{name}_pearson"] = _correlation(values[i], kl)
            correlation[f"{r:g}"][f"{name}_spearman"] = _correlation(_ranks(values[i]), _ranks(kl))
    return {
        "ratio": ratio,
        "num_prompts": len(deviation),
        "measured_ratios": [float(r) for r in ratios],
        "policies": results,
        "correlation_with_kl": correlation,
    }


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("quality_json", type=Path, nargs="+")
    parser.add_argument("--ratio", type=float, default=0.15, help="the uniform ratio (budget)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    out = {}
    for path in args.quality_json:
        try:
            result = evaluate(json.loads(path.read_text()), args.ratio)
        except (OSError, ValueError, KeyError) as error:
            print(f"{path}: {error}", file=sys.stderr)
            return 2
        out[str(path)] = result
        print(f"{path} ({result['num_prompts']} prompts, budget of ratio {args.ratio:g}):")
        for name, row in result["policies"].items():
            low, high = row["ratio_range"]
            print(
                f"  {name:<15} KL {row['kl']:.4f} ({row['kl_diff']:+.4f} "
                f"[{row['kl_diff_ci'][0]:+.4f}, {row['kl_diff_ci'][1]:+.4f}])  "
                f"top-1 {row['top1']:.3f} ({row['top1_diff']:+.3f} "
                f"[{row['top1_diff_ci'][0]:+.3f}, {row['top1_diff_ci'][1]:+.3f}])  "
                f"ratios {low:.2f}-{high:.2f}"
            )
        for r, c in result["correlation_with_kl"].items():
            print(
                f"  with KL at {r} (Pearson / Spearman): "
                + ", ".join(
                    f"{name.removesuffix('_pearson')} {c[name]:+.2f} / "
                    f"{c[name.replace('pearson', 'spearman')]:+.2f}"
                    for name in c
                    if name.endswith("pearson")
                )
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
