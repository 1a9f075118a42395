"""A pod that starts into a deployment whose pods have scored calibration pairs: its
inline quality proxy with the pairs shared through the lookup server, against on its own.

    python -m holeblend_devtools.calibration_start --json out/calibration-start.json

1. A lookup server, and a first holeblend-serve pod naming it (the deployment's history),
   whose shadow may sample every blended request within its whole token budget, so that
   it scores pairs in a minute instead of many: it is sent question pairs (first pass,
   then the whole prompt) one at a time, each shadow awaited (`shadow_load.settle`), until
   its inline proxy holds `MIN_PAIRS` pairs at the ratio; then it stops (its last pairs go
   out as it stops).
2. Two fresh pods, one after the other, with a default BlendDeployment's proxy settings
   (sample rate, budget, idle floor) at the same ratio: `shared` names that lookup server,
   `alone` a second one that holds no pair, so that both pods do the same lookups on the
   request path (the bench waits until the first server has dropped the stopped history
   pod's segments: it holds only pairs). Each gets the same warm-up and the same saturated phase
   (`--clients` closed-loop clients with no think time, the shadow bench's workload); a
   scrape every second records when the first inline estimate came.
3. One JSON row per arm: seconds from the phase's start to the first inline estimate
   (null: none came), inline and shadow samples per 60-s interval (the tuner's default
   interval; the issue's goal is 5), pairs received, requests per second, TTFT and
   inter-token latency percentiles, and every request's TTFT and return time in send
   order. `--order alone,shared` runs the arms the other way round.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

from holeblend_contract.blend_settings import DEFAULT_SHADOW_SAMPLE_RATE
from holeblend_runtime import local_http
from holeblend_runtime.bench import shadow_load
from holeblend_runtime.lookup_server.processes import LookupProcess
from holeblend_runtime.quality.inline_proxy import MIN_PAIRS

RATIO = 0.15
ARMS = ("shared", "alone")
# Seconds without a heartbeat after which the lookup servers drop a pod (the history pod's
# segments go with it).
POD_TIMEOUT_S = 2.0
LOG = shadow_load.LOG


def settings(ratio: float, lookup_url: str | None, history: bool = False) -> str:
    """blend.json of a CPU pod with the proxies on; `history`: every blended request may
    be shadowed, within the whole budget."""
    text = json.loads(shadow_load.serve_settings(ratio, True, DEFAULT_SHADOW_SAMPLE_RATE))
    text["lookupServerUrl"] = lookup_url
    if history:
        text |= {"shadowSampleRate": 1.0, "shadowBudget": 1.0}
    return json.dumps(text)


class FirstEstimate:
    """Scrapes a server's metrics every `every_s` from `start` on and keeps the first time
    its inline proxy gave an estimate (seconds after `start`)."""

    def __init__(self, metrics_url: str, every_s: float = 1.0) -> None:
        self.metrics_url, self.every_s = metrics_url, every_s
        self.seconds: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = 0.0
        self._baseline = 0.0

    def __enter__(self) -> FirstEstimate:
        self._baseline = self._count()
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _count(self) -> float:
        return shadow_load.proxy_counts(shadow_load.scrape(self.metrics_url))["inline_samples"]

    def _run(self) -> None:
        while self.seconds is None and not self._stop.wait(self.every_s):
            if self._count() > self._baseline:
                self.seconds = time.monotonic() - self._started


def history(lookup_url: str, plan: shadow_load.Plan, work: Path, threads: int) -> dict:
    """The first pod: pairs until its calibration holds MIN_PAIRS (or the plan runs out)."""
    with shadow_load.serve_engine(work, settings(RATIO, lookup_url, history=True), threads) as t:
        shadow_load.drive_sequential(t.completions_url, plan.warm)
        sent = 0
        for pair in plan.calibrate:
            shadow_load.settle(t, [pair], MIN_PAIRS, proxies_on=True)
            sent += 1
            if (
                shadow_load.proxy_counts(shadow_load.scrape(t.metrics_url))["inline_pairs"]
                >= MIN_PAIRS
            ):
                break
        counts = shadow_load.proxy_counts(shadow_load.scrape(t.metrics_url))
    return {"questions": sent, "inline_pairs": counts["inline_pairs"]}


def wait_index_empty(lookup: LookupProcess, timeout_s: float = 30.0) -> None:
    """Until the server's index holds no segment (a stopped pod's go after its timeout)."""
    deadline = time.monotonic() + timeout_s
    while json.loads(local_http.LOCAL.open(f"{lookup.url}/stats").read())["entries"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the lookup server still indexes segments after {timeout_s} s")
        time.sleep(0.5)


def run_arm(
    arm: str, lookup_url: str, plan: shadow_load.Plan, work: Path, threads: int, clients: int
) -> dict:
    with shadow_load.serve_engine(work / arm, settings(RATIO, lookup_url), threads) as target:
        warm = shadow_load.drive_sequential(target.completions_url, plan.warm)
        if not all(t.ok for t in warm):
            raise RuntimeError(f"{arm}: warm-up requests failed")
        before = shadow_load.scrape(target.metrics_url)
        started = time.monotonic()
        with FirstEstimate(target.metrics_url) as first:
            timings = shadow_load.drive_saturated(
                target.completions_url, plan.phases["saturated"], clients
            )
        wall_s = time.monotonic() - started
        after = shadow_load.scrape(target.metrics_url)
    counts = {key: shadow_load.proxy_counts(s) for key, s in (("before", before), ("after", after))}

    def gained(key: str) -> float:
        return counts["after"][key] - counts["before"][key]

    def total(samples: dict, name: str, labels: dict) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    received = total(after, "holeblend_inline_proxy_shared_pairs_total", {"direction": "received"})
    stats = shadow_load.arm_stats([t.__dict__ for t in timings])
    ok = len(timings) - stats["failed_requests"]
    return {
        "arm": arm,
        "ratio": RATIO,
        "clients": clients,
        "first_inline_estimate_s": first.seconds,
        "inline_samples_per_interval": shadow_load.per_interval(gained("inline_samples"), wall_s),
        "shadow_samples_per_interval": shadow_load.per_interval(gained("shadow_scored"), wall_s),
        "interval_s": shadow_load.INTERVAL_S,
        "inline_samples": gained("inline_samples"),
        "blended_requests": gained("blended"),
        "pairs_received": received,
        "inline_pairs_at_end": counts["after"]["inline_pairs"],
        "requests_per_s": ok / wall_s if wall_s > 0 else None,
        "wall_s": wall_s,
        **stats,
        "ttfts_s": [t.ttft_s for t in timings],
        "returns_s": [t.return_s for t in timings],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the result here")
    whole = shadow_load.whole_number
    parser.add_argument("--seed", type=whole(0), default=0, help="workload seed, >= 0")
    parser.add_argument("--saturated-questions", type=whole(1), default=24)
    parser.add_argument("--history-questions", type=whole(0), default=24)
    parser.add_argument("--clients", type=whole(1), default=4)
    parser.add_argument("--threads", type=whole(1), default=2, help="each server's torch threads")
    parser.add_argument("--work-dir", type=Path, default=Path("out/calibration-start"))
    parser.add_argument("--order", default=",".join(ARMS), help="the arms, in run order")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers
    plan = shadow_load.build_plan(
        shadow_load.serve_body, warm_questions=2, paced_questions=0,
        saturated_questions=args.saturated_questions, max_tokens=8,
        calibrate_questions=args.history_questions, seed=args.seed,
    )  # fmt: skip
    order = args.order.split(",")
    if sorted(order) != sorted(ARMS):
        parser.error(f"--order: name each of {', '.join(ARMS)} once, got {args.order!r}")
    rows = []
    timeout = ("--pod-timeout", str(POD_TIMEOUT_S))
    with LookupProcess(*timeout) as shared, LookupProcess(*timeout) as empty:
        made = history(shared.url, plan, args.work_dir / "history", args.threads)
        wait_index_empty(shared)
        LOG(f"history: {made}")
        for arm in order:
            url = shared.url if arm == "shared" else empty.url
            row = run_arm(arm, url, plan, args.work_dir, args.threads, args.clients)
            LOG(f"{arm}: " + json.dumps({k: row[k] for k in list(row)[:12]}))
            rows.append(row)
    result = {
        "config": vars(args) | {"json": str(args.json), "work_dir": str(args.work_dir)},
        "history": made,
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
