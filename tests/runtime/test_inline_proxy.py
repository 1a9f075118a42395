"""The inline quality proxy (runtime/quality/inline_proxy.py): the blend's statistic, its
calibration against shadow scores, and what is exported (nothing without calibration)."""

import gc
import threading
import tracemalloc

import pytest
import torch
from prometheus_client import CollectorRegistry

from holeblend_runtime.blend.reuse import ReusePolicy, plan_reuse
from holeblend_runtime.quality.inline_proxy import (
    MAX_RATIOS,
    MIN_PAIRS,
    Calibration,
    InlineProxy,
    residual_deviation,
)
from holeblend_runtime.quality.shadow import ShadowScore, ratio_label

SYSTEM = "Answer the question from the documents in a few words."
DOCS = [
    " Alice Moreau was born in Lyon in 1980 and studied chemistry in Grenoble.",
    " Bob Lindqvist lives in Oslo, where he repairs old sailing boats for a living.",
    " Carol Zhang works at Zeta Corp as the head of its battery research lab.",
]
QUESTION = " Where was Alice Moreau born?"


def test_too_few_pairs_give_no_signal_not_a_guess():
    calibration = Calibration()
    assert calibration.estimate(0.5) is None and calibration.correlation() is None
    for i in range(MIN_PAIRS - 1):
        calibration.add(i / 10, 1 - i / 10)
    assert calibration.estimate(0.3) is None and calibration.correlation() is None
    calibration.add(0.9, 0.1)
    assert calibration.estimate(0.3) == pytest.approx(0.7)


def test_monotone_pairs_give_sensible_estimates():
    calibration = Calibration()
    for i in range(20):
        x = i / 19
        calibration.add(x, 1 - x)  # the more deviation left, the lower the score
    assert calibration.estimate(0.25) == pytest.approx(0.75)
    assert calibration.estimate(-1.0) == pytest.approx(1.0)  # flat beyond the data
    assert calibration.estimate(2.0) == pytest.approx(0.0)
    assert calibration.correlation() == pytest.approx(-1.0)


def test_a_noisy_rising_stretch_is_pooled_so_the_estimate_never_rises():
    calibration = Calibration()
    pairs = [(0.1, 1.0), (0.2, 0.6), (0.3, 1.0), (0.4, 0.4), (0.5, 0.5), (0.6, 0.0)]
    for x, y in pairs * 2:
        calibration.add(x, y)
    grid = [calibration.estimate(i / 20) for i in range(21)]
    assert all(a >= b - 1e-12 for a, b in zip(grid, grid[1:], strict=False))
    # 0.2 and 0.3 violate the order (0.6 then 1.0): pooled to their mean.
    assert calibration.estimate(0.25) == pytest.approx(0.8)
    assert all(0.0 <= value <= 1.0 for value in grid)


def test_no_spread_gives_no_correlation_and_garbage_pairs_are_ignored():
    calibration = Calibration(min_pairs=2)
    calibration.add(float("nan"), 1.0)
    calibration.add(0.3, float("inf"))
    assert len(calibration) == 0
    for x in (0.1, 0.5, 0.9):
        calibration.add(x, 1.0)
    assert calibration.correlation() is None  # every score equal: no signal to correlate
    assert calibration.estimate(0.5) == 1.0
    with pytest.raises(ValueError, match="min_pairs"):
        Calibration(min_pairs=1)


def test_the_correlation_needs_values_that_differ_at_any_scale_and_stays_within_one():
    """No spread means equal values, whatever their size: equal statistics of any
    magnitude have no correlation (the rounding of their mean must not make one up), and
    statistics that differ by little still correlate. Rounding never takes |r| past 1."""
    scores = [0.1 * i for i in range(MIN_PAIRS)]
    for statistic in (0.1, 63.9, 12345.6):
        equal = Calibration()
        for score in scores:
            equal.add(statistic, score)
        assert equal.correlation() is None, statistic
    close = Calibration()
    for i, score in enumerate(scores):
        close.add(1e-13 * i, score)
    assert close.correlation() == pytest.approx(1.0)
    falling = Calibration()
    for i in range(MIN_PAIRS):
        falling.add(0.1 * i, 1 - 0.05 * i)
    assert -1.0 <= falling.correlation() <= -1.0 + 1e-12


