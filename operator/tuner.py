"""The recompute-ratio control law: a pure function of the spec, the ratio, a reading and
the tuner's state. No clock, no API, no metrics source: the driver (`tuning_loop`) passes
them in, so the law runs in simulated time in its tests.

Quality first. Each interval, in this order:

1. A ratio outside [minRatio, maxRatio] (or not a ratio at all, e.g. patched by hand) is
   clamped into the bounds at once, whatever the metrics say.
2. No action without a trustworthy reading: the source failed, the data is stale, the pods
   do not run the ratio yet, the proxy is NaN or absent, or there are fewer than minSamples
   samples taken at the ratio in force.
3. Proxy below target - band: raise the ratio multiplicatively (x stepUpFactor), capped at
   maxRatio. Quality is restored fast, because a bad ratio costs answers.
4. Proxy above target + band for a whole cooldown: lower it additively (- stepDown), not
   below minRatio, and start a new cooldown. Speed is won back slowly.
5. Otherwise (inside the band, or above it but still cooling down): hold.

Every decision carries a reason code, a sentence with the numbers it saw, and the state
for the next call (when the proxy was first seen above the band).
"""

import dataclasses
import math
from typing import Literal

from holeblend_operator.api import TuningSpec

Direction = Literal["up", "down", "hold"]
# Data older than this many intervals is stale: the source stopped seeing the pods.
STALE_INTERVALS = 3
# Ratios are rounded so that the values written to status and blend.json stay readable and
# the pods' ratio label (a string) matches what was decided.
RATIO_DECIMALS = 4
# Two ratios this close are the same ratio (the pods report the one they run as a float).
RATIO_TOLERANCE = 5e-5


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a metrics source read for one BlendDeployment over the last window."""

    f1_proxy: float | None  # mean answer-token F1 of samples taken at `ratio`; None: none
    top1_agreement: float | None  # mean top-1 agreement of the same samples
    num_samples: int  # proxy samples taken at the ratio in force, in the window
    hit_percent: float | None  # reused / prompt tokens over the window, in percent
    ttft_seconds: float | None  # mean time to first token over the window
    age_s: float | None  # how old the newest data point is; None: unknown (fresh scrape)
    ratios_in_force: tuple[float, ...] = ()  # what each pod reports it runs with
    error: str | None = None  # why nothing could be read (source down, garbage, ...)


@dataclasses.dataclass(frozen=True)
class State:
    """What the law remembers between calls."""

    above_since: float | None = None  # when the proxy was first seen above target + band


@dataclasses.dataclass(frozen=True)
class Decision:
    direction: Direction
    from_ratio: float | None  # None: the old value was not a ratio at all
    to_ratio: float
    code: str  # CamelCase reason code, e.g. BelowTarget, InBand, TooFewSamples
    reason: str  # the sentence for status, with the numbers
    is_tuned: bool  # quality meets the target at this ratio (the Tuned condition)
    state: State

    @property
    def is_change(self) -> bool:
        return self.direction != "hold"


def decide(spec: TuningSpec, ratio: object, reading: Reading, state: State, now: float) -> Decision:
    """The next ratio for a BlendDeployment whose pods run `ratio` (see the module doc)."""
    clamped = clamp_decision(spec, ratio)
    if clamped is not None:
        return clamped
    ratio = float(ratio)
    untrusted = _untrusted(spec, ratio, reading)
    if untrusted is not None:
        return _hold(ratio, *untrusted, is_tuned=False, state=State())
    f1 = reading.f1_proxy
    low, high = spec.target_f1_proxy - spec.band, spec.target_f1_proxy + spec.band
    seen = f"F1 proxy {f1:.3f} over {reading.num_samples} samples"
    if f1 < low:
        return _raise(spec, ratio, f"{seen} is below {low:.3f} (target - band)")
    if f1 <= high:
        return _hold(ratio, "InBand", f"{seen} is within {low:.3f}..{high:.3f}", True, State())
    return _above(spec, ratio, f"{seen} is above {high:.3f} (target + band)", state, now)


def clamp_decision(spec: TuningSpec, ratio: object) -> Decision | None:
    """A decision that moves `ratio` into the bounds, or None if it is inside them."""
    if not _is_ratio(ratio):
        to = round_ratio(spec.max_ratio)  # quality first: the safest ratio the bounds allow
        text = f"status.recomputeRatio {ratio!r} is not a ratio in (0, 1]; reset to maxRatio {to}"
        return Decision("up", None, to, "ClampedToBounds", text, False, State())
    ratio = float(ratio)
    to = round_ratio(min(max(ratio, spec.min_ratio), spec.max_ratio))
    if abs(to - ratio) <= RATIO_TOLERANCE / 10:
        return None
    direction: Direction = "up" if to > ratio else "down"
    bounds = f"[{spec.min_ratio}, {spec.max_ratio}]"
    text = f"ratio {ratio} is outside the tuning bounds {bounds}; clamped to {to}"
    return Decision(direction, ratio, to, "ClampedToBounds", text, False, State())


def round_ratio(ratio: float) -> float:
    return round(ratio, RATIO_DECIMALS)


def _untrusted(spec: TuningSpec, ratio: float, reading: Reading) -> tuple[str, str] | None:
    """(code, sentence) when the reading must not be acted on, else None."""
    if reading.error is not None:
        return "MetricsUnavailable", f"no metrics: {reading.error}"
    stale_after = STALE_INTERVALS * spec.interval_seconds
    if reading.age_s is not None and not reading.age_s <= stale_after:  # NaN is stale too
        return "StaleMetrics", f"newest data is {reading.age_s:.0f} s old (over {stale_after} s)"
    others = [r for r in reading.ratios_in_force if not abs(r - ratio) <= RATIO_TOLERANCE]
    if others:
        return "RatioNotApplied", f"pods still run ratio {others[0]}, not {ratio}; waiting"
    if reading.f1_proxy is None or not math.isfinite(reading.f1_proxy):
        return "NoSamples", f"no finite F1 proxy at ratio {ratio} ({reading.f1_proxy})"
    if reading.num_samples < spec.min_samples:
        return "TooFewSamples", (
            f"{reading.num_samples} F1-proxy samples at ratio {ratio}, "
            f"fewer than minSamples {spec.min_samples}"
        )
    return None


def _raise(spec: TuningSpec, ratio: float, seen: str) -> Decision:
    if ratio >= spec.max_ratio - RATIO_TOLERANCE:
        text = f"{seen}, but the ratio is at maxRatio {spec.max_ratio}"
        return _hold(ratio, "PinnedAtMaxRatio", text, False, State())
    to = round_ratio(min(ratio * spec.step_up_factor, spec.max_ratio))
    text = f"{seen}: raised x{spec.step_up_factor} to {to}"
    return Decision("up", ratio, to, "BelowTarget", text, False, State())


def _above(spec: TuningSpec, ratio: float, seen: str, state: State, now: float) -> Decision:
    since = now if state.above_since is None else state.above_since
    cooled = now - since
    if ratio <= spec.min_ratio + RATIO_TOLERANCE:
        return _hold(ratio, "AtMinRatio", f"{seen}; already at minRatio", True, State(since))
    if cooled < spec.cooldown_seconds:
        text = f"{seen} for {cooled:.0f} s of a {spec.cooldown_seconds} s cooldown"
        return _hold(ratio, "AboveTargetCooling", text, True, State(since))
    to = round_ratio(max(ratio - spec.step_down, spec.min_ratio))
    text = f"{seen} for {cooled:.0f} s (cooldown {spec.cooldown_seconds} s): lowered to {to}"
    return Decision("down", ratio, to, "AboveTarget", text, True, State(now))


def _hold(ratio: float, code: str, reason: str, is_tuned: bool, state: State) -> Decision:
    return Decision("hold", ratio, ratio, code, reason, is_tuned, state)


def _is_ratio(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= 1
    )
