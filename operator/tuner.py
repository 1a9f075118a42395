"""The recompute-ratio control law: a pure function of the spec, the ratio, a reading and
the tuner's state. No clock, no API, no metrics source: the driver (`tuning_loop`) passes
them in, so the law runs in simulated time in its tests.

Quality first. Each interval, in this order:

1. A ratio outside [minRatio, maxRatio] (or not a ratio at all, e.g. patched by hand) is
   clamped into the bounds at once, whatever the metrics say.
2. No action without a trustworthy reading: the engine scores no proxies at all
   (blend.mode off, or spec.tuning.qualityProxies false), the source failed, the data is
   stale, the pods do not run the ratio yet, the proxy is NaN or absent, or there are fewer
   than minSamples samples taken at the ratio in force. The reading is the window's, or its last
   RECENT_INTERVALS intervals' alone when they differ from the older part by more than
   noise (the workload changed under a held ratio). The proxy is the shadow's (full
   prefill scored against the blended answer) when the window has minSamples of them,
   else the engine's inline proxy (`select_signal`); the reason says "(inline proxy)".
3. Proxy below target - band: raise the ratio multiplicatively (x stepUpFactor), capped at
   maxRatio, or straight back to the lowest ratio recently measured meeting the target
   when there is one above. Quality is restored fast, because a bad ratio costs answers.
   One exception: just after a step down from a ratio known to meet the target, a reading
   below the band by less than its noise waits for CONFIRM_FACTOR x minSamples samples
   (`ConfirmingBelowTarget`) before the step is undone and remembered as a floor.
4. Proxy above target + band for a whole cooldown: lower it additively (- stepDown), not
   below minRatio, and start a new cooldown. Speed is won back slowly: a reading above
   the band by less than its noise waits for CONFIRM_DOWN_FACTOR x minSamples samples
   (`ConfirmingAboveTarget`) before the step is taken, since a step down on a few lucky
   samples lands below the target and costs answers until it is undone. A step that would
   land on or below a ratio recently measured below target is not taken (`AtLearnedFloor`,
   reported at once, not after a cooldown that could only end in the same hold): the loop
   settles instead of oscillating around the smallest ratio that meets the target.
5. Otherwise (inside the band, or above it but still cooling down): hold.

The cooldown counts from the last change (samples before it were taken at another ratio and
do not count) or from the first reading above the band, and readings that cannot be trusted
(too few samples yet) do not restart it; a reading inside the band or below it does (one
below by less than its noise too: the ratio was not above the band for a whole cooldown).

What was learned (the floor: the highest ratio measured below target; the lowest ratio
measured meeting it, and the one above that it replaced) is forgotten MEMORY_COOLDOWNS
cooldowns after it was measured, so a workload that becomes easier is found again by a
probe one step below. A reading inside the band teaches "meets the target" only with
REMEMBER_IN_BAND_FACTOR x minSamples samples (a few samples read in band by luck). When
the lowest known-good ratio later falls below target, the one above it is the way back
up, so the raise does not overshoot by a whole step. A change of the target or the band
forgets what it makes unknown (`State.retargeted`): a floor when target - band falls, the
known-good ratios when it rises.

Every decision carries a reason code, a sentence with the numbers it saw, and the state
for the next call.
"""

from __future__ import annotations

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
# What the law learned about ratios is forgotten after this many cooldowns.
MEMORY_COOLDOWNS = 20
# A reading inside the band is remembered as "this ratio meets the target" only when it
# holds this many times minSamples: the memory outlives the reading by MEMORY_COOLDOWNS,
# and a few nearly binary samples put a ratio in the band by luck (a raise would then go
# back to it, and its failure erases the memory of a higher ratio that did meet it).
REMEMBER_IN_BAND_FACTOR = 2
# A step down that reads below the band is undone (and its ratio remembered as a floor)
# at once when the reading is clearly below; when it is within CONFIRM_Z standard errors
# of the band, the law first waits for CONFIRM_FACTOR x minSamples samples: a floor learned
# from 5 to 10 nearly binary samples is wrong often, and it holds the ratio a step too high
# for MEMORY_COOLDOWNS cooldowns. (In simulation, one standard error and 4 x minSamples
# cut from-high runs that end a step too high from 18 % to 9 %; docs/tuning.md.)
CONFIRM_FACTOR = 4
CONFIRM_Z = 1.0
# The same for a step down: a reading above the band by less than CONFIRM_DOWN_Z standard
# errors waits for CONFIRM_DOWN_FACTOR x minSamples samples before the ratio is lowered.
# (In simulation, from-high runs that end below target: 12.0 % -> 5.8 % at 2.8 samples
# per interval, 5.4 % -> 0.8 % at 1.75, for 1-4 points of runs meeting every goal; a
# factor of 4 cut more but met the goals less often; docs/tuning.md.)
CONFIRM_DOWN_FACTOR = 2
CONFIRM_DOWN_Z = 1.0
# The window is long (tuning_loop.window_seconds) so that a held ratio reads many samples,
# which also makes a workload change at a held ratio show only as the window fills with
# new samples. The sources also read the last RECENT_INTERVALS intervals of the window;
# when those samples' mean differs from the older ones' by more than CHANGE_Z standard
# errors (both parts at least minSamples), the law reads only the recent ones. (In
# simulation this brought held-out workload-change runs meeting every goal from 0.74 to
# 0.96, and left the other scenarios as they were; docs/tuning.md.)
RECENT_INTERVALS = 3
CHANGE_Z = 2.0