def test_only_calibrated_estimates_are_exported_by_ratio():
    registry = CollectorRegistry()
    proxy = InlineProxy(registry)

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    assert proxy.observe(0.15, 0.4) is None
    assert value("holeblend_inline_f1_proxy_count", ratio="0.15") is None
    assert value("holeblend_inline_residual_deviation_count", ratio="0.15") == 1
    for i in range(MIN_PAIRS):
        if i == MIN_PAIRS - 1:  # one pair short: still no signal, nothing observed
            assert proxy.observe(0.15, 0.4) is None
            assert value("holeblend_inline_proxy_correlation", ratio="0.15") is None
        x = i / (MIN_PAIRS - 1)
        proxy.add_pair(x, ShadowScore(f1=1 - x, top1=1 - x / 2, ratio=0.15, seconds=1.0))
    assert value("holeblend_inline_f1_proxy_count", ratio="0.15") is None
    assert value("holeblend_inline_proxy_pairs", ratio="0.15") == MIN_PAIRS
    assert value("holeblend_inline_proxy_correlation", ratio="0.15") == pytest.approx(-1.0)
    f1, top1 = proxy.observe(0.15, 0.5)
    assert (f1, top1) == (pytest.approx(0.5), pytest.approx(0.75))
    assert value("holeblend_inline_f1_proxy_count", ratio="0.15") == 1
    assert value("holeblend_inline_f1_proxy_sum", ratio="0.15") == pytest.approx(0.5)
    assert value("holeblend_inline_top1_proxy_sum", ratio="0.15") == pytest.approx(0.75)
    assert value("holeblend_inline_proxy_pooled", ratio="0.15") == 0
    # A higher ratio has no pairs of its own: it borrows the fit of the lower one's.
    assert proxy.observe(0.3, 0.5) == (pytest.approx(0.5), pytest.approx(0.75))
    assert value("holeblend_inline_f1_proxy_count", ratio="0.3") == 1
    assert value("holeblend_inline_proxy_pooled", ratio="0.3") == 1
    assert proxy.num_pairs(0.15) == MIN_PAIRS and proxy.num_pairs(0.3) == 0


class _FirstSetWaits:
    """A gauge whose first `set` waits (for `release`, at most a second) after saying
    `entered`: one thread's update held up where another thread's may overtake it."""

    def __init__(self, gauge) -> None:
        self.gauge, self.entered, self.release = gauge, threading.Event(), threading.Event()
        self.held = False

    def labels(self, **labels):
        child, outer = self.gauge.labels(**labels), self

        class Child:
            def set(self, value):
                if not outer.held:
                    outer.held = True
                    outer.entered.set()
                    outer.release.wait(1.0)
                child.set(value)

        return Child()

    def remove(self, *labels):
        self.gauge.remove(*labels)


def test_the_pairs_gauge_holds_the_last_count_when_two_threads_add_pairs():
    """The shadow's thread (`add_pair`) and the sharing thread (`add_shared`) add pairs at
    once: the gauge must end at the count the calibration holds, not at whichever thread
    set it last with the count it read earlier."""
    registry = CollectorRegistry()
    proxy = InlineProxy(registry)
    proxy.metrics.pairs = slow = _FirstSetWaits(proxy.metrics.pairs)
    first = threading.Thread(target=proxy.add_shared, args=(0.2, 0.1, 0.9, 0.9))
    first.start()
    assert slow.entered.wait(2.0)
    second = threading.Thread(target=proxy.add_shared, args=(0.2, 0.3, 0.7, 0.7))
    second.start()
    second.join(0.2)  # may overtake the first thread's update, or wait for it
    slow.release.set()
    first.join(2.0)
    second.join(2.0)
    assert proxy.num_pairs(0.2) == 2
    assert registry.get_sample_value("holeblend_inline_proxy_pairs", {"ratio": "0.2"}) == 2


