"""The control law in simulated time: each rule alone, then closed loops against a model
of how quality depends on the ratio."""

import dataclasses
import math
import random

import pytest

from holeblend_operator.api import TuningSpec
from holeblend_operator.tuner import (
    INLINE,
    MEMORY_COOLDOWNS,
    SHADOW,
    Reading,
    State,
    decide,
    select_signal,
)

SPEC = TuningSpec.model_validate(
    {
        "targetF1Proxy": 0.9,
        "band": 0.02,
        "minRatio": 0.05,
        "maxRatio": 0.6,
        "stepUpFactor": 1.5,
        "stepDown": 0.02,
        "intervalSeconds": 10,
        "cooldownSeconds": 30,
        "minSamples": 20,
    }
)


def reading(f1=0.9, n=50, **changes) -> Reading:
    values = {
        "f1_proxy": f1,
        "top1_agreement": f1,
        "num_samples": n,
        "hit_percent": 80.0,
        "ttft_seconds": 0.3,
        "age_s": 5.0,
    }
    return Reading(**(values | changes))


def test_quality_below_the_band_raises_the_ratio_multiplicatively():
    decision = decide(SPEC, 0.1, reading(f1=0.8), State(), now=0)
    assert (decision.direction, decision.to_ratio, decision.code) == ("up", 0.15, "BelowTarget")
    assert "0.800" in decision.reason and "50 samples" in decision.reason


def test_a_raise_is_capped_at_max_ratio():
    assert decide(SPEC, 0.5, reading(f1=0.5), State(), now=0).to_ratio == 0.6


def test_below_target_at_max_ratio_holds_and_says_it_is_pinned():
    decision = decide(SPEC, 0.6, reading(f1=0.5), State(), now=0)
    assert (decision.direction, decision.code, decision.is_tuned) == (
        "hold",
        "PinnedAtMaxRatio",
        False,
    )


def test_quality_inside_the_band_holds():
    decision = decide(SPEC, 0.2, reading(f1=0.915), State(), now=0)
    assert (decision.direction, decision.code, decision.is_tuned) == ("hold", "InBand", True)


def test_quality_above_the_band_lowers_only_after_a_whole_cooldown():
    state, ratio = State(), 0.3
    for now in (0, 10, 20):
        decision = decide(SPEC, ratio, reading(f1=0.97), state, now)
        assert (decision.direction, decision.code) == ("hold", "AboveTargetCooling")
        state = decision.state
    decision = decide(SPEC, ratio, reading(f1=0.97), state, now=30)
    assert (decision.direction, decision.to_ratio) == ("down", 0.28)
    # A new cooldown starts with the change.
    again = decide(SPEC, 0.28, reading(f1=0.97), decision.state, now=40)
    assert again.direction == "hold"


def test_a_dip_into_the_band_restarts_the_cooldown():
    state = decide(SPEC, 0.3, reading(f1=0.97), State(), now=0).state
    state = decide(SPEC, 0.3, reading(f1=0.9), state, now=20).state
    assert decide(SPEC, 0.3, reading(f1=0.97), state, now=40).direction == "hold"


def test_readings_without_enough_samples_after_a_change_do_not_restart_the_cooldown():
    down = decide(SPEC, 0.3, reading(f1=0.97), State(above_since=0), now=30)
    assert (down.direction, down.to_ratio) == ("down", 0.28)
    state = down.state
    for now in (40, 50):  # samples at the new ratio are still coming in
        state = decide(SPEC, 0.28, reading(f1=0.97, n=3), state, now).state
    # Every sample at 0.28 was above the band, and a cooldown has passed since the change.
    assert decide(SPEC, 0.28, reading(f1=0.97), state, now=60).direction == "down"