# The quality signals a reading can carry (status.metrics.proxySignal).
SHADOW = "shadow"  # full-prefill shadow requests scored against the blended answer
INLINE = "inline"  # the engine's inline estimate, scored on every blended request


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
    # The same proxy over the last RECENT_INTERVALS intervals only (a part of the window):
    # when it differs from the older part by more than noise, the workload changed.
    recent_f1_proxy: float | None = None
    recent_num_samples: int = 0
    # Why the engine scores no quality proxies at all (blend.mode off: nothing is blended;
    # or spec.tuning.qualityProxies false); None when it does. Hit rate and TTFT are still
    # read.
    no_proxies: str | None = None
    # The engine's inline proxy over the same window, at the same ratio: scored on every
    # blended request at no cost, the stand-in when too few shadows ran (`select_signal`).
    inline_f1_proxy: float | None = None
    inline_top1: float | None = None
    inline_num_samples: int = 0
    recent_inline_f1_proxy: float | None = None
    recent_inline_num_samples: int = 0
    # Which proxy f1_proxy, top1_agreement and num_samples are: SHADOW or INLINE; with
    # INLINE, shadow_num_samples is how many shadow samples the window had.
    signal: str = SHADOW
    shadow_num_samples: int | None = None


@dataclasses.dataclass(frozen=True)
class State:
    """What the law remembers between calls (kept in status, so a failover continues it)."""

    # Since when the proxy has been above target + band (a cooldown runs from here).
    above_since: float | None = None
    # The highest ratio measured below target - band, and when.
    floor: float | None = None
    floor_at: float | None = None
    # The lowest ratio measured meeting the target (inside the band or above), and when.
    good: float | None = None
    good_at: float | None = None
    # The ratio that was `good` before a lower one met the target: the way back up if the
    # lower one fails later (one rung of the ladder, so the loop does not overshoot).
    good_above: float | None = None
    good_above_at: float | None = None

    def recalled(self, spec: TuningSpec, now: float) -> State:
        """This state without what was learned over MEMORY_COOLDOWNS cooldowns ago."""
        memory = MEMORY_COOLDOWNS * spec.cooldown_seconds
        state = self
        if self.floor_at is not None and now - self.floor_at > memory:
            state = dataclasses.replace(state, floor=None, floor_at=None)
        if self.good_at is not None and now - self.good_at > memory:
            state = dataclasses.replace(state, good=None, good_at=None)
        if self.good_above_at is not None and now - self.good_above_at > memory:
            state = dataclasses.replace(state, good_above=None, good_above_at=None)
        return state

    def below_at(self, ratio: float, now: float) -> State:
        """Learned: `ratio` is below target (a higher ratio known good is kept only above)."""
        floor = ratio if self.floor is None or self.floor_at is None else max(self.floor, ratio)
        good, good_at = (self.good, self.good_at)
        above, above_at = (self.good_above, self.good_above_at)
        if good is not None and good <= ratio + RATIO_TOLERANCE:
            # That ratio is no longer good (the workload changed, or it read in band by
            # luck): the one it replaced takes its place if it is above this one.
            good, good_at = (above, above_at) if _higher(above, ratio) else (None, None)
            above, above_at = None, None
        return State(None, floor, now, good, good_at, above, above_at)

    def meeting_at(self, ratio: float, now: float, above_since: float | None) -> State:
        """Learned: `ratio` meets the target."""
        good, good_at = ratio, now
        above, above_at = (self.good_above, self.good_above_at)
        if _higher(self.good, ratio):  # a lower ratio meets it: the old one is the rung above
            above, above_at = self.good, self.good_at
        elif self.good is not None and _higher(ratio, self.good):
            # A higher ratio: the lowest known good stays, and this one is the rung above
            # it if it is closer than the one known.
            good, good_at = self.good, self.good_at
            if above is None or not _higher(ratio, above):
                above, above_at = ratio, now
        floor, floor_at = (self.floor, self.floor_at)
        if floor is not None and floor >= ratio - RATIO_TOLERANCE:
            floor, floor_at = None, None  # the workload changed: that ratio is no longer low
        return State(above_since, floor, floor_at, good, good_at, above, above_at)

    def retargeted(self, old_target: float, old_band: float, spec: TuningSpec) -> tuple[State, str]:
        """This state, learned against the target `old_target` and band `old_band`, for
        `spec`'s, and a phrase naming what was forgotten ('' when nothing). A reading below
        the old target - band is below a higher one too, one meeting it meets a lower one,
        and one above the old target + band is above a lower one; the rest says nothing of
        the new target."""
        low, old_low = spec.target_f1_proxy - spec.band, old_target - old_band
        high, old_high = spec.target_f1_proxy + spec.band, old_target + old_band
        state, forgot = self, []
        if low < old_low and self.floor is not None:
            state = dataclasses.replace(state, floor=None, floor_at=None)
            forgot.append(f"ratio {self.floor}, measured below the old target")
        if low > old_low and self.good is not None:
            state = dataclasses.replace(
                state, good=None, good_at=None, good_above=None, good_above_at=None
            )
            forgot.append(f"ratio {self.good}, measured meeting the old target")
        if high > old_high and self.above_since is not None:
            state = replace_since(state, None)
            forgot.append("the cooldown begun above the old target + band")
        if not forgot:
            return self, ""
        change = (
            f"target {old_target} band {old_band} changed to "
            f"{spec.target_f1_proxy} band {spec.band}"
        )
        return state, f"{change}: forgot {' and '.join(forgot)}"


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


