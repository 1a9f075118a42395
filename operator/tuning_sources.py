"""Where the tuner reads the engine's metrics: Prometheus (PromQL), or the pods directly.

Both sources compute the same thing, the increase of each series over a window, per pod
and then summed, and hand it to `reading`, which turns it into the tuner's `Reading`:

1. Per series (one pod, one label set): value now minus value a window ago. A series that
   is new in the window (a pod that started, a ratio that was just set) counts from zero,
   and so does every series of a pod whose counters went down anywhere in the window (it
   restarted), so a histogram's `_sum` and `_count` never mix a restarted total with an
   increase. Prometheus gives each series' raw values and resets (`_window_query`); the
   arithmetic per pod is the same for both sources (`_grown`).
2. Summed over pods, by the `ratio` label for the quality proxies (the engine labels each
   sample with the ratio in force), over everything for tokens and TTFT (holeblend-serve's
   `holeblend_ttft_seconds`; on vLLM pods vLLM's own `vllm:time_to_first_token_seconds`,
   which its API server exports on the engine's port, not on the connector's: the
   direct scrape reads it there with a second, concurrent request per pod). The proxies are
   the shadow's (`holeblend_f1_proxy`, `holeblend_top1_agreement`) and the inline ones
   (`holeblend_inline_f1_proxy`, `holeblend_inline_top1_proxy`), both read; the law
   acts on the inline ones when the shadow gave fewer than minSamples.
3. The proxies count only the samples taken at the ratio the tuner set: samples from before
   a change say nothing about the new ratio.
4. The F1 proxy is also read over the last part of the window (`recent_s`), so the law can
   tell a workload that changed under a held ratio (`tuner.recent_if_changed`).

Failures never raise out of `read`: a Prometheus that is down, slow, or answers garbage or
HTML, and pods that vanish mid-scrape, give a `Reading` with `error` set (nothing usable)
or with the pods that did answer. The tuner takes no action on an error. A TTFT read that
fails (vLLM's port, or the TTFT queries) only leaves TTFT out: the quality figures stay.
"""

import asyncio
import dataclasses
import json
import math
import time
import urllib.parse
from collections.abc import Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from holeblend_operator.tuner import RATIO_TOLERANCE, Reading

# The engine's metric names (docs/serving.md, "Metrics") the tuner reads.
F1 = "holeblend_f1_proxy"
TOP1 = "holeblend_top1_agreement"
# The inline proxy (scored on every blended request, no shadow): the same shape, labelled
# by `ratio` too; the tuner falls back on it when the shadow gave too few samples.
INLINE_F1 = "holeblend_inline_f1_proxy"
INLINE_TOP1 = "holeblend_inline_top1_proxy"
TTFT = "holeblend_ttft_seconds"
# vLLM's API server measures TTFT itself (labels model_name, engine) and exports it on the
# engine's port; the connector's metrics port has no TTFT.
VLLM_TTFT = "vllm:time_to_first_token_seconds"
PROMPT_TOKENS = "holeblend_prompt_tokens_total"
REUSED_TOKENS = "holeblend_reused_tokens_total"
RATIO_GAUGE = "holeblend_recompute_ratio"
RATIO_LABEL = "ratio"
# Taken over the recent part of the window too.
RECENT = (f"{F1}_sum", f"{F1}_count", f"{INLINE_F1}_sum", f"{INLINE_F1}_count")
# Counters the window is taken over, and whether they are split by the ratio label; the
# TTFT histogram's are added by `windowed`.
COUNTERS = {
    f"{F1}_sum": True,
    f"{F1}_count": True,
    f"{TOP1}_sum": True,
    f"{TOP1}_count": True,
    f"{INLINE_F1}_sum": True,
    f"{INLINE_F1}_count": True,
    f"{INLINE_TOP1}_sum": True,
    f"{INLINE_TOP1}_count": True,
    PROMPT_TOKENS: False,
    REUSED_TOKENS: False,
}