def test_a_ratio_measured_below_target_is_a_floor_the_loop_does_not_step_back_onto():
    up = decide(SPEC, 0.1, reading(f1=0.8), State(), now=0)
    assert (up.direction, up.to_ratio, up.state.floor) == ("up", 0.15, 0.1)
    state = up.state
    for now in (10, 20, 30):
        decision = decide(SPEC, 0.15, reading(f1=0.97), state, now)
        state = decision.state
    assert (decision.direction, decision.code) == ("hold", "AboveTargetCooling")
    decision = decide(SPEC, 0.15, reading(f1=0.97), state, now=40)
    assert (decision.direction, decision.to_ratio) == ("down", 0.13)
    # 10 s into the cooldown: the step it would lead to (0.08) is below the floor, so the
    # law says so at once instead of counting down a cooldown that ends in no step.
    early = decide(SpecWith(stepDown=0.05), 0.13, reading(f1=0.97), decision.state, now=50)
    assert (early.direction, early.code) == ("hold", "AtLearnedFloor")
    stepped = decide(SpecWith(stepDown=0.05), 0.13, reading(f1=0.97), early.state, now=80)
    assert (stepped.direction, stepped.code) == ("hold", "AtLearnedFloor")
    assert "0.1" in stepped.reason and stepped.is_tuned


def test_a_raise_goes_straight_back_to_the_lowest_ratio_measured_meeting_the_target():
    state = decide(SPEC, 0.3, reading(f1=0.91), State(), now=0).state
    assert state.good == 0.3
    up = decide(SPEC, 0.1, reading(f1=0.8), state, now=10)
    assert (up.direction, up.to_ratio) == ("up", 0.3)  # not x1.5 = 0.15: 0.3 is known good
    # A ratio that met the target and now falls below it is no longer known good.
    up = decide(SPEC, 0.3, reading(f1=0.8), up.state, now=20)
    assert (up.to_ratio, up.state.good, up.state.floor) == (0.45, None, 0.3)


def test_an_in_band_reading_is_remembered_as_meeting_the_target_only_on_enough_samples():
    known = decide(SPEC, 0.3, reading(f1=0.91), State(), now=0).state  # 50 samples: remembered
    thin = decide(SPEC, 0.2, reading(f1=0.9, n=SPEC.min_samples), known, now=10)
    assert (thin.code, thin.state.good) == ("InBand", 0.3)  # 20 samples: held, not learned
    # Its failure then raises straight back to the ratio that did meet the target.
    up = decide(SPEC, 0.2, reading(f1=0.8), thin.state, now=20)
    assert (up.direction, up.to_ratio) == ("up", 0.3)
    full = decide(SPEC, 0.2, reading(f1=0.9, n=2 * SPEC.min_samples), known, now=10)
    assert full.state.good == 0.2


def test_when_the_lowest_known_good_ratio_fails_a_raise_goes_back_to_the_one_it_replaced():
    # 0.6 met the target, then 0.4 did too (so 0.6 is kept as the rung above it) ...
    known = decide(SPEC, 0.6, reading(f1=0.91), State(), now=0).state
    lower = decide(SPEC, 0.4, reading(f1=0.91), known, now=10).state
    assert (lower.good, lower.good_above) == (0.4, 0.6)
    # ... then 0.4 fell below target (the workload changed, or it read in band by luck):
    # the raise goes back to 0.6, not a whole step (x2) past it.
    wide = SpecWith(maxRatio=1.0, stepUpFactor=2.0)
    up = decide(wide, 0.4, reading(f1=0.8), lower, now=20)
    assert (up.direction, up.to_ratio) == ("up", 0.6)
    assert (up.state.good, up.state.good_above, up.state.floor) == (0.6, None, 0.4)
    # Without the rung (the old law) the raise would have gone a whole step, to 0.8.
    bare = decide(wide, 0.4, reading(f1=0.8), replace_rung(lower), now=20)
    assert bare.to_ratio == 0.8


def test_a_higher_ratio_meeting_the_target_becomes_the_rung_if_it_is_closer():
    state = decide(SPEC, 0.2, reading(f1=0.91), State(), now=0).state
    state = decide(SPEC, 0.5, reading(f1=0.91), state, now=10).state
    assert (state.good, state.good_above) == (0.2, 0.5)
    state = decide(SPEC, 0.3, reading(f1=0.91), state, now=20).state
    assert (state.good, state.good_above) == (0.2, 0.3)
    state = decide(SPEC, 0.45, reading(f1=0.91), state, now=30).state
    assert (state.good, state.good_above) == (0.2, 0.3)


