"""holeblend-bench --load: full prefill vs prefix vs hole mode through the real server.

1. One seeded Zipf request stream (`load_workload`), the same for every mode.
2. Start one `holeblend-serve` per mode on 127.0.0.1, each with a `blend.json` for its
   mode, and wait until all are ready; send each its warm-up requests.
3. Cut the measured requests into `num_blocks` blocks in stream order and send block
   after block, each block to every mode's server in turn through `num_clients`
   closed-loop streaming clients, the servers' order turned by one per block. Only one
   server works at a time, and background load on a shared machine falls on all modes
   alike (as the offline bench interleaves).
4. The blending modes run their quality proxies as a BlendDeployment does by default (a
   shadow full prefill for a sampled share of requests, within a budget). A shadow still
   running when its mode's block ends would go on in the idle time of the next mode's
   block, on that mode's clock. So after each block the bench waits until that server's
   shadows are done, and adds the shadow work they did meanwhile (its idle units'
   seconds) to the mode's wall time: at saturation that work would have taken the
   engine's time. `shadow_s` is every shadow second of the mode's blocks, `shadow_drain_s`
   the part added after them.
5. One result row per mode: throughput over its blocks' wall time, TTFT percentiles, the
   reused share the server reports in `usage`, and agreement of the greedy answers with
   full prefill's (full's answers are the reference). Servers stop with SIGTERM.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from holeblend_contract.blend_settings import BlendMode, BlendSettings, ModelSettings
from holeblend_runtime.bench.load_client import Outcome, ServeProcess, drive
from holeblend_runtime.bench.load_workload import LoadRequest, LoadWorkloadConfig
from holeblend_runtime.bench.report import percentile
from holeblend_runtime.bench.shadow_load import proxy_counts, scrape, wait_shadows_done
from holeblend_runtime.quality.scores import answer_f1, answer_words

FULL = "full"
LOAD_MODES = (FULL, "prefix", "hole")
# blend.json `mode` per benchmark mode (the CRD's names: `off` is full prefill).
BLEND_MODE = {FULL: BlendMode.OFF, "prefix": BlendMode.PREFIX, "hole": BlendMode.HOLE}
# The model `holeblend-serve` loads (the blend engine's SmolLM2), as blend.json names it.
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Column order of the load table and key order of each JSON result.
LOAD_RESULT_KEYS = (
    "mode",
    "ratio",
    "clients",
    "requests",
    "requests_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "request_s_mean",
    "reused_share",
    "top1_vs_full",
    "f1_vs_full",
    "num_errors",
    "num_rejected",
    "shadow_s",
    "shadow_drain_s",
)
# How long the bench waits after a block for a server's shadows to finish.
DRAIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LoadConfig:
    workload: LoadWorkloadConfig
    modes: tuple[str, ...] = LOAD_MODES
    ratio: float = 0.15
    num_clients: int = 4
    max_tokens: int = 12
    # Measured requests are sent in this many rounds over the modes.
    num_blocks: int = 4
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.modes or not set(self.modes) <= set(LOAD_MODES):
            raise ValueError(f"modes: expected some of {LOAD_MODES}, got {self.modes}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio: must be within [0, 1], got {self.ratio}")
        if self.num_clients < 1:
            raise ValueError(f"num_clients: must be >= 1, got {self.num_clients}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {self.num_blocks}")
        if self.num_blocks > self.workload.num_requests:
            raise ValueError(
                f"num_blocks: {self.num_blocks} blocks need as many measured requests, got "
                f"{self.workload.num_requests}; lower --blocks or raise --requests"
            )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")


def blend_settings(mode: str, ratio: float) -> str:
    """The blend.json a mode's server reads, through the settings contract."""
    settings = BlendSettings(
        model=ModelSettings(name=MODEL_NAME), mode=BLEND_MODE[mode], recompute_ratio=ratio
    )
    return settings.to_json()