class _EvictsBeforeFirstLabels:
    """A gauge whose first `labels` call first runs `evict` on another thread and waits
    for it (at most half a second): an eviction that comes between a ratio's estimate
    and the export of which fit it came from, wherever that export does not hold the
    proxy's lock."""

    def __init__(self, gauge, evict) -> None:
        self.gauge, self.evict = gauge, evict
        self.thread: threading.Thread | None = None

    def labels(self, **labels):
        if self.thread is None:
            self.thread = threading.Thread(target=self.evict)
            self.thread.start()
            self.thread.join(0.5)
        return self.gauge.labels(**labels)

    def remove(self, *labels):
        self.gauge.remove(*labels)


def test_a_ratio_evicted_while_its_estimate_is_exported_leaves_no_pooled_series():
    """The sharing thread may evict a ratio (`MAX_RATIOS` newer ones got pairs) between
    the serving thread's estimate at it and the export of which fit it came from: the
    `pooled` series must not come back for the evicted ratio, where nothing would ever
    remove it again."""
    registry = CollectorRegistry()
    proxy = InlineProxy(registry)
    for i in range(MIN_PAIRS):
        proxy.add_shared(0.1, i / (MIN_PAIRS - 1), 1.0, 1.0)
    proxy.add_shared(0.3, 0.5, 1.0, 1.0)  # too few of its own: borrows 0.1's fit

    def evict():
        for i in range(MAX_RATIOS):
            proxy.add_shared(0.5 + i / 100, 0.5, 1.0, 1.0)

    proxy.metrics.pooled = evicting = _EvictsBeforeFirstLabels(proxy.metrics.pooled, evict)
    assert proxy.observe(0.3, 0.5) is not None
    evicting.thread.join(2.0)
    assert proxy.num_pairs(0.3) == 0
    assert registry.get_sample_value("holeblend_inline_proxy_pooled", {"ratio": "0.3"}) is None


def test_the_series_of_ratios_that_only_borrowed_a_fit_go_when_newer_ratios_are_observed():
    """A pod whose shadows score nothing (calibrated by its deployment's pairs) while the
    tuner moves the ratio: each ratio only borrows a fit, so it has no calibration whose
    eviction would remove its series. They go once `MAX_RATIOS` other ratios were
    observed since it; a ratio observed again is kept, with its counts."""
    registry = CollectorRegistry()
    proxy = InlineProxy(registry)
    for i in range(MIN_PAIRS):
        x = i / (MIN_PAIRS - 1)
        proxy.add_shared(0.0, x, 1 - x, 1.0)
    names = (
        "holeblend_inline_residual_deviation_count",
        "holeblend_inline_f1_proxy_count",
        "holeblend_inline_top1_proxy_count",
        "holeblend_inline_proxy_pooled",
    )

    def exported(ratio):
        values = [registry.get_sample_value(name, {"ratio": ratio_label(ratio)}) for name in names]
        return [value for value in values if value is not None]

    ratios = [step / 100 for step in range(1, 2 * MAX_RATIOS + 1)]
    for ratio in ratios:
        assert proxy.observe(ratio, 0.5) is not None
    assert all(exported(ratio) == [] for ratio in ratios[:-MAX_RATIOS])
    assert all(exported(ratio) == [1, 1, 1, 1] for ratio in ratios[-MAX_RATIOS:])
    oldest, next_oldest = ratios[-MAX_RATIOS], ratios[-MAX_RATIOS + 1]
    assert proxy.observe(oldest, 0.5) is not None and proxy.observe(0.99, 0.5) is not None
    assert exported(oldest) == [2, 2, 2, 1] and exported(next_oldest) == []