def test_a_step_down_on_a_reading_above_by_less_than_its_noise_waits_for_more_samples():
    """The live from-high run at saturation lowered 0.2 (offline F1 0.73, in band) to 0.02
    (0.61) on 0.833 over 6 shadow samples: above 0.78 by less than one standard error."""
    spec = SpecWith(minSamples=4, band=0.05, targetF1Proxy=0.73, cooldownSeconds=45)
    above = State(above_since=0)
    wait = decide(spec, 0.2, reading(f1=0.833, n=6), above, now=90)
    assert (wait.direction, wait.code, wait.is_tuned) == ("hold", "ConfirmingAboveTarget", True)
    assert "8 samples" in wait.reason and "0.833 over 6 samples" in wait.reason
    # Clearly above (1.0 has no spread; 0.95 - 0.08 over 7 > 0.78): lowered at once.
    assert decide(spec, 0.2, reading(f1=1.0, n=4), above, now=90).code == "AboveTarget"
    assert decide(spec, 0.4, reading(f1=0.95, n=7), above, now=90).direction == "down"
    # With 2 x minSamples the same mean is trusted.
    assert decide(spec, 0.2, reading(f1=0.833, n=8), wait.state, now=135).direction == "down"
    # Still cooling down first: the cooldown's code, not this one.
    assert decide(spec, 0.2, reading(f1=0.833, n=6), State(), now=0).code == "AboveTargetCooling"


def test_a_step_down_that_reads_below_by_less_than_its_noise_is_confirmed_before_undone():
    spec = SpecWith(minSamples=4, band=0.05, targetF1Proxy=0.73)  # below the band: < 0.68
    known = decide(spec, 0.6, reading(f1=0.9, n=30), State(), now=0).state  # 0.6 meets it
    # Stepped down to 0.4: 0.6 over 5 samples is below 0.68, but 0.6 + 0.22 (one standard
    # error) is not.
    wait = decide(spec, 0.4, reading(f1=0.6, n=5), known, now=30)
    assert (wait.direction, wait.code, wait.is_tuned) == ("hold", "ConfirmingBelowTarget", False)
    assert wait.state.floor is None and "16 samples" in wait.reason
    # 0.5 over 7 is within one standard error (0.19) of the band too.
    assert decide(spec, 0.4, reading(f1=0.5, n=7), known, now=30).code == "ConfirmingBelowTarget"
    # Clearly below (0.2 + 0.18 < 0.68): undone at once, quality first.
    assert decide(spec, 0.4, reading(f1=0.2, n=5), known, now=30).to_ratio == 0.6
    # With 4 x minSamples the same mean is trusted: undone, and 0.4 becomes the floor.
    up = decide(spec, 0.4, reading(f1=0.6, n=16), wait.state, now=60)
    assert (up.direction, up.to_ratio, up.state.floor) == ("up", 0.6, 0.4)
    # Without a known-good ratio above (climbing from below), nothing waits.
    climb = decide(spec, 0.4, reading(f1=0.6, n=5), State(), now=30)
    assert (climb.direction, climb.code) == ("up", "BelowTarget")


def test_a_reading_below_the_band_while_confirming_restarts_the_cooldown():
    """Stepped down at 30 s, the new ratio read below the band by less than its noise at
    40 s: when it reads above at 70 s, it has not been above for a whole cooldown, so it
    is not lowered again at once (a step down from a ratio that straddles the band)."""
    spec = SpecWith(minSamples=4, band=0.05, targetF1Proxy=0.73, cooldownSeconds=30)
    known = decide(spec, 0.6, reading(f1=0.9, n=30), State(), now=0).state
    down = decide(spec, 0.6, reading(f1=0.9, n=30), replace(known, 0), now=30)
    assert (down.direction, down.to_ratio) == ("down", 0.58)
    wait = decide(spec, 0.58, reading(f1=0.6, n=5), down.state, now=40)
    assert wait.code == "ConfirmingBelowTarget"
    above = decide(spec, 0.58, reading(f1=0.95, n=40), wait.state, now=70)
    assert (above.direction, above.code) == ("hold", "AboveTargetCooling")
    assert "for 0 s of a 30 s cooldown" in above.reason
    later = decide(spec, 0.58, reading(f1=0.95, n=40), above.state, now=100)
    assert (later.direction, later.to_ratio) == ("down", 0.56)