def select_signal(spec: TuningSpec, reading: Reading) -> Reading:
    """The reading on the proxy the law acts on: the shadow samples when the window has
    minSamples of them, else the inline proxy when it has more samples than the shadow
    (its values moved into f1_proxy, top1_agreement and num_samples, `signal` INLINE).
    Idempotent: a reading already on the inline proxy is returned as it is."""
    if reading.signal != SHADOW or reading.num_samples >= spec.min_samples:
        return reading
    inline = reading.inline_f1_proxy
    if inline is None or not math.isfinite(inline):
        return reading
    if reading.inline_num_samples <= reading.num_samples:
        return reading
    return dataclasses.replace(
        reading,
        f1_proxy=inline,
        top1_agreement=reading.inline_top1,
        num_samples=reading.inline_num_samples,
        recent_f1_proxy=reading.recent_inline_f1_proxy,
        recent_num_samples=reading.recent_inline_num_samples,
        signal=INLINE,
        shadow_num_samples=reading.num_samples,
    )


def signal_note(reading: Reading) -> str:
    """' (inline proxy: ...)' for a reading on the inline proxy; '' on shadow samples."""
    if reading.signal != INLINE:
        return ""
    return f" (inline proxy: {reading.shadow_num_samples or 0} shadow samples in the window)"


def decide(spec: TuningSpec, ratio: object, reading: Reading, state: State, now: float) -> Decision:
    """The next ratio for a BlendDeployment whose pods run `ratio` (see the module doc)."""
    clamped = clamp_decision(spec, ratio)
    if clamped is not None:
        return clamped
    ratio = float(ratio)
    state = state.recalled(spec, now)
    reading = select_signal(spec, reading)
    untrusted = _untrusted(spec, ratio, reading)
    if untrusted is not None:
        return _hold(ratio, *untrusted, is_tuned=False, state=state)
    reading, changed = recent_if_changed(spec, reading)
    f1 = reading.f1_proxy
    low, high = spec.target_f1_proxy - spec.band, spec.target_f1_proxy + spec.band
    seen = f"{changed}F1 proxy {f1:.3f} over {reading.num_samples} samples{signal_note(reading)}"
    if f1 < low:
        if _is_unconfirmed(spec, ratio, reading, state, low):
            need = CONFIRM_FACTOR * spec.min_samples
            text = (
                f"{seen} is below {low:.3f} (target - band) by less than its noise, a step "
                f"down from {state.good} (known to meet the target): waiting for {need} "
                "samples before raising"
            )
            return _hold(ratio, "ConfirmingBelowTarget", text, False, replace_since(state, None))
        return _raise(spec, ratio, f"{seen} is below {low:.3f} (target - band)", state, now)
    if f1 <= high:
        text = f"{seen} is within {low:.3f}..{high:.3f}"
        if reading.num_samples < REMEMBER_IN_BAND_FACTOR * spec.min_samples:
            return _hold(ratio, "InBand", text, True, replace_since(state, None))
        return _hold(ratio, "InBand", text, True, state.meeting_at(ratio, now, None))
    return _above(spec, ratio, reading, f"{seen} is above {high:.3f} (target + band)", state, now)