def test_a_ratio_without_pairs_borrows_the_fit_of_lower_ratios_only_inside_its_span():
    """The borrowed fit never extrapolates: a statistic beyond the pairs' span gets no
    estimate; a ratio borrows from its own pairs and lower ratios' only; its own
    calibration, once it has enough pairs, wins over the borrowed one."""
    proxy = InlineProxy()
    for i in range(MIN_PAIRS - 1):  # one short in all: nothing anywhere
        x = 0.2 + 0.4 * i / (MIN_PAIRS - 1)
        proxy.add_pair(x, ShadowScore(f1=1 - x, top1=1.0, ratio=0.15, seconds=1.0))
    assert proxy.observe(0.3, 0.4) is None and proxy.observe(0.15, 0.4) is None
    proxy.add_pair(0.6, ShadowScore(f1=0.4, top1=1.0, ratio=0.2, seconds=1.0))
    # 0.2 borrows the fit of all 8 (0.15's 7 and its own), inside 0.2..0.6; 0.15 has only
    # its own 7 below it, and 0.05 none.
    for ratio in (0.2, 0.3):
        assert proxy.observe(ratio, 0.4)[0] == pytest.approx(0.6)
        assert proxy.observe(ratio, 0.19) is None and proxy.observe(ratio, 0.61) is None
    assert proxy.observe(0.15, 0.4) is None and proxy.observe(0.05, 0.4) is None
    for _ in range(MIN_PAIRS):  # 0.2's own pairs say otherwise: they win for 0.2
        proxy.add_pair(0.4, ShadowScore(f1=0.9, top1=0.9, ratio=0.2, seconds=1.0))
    # Its own fit (one pair at 0.6, eight at 0.4): F1 0.9 at 0.4; top-1 rises from 0.9
    # to 1.0 there, so it is pooled into one block.
    assert proxy.observe(0.2, 0.4) == (pytest.approx(0.9), pytest.approx((8 * 0.9 + 1) / 9))
    assert proxy.observe(0.2, 0.7) is not None  # its own fit: flat beyond its pairs
    # 0.3 now borrows all 16 pairs (the fit is rebuilt after each new pair): 0.2's new
    # ones lift its estimate above the 0.6 it read before them.
    assert 0.6 < proxy.observe(0.3, 0.4)[0] < 0.9


def test_pairs_of_higher_ratios_never_lend_a_lower_ratio_an_estimate():
    """After a step down (from-high), the pairs scored at the higher ratios read the new
    ratio too high; the lower ratio gets no estimate until it has pairs of its own, and
    then its own fit, not theirs."""
    registry = CollectorRegistry()
    proxy = InlineProxy(registry)
    for ratio in (0.8, 0.6, 0.4):
        for i in range(MIN_PAIRS):
            x = 0.1 + 0.9 * i / (MIN_PAIRS - 1)  # statistics spanning 0.1..1.0
            proxy.add_pair(x, ShadowScore(f1=1.0, top1=1.0, ratio=ratio, seconds=1.0))
    assert proxy.observe(0.6, 0.5) == (1.0, 1.0)  # its own fit
    assert proxy.observe(0.02, 0.5) is None  # inside their span, yet no estimate
    assert registry.get_sample_value("holeblend_inline_f1_proxy_count", {"ratio": "0.02"}) is None
    for i in range(MIN_PAIRS - 1):
        x = 0.2 + 0.6 * i / (MIN_PAIRS - 2)
        proxy.add_pair(x, ShadowScore(f1=0.5, top1=0.8, ratio=0.02, seconds=1.0))
    assert proxy.observe(0.02, 0.5) is None  # 7 pairs of its own, none lower
    # A ratio between borrows from 0.02's 7 pairs and its own one: the lower ratio's
    # reading, not the higher ones' 1.0.
    proxy.add_pair(0.5, ShadowScore(f1=0.7, top1=0.9, ratio=0.1, seconds=1.0))
    f1, _ = proxy.observe(0.1, 0.5)
    assert 0.5 <= f1 < 0.6
    assert registry.get_sample_value("holeblend_inline_proxy_pooled", {"ratio": "0.1"}) == 1
    proxy.add_pair(0.5, ShadowScore(f1=0.5, top1=0.8, ratio=0.02, seconds=1.0))
    assert proxy.observe(0.02, 0.5) == (pytest.approx(0.5), pytest.approx(0.8))
    assert registry.get_sample_value("holeblend_inline_proxy_pooled", {"ratio": "0.02"}) == 0


