"""The inline quality proxy: a zero-cost estimate from each blend's own statistics.

The shadow full prefill (shadow.py) measures quality, but only within its token budget
(blend.json `shadowBudget`); the inline proxy gives the tuner a signal for every blended
request, at no cost beyond a sum over numbers the blend computed anyway:

1. **The statistic** (`residual_deviation`): at the check layer the blend compares each
   cached token's fresh K with its cached K and recomputes the tokens that moved most.
   The squared deviation left in the cached tokens it did *not* recompute, per compared
   token (0: every deviating token was recomputed), says how much stale KV the answer
   was computed on. A mean, not a share of the total: a prompt whose cached KV barely
   moved (its documents were stored next to the same neighbours) leaves little stale KV
   even when the blend recomputes few of its tokens, and a share would read that as
   mostly stale (measured: `python -m holeblend_devtools.inline_statistics`, whose
   figures docs/tuning.md quotes). It is taken where the shared reuse path returns
   (`BlendEngine.blend_reused`: holeblend-serve's prefill, the vLLM connector's worker).
2. **Calibration** (`Calibration`): for requests that were both blended and shadowed, the
   pair (statistic, shadow score) is kept, per ratio (the last `MAX_PAIRS`). An isotonic
   fit (the score never rises with the statistic) maps a statistic to the expected shadow
   F1 and top-1 agreement. A ratio with fewer than `MIN_PAIRS` pairs of its own (the
   tuner just moved to it) borrows the fit of the pairs scored at it and at *lower*
   ratios only, and only inside the statistics those pairs span: beyond them a fit would
   extrapolate. Never from higher ratios: the statistic measures only part of what a
   lower ratio leaves stale, so their pairs read a lower ratio too high (measured in a
   saturated closed loop: 0.98 at ratio 0.02 from pairs scored at 0.2-0.8, where the
   shadows read 0.75 and an offline sweep 0.61), and a tuner that steps down on such a
   reading settles below its target. Pairs of lower ratios err the other way, which costs
   at most a raise that more samples undo. Fewer pairs than that, or a statistic outside
   their span: no estimate at all, no signal rather than a guess.
3. **Export** (`InlineProxy`): every blended request's calibrated estimates are observed
   in `holeblend_inline_f1_proxy{ratio}` and `holeblend_inline_top1_proxy{ratio}` (the
   shadow's buckets), only when calibrated; `holeblend_inline_proxy_pairs{ratio}` holds
   the pairs each calibration has, `holeblend_inline_proxy_pooled{ratio}` whether the
   ratio's last estimate came from the borrowed fit (1) or its own (0),
   `holeblend_inline_proxy_correlation{ratio}` the Pearson correlation of statistic and
   shadow F1 (absent with too few pairs or no spread), and `holeblend_inline_residual_deviation{ratio}` the raw statistic of every
   blended request (observed whether or not calibrated). A ratio's series do not outlive
   it: the gauges go when its calibration is evicted (the `MAX_RATIOS` ratios given pairs
   last keep theirs), the histograms and `pooled` when `MAX_RATIOS` other ratios were
   observed since it (a ratio that only borrows a fit has no calibration to evict).
4. **Sharing** (shared_calibration.py): with a lookup server, the pods of a deployment
   share their pairs through it (`on_pair` publishes this pod's, `add_shared` keeps the
   others'), so a pod that starts is calibrated as soon as its deployment is;
   `holeblend_inline_proxy_shared_pairs_total{direction}` counts them.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from holeblend_runtime.blend.reuse import SegmentReuse
from holeblend_runtime.blend.segments import SegmentedPrompt
from holeblend_runtime.quality.shadow import PROXY_BUCKETS, ShadowScore, ratio_label

# The series the tuner reads (one place for their names).
INLINE_F1_METRIC = "holeblend_inline_f1_proxy"
INLINE_TOP1_METRIC = "holeblend_inline_top1_proxy"
INLINE_PAIRS_METRIC = "holeblend_inline_proxy_pairs"
INLINE_CORRELATION_METRIC = "holeblend_inline_proxy_correlation"
INLINE_STATISTIC_METRIC = "holeblend_inline_residual_deviation"
INLINE_POOLED_METRIC = "holeblend_inline_proxy_pooled"
INLINE_SHARED_METRIC = "holeblend_inline_proxy_shared_pairs"
INLINE_SHARE_FAILURES_METRIC = "holeblend_inline_proxy_share_failures"
# A calibration needs this many (statistic, shadow score) pairs at a ratio to estimate.
MIN_PAIRS = 8
# The definition of `residual_deviation` (2: the deviation left per compared token; 1 was
# its share of the total): raised with any change of what the statistic measures or of
# its scale, so that pods never share pairs of two definitions (`calibration_scope`).
STATISTIC_VERSION = 2
# Pairs kept per ratio (the newest): the fit follows a workload that changes.
MAX_PAIRS = 256
# Ratios whose pairs are kept (the most recently used): the tuner moves among a few.
MAX_RATIOS = 16
# The statistic's scale is the model's (squared K at the check layer): buckets doubling
# from 1/1024 to 64.
STATISTIC_BUCKETS = tuple(2.0**e for e in range(-10, 7))


def residual_deviation(
    prompt: SegmentedPrompt,
    reuse: SegmentReuse,
    deviation: torch.Tensor,
    selected: torch.Tensor,
    num_tokens: int | None = None,
) -> float | None:
    """Mean check-layer deviation left in the cached tokens the blend did not recompute,
    per compared cached token (>= 0); None without a blend (no cached token was compared)
    or with a deviation that is not finite.

    `deviation` and `selected` are `Blended.deviation` / `Blended.selected` (or a
    `Prefill`'s `deviation` / `selected_positions`) of the prompt's first `num_tokens`
    tokens (default: all). The deviation is per compared cached token in position order:
    the reused segments' positions after the exact prefix (whose tokens come first and
    are never compared), the prompt's last token excluded when the blend computed its
    logits. A selected position outside them (never expected) falls back to taking the
    selected tokens as the most deviating ones, which the default strategy picks."""
    count = int(deviation.numel())
    if count == 0:
        return None
    values = deviation.detach().to("cpu", torch.float64).reshape(-1)
    total = float(values.sum())
    if not math.isfinite(total):
        return None
    picked = [int(p) for p in selected.detach().to("cpu").reshape(-1).tolist()]
    compared = _compared_positions(prompt, reuse, num_tokens)
    index = {p: i for i, p in enumerate(compared[-count:])} if len(compared) >= count else {}
    if picked and all(p in index for p in picked):
        recomputed = float(values[[index[p] for p in picked]].sum())
    else:
        recomputed = float(values.topk(min(len(picked), count)).values.sum()) if picked else 0.0
    return max(0.0, total - recomputed) / count


def _compared_positions(
    prompt: SegmentedPrompt, reuse: SegmentReuse, num_tokens: int | None
) -> list[int]:
    end = prompt.num_tokens if num_tokens is None else num_tokens
    positions = sorted(
        p
        for i in reuse.reused_segments
        for p in range(prompt.segments[i].start, min(prompt.segments[i].end, end))
    )
    if end == prompt.num_tokens and positions and positions[-1] == prompt.num_tokens - 1:
        positions.pop()  # computed for its logits, never compared
    return positions


@dataclass(frozen=True)
class _Block:
    x: float  # mean statistic of the block's pairs
    y: float  # mean score


class Calibration:
    """Statistic -> expected score, fitted on (statistic, score) pairs: isotonic
    regression with the score non-increasing in the statistic (pool adjacent violators),
    linear between the blocks' mean statistics, flat beyond them, clamped to [0, 1].
    Fewer than `min_pairs` pairs: `estimate` is None (no signal)."""

    def __init__(self, min_pairs: int = MIN_PAIRS, max_pairs: int = MAX_PAIRS) -> None:
        _check_pair_counts(min_pairs, max_pairs)
        self.min_pairs = min_pairs
        self._pairs: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_pairs)
        self._fit: list[_Block] | None = None
        # The least and greatest statistic of the pairs (with the fit: None when stale).
        self._span: tuple[float, float] | None = None

    def __len__(self) -> int:
        return len(self._pairs)

    def add(self, statistic: float, score: float) -> None:
        if not (math.isfinite(statistic) and math.isfinite(score)):
            return  # a pair that says nothing
        self._pairs.append((float(statistic), float(score)))
        self._fit = None

    def estimate(self, statistic: float, extrapolate: bool = True) -> float | None:
        """The expected score at `statistic`; None with too few pairs, or (`extrapolate`
        False) outside the statistics the pairs span."""
        if len(self._pairs) < self.min_pairs or not math.isfinite(statistic):
            return None
        if self._fit is None or self._span is None:
            self._fit = _fit_non_increasing(self._pairs)
            self._span = (min(x for x, _ in self._pairs), max(x for x, _ in self._pairs))
        if not extrapolate and not self._span[0] <= statistic <= self._span[1]:
            return None
        blocks = self._fit
        xs = [block.x for block in blocks]
        at = bisect.bisect_left(xs, statistic)
        if at == 0:
            value = blocks[0].y
        elif at == len(blocks):
            value = blocks[-1].y
        else:
            left, right = blocks[at - 1], blocks[at]
            weight = (statistic - left.x) / (right.x - left.x)
            value = left.y + weight * (right.y - left.y)
        return min(1.0, max(0.0, value))

    def pairs(self) -> list[tuple[float, float]]:
        """The (statistic, score) pairs held, oldest first."""
        return list(self._pairs)

    def correlation(self) -> float | None:
        """Pearson correlation of statistic and score; None with too few pairs or no
        spread in either."""
        if len(self._pairs) < self.min_pairs:
            return None
        return _pearson([x for x, _ in self._pairs], [y for _, y in self._pairs])


def _check_pair_counts(min_pairs: int, max_pairs: int) -> None:
    """ValueError naming the count that breaks 2 <= min_pairs <= max_pairs, whole numbers
    (a fit needs two pairs; the deque of pairs takes only an int as its length)."""
    for name, value in (("min_pairs", min_pairs), ("max_pairs", max_pairs)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected a whole number of pairs, got {value!r}")
    if min_pairs < 2:
        raise ValueError(f"min_pairs: must be >= 2, got {min_pairs}")
    if max_pairs < min_pairs:
        raise ValueError(f"max_pairs: must be >= min_pairs ({min_pairs}), got {max_pairs}")


def _fit_non_increasing(pairs: Sequence[tuple[float, float]]) -> list[_Block]:
    """Pool adjacent violators: blocks in increasing statistic whose scores never rise."""
    grouped: dict[float, list[float]] = collections.defaultdict(list)
    for x, y in pairs:
        grouped[x].append(y)
    # [sum x, sum y, count] per block, merged while a block's mean score exceeds the one
    # before it (the fit may only fall as the statistic grows).
    stack: list[list[float]] = []
    for x in sorted(grouped):
        ys = grouped[x]
        stack.append([x * len(ys), sum(ys), float(len(ys))])
        while len(stack) > 1 and stack[-1][1] / stack[-1][2] > stack[-2][1] / stack[-2][2]:
            sx, sy, n = stack.pop()
            stack[-1][0] += sx
            stack[-1][1] += sy
            stack[-1][2] += n
    return [_Block(sx / n, sy / n) for sx, sy, n in stack]


def _pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """None without spread: where all values of either are equal, whatever their size
    (the rounding of a mean of equal values leaves squares that a fixed floor would count
    as spread, and statistics of a small scale spread less than any such floor)."""
    if min(xs) == max(xs) or min(ys) == max(ys):
        return None
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    syy = sum((y - mean_y) ** 2 for y in ys)
    if sxx == 0 or syy == 0:  # spread below what a float's square holds
        return None
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    # Rounding may take it just past +-1 (a perfectly falling calibration read -1 - 2e-16).
    return max(-1.0, min(1.0, sxy / (math.sqrt(sxx) * math.sqrt(syy))))


class InlineProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.f1 = Histogram(
            INLINE_F1_METRIC,
            "Inline F1 proxy: each blended request's check-layer statistic, calibrated "
            "against the shadow F1 at its ratio (observed only when calibrated).",
            ["ratio"],
            buckets=PROXY_BUCKETS,
            registry=registry,
        )
        self.top1 = Histogram(
            INLINE_TOP1_METRIC,
            "Inline top-1 proxy: the same statistic calibrated against the shadow's top-1 "
            "agreement (observed only when calibrated).",
            ["ratio"],
            buckets=PROXY_BUCKETS,
            registry=registry,
        )
        self.pairs = Gauge(
            INLINE_PAIRS_METRIC,
            "(statistic, shadow score) pairs the inline proxy's calibration holds, by ratio.",
            ["ratio"],
            registry=registry,
        )
        self.correlation = Gauge(
            INLINE_CORRELATION_METRIC,
            "Pearson correlation of the inline statistic and the shadow F1, by ratio "
            "(absent with too few pairs or no spread).",
            ["ratio"],
            registry=registry,
        )
        self.pooled = Gauge(
            INLINE_POOLED_METRIC,
            "1 when the ratio's last inline estimate came from the fit borrowed from its "
            "own and lower ratios' pairs (its own had too few), 0 when from its own.",
            ["ratio"],
            registry=registry,
        )
        self.statistic = Histogram(
            INLINE_STATISTIC_METRIC,
            "Check-layer squared K deviation left in the cached tokens not recomputed, per "
            "compared token, of every blended request (uncalibrated), by ratio.",
            ["ratio"],
            buckets=STATISTIC_BUCKETS,
            registry=registry,
        )
        self.shared_pairs = Counter(
            INLINE_SHARED_METRIC,
            "Calibration pairs shared through the deployment's lookup server: published "
            "(scored by this pod's shadow, each once: not its re-sends to a restarted "
            "server) and received (scored by the other pods').",
            ["direction"],
            registry=registry,
        )
        self.share_failures = Counter(
            INLINE_SHARE_FAILURES_METRIC,
            "Exchanges of calibration pairs the lookup server did not answer (the pod "
            "calibrates on its own pairs meanwhile; unsent ones are kept).",
            registry=registry,
        )


@dataclass
class _RatioState:
    f1: Calibration
    top1: Calibration

    def estimates(self, statistic: float, extrapolate: bool = True) -> tuple[float, float] | None:
        f1 = self.f1.estimate(statistic, extrapolate)
        top1 = self.top1.estimate(statistic, extrapolate)
        return None if f1 is None or top1 is None else (f1, top1)


class InlineProxy:
    """Per-ratio calibrations of the statistic, and for a ratio with too few pairs of its
    own the fit of the pairs of it and every lower ratio (built when first needed after a
    pair was added), fed by the shadow and read for every blended request; thread-safe
    (the serving thread observes, the shadow's adds)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        min_pairs: int = MIN_PAIRS,
        max_pairs: int = MAX_PAIRS,
        *,
        metrics: InlineProxyMetrics | None = None,
    ) -> None:
        """Series on `registry` (or the given `metrics`, e.g. a module's own); neither:
        nothing is exported. Bad pair counts are refused here, not by the first
        calibration built on the serving thread."""
        _check_pair_counts(min_pairs, max_pairs)
        self.min_pairs, self.max_pairs = min_pairs, max_pairs
        if metrics is None and registry is not None:
            metrics = InlineProxyMetrics(registry)
        self.metrics = metrics
        self._lock = threading.Lock()
        self._ratios: collections.OrderedDict[str, _RatioState] = collections.OrderedDict()
        # The fit a ratio without enough pairs of its own borrows (its pairs and those of
        # every lower ratio), by ratio label, the `MAX_RATIOS` built last; emptied
        # whenever a pair is added.
        self._borrowed: dict[str, _RatioState] = {}
        # The ratios whose per-request series are exported, the `MAX_RATIOS` observed last.
        self._observed: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Called with (ratio, statistic, f1, top1) after each pair this pod's shadow
        # scored is kept (outside the lock): `SharedCalibration.publish`.
        self.on_pair: Callable[[float, float, float, float], None] | None = None

    def observe(self, ratio: float, statistic: float | None) -> tuple[float, float] | None:
        """One blended request's statistic: the raw value is exported; the calibrated
        (F1, top-1) estimates are exported and returned, or None without calibration."""
        if statistic is None or not math.isfinite(statistic):
            return None
        label = ratio_label(ratio)
        with self._lock:
            state = self._ratios.get(label)
            estimates = None if state is None else state.estimates(statistic)
            pooled = estimates is None
            if pooled:
                estimates = self._borrowed_fit(label).estimates(statistic, extrapolate=False)
            # Under the lock, as in `_add`: a series set after it let go could come back
            # for a ratio another thread has just evicted, and stay exported for good.
            if self.metrics is not None:
                self._keep_observed(label)
                self.metrics.statistic.labels(ratio=label).observe(statistic)
                if estimates is not None:
                    self.metrics.f1.labels(ratio=label).observe(estimates[0])
                    self.metrics.top1.labels(ratio=label).observe(estimates[1])
                    self.metrics.pooled.labels(ratio=label).set(float(pooled))
        return estimates

    def add_pair(self, statistic: float | None, score: ShadowScore) -> None:
        """A request that was blended (with `statistic`) and scored by the shadow; passed
        on to `on_pair` (the deployment's shared calibration) once kept."""
        if statistic is None or not math.isfinite(statistic):
            return
        self._add(score.ratio, statistic, score.f1, score.top1)
        if self.on_pair is not None:
            self.on_pair(float(score.ratio), float(statistic), score.f1, score.top1)

    def add_shared(self, ratio: float, statistic: float, f1: float, top1: float) -> None:
        """A pair another pod of the deployment scored (`SharedCalibration`): kept as
        this pod's own are, not passed on again."""
        if math.isfinite(statistic):
            self._add(ratio, statistic, f1, top1)

    def _add(self, ratio: float, statistic: float, f1: float, top1: float) -> None:
        label = ratio_label(ratio)
        with self._lock:
            own = self._state(label)
            own.f1.add(statistic, f1)
            own.top1.add(statistic, top1)
            self._borrowed.clear()
            # Under the lock: the shadow's thread and the sharing thread add pairs at once,
            # and a count set after the lock let go could overwrite a newer one, or bring
            # back the series of a ratio another add has just evicted (`_state`).
            if self.metrics is not None:
                self.metrics.pairs.labels(ratio=label).set(len(own.f1))
                correlation = own.f1.correlation()
                if correlation is not None:
                    self.metrics.correlation.labels(ratio=label).set(correlation)
                else:
                    _remove(self.metrics.correlation, label)

    def num_pairs(self, ratio: float) -> int:
        with self._lock:
            state = self._ratios.get(ratio_label(ratio))
            return 0 if state is None else len(state.f1)

    def correlation(self, ratio: float) -> float | None:
        with self._lock:
            state = self._ratios.get(ratio_label(ratio))
            return None if state is None else state.f1.correlation()

    def _borrowed_fit(self, label: str) -> _RatioState:
        """The fit of the pairs of `label`'s ratio and every lower one (under the lock)."""
        fit = self._borrowed.get(label)
        if fit is None:
            ratio = float(label)
            lenders = [s for r, s in self._ratios.items() if float(r) <= ratio]
            size = max(self.max_pairs, sum(len(s.f1) for s in lenders))
            fit = _RatioState(Calibration(self.min_pairs, size), Calibration(self.min_pairs, size))
            for lender in lenders:
                for mine, theirs in ((fit.f1, lender.f1), (fit.top1, lender.top1)):
                    for x, y in theirs.pairs():
                        mine.add(x, y)
            # Bounded as the ratios are: where no pair arrives (no shadow of its own) it
            # is never emptied, and each ratio the tuner visits would keep a copy.
            while len(self._borrowed) >= MAX_RATIOS:
                del self._borrowed[next(iter(self._borrowed))]
            self._borrowed[label] = fit
        return fit

    def _state(self, label: str) -> _RatioState:
        state = self._ratios.get(label)
        if state is None:
            state = self._new_state()
            self._ratios[label] = state
            while len(self._ratios) > MAX_RATIOS:
                old, _ = self._ratios.popitem(last=False)
                if self.metrics is not None:
                    _remove(self.metrics.pairs, old)
                    _remove(self.metrics.correlation, old)
                    _remove(self.metrics.pooled, old)
        self._ratios.move_to_end(label)
        return state

    def _keep_observed(self, label: str) -> None:
        """Under the lock: `label` becomes the ratio observed last; the series `observe`
        sets for the ratio observed longest ago go beyond `MAX_RATIOS`. A ratio that only
        ever borrowed a fit has no calibration of its own whose eviction (`_state`) would
        remove them, and the tuner visits ever new ratios."""
        self._observed[label] = None
        self._observed.move_to_end(label)
        while len(self._observed) > MAX_RATIOS:
            old, _ = self._observed.popitem(last=False)
            for series in (
                self.metrics.statistic,
                self.metrics.f1,
                self.metrics.top1,
                self.metrics.pooled,
            ):
                _remove(series, old)

    def _new_state(self) -> _RatioState:
        return _RatioState(
            Calibration(self.min_pairs, self.max_pairs),
            Calibration(self.min_pairs, self.max_pairs),
        )


def _remove(series: Gauge | Histogram, label: str) -> None:
    with contextlib.suppress(KeyError):
        series.remove(label)