def recent_if_changed(spec: TuningSpec, reading: Reading) -> tuple[Reading, str]:
    """The reading the law acts on, and a phrase for the reason: the recent part of the
    window alone when it differs from the older part by more than CHANGE_Z standard errors
    (the largest a proxy in [0, 1] with the window's mean can have), else the whole."""
    recent, num = reading.recent_f1_proxy, reading.recent_num_samples
    older_num = reading.num_samples - num
    if recent is None or not math.isfinite(recent) or reading.f1_proxy is None:
        return reading, ""
    if num < spec.min_samples or older_num < spec.min_samples:
        return reading, ""
    older = (reading.f1_proxy * reading.num_samples - recent * num) / older_num
    mean = reading.f1_proxy
    error = math.sqrt(max(mean * (1 - mean), 0.01) * (1 / num + 1 / older_num))
    if abs(recent - older) <= CHANGE_Z * error:
        return reading, ""
    phrase = (
        f"the workload changed (the last {num} samples read {recent:.3f}, the "
        f"{older_num} before them {older:.3f}): reading the recent ones only: "
    )
    return dataclasses.replace(reading, f1_proxy=recent, num_samples=num), phrase


def clamp_decision(spec: TuningSpec, ratio: object) -> Decision | None:
    """A decision that moves `ratio` into the bounds, or None if it is inside them."""
    if not _is_ratio(ratio):
        to = round_ratio(spec.max_ratio)  # quality first: the safest ratio the bounds allow
        text = f"status.recomputeRatio {ratio!r} is not a ratio in (0, 1]; reset to maxRatio {to}"
        return Decision("up", None, to, "ClampedToBounds", text, False, State())
    ratio = float(ratio)
    to = round_ratio(min(max(ratio, spec.min_ratio), spec.max_ratio))
    # Inside the bounds is not clamped, whatever its decimals (a spec's 0.33333 is not
    # "outside" because rounding moves it).
    if spec.min_ratio <= ratio <= spec.max_ratio or abs(to - ratio) <= RATIO_TOLERANCE / 10:
        return None
    direction: Direction = "up" if to > ratio else "down"
    bounds = f"[{spec.min_ratio}, {spec.max_ratio}]"
    text = f"ratio {ratio} is outside the tuning bounds {bounds}; clamped to {to}"
    return Decision(direction, ratio, to, "ClampedToBounds", text, False, State())


def round_ratio(ratio: float) -> float:
    return round(ratio, RATIO_DECIMALS)


def _untrusted(spec: TuningSpec, ratio: float, reading: Reading) -> tuple[str, str] | None:
    """(code, sentence) when the reading must not be acted on, else None."""
    if reading.no_proxies is not None:
        return "NoQualityProxies", (
            f"{reading.no_proxies}; the ratio stays at {ratio} "
            "(set spec.tuning.enabled: false to stop tuning)"
        )
    if reading.error is not None:
        return "MetricsUnavailable", f"no metrics: {reading.error}"
    stale_after = STALE_INTERVALS * spec.interval_seconds
    if reading.age_s is not None and not reading.age_s <= stale_after:  # NaN is stale too
        return "StaleMetrics", f"newest data is {reading.age_s:.0f} s old (over {stale_after} s)"
    others = [r for r in reading.ratios_in_force if not abs(r - ratio) <= RATIO_TOLERANCE]
    if others:
        return "RatioNotApplied", f"pods still run ratio {others[0]}, not {ratio}; waiting"
    note = signal_note(reading)
    if reading.f1_proxy is None or not math.isfinite(reading.f1_proxy):
        return "NoSamples", f"no finite F1 proxy at ratio {ratio} ({reading.f1_proxy}){note}"
    if reading.num_samples < spec.min_samples:
        return "TooFewSamples", (
            f"{reading.num_samples} F1-proxy samples at ratio {ratio}, "
            f"fewer than minSamples {spec.min_samples}{note}"
        )
    return None