def run_load(
    config: LoadConfig,
    requests: Sequence[LoadRequest],
    workdir: Path,
    tokenize: Callable[[str], list[int]],
) -> list[dict[str, Any]]:
    """One row per mode, in `LOAD_MODES` order; server logs land in `workdir`."""
    modes = [m for m in LOAD_MODES if m in config.modes]
    outcomes: dict[str, list[Outcome]] = {mode: [] for mode in modes}
    wall_s = dict.fromkeys(modes, 0.0)
    shadow = {mode: ShadowSeconds() for mode in modes}
    with ExitStack() as stack:
        servers = {mode: stack.enter_context(_server(config, mode, workdir)) for mode in modes}
        for server in servers.values():
            server.wait_ready(config.timeout_s)
        models = {mode: server.model_name() for mode, server in servers.items()}
        warm_up = [r for r in requests if r.is_warmup]
        blocks = [(True, warm_up)] if warm_up else []
        blocks += [(False, block) for block in _blocks(requests, config)]
        for turn, (is_warmup, block) in enumerate(blocks):
            for mode in _turned(modes, turn):
                server = servers[mode]
                done, seconds, moved = _run_block(config, mode, server, models[mode], block)
                if not is_warmup:
                    outcomes[mode] += done
                    wall_s[mode] += seconds + moved.idle
                    shadow[mode].add(moved)
    references = {o.index: o.text for o in outcomes.get(FULL, ()) if o.is_ok} or None
    questions = {r.index: r.question for r in requests}
    return [
        summarize_load(mode, None if mode == FULL else config.ratio, config.num_clients,
                       outcomes[mode], wall_s[mode], references, tokenize, questions,
                       shadow[mode])
        for mode in modes
    ]  # fmt: skip


def _run_block(
    config: LoadConfig, mode: str, server: ServeProcess, model: str, block: list[LoadRequest]
) -> tuple[list[Outcome], float, ShadowSeconds]:
    """One block to one server: its outcomes, its wall time, and (a blending mode) the
    shadow work of the block and of the wait after it, in which its shadows finished."""
    if mode == FULL:  # nothing blended, no shadow
        done, seconds = drive(server.port, block, model, config.num_clients,
                              config.max_tokens, config.timeout_s)  # fmt: skip
        return done, seconds, ShadowSeconds()
    metrics_url = f"http://127.0.0.1:{server.port}/metrics"
    before = scrape(metrics_url)
    done, seconds = drive(server.port, block, model, config.num_clients,
                          config.max_tokens, config.timeout_s)  # fmt: skip
    ended = scrape(metrics_url)
    if not wait_shadows_done(
        metrics_url, DRAIN_TIMEOUT_S, blended_over=proxy_counts(before)["blended"]
    ):
        raise RuntimeError(f"{mode}: shadows still running {DRAIN_TIMEOUT_S:.0f} s after a block")
    drained = ShadowSeconds.between(ended, scrape(metrics_url))
    during = ShadowSeconds.between(before, ended)
    return done, seconds, ShadowSeconds(during.total + drained.total, drained.idle)


@dataclass
class ShadowSeconds:
    """Seconds of shadow work of one mode's blocks: all of it, and the part done after
    the blocks ended (added to the mode's wall time)."""

    total: float = 0.0
    idle: float = 0.0

    @classmethod
    def between(cls, before: dict, after: dict) -> ShadowSeconds:
        """The shadow seconds between two scrapes: every unit's, and the idle units'."""
        start, end = proxy_counts(before)["units"], proxy_counts(after)["units"]

        def moved(state: str) -> float:
            return max(0.0, end[state]["seconds"] - start[state]["seconds"])

        return cls(moved("idle") + moved("serving"), moved("idle"))

    def add(self, other: ShadowSeconds) -> None:
        self.total += other.total
        self.idle += other.idle


def _server(config: LoadConfig, mode: str, workdir: Path) -> ServeProcess:
    settings_path = workdir / f"blend-{mode}.json"
    settings_path.write_text(blend_settings(mode, config.ratio))
    return ServeProcess(settings_path, workdir / f"serve-{mode}.log")