def test_a_workload_that_changed_under_a_held_ratio_is_read_from_the_recent_samples():
    spec = SpecWith(minSamples=4, band=0.05, targetF1Proxy=0.73)  # band 0.68..0.78
    # 100 samples over the window read 0.74, in band; the last 30 of them read 0.45: the
    # older 70 read 0.864, 0.41 apart, over 2 standard errors (2 x 0.097): raise.
    changed = decide(
        spec, 0.3, reading(0.74, 100, recent_f1_proxy=0.45, recent_num_samples=30), State(), now=0
    )
    assert (changed.direction, changed.code, changed.to_ratio) == ("up", "BelowTarget", 0.45)
    assert "the workload changed" in changed.reason and "0.450 over 30" in changed.reason
    # The same window whose recent part reads within noise of the rest: held in band.
    same = reading(0.74, 100, recent_f1_proxy=0.70, recent_num_samples=30)
    assert decide(spec, 0.3, same, State(), now=0).code == "InBand"
    # A recent part under minSamples says nothing yet, nor does an older part that thin.
    thin = reading(0.74, 100, recent_f1_proxy=0.0, recent_num_samples=3)
    assert decide(spec, 0.3, thin, State(), now=0).code == "InBand"
    young = reading(0.74, 33, recent_f1_proxy=0.70, recent_num_samples=30)
    assert decide(spec, 0.3, young, State(), now=0).code == "InBand"
    # A workload that became easier reads high at once too (a cooldown starts).
    easier = reading(0.76, 100, recent_f1_proxy=0.99, recent_num_samples=30)
    assert decide(spec, 0.3, easier, State(), now=0).code == "AboveTargetCooling"
    assert decide(spec, 0.3, reading(0.76, 100), State(), now=0).code == "InBand"


def replace_rung(state: State) -> State:
    return dataclasses.replace(state, good_above=None, good_above_at=None)


def test_what_was_learned_is_forgotten_after_the_memory_so_an_easier_workload_is_found():
    state = decide(SPEC, 0.1, reading(f1=0.8), State(), now=0).state
    memory = MEMORY_COOLDOWNS * SPEC.cooldown_seconds
    held = decide(SpecWith(stepDown=0.05), 0.15, reading(f1=0.97), replace(state, 0), memory)
    assert held.code == "AtLearnedFloor"
    later = decide(SpecWith(stepDown=0.05), 0.15, reading(f1=0.97), held.state, memory + 40)
    assert (later.direction, later.to_ratio) == ("down", 0.1)


def SpecWith(**changes) -> TuningSpec:
    return TuningSpec.model_validate(SPEC.model_dump(by_alias=True) | changes)


def replace(state: State, above_since: float) -> State:
    return State(above_since, state.floor, state.floor_at, state.good, state.good_at)


def test_lowering_stops_at_min_ratio():
    decision = decide(SPEC, 0.06, reading(f1=0.99), State(above_since=0), now=100)
    assert decision.to_ratio == 0.05
    held = decide(SPEC, 0.05, reading(f1=0.99), State(above_since=0), now=200)
    assert (held.direction, held.code) == ("hold", "AtMinRatio")


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"n": 19}, "TooFewSamples"),
        ({"n": 0, "f1": None}, "NoSamples"),
        ({"f1": math.nan}, "NoSamples"),
        ({"f1": math.inf}, "NoSamples"),
        ({"age_s": 31.0}, "StaleMetrics"),
        ({"age_s": math.nan}, "StaleMetrics"),
        ({"error": "Prometheus answered HTML"}, "MetricsUnavailable"),
        ({"ratios_in_force": (0.2, 0.3)}, "RatioNotApplied"),
        ({"no_proxies": "blend.mode is off"}, "NoQualityProxies"),
        ({"no_proxies": "blend.mode is off", "f1": 0.99, "error": "down"}, "NoQualityProxies"),
    ],
)
def test_no_action_on_an_untrustworthy_reading(changes, code):
    decision = decide(SPEC, 0.2, reading(**({"f1": 0.1} | changes)), State(above_since=0), now=500)
    assert (decision.direction, decision.to_ratio, decision.code) == ("hold", 0.2, code)
    assert not decision.is_tuned and decision.state == State(above_since=0)  # nothing learned


def test_an_engine_without_proxies_holds_and_says_how_to_stop_tuning():
    decision = decide(SPEC, 0.2, reading(no_proxies="blend.mode is off"), State(), 500)
    assert decision.reason.startswith("blend.mode is off; the ratio stays at 0.2")
    assert "spec.tuning.enabled: false" in decision.reason
    # A ratio out of bounds is still clamped first.
    off = reading(no_proxies="blend.mode is off")
    assert decide(SPEC, 0.9, off, State(), 500).code == "ClampedToBounds"


