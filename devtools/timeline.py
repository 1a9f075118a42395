"""What the closed loop did over time: a recorder and a PNG plot (demo, closed-loop runs).

`Recorder` samples, every `every_s` seconds on its own thread: the BlendDeployment's status
(ratio, F1 proxy, hit %, the tuning history) and the engine's own /metrics (mean TTFT of
the requests finished since the previous sample). `plot` draws ratio, proxy and TTFT
against time in one PNG, with the tuner's decisions as vertical marks.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from holeblend_runtime import local_http


@dataclasses.dataclass(frozen=True)
class Sample:
    t_s: float  # seconds since the recorder started
    t_wall: float  # time.time() of the sample
    ratio: float | None  # status.recomputeRatio
    f1_proxy: float | None  # status.metrics.f1Proxy (the tuner's last reading)
    hit_percent: float | None
    ttft_s: float | None  # mean TTFT of the requests finished since the last sample
    # The engine's quality samples so far (holeblend_f1_proxy_count over all ratios): how
    # fast the shadow feeds the tuner.
    quality_samples: float | None = None


class Recorder:
    def __init__(self, read_status: Callable[[], dict], metrics_url: str | None, every_s=2.0):
        self.read_status, self.metrics_url, self.every_s = read_status, metrics_url, every_s
        self.samples: list[Sample] = []
        self.history: list[dict] = []  # status.tuning.history at the last sample
        self._started = time.monotonic()
        self._ttft: tuple[float, float] | None = None  # (sum, count) at the last sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sample()
            except Exception:  # noqa: S112 - a missed sample is a gap in the plot
                continue

    def sample(self) -> Sample:
        status = self.read_status() or {}
        metrics = status.get("metrics") or {}
        self.history = list((status.get("tuning") or {}).get("history") or [])
        ttft_s, quality_samples = self._engine_metrics()
        sample = Sample(
            time.monotonic() - self._started,
            time.time(),
            status.get("recomputeRatio"),
            metrics.get("f1Proxy"),
            metrics.get("hitPercent"),
            ttft_s,
            quality_samples,
        )
        self.samples.append(sample)
        return sample

    def _engine_metrics(self) -> tuple[float | None, float | None]:
        """(mean TTFT since the last sample, quality samples so far) from /metrics."""
        if self.metrics_url is None:
            return None, None
        try:
            with local_http.LOCAL.open(self.metrics_url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return None, None
        total, quality = [0.0, 0.0], 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "holeblend_ttft_seconds_sum":
                    total[0] += s.value
                elif s.name == "holeblend_ttft_seconds_count":
                    total[1] += s.value
                elif s.name == "holeblend_f1_proxy_count":
                    quality += s.value
        previous, self._ttft = self._ttft, (total[0], total[1])
        if previous is None or total[1] <= previous[1]:
            return None, quality
        return (total[0] - previous[0]) / (total[1] - previous[1]), quality


def quality_samples_per(samples: list[Sample], seconds: float) -> float | None:
    """Quality samples the engine scored per `seconds`, over the recorded span."""
    counted = [s for s in samples if s.quality_samples is not None]
    if len(counted) < 2 or counted[-1].t_s <= counted[0].t_s:
        return None
    grown = counted[-1].quality_samples - counted[0].quality_samples
    return grown / (counted[-1].t_s - counted[0].t_s) * seconds


def plot(samples: list[Sample], path: str | Path, title: str, target: float | None = None) -> None:
    """Ratio, F1 proxy and TTFT against time, one panel each, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(9, 7))
    t = [s.t_s for s in samples]
    series = (
        ("recompute ratio", [s.ratio for s in samples], "tab:blue"),
        ("F1 proxy", [s.f1_proxy for s in samples], "tab:green"),
        ("TTFT (s)", [s.ttft_s for s in samples], "tab:red"),
    )
    for axis, (label, values, colour) in zip(axes, series, strict=True):
        points = [(x, y) for x, y in zip(t, values, strict=True) if y is not None]
        if points:
            axis.plot(*zip(*points, strict=True), marker=".", color=colour, drawstyle="steps-post")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    if target is not None:
        axes[1].axhline(target, color="grey", linestyle="--", label="target")
        axes[1].legend(loc="lower right")
    axes[-1].set_xlabel("seconds")
    axes[0].set_title(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_runs(runs: dict[str, list[Sample]], path: str | Path, target: float) -> None:
    """Several runs: the ratio (top) and the F1 proxy (bottom) of each against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ratio_axis, f1_axis) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    for name, samples in runs.items():
        for axis, values in (
            (ratio_axis, [s.ratio for s in samples]),
            (f1_axis, [s.f1_proxy for s in samples]),
        ):
            points = [(s.t_s, v) for s, v in zip(samples, values, strict=True) if v is not None]
            if points:
                axis.plot(*zip(*points, strict=True), drawstyle="steps-post", label=name)
    f1_axis.axhline(target, color="grey", linestyle="--", label="target")
    ratio_axis.set_ylabel("recompute ratio")
    f1_axis.set_ylabel("F1 proxy (tuner's reading)")
    f1_axis.set_xlabel("seconds")
    ratio_axis.legend(loc="upper right")
    f1_axis.legend(loc="lower right")
    for axis in (ratio_axis, f1_axis):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