def test_borrowed_fits_stay_bounded_while_no_pair_arrives():
    """A pod whose shadows score nothing (shadowBudget 0, calibrated by the pairs its
    deployment shared before) never adds a pair again, while the tuner moves the ratio:
    each new ratio borrows a fit holding a copy of the lower ratios' pairs, and the memory
    those fits hold must not grow with every ratio ever visited."""
    proxy = InlineProxy()
    for i in range(64):
        x = i / 63
        proxy.add_pair(x, ShadowScore(f1=1 - x, top1=1 - x, ratio=0.0, seconds=1.0))
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        assert proxy.observe(0.0001, 0.5) is not None  # borrowed from ratio 0's pairs
        one_fit = tracemalloc.get_traced_memory()[0] - before
        for step in range(2, 8 * MAX_RATIOS):
            assert proxy.observe(0.0001 * step, 0.5) is not None
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2 * MAX_RATIOS * one_fit


def test_the_statistic_is_the_deviation_left_in_tokens_not_recomputed_per_compared_token(
    reference_engine,
):
    prompt = reference_engine.build_prompt(SYSTEM, DOCS, QUESTION)
    # Documents 0 and 2 reused (system prompt not: no exact prefix), document 1 a hole.
    flags = [False, True, False, True, False]
    reuse = plan_reuse(prompt, flags, ReusePolicy.HOLE)
    positions = [p for i in reuse.reused_segments for p in range(*_range(prompt, i))]
    count = len(positions)
    deviation = torch.ones(count)
    deviation[3] = 7.0  # 7 of the mass sits on the 4th compared token
    total = float(deviation.sum())
    picked = torch.tensor([positions[3]])
    left = residual_deviation(prompt, reuse, deviation, picked)
    assert left == pytest.approx((total - 7.0) / count)
    assert residual_deviation(prompt, reuse, deviation, picked[:0]) == pytest.approx(total / count)
    everything = torch.tensor(positions)
    assert residual_deviation(prompt, reuse, deviation, everything) == 0.0
    assert residual_deviation(prompt, reuse, deviation[:0], picked[:0]) is None
    assert residual_deviation(prompt, reuse, torch.zeros(count), picked) == 0.0
    assert residual_deviation(prompt, reuse, deviation * float("nan"), picked) is None
    # A mean, not a share: the same picks on KV that moved ten times less leave ten
    # times less (a share would read the same).
    assert residual_deviation(prompt, reuse, deviation / 10, picked) == pytest.approx(left / 10)
    # A selected position the layout does not explain: the most deviating tokens are taken.
    assert residual_deviation(prompt, reuse, deviation, torch.tensor([0])) == (
        pytest.approx((total - 7.0) / count)
    )


def _range(prompt, i):
    return prompt.segments[i].start, prompt.segments[i].end


def test_the_statistic_of_real_blends_falls_as_the_ratio_rises(new_engine):
    left = []
    for ratio in (0.0, 0.15, 0.5, 1.0):
        engine = new_engine(ratio=ratio)
        engine.prefill(engine.build_prompt(SYSTEM, [DOCS[0], DOCS[2]], QUESTION), mode="hole")
        prefill = engine.prefill(engine.build_prompt(SYSTEM, DOCS, QUESTION), mode="hole")
        assert prefill.deviation.numel() > 0
        left.append(
            residual_deviation(
                prefill.prompt, prefill.reuse, prefill.deviation, prefill.selected_positions
            )
        )
        if ratio == 0.0:  # nothing recomputed: the mean deviation of every compared token
            assert left[0] == pytest.approx(float(prefill.deviation.double().mean()))
    assert left[-1] == pytest.approx(0.0, abs=1e-9)
    assert left[0] > left[1] > left[2] > left[3]


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"min_pairs": 1}, "min_pairs"),
        ({"min_pairs": 8, "max_pairs": 4}, "max_pairs"),
        ({"max_pairs": 300.5}, "max_pairs"),
        ({"min_pairs": True}, "min_pairs"),
    ],
)
def test_bad_pair_counts_are_refused_at_construction_not_on_the_serving_thread(settings, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        InlineProxy(**settings)
    with pytest.raises(ValueError, match=f"^{field}: "):
        Calibration(**settings)