@pytest.mark.parametrize(("ratio", "to", "direction"), [(0.9, 0.6, "down"), (0.01, 0.05, "up")])
def test_a_ratio_outside_the_bounds_is_clamped_whatever_the_metrics(ratio, to, direction):
    decision = decide(SPEC, ratio, reading(error="down"), State(), now=0)
    assert (decision.direction, decision.to_ratio, decision.code) == (
        direction,
        to,
        "ClampedToBounds",
    )
    assert str(ratio) in decision.reason


@pytest.mark.parametrize("garbage", [None, "0.3", math.nan, -1.0, 0.0, 7.0, True])
def test_a_value_that_is_no_ratio_resets_to_max_ratio(garbage):
    decision = decide(SPEC, garbage, reading(), State(), now=0)
    assert (decision.to_ratio, decision.code, decision.from_ratio) == (0.6, "ClampedToBounds", None)


def test_ratios_are_rounded_so_labels_and_files_stay_readable():
    assert decide(SPEC, 0.15, reading(f1=0.5), State(), now=0).to_ratio == 0.225
    assert decide(SPEC, 0.1234, reading(f1=0.5), State(), now=0).to_ratio == 0.1851


def test_a_ratio_inside_the_bounds_with_more_decimals_is_not_clamped():
    """A spec's recomputeRatio 0.33333 is inside [minRatio, maxRatio]: the law acts on the
    reading (in band: hold, tuned), not "outside the tuning bounds; clamped to 0.3333"."""
    decision = decide(SPEC, 0.33333, reading(f1=0.9), State(), now=0)
    assert (decision.direction, decision.code, decision.is_tuned) == ("hold", "InBand", True)
    assert decide(SPEC, 0.33333, reading(f1=0.5), State(), now=0).to_ratio == 0.5


def test_a_step_down_to_a_min_ratio_below_the_rounding_stays_a_ratio():
    """minRatio 0.00001: the step down lands on it, not on 0.0 (rounded), which is no
    ratio and would send the next interval to maxRatio."""
    spec = TuningSpec.model_validate(
        SPEC.model_dump(by_alias=True) | {"minRatio": 0.00001, "cooldownSeconds": 0}
    )
    decision = decide(spec, 0.02, reading(f1=0.99, n=1000), State(above_since=0), now=100)
    assert (decision.direction, decision.to_ratio) == ("down", 0.00001)
    following = decide(spec, decision.to_ratio, reading(f1=0.99, n=1000), decision.state, 200)
    assert (following.direction, following.code) == ("hold", "AtMinRatio")


class Plant:
    """Quality rises with the ratio and saturates; each sample is noisy."""

    def __init__(self, knee: float, seed: int = 0, noise: float = 0.03):
        self.knee, self.noise = knee, noise
        self.random = random.Random(seed)

    def quality(self, ratio: float) -> float:
        return 1.0 - 0.35 * math.exp(-ratio / self.knee)

    def read(self, ratio: float, num_samples: int) -> Reading:
        noise = [self.random.gauss(0, self.noise) for _ in range(num_samples)]
        f1 = self.quality(ratio) + sum(noise) / num_samples
        return reading(f1=f1, n=num_samples, ratios_in_force=(ratio,))


def run_loop(plant, ratio: float, spec=SPEC, intervals: int = 40, samples_per_interval=10):
    """Every interval: the window holds the samples taken at the ratio in force since the
    last change (the engine labels them by ratio), as the metrics sources report them."""
    ratios, state, samples = [ratio], State(), 0
    for step in range(intervals):
        samples += samples_per_interval
        decision = decide(
            spec, ratio, plant.read(ratio, samples), state, now=step * spec.interval_seconds
        )
        state = decision.state
        if decision.is_change:
            ratio, samples = decision.to_ratio, 0
        ratios.append(ratio)
    return ratios


def direction_changes(ratios: list[float]) -> int:
    steps = [b - a for a, b in zip(ratios, ratios[1:], strict=False) if b != a]
    return sum(1 for a, b in zip(steps, steps[1:], strict=False) if (a > 0) != (b > 0))


def smallest_ratio_meeting(plant, spec=SPEC) -> float:
    ratio = spec.min_ratio
    while plant.quality(ratio) < spec.target_f1_proxy - spec.band and ratio < spec.max_ratio:
        ratio += 0.001
    return ratio