def ttft_series(ttft: str) -> tuple[str, str]:
    """The TTFT histogram's counters the mean is taken of."""
    return f"{ttft}_sum", f"{ttft}_count"


def windowed(ttft: str = TTFT) -> dict[str, bool]:
    """Every counter the window is taken over, with the TTFT histogram `ttft`."""
    return COUNTERS | dict.fromkeys(ttft_series(ttft), False)


WINDOWED = windowed()  # holeblend-serve's
TIMEOUT_S = 5.0  # one query or scrape; the tuner's interval is at least 5 s
MAX_BODY_BYTES = 8 << 20  # a /metrics page or query answer larger than this is garbage

Increases = dict[str, dict[str, float]]  # metric -> ratio label ("" if unsplit) -> increase
# Marks the values `_window_query` adds beside each series' value now: "then" (a window
# ago) and "resets" (how often the series went down since then).
VALUE_LABEL = "holeblend_value"
# Prometheus's default lookback: how far before the window's start `offset` finds the
# sample it takes as the series' value then.
LOOKBACK_S = 300


@dataclasses.dataclass(frozen=True)
class Target:
    """The engine pods of one BlendDeployment, as the sources find them."""

    namespace: str
    service: str  # the engine Service: Prometheus's `service` label (prometheus-operator)
    pod_urls: dict[str, str]  # ready pod name -> its /metrics URL (direct scrape only)
    ttft: str = TTFT  # the TTFT histogram the pods export: TTFT or VLLM_TTFT
    # Ready pod name -> the /metrics URL with `ttft`, for pods that export it on another
    # port than pod_urls' (vLLM's API server next to the connector's port; direct scrape).
    ttft_urls: dict[str, str] = dataclasses.field(default_factory=dict)


class SourceError(Exception):
    """The source gave nothing usable; the message says what it answered."""


def reading(
    increases: Increases,
    ratio: float,
    ratios_in_force: Iterable[float],
    age_s: float | None,
    recent: Increases | None = None,
    ttft: str = TTFT,
) -> Reading:
    """The tuner's view of one window: proxies at `ratio` (the shadow's and the inline
    one's), hit rate and TTFT (the mean of histogram `ttft`) over all, and the F1 proxies at
    `ratio` over the recent part of the window (`recent`, if read). Which proxy the law acts
    on is its choice (`tuner.select_signal`)."""
    recent = recent or {}
    f1, num = _mean_at(increases, F1, ratio)
    top1, _ = _mean_at(increases, TOP1, ratio)
    recent_f1, recent_num = _mean_at(recent, F1, ratio)
    inline_f1, inline_num = _mean_at(increases, INLINE_F1, ratio)
    inline_top1, _ = _mean_at(increases, INLINE_TOP1, ratio)
    recent_inline_f1, recent_inline_num = _mean_at(recent, INLINE_F1, ratio)
    prompt, reused = _total(increases, PROMPT_TOKENS), _total(increases, REUSED_TOKENS)
    ttft_sum, ttft_num = (_total(increases, name) for name in ttft_series(ttft))
    return Reading(
        f1_proxy=f1,
        top1_agreement=top1,
        num_samples=num,
        hit_percent=min(100.0, 100.0 * reused / prompt) if prompt > 0 else None,
        ttft_seconds=ttft_sum / ttft_num if ttft_num > 0 else None,
        age_s=age_s,
        ratios_in_force=tuple(sorted(set(ratios_in_force))),
        recent_f1_proxy=recent_f1,
        recent_num_samples=recent_num,
        inline_f1_proxy=inline_f1,
        inline_top1=inline_top1,
        inline_num_samples=inline_num,
        recent_inline_f1_proxy=recent_inline_f1,
        recent_inline_num_samples=recent_inline_num,
    )


def _mean_at(increases: Increases, histogram: str, ratio: float) -> tuple[float | None, int]:
    """A histogram's mean over the samples taken at `ratio` (None without any), and their
    number."""
    total = _at_ratio(increases, f"{histogram}_sum", ratio)
    count = _at_ratio(increases, f"{histogram}_count", ratio)
    mean = total / count if count > 0 else None
    return mean, int(round(count)) if math.isfinite(count) else 0