def _is_unconfirmed(
    spec: TuningSpec, ratio: float, reading: Reading, state: State, low: float
) -> bool:
    """A reading below the band that does not yet justify undoing a step down: a ratio
    above is known to meet the target, the samples are fewer than CONFIRM_FACTOR x
    minSamples, and the mean is within CONFIRM_Z standard errors of the band (the largest
    standard error a proxy in [0, 1] with this mean can have: sqrt(m (1 - m) / n))."""
    if not _higher(state.good, ratio) or reading.f1_proxy is None:
        return False
    if reading.num_samples >= CONFIRM_FACTOR * spec.min_samples:
        return False
    f1 = reading.f1_proxy
    return f1 + CONFIRM_Z * _largest_error(f1, reading.num_samples) >= low


def _is_within_noise(spec: TuningSpec, reading: Reading, high: float) -> bool:
    """A reading above the band that does not yet justify a step down: fewer than
    CONFIRM_DOWN_FACTOR x minSamples samples, and the mean within CONFIRM_DOWN_Z standard
    errors of the band (`_largest_error`)."""
    if reading.f1_proxy is None or reading.num_samples >= CONFIRM_DOWN_FACTOR * spec.min_samples:
        return False
    f1 = reading.f1_proxy
    return f1 - CONFIRM_DOWN_Z * _largest_error(f1, reading.num_samples) <= high


def _largest_error(mean: float, num_samples: int) -> float:
    """The largest standard error a mean of `num_samples` proxies in [0, 1] can have:
    sqrt(m (1 - m) / n)."""
    return math.sqrt(max(mean * (1 - mean), 0.0) / num_samples)


def _raise(spec: TuningSpec, ratio: float, seen: str, state: State, now: float) -> Decision:
    learned = state.below_at(ratio, now)
    if ratio >= spec.max_ratio - RATIO_TOLERANCE:
        text = f"{seen}, but the ratio is at maxRatio {spec.max_ratio}"
        return _hold(ratio, "PinnedAtMaxRatio", text, False, learned)
    # A good ratio above maxRatio (the bound lowered since) was never measured at maxRatio:
    # the step up is capped there and says so.
    if learned.good is not None and ratio < learned.good <= spec.max_ratio + RATIO_TOLERANCE:
        to = round_ratio(min(learned.good, spec.max_ratio))
        text = f"{seen}: raised back to {to}, the lowest ratio measured meeting the target"
    else:
        to = round_ratio(min(ratio * spec.step_up_factor, spec.max_ratio))
        text = f"{seen}: raised x{spec.step_up_factor} to {to}"
    return Decision("up", ratio, to, "BelowTarget", text, False, learned)


def _above(
    spec: TuningSpec, ratio: float, reading: Reading, seen: str, state: State, now: float
) -> Decision:
    since = now if state.above_since is None else state.above_since
    learned = state.meeting_at(ratio, now, since)
    cooled = now - since
    if ratio <= spec.min_ratio + RATIO_TOLERANCE:
        return _hold(ratio, "AtMinRatio", f"{seen}; already at minRatio", True, learned)
    # Rounded before the bound, not after: a minRatio below 0.00005 would round to 0, no
    # ratio at all, which the next interval resets to maxRatio.
    to = max(round_ratio(ratio - spec.step_down), spec.min_ratio)
    # A step the floor forbids is not taken however long the proxy stays above the band:
    # say so at once rather than count down a cooldown that leads nowhere.
    if learned.floor is not None and to <= learned.floor + RATIO_TOLERANCE:
        text = f"{seen}, but {to} is not above {learned.floor}, measured below target"
        return _hold(ratio, "AtLearnedFloor", text, True, learned)
    if cooled < spec.cooldown_seconds:
        text = f"{seen} for {cooled:.0f} s of a {spec.cooldown_seconds} s cooldown"
        return _hold(ratio, "AboveTargetCooling", text, True, learned)
    if _is_within_noise(spec, reading, spec.target_f1_proxy + spec.band):
        need = CONFIRM_DOWN_FACTOR * spec.min_samples
        text = f"{seen} by less than its noise: waiting for {need} samples before lowering"
        return _hold(ratio, "ConfirmingAboveTarget", text, True, learned)
    text = f"{seen} for {cooled:.0f} s (cooldown {spec.cooldown_seconds} s): lowered to {to}"
    return Decision("down", ratio, to, "AboveTarget", text, True, replace_since(learned, now))


def _higher(ratio: float | None, other: float) -> bool:
    return ratio is not None and ratio > other + RATIO_TOLERANCE


def replace_since(state: State, above_since: float | None) -> State:
    return dataclasses.replace(state, above_since=above_since)


def _hold(ratio: float, code: str, reason: str, is_tuned: bool, state: State) -> Decision:
    return Decision("hold", ratio, ratio, code, reason, is_tuned, state)


def _is_ratio(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= 1
    )