@pytest.mark.parametrize("seed", range(5))
def test_from_a_low_ratio_the_loop_reaches_the_target_and_holds_it(seed):
    plant = Plant(knee=0.08, seed=seed)
    ratios = run_loop(plant, 0.05)
    reached = next(i for i, r in enumerate(ratios) if plant.quality(r) >= 0.88)
    assert reached <= 10, ratios
    assert all(plant.quality(r) >= 0.88 for r in ratios[reached:]), ratios
    assert direction_changes(ratios) <= 2, ratios
    assert all(SPEC.min_ratio <= r <= SPEC.max_ratio for r in ratios)


@pytest.mark.parametrize("seed", range(5))
def test_from_a_high_ratio_the_loop_comes_down_to_within_one_step_of_the_knee(seed):
    plant = Plant(knee=0.08, seed=seed)
    fast = TuningSpec.model_validate(
        SPEC.model_dump(by_alias=True) | {"stepDown": 0.05, "cooldownSeconds": 20}
    )
    ratios = run_loop(plant, 0.6, spec=fast, intervals=60)
    best = smallest_ratio_meeting(plant, fast)
    assert abs(ratios[-1] - best) <= fast.step_down * fast.step_up_factor, (best, ratios)
    assert plant.quality(ratios[-1]) >= 0.88
    assert direction_changes(ratios) <= 2, ratios
    assert all(fast.min_ratio <= r <= fast.max_ratio for r in ratios)


class StepPlant(Plant):
    """The closed-loop workload's shape: quality jumps from 0.83 to 1.0 at a threshold
    ratio, so every ratio that meets the target is above the band too."""

    def __init__(self, threshold: float, seed: int = 0):
        super().__init__(knee=1.0, seed=seed, noise=0.0)
        self.threshold = threshold

    def quality(self, ratio: float) -> float:
        return 1.0 if ratio >= self.threshold else 0.83


STEP_SPEC = TuningSpec.model_validate(
    {
        "targetF1Proxy": 0.9,
        "band": 0.05,
        "minRatio": 0.02,
        "maxRatio": 0.9,
        "stepUpFactor": 1.6,
        "stepDown": 0.15,
        "intervalSeconds": 8,
        "cooldownSeconds": 8,
        "minSamples": 3,
    }
)


@pytest.mark.parametrize("threshold", [0.07, 0.2, 0.33])
@pytest.mark.parametrize("start", [0.02, 0.8])
def test_a_step_shaped_quality_settles_without_oscillating(threshold, start):
    plant = StepPlant(threshold)
    ratios = run_loop(plant, start, spec=STEP_SPEC, intervals=19, samples_per_interval=3)
    changes = [i for i, (a, b) in enumerate(zip(ratios, ratios[1:], strict=False)) if a != b]
    assert changes[-1] < 12, ratios  # converged: no change after the first 12 intervals
    assert direction_changes(ratios) <= 2, ratios
    assert plant.quality(ratios[-1]) == 1.0, ratios
    assert ratios[-1] - threshold <= max(STEP_SPEC.step_down, threshold * 0.6), ratios
    assert all(STEP_SPEC.min_ratio <= r <= STEP_SPEC.max_ratio for r in ratios)


# --- the inline proxy: the fallback when the shadow gave too few samples ---------------------


def inline(f1, n, shadow_f1=0.5, shadow_n=3, **changes) -> Reading:
    return reading(
        f1=shadow_f1,
        n=shadow_n,
        inline_f1_proxy=f1,
        inline_top1=f1,
        inline_num_samples=n,
        **changes,
    )


def test_too_few_shadow_samples_fall_back_on_the_inline_proxy_and_say_so():
    decision = decide(SPEC, 0.2, inline(0.7, 200), State(), now=100)
    assert (decision.direction, decision.code) == ("up", "BelowTarget")
    assert "F1 proxy 0.700 over 200 samples (inline proxy: 3 shadow samples" in decision.reason
    # In band on the inline proxy: held, and said which signal.
    held = decide(SPEC, 0.2, inline(0.9, 200), State(), now=100)
    assert held.code == "InBand" and "(inline proxy" in held.reason


def test_enough_shadow_samples_win_over_the_inline_proxy():
    decision = decide(SPEC, 0.2, inline(0.99, 500, shadow_f1=0.7, shadow_n=20), State(), now=100)
    assert (decision.direction, decision.code) == ("up", "BelowTarget")
    assert "inline" not in decision.reason


