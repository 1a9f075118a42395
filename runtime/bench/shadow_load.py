"""Does shadow scoring slow serving down? TTFT under load with the proxies off and on.

`python -m holeblend_runtime.bench.shadow_load --json out/shadow-load.json`

1. One serving thread runs the reference engine on hole-mode requests, one at a time, in
   arrival order, as a CPU pod does; TTFT counts from a request's arrival (queueing
   included) to its first token's logits.
2. Arrivals are open-loop (seeded exponential gaps) at `--load` of the measured service
   rate, so a slower server shows as longer queues rather than as fewer requests.
3. Blocks of requests alternate between proxies off and on (same arrival pattern in both),
   so background load on a shared machine hits both arms alike. With proxies on, every
   answered request is offered to the `ShadowScorer` at `--sample-rate`.
4. The JSON has one row per arm (TTFT p50/p90/p99, interpolated between ranks as numpy
   does; shadow outcomes, mean proxies), `ttft_p99_on_over_off` and whether it meets the
   goal (`meets_ttft_p99_goal`: at most 1.10).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import threading
import time
from pathlib import Path

from holeblend_runtime.bench.report import percentile
from holeblend_runtime.bench.workload import WorkloadConfig, generate_workload
from holeblend_runtime.engine import ReferenceEngine
from holeblend_runtime.shadow import ShadowRequest, ShadowScorer

# The goal: TTFT p99 with the proxies on within 10 % of the proxies off.
TTFT_P99_GOAL = 1.10


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    engine = ReferenceEngine.load(num_threads=args.threads)
    result = run(engine, args)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--requests-per-block", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=4, help="blocks per arm")
    parser.add_argument("--load", type=float, default=0.6, help="arrival rate / service rate")
    parser.add_argument("--sample-rate", type=float, default=0.2)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser


class Server:
    """The serving thread: requests in arrival order, TTFT from arrival."""

    def __init__(self, engine: ReferenceEngine, ratio: float, max_new_tokens: int):
        self.engine, self.ratio, self.max_new_tokens = engine, ratio, max_new_tokens
        self.requests: queue.Queue = queue.Queue()
        self.serving = threading.Event()
        self.shadow: ShadowScorer | None = None
        self.ttfts: list[float] = []

    def is_busy(self) -> bool:
        return self.serving.is_set() or not self.requests.empty()

    def serve(self, prompt, arrived: float) -> None:
        self.serving.set()
        try:
            prefill = self.engine.prefill(prompt, mode="hole", ratio=self.ratio)
            self.ttfts.append(time.monotonic() - arrived)
            answer = tuple(self.engine.generate(prefill, self.max_new_tokens))
        finally:
            self.serving.clear()
        if self.shadow is not None:
            self.shadow.offer(ShadowRequest(prompt, answer, self.ratio))

    def run_block(self, prompts: list, gaps: list[float]) -> None:
        worker = threading.Thread(target=self._drain, args=(len(prompts),))
        worker.start()
        for prompt, gap in zip(prompts, gaps, strict=True):
            time.sleep(gap)
            self.requests.put((prompt, time.monotonic()))
        worker.join()

    def _drain(self, count: int) -> None:
        for _ in range(count):
            prompt, arrived = self.requests.get()
            self.serve(prompt, arrived)


def run(engine: ReferenceEngine, args) -> dict:
    prompts = _prompts(engine, args)
    server = Server(engine, args.ratio, args.max_new_tokens)
    service_s = _warm_up(server, prompts)
    rng = random.Random(args.seed)
    shadow = ShadowScorer(
        engine.model, engine.tokenizer, args.sample_rate, is_busy=server.is_busy, rng=rng
    )
    arms = {"off": [], "on": []}
    started = time.monotonic()
    for block in range(args.blocks):
        picks = [rng.choice(prompts) for _ in range(args.requests_per_block)]
        gaps = [rng.expovariate(args.load / service_s) for _ in picks]
        for arm in ("off", "on") if block % 2 == 0 else ("on", "off"):
            server.shadow, server.ttfts = (shadow if arm == "on" else None), []
            server.run_block(picks, gaps)
            shadow.wait_idle(120)  # no shadow work spills into the next block
            arms[arm] += server.ttfts
    shadow.close()
    rows = [_row("off", arms["off"]), _row("on", arms["on"]) | _shadow_stats(shadow)]
    p99_on_over_off = rows[1]["ttft_p99_s"] / rows[0]["ttft_p99_s"]
    return {
        "config": vars(args) | {"service_s": service_s, "wall_s": time.monotonic() - started},
        "results": rows,
        "ttft_p99_on_over_off": p99_on_over_off,
        "ttft_p99_goal": TTFT_P99_GOAL,
        "meets_ttft_p99_goal": p99_on_over_off <= TTFT_P99_GOAL,
    }


def _prompts(engine: ReferenceEngine, args) -> list:
    config = WorkloadConfig(
        seed=args.seed, num_questions=args.questions, num_documents=args.documents
    )
    count = lambda text: len(engine.tokenizer.encode(text))  # noqa: E731
    workload = generate_workload(config, count)
    return [
        engine.build_prompt(qa.system, qa.document_texts(without_holes=False), qa.question)
        for qa in workload
    ]


def _warm_up(server: Server, prompts: list) -> float:
    """Caches every document once (so the stream mixes hits and holes), returns the mean
    service time of a warm request."""
    for prompt in prompts:
        server.serve(prompt, time.monotonic())
    started = time.monotonic()
    for prompt in prompts:
        server.serve(prompt, time.monotonic())
    return (time.monotonic() - started) / len(prompts)


def _row(arm: str, ttfts: list[float]) -> dict:
    return {
        "shadow": arm,
        "requests": len(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_p99_s": percentile(ttfts, 0.99),
    }


def _shadow_stats(shadow: ShadowScorer) -> dict:
    scores = shadow.scores
    return {
        "shadow_offers": dict(shadow.outcomes),
        "f1_proxy_mean": statistics.fmean(s.f1 for s in scores) if scores else None,
        "top1_agreement_mean": statistics.fmean(s.top1 for s in scores) if scores else None,
        "shadow_seconds_mean": statistics.fmean(s.seconds for s in scores) if scores else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