def _turned(modes: Sequence[str], turn: int) -> list[str]:
    """The modes starting at `turn` (mod their number): the servers' order turns by one per
    block, so that no mode always runs first or last in a round, where a load that grows or
    fades on a shared machine during each round would fall on it alone."""
    shift = turn % len(modes)
    return [*modes[shift:], *modes[:shift]]


def _blocks(requests: Sequence[LoadRequest], config: LoadConfig) -> list[list[LoadRequest]]:
    """The measured requests in stream order, in `num_blocks` blocks whose sizes differ by
    one at most (blocks of a rounded-up size would make fewer: 4 requests in blocks of 2
    are 2 blocks, not 3, and the servers' order would not turn through every place)."""
    measured = [r for r in requests if not r.is_warmup]
    n, count = len(measured), config.num_blocks
    return [measured[n * i // count : n * (i + 1) // count] for i in range(count)]


def summarize_load(
    mode: str,
    ratio: float | None,
    num_clients: int,
    outcomes: Sequence[Outcome],
    wall_s: float,
    references: dict[int, str] | None,
    tokenize: Callable[[str], list[int]],
    questions: dict[int, str],
    shadow: ShadowSeconds | None = None,
) -> dict[str, Any]:
    """One result row; quality keys are None without full-prefill references; the shadow
    keys 0 without `shadow`."""
    ok = [o for o in outcomes if o.is_ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    itls = [gap for o in ok for gap in o.itls_s]
    row: dict[str, Any] = {
        "mode": mode,
        "ratio": ratio,
        "clients": num_clients,
        "requests": len(outcomes),
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_p50_s": percentile(ttfts, 0.5) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
        "itl_p50_s": percentile(itls, 0.5) if itls else None,
        "itl_p99_s": percentile(itls, 0.99) if itls else None,
        # What the percentiles are of: with few samples they interpolate between the largest.
        "num_ttft_samples": len(ttfts),
        "num_itl_samples": len(itls),
        "request_s_mean": statistics.fmean(o.request_s for o in ok) if ok else None,
        "reused_share": reused_share(ok),
        "top1_vs_full": None,
        "f1_vs_full": None,
        "num_errors": len(outcomes) - len(ok),
        "num_rejected": sum(o.num_rejected for o in outcomes),
        "shadow_s": shadow.total if shadow is not None else 0.0,
        "shadow_drain_s": shadow.idle if shadow is not None else 0.0,
    }
    compared = [o for o in ok if references is not None and o.index in references]
    if compared:
        row["top1_vs_full"] = statistics.fmean(
            greedy_agreement(tokenize(o.text), tokenize(references[o.index])) for o in compared
        )
        row["f1_vs_full"] = statistics.fmean(
            answer_f1(answer_words(o.text), answer_words(references[o.index]),
                      answer_words(questions[o.index]))
            for o in compared
        )  # fmt: skip
    row["wall_s"] = wall_s
    return row


def reused_share(outcomes: Sequence[Outcome]) -> float | None:
    """Cached over prompt tokens, from `usage` (OpenAI's `prompt_tokens_details`)."""
    usages = [o.usage for o in outcomes if o.usage]
    prompt = sum(u.get("prompt_tokens", 0) for u in usages)
    if not usages or prompt == 0:
        return None
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    return cached / prompt


def greedy_agreement(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """Share of the reference answer's positions where the greedy candidate agrees,
    counting up to the first disagreement (after it the two continue from different
    contexts, so later positions are not comparable). A lower bound of teacher-forced
    top-1 agreement; 1.0 when both are empty."""
    if not reference:
        return 1.0 if not candidate else 0.0
    agreed = 0
    for mine, theirs in zip(candidate, reference, strict=False):
        if mine != theirs:
            break
        agreed += 1
    return agreed / len(reference)