def test_the_selected_reading_carries_the_signal_and_the_shadow_count():
    chosen = select_signal(SPEC, inline(0.8, 200))
    assert (chosen.signal, chosen.f1_proxy, chosen.num_samples) == (INLINE, 0.8, 200)
    assert chosen.shadow_num_samples == 3
    assert select_signal(SPEC, chosen) == chosen  # idempotent
    shadow = select_signal(SPEC, inline(0.8, 200, shadow_n=20))
    assert (shadow.signal, shadow.f1_proxy, shadow.num_samples) == (SHADOW, 0.5, 20)


@pytest.mark.parametrize(
    "changes",
    [
        {"inline_f1_proxy": None, "inline_num_samples": 0},
        {"inline_f1_proxy": math.nan},
        {"inline_num_samples": 2},  # fewer than the shadow's 3: no better
    ],
)
def test_no_usable_inline_proxy_leaves_the_shadow_reading(changes):
    seen = reading(f1=0.5, n=3, inline_f1_proxy=0.8, inline_num_samples=200)
    seen = dataclasses.replace(seen, **changes)
    assert select_signal(SPEC, seen).signal == SHADOW
    assert decide(SPEC, 0.2, seen, State(), now=100).code == "TooFewSamples"


def test_too_few_inline_samples_hold_and_say_which_signal():
    decision = decide(SPEC, 0.2, inline(0.5, 10, shadow_n=2), State(), now=100)
    assert decision.code == "TooFewSamples"
    assert decision.reason.startswith("10 F1-proxy samples at ratio 0.2")
    assert "(inline proxy: 2 shadow samples" in decision.reason


def test_the_inline_proxy_reads_its_own_recent_part():
    seen = inline(
        0.85,
        200,
        recent_f1_proxy=0.99,
        recent_num_samples=2,
        recent_inline_f1_proxy=0.4,
        recent_inline_num_samples=60,
    )
    decision = decide(SPEC, 0.2, seen, State(), now=100)
    assert decision.reason.startswith("the workload changed (the last 60 samples read 0.400")
    assert "(inline proxy" in decision.reason and decision.code == "BelowTarget"


def test_a_raise_past_a_lowered_max_ratio_does_not_claim_max_ratio_was_measured():
    """Good at 0.5, then maxRatio lowered to 0.4: a raise from 0.3 is capped at 0.4, a ratio
    never measured, so the reason is the step up's, not "raised back to ... measured"."""
    up = decide(SpecWith(maxRatio=0.4), 0.3, reading(f1=0.5), State(good=0.5, good_at=0), now=1)
    assert (up.direction, up.to_ratio) == ("up", 0.4)
    assert "raised x1.5 to 0.4" in up.reason and "measured meeting" not in up.reason
    back = decide(SPEC, 0.3, reading(f1=0.5), State(good=0.5, good_at=0), now=1)
    assert (back.to_ratio, "raised back to 0.5" in back.reason) == (0.5, True)


def test_a_changed_target_forgets_only_what_it_makes_unknown():
    """Below 0.88 is below a higher target - band too, meeting 0.88 meets a lower one."""
    learned = State(above_since=5, floor=0.1, floor_at=1, good=0.2, good_at=2, good_above=0.3)
    learned = dataclasses.replace(learned, good_above_at=3)
    raised, why = learned.retargeted(0.9, 0.02, SpecWith(targetF1Proxy=0.95))
    assert raised == State(floor=0.1, floor_at=1)
    assert why == (
        "target 0.9 band 0.02 changed to 0.95 band 0.02: forgot ratio 0.2, measured meeting "
        "the old target and the cooldown begun above the old target + band"
    )
    lowered, why = learned.retargeted(0.9, 0.02, SpecWith(targetF1Proxy=0.8))
    assert lowered == dataclasses.replace(learned, floor=None, floor_at=None)
    assert why.endswith("forgot ratio 0.1, measured below the old target")
    # A wider band lowers target - band and raises target + band.
    wider, _ = learned.retargeted(0.9, 0.02, SpecWith(band=0.05))
    assert wider == dataclasses.replace(learned, above_since=None, floor=None, floor_at=None)
    assert learned.retargeted(0.9, 0.02, SpecWith(maxRatio=0.4)) == (learned, "")