def failed(message: str) -> Reading:
    return Reading(None, None, 0, None, None, None, error=message)


def _at_ratio(increases: Increases, metric: str, ratio: float) -> float:
    return sum(
        value
        for label, value in increases.get(metric, {}).items()
        if abs(_as_float(label) - ratio) <= RATIO_TOLERANCE
    )


def _total(increases: Increases, metric: str) -> float:
    return sum(increases.get(metric, {}).values())


def _as_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


class PrometheusSource:
    """PromQL against spec.tuning.prometheusUrl; series are selected by namespace and the
    engine Service's name (the labels prometheus-operator's ServiceMonitor gives them)."""

    def __init__(self, url: str, session: aiohttp.ClientSession, timeout_s: float = TIMEOUT_S):
        self.url = url.rstrip("/")
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def read(
        self, target: Target, ratio: float, window_s: float, recent_s: float | None = None
    ) -> Reading:
        selector = f'namespace="{target.namespace}",service="{target.service}"'
        counters = windowed(target.ttft)
        queries = {name: _window_query(name, selector, window_s) for name in counters}
        if recent_s is not None:
            for name in RECENT:
                queries[f"recent:{name}"] = _window_query(name, selector, recent_s)
        queries["ratio"] = f"{RATIO_GAUGE}{{{selector}}}"
        queries["age"] = f"time() - max(timestamp({RATIO_GAUGE}{{{selector}}}))"
        ttft = ttft_series(target.ttft)
        # The TTFT queries may fail alone (their answer left out); any other fails the read.
        answers = await asyncio.gather(
            *(self.query(q) for q in queries.values()), return_exceptions=True
        )
        found = dict(zip(queries, answers, strict=True))
        for name, answer in found.items():
            if isinstance(answer, SourceError) and name not in ttft:
                return failed(str(answer))
            if isinstance(answer, BaseException) and not isinstance(answer, SourceError):
                raise answer
        if any(isinstance(found[name], SourceError) for name in ttft):
            found |= dict.fromkeys(ttft, [])  # no TTFT this time; the quality figures stay
        increases = _increases({name: found[name] for name in counters}, counters)
        recent_found = {n: found[f"recent:{n}"] for n in RECENT if f"recent:{n}" in found}
        recent = _increases(recent_found, counters)
        if not found["ratio"]:
            return failed(f"Prometheus has no {RATIO_GAUGE} series for {selector}")
        ages = [value for _, value in found["age"]]
        age = ages[0] if ages else None
        ratios = (v for _, v in found["ratio"])
        return reading(increases, ratio, ratios, age, recent, ttft=target.ttft)

    async def query(self, promql: str) -> list[tuple[dict, float]]:
        """An instant query's vector as (labels, value) pairs; SourceError on anything else."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        try:
            async with self._session.get(url, timeout=self._timeout) as response:
                body = await read_body(response)
                status = response.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise SourceError(f"Prometheus at {self.url}: {type(exc).__name__}: {exc}") from exc
        if body is None:
            raise SourceError(f"Prometheus at {self.url}: answer over {MAX_BODY_BYTES} bytes")
        return _parse_vector(self.url, status, body)


async def read_body(response: aiohttp.ClientResponse) -> "bytes | None":
    """The whole body, or None when it is over MAX_BODY_BYTES. (`content.read(n)` returns
    what has arrived so far, up to n bytes: one call cuts a page that comes in several
    reads, e.g. vLLM's /metrics of 50 KB and more, at a line or inside a number.)"""
    body = bytearray()
    while len(body) <= MAX_BODY_BYTES:
        chunk = await response.content.read(MAX_BODY_BYTES + 1 - len(body))
        if not chunk:
            return bytes(body)
        body += chunk
    return None


def _window_query(metric: str, selector: str, window_s: float) -> str:
    """Each series of `metric` as it is now, and beside it (marked by VALUE_LABEL) its value
    a window ago and how often it went down since then: counted from the sample `offset`
    takes as the window's start (the resets over the window alone miss a restart between
    that sample and the next), or over the window for a series that is new in it.

    Per series PromQL cannot tell a restart whose `_sum` grew past its old value while its
    `_count` did not: which pods restarted is decided over all their series (`_increases`).
    """
    series = f"{metric}{{{selector}}}"
    span = max(1, int(round(window_s)))
    window = f"{span}s"
    since_then = (
        f"resets({series}[{span + LOOKBACK_S}s]) - resets({series}[{LOOKBACK_S}s] offset {window})"
    )
    resets = f"({since_then}) or resets({series}[{window}])"
    marked = {"then": f"{series} offset {window}", "resets": resets}
    return " or ".join(
        [series]
        + [f'label_replace({e}, "{VALUE_LABEL}", "{v}", "", "")' for v, e in marked.items()]
    )


def _increases(
    answers: dict[str, list[tuple[dict, float]]], counters: dict[str, bool]
) -> Increases:
    """Step 1 on `_window_query`'s answers, by metric: each series' increase, every series of
    a pod that restarted (any of them went down) counted from zero, summed by the ratio label
    where the metric is split by it."""
    restarted = {
        _pod(labels)
        for vector in answers.values()
        for labels, value in vector
        if labels.get(VALUE_LABEL) == "resets" and value > 0
    }
    increases: Increases = {}
    for metric, vector in answers.items():
        then = {
            _series(labels): value for labels, value in vector if labels.get(VALUE_LABEL) == "then"
        }
        for labels, value in vector:
            if VALUE_LABEL in labels or not math.isfinite(value):
                continue
            before = None if _pod(labels) in restarted else then.get(_series(labels))
            label = labels.get(RATIO_LABEL, "") if counters[metric] else ""
            per_metric = increases.setdefault(metric, {})
            per_metric[label] = per_metric.get(label, 0.0) + _grown(value, before)
    return increases


def _pod(labels: dict) -> tuple[str, str]:
    """The pod a series is scraped from (the labels prometheus-operator gives it)."""
    return labels.get("namespace", ""), labels.get("pod", "")


def _series(labels: dict) -> frozenset:
    """A series' identity across the values of one answer (resets and `offset` drop the
    metric name)."""
    return frozenset((k, v) for k, v in labels.items() if k not in ("__name__", VALUE_LABEL))


def _grown(value: float, before: float | None) -> float:
    """A counter's increase since `before`; from zero when it has no value then or went down."""
    return value - before if before is not None and value >= before else value


def _parse_vector(url: str, status: int, body: bytes) -> list[tuple[dict, float]]:
    try:
        answer = json.loads(body)
        if status != 200 or answer.get("status") != "success":
            raise SourceError(
                f"Prometheus at {url}: HTTP {status}: {answer.get('error', '')}"[:300]
            )
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        if data["resultType"] != "vector":
            raise SourceError(f"Prometheus at {url}: expected a vector, got {data['resultType']}")
        return [(dict(item["metric"]), float(item["value"][1])) for item in data["result"]]
    except SourceError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        snippet = body[:80].decode(errors="replace").replace("\n", " ")
        raise SourceError(
            f"Prometheus at {url}: HTTP {status}: not a query answer ({snippet!r})"
        ) from exc


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One scrape of one pod: counter values by (metric, ratio label), and its ratio gauge;
    `missing`: the metrics it could not read (its TTFT page failed), which it neither
    counts nor serves as a baseline for."""

    at: float
    counters: dict[tuple[str, str], float]
    ratio: float | None
    missing: frozenset[str] = frozenset()


class ScrapeSource:
    """Scrapes the ready engine pods' /metrics directly and keeps a window of snapshots per
    pod (in memory: after a restart the first window is short, and the tuner waits for
    minSamples)."""

    def __init__(
        self, session: aiohttp.ClientSession, timeout_s: float = TIMEOUT_S, clock=time.monotonic
    ):
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock
        # (namespace, engine Service, pod) -> oldest first: one source serves every
        # BlendDeployment, and a read forgets only its own deployment's pods that are gone.
        self._history: dict[tuple[str, str, str], list[Snapshot]] = {}

    async def read(
        self, target: Target, ratio: float, window_s: float, recent_s: float | None = None
    ) -> Reading:
        if not target.pod_urls:
            return failed("no ready engine pods to scrape")
        names = list(target.pod_urls)
        counters = windowed(target.ttft)
        # Pods whose TTFT is on another port: one more request each, at the same time and
        # with the same timeout, so a read takes no longer than before.
        elsewhere = [name for name in names if name in target.ttft_urls]
        scraped, ttft_pages = await asyncio.gather(
            asyncio.gather(*(self.scrape(target.pod_urls[n], counters) for n in names)),
            asyncio.gather(
                *(self.scrape_ttft(target.ttft_urls[n], target.ttft) for n in elsewhere)
            ),
        )
        now = self._clock()
        answered = {
            name: snap
            for name, snap in zip(names, scraped, strict=True)
            if isinstance(snap, Snapshot)
        }
        if not answered:
            return failed(f"no engine pod answered on /metrics ({scraped[0]})")
        for name, page in zip(elsewhere, ttft_pages, strict=True):
            if name in answered:
                answered[name] = _with_ttft(answered[name], page, target.ttft)
        increases: Increases = {}
        recent: Increases = {}
        for name, snapshot in answered.items():
            history = self._remember(
                (target.namespace, target.service, name), snapshot, now, window_s
            )
            _add_increases(increases, history, _baseline(history, now, window_s))
            if recent_s is not None:
                _add_increases(recent, history, _baseline(history, now, recent_s))
        self._forget_gone(target, names)
        ratios = [s.ratio for s in answered.values() if s.ratio is not None]
        recent_or_none = recent if recent_s is not None else None
        return reading(increases, ratio, ratios, None, recent_or_none, ttft=target.ttft)

    async def scrape(self, url: str, counters: dict[str, bool] = WINDOWED) -> "Snapshot | str":
        """The pod's counters now, or why not (a pod may vanish mid-scrape)."""
        body = await self._get(url)
        if isinstance(body, str):
            return body
        try:
            return parse_metrics(body.decode(errors="replace"), self._clock(), counters)
        except ValueError as exc:
            return f"{url}: not Prometheus text format: {exc}"

    async def scrape_ttft(self, url: str, ttft: str) -> "dict[tuple[str, str], float] | str":
        """The TTFT histogram's totals on the page at `url` (vLLM's /metrics), or why not."""
        body = await self._get(url)
        if isinstance(body, str):
            return body
        try:
            return parse_totals(body.decode(errors="replace"), ttft)
        except ValueError as exc:
            return f"{url}: {exc}"

    async def _get(self, url: str) -> "bytes | str":
        """The whole page at `url` (at most MAX_BODY_BYTES), or why not."""
        try:
            async with self._session.get(url, timeout=self._timeout) as response:
                if response.status != 200:
                    return f"{url}: HTTP {response.status}"
                body = await read_body(response)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return f"{url}: {type(exc).__name__}: {exc}"
        if body is None:
            return f"{url}: page over {MAX_BODY_BYTES} bytes"
        return body

    def _remember(
        self, key: tuple[str, str, str], snapshot: Snapshot, now: float, window_s: float
    ) -> list[Snapshot]:
        """Store the snapshot; return the pod's snapshots back to the window's start."""
        history = self._history.setdefault(key, [])
        history.append(snapshot)
        while len(history) > 1 and history[1].at <= now - window_s:
            history.pop(0)
        return history

    def forget(self, namespace: str, service: str) -> None:
        """Drop every pod's history of the deployment whose engine Service this is."""
        for key in [k for k in self._history if k[:2] == (namespace, service)]:
            del self._history[key]

    def _forget_gone(self, target: Target, pods: list[str]) -> None:
        """Drop the history of `target`'s pods that are no longer among `pods` (other
        deployments' pods, in the same namespace or not, are theirs to forget)."""
        owner = (target.namespace, target.service)
        for key in [k for k in self._history if k[:2] == owner and k[2] not in pods]:
            del self._history[key]


def _baseline(history: list[Snapshot], now: float, span_s: float) -> Snapshot | None:
    """The newest snapshot at least `span_s` old, or the oldest kept; None when that is the
    latest (a new pod: its first scrape is its baseline)."""
    older = [s for s in history if s.at <= now - span_s]
    then = older[-1] if older else history[0]
    return then if then is not history[-1] else None


def parse_metrics(text: str, at: float, names: dict[str, bool] = WINDOWED) -> Snapshot:
    """The counters the tuner reads (`names`, split by ratio or not) and the ratio gauge from
    a /metrics page (ValueError on text that is not Prometheus's format)."""
    counters: dict[tuple[str, str], float] = {}
    ratio = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                label = sample.labels.get(RATIO_LABEL, "") if names[sample.name] else ""
                key = (sample.name, label)
                counters[key] = counters.get(key, 0.0) + sample.value
            elif sample.name == RATIO_GAUGE and math.isfinite(sample.value):
                ratio = sample.value
    return Snapshot(at, counters, ratio)


def parse_totals(text: str, histogram: str) -> dict[tuple[str, str], float]:
    """A histogram's `_sum` and `_count` on a /metrics page, summed over its labels (vLLM's
    page is large: only those lines are parsed); ValueError when they are not there."""
    names = ttft_series(histogram)
    lines = [line for line in text.splitlines() if line.startswith(names)]
    totals: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in names:
                key = (sample.name, "")
                totals[key] = totals.get(key, 0.0) + sample.value
    if missing := [name for name in names if (name, "") not in totals]:
        raise ValueError(f"no {missing[0]} series")
    return totals


def _with_ttft(
    snapshot: Snapshot, page: "dict[tuple[str, str], float] | str", ttft: str
) -> Snapshot:
    """The pod's snapshot with its TTFT page's totals, or marked without them (a failed
    TTFT read loses only TTFT)."""
    if isinstance(page, str):
        return dataclasses.replace(snapshot, missing=frozenset(ttft_series(ttft)))
    return dataclasses.replace(snapshot, counters=snapshot.counters | page)


def _add_increases(increases: Increases, history: list[Snapshot], then: Snapshot | None) -> None:
    """Each counter's increase from `then` to the newest snapshot of `history`. A pod that
    restarted since `then` (any of its counters went down between two of its snapshots)
    counts every counter from zero: per series, a histogram's `_count` that grew past the
    baseline after a restart while its `_sum` did not (or the other way round) would pair
    an increase with a restarted total (a mean of 3.0 for a proxy in [0, 1])."""
    if then is None:
        return  # the first sight of a pod is its baseline: its past is not this window's
    now = history[-1]
    restarted = _restarted(history[_index(history, then) :])
    for (metric, label), value in now.counters.items():
        if metric in then.missing:
            continue  # no baseline: counted from zero it would be the pod's whole past
        before = None if restarted else then.counters.get((metric, label))
        if not math.isfinite(value):
            continue
        per_metric = increases.setdefault(metric, {})
        per_metric[label] = per_metric.get(label, 0.0) + _grown(value, before)


def _index(history: list[Snapshot], snapshot: Snapshot) -> int:
    return next(i for i, kept in enumerate(history) if kept is snapshot)


def _restarted(snapshots: list[Snapshot]) -> bool:
    """Whether any counter went down between two consecutive snapshots of one pod: its
    process restarted (counters only grow), so all of them started again from zero."""
    for before, after in zip(snapshots, snapshots[1:], strict=False):
        for key, value in after.counters.items():
            old = before.counters.get(key)
            if old is not None and math.isfinite(old) and math.isfinite(value) and value < old:
                return True
    return False
