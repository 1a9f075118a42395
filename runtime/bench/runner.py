"""Run the two-pass workload through the engine in every mode and ratio.

Pass 1 sends each prompt with its hole documents left out (optionally in a shuffled
order), into an empty KV store; the engine stores the documents it computed, as its
store policy says. Before pass 2 every engine's background store is drained (the idle
time a server has between bursts; its compute is reported per row). Pass 2 sends the
full prompts: every document but the holes is a hit. Each (mode, ratio, store policy)
sweep point has its own engine with its own store, empty at the start, so its two
passes see the same cache state as every other point's. With `repeat`, pass 3 sends pass
2's prompts again, each right after its pass-2 send, with the segments that send stored
removed again: the same cache state, on shapes the machine has now seen (pass 2 is what a
prompt with a new document set pays, pass 3 what a seen one pays). Pass 3 times the
prefill only; its quality columns are pass 2's (the same computation). Full prefill of every prompt in
both passes runs once; its answers are the reference for the blended ones.

Selection strategies are a sweep dimension (`BenchConfig.selections`: a `BlendConfig.selection`
string, optionally with `@layers` for `filter_layers` and `#layer` for its check layer). With
`WorkloadConfig.regroup_first_pass`, pass 1 is `first_pass_requests` (documents pooled across
prompts, new order, new neighbours): it only fills the stores and is not measured. With
`BenchConfig.shared_store` every engine shares one KV store (the caller makes it so): pass 1
is sent once, and what each measured send stores is removed again right after it, so every
sweep point meets the same cache state while memory holds the documents once instead of once
per sweep point.

Requests are interleaved: each prompt goes to full prefill and then to every sweep
point before the next prompt (the points' order rotated by one per prompt). A slower or busier machine then slows all modes alike
instead of whichever happened to run last, which keeps the speedups honest. The price
is memory: every sweep point's store holds the run's documents at once.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple, Protocol

import torch
from tqdm import tqdm

from holeblend_contract.blend_settings import DEFAULT_CHECK_LAYER, parse_selection
from holeblend_runtime.bench.report import RequestMeasure, summarize
from holeblend_runtime.bench.workload import (
    FirstPassRequest,
    NeighbourOrder,
    QAPrompt,
    WorkloadConfig,
    first_pass_plan,
)
from holeblend_runtime.blend.config import IN_CONTEXT, K_DEVIATION, STORE_POLICIES
from holeblend_runtime.blend.reuse import SegmentReuse
from holeblend_runtime.blend.segments import SegmentedPrompt
from holeblend_runtime.quality.inline_proxy import residual_deviation
from holeblend_runtime.quality.scores import (
    answer_f1,
    answer_words,
    kl_divergence,
    mean_nll,
    top1_agreement,
)

FULL = "full"
BLEND_MODES = ("prefix", "hole")
PASSES = (1, 2)
# Pass 2 sent again on the same cache state (BenchConfig.repeat).
REPEAT_PASS = 3
# Separates a selection from its filter layers in a sweep entry: "kDeviation@4/8".
FILTER_MARK = "@"
# Ends a sweep entry with the check layer it runs at: "kDeviation#2", "kDeviation@4/8#2".
CHECK_MARK = "#"


class SelectionEntry(NamedTuple):
    """One sweep entry: a `BlendConfig.selection`, its `filter_layers` and the check layer
    it runs at (None: the run's `BenchConfig.check_layer`)."""

    selection: str
    filter_layers: tuple[int, ...] = ()
    check_layer: int | None = None


def parse_selection_entry(entry: str) -> SelectionEntry:
    """`"sinks:0.25+kDeviation@4/8#2"` -> `("sinks:0.25+kDeviation", (4, 8), 2)`: a
    `BlendConfig.selection`, its `filter_layers` (none without `@`) and its check layer
    (None without `#`). ValueError naming `selections` and the entry otherwise."""
    rest, checked, check_text = entry.strip().partition(CHECK_MARK)
    check_layer = None
    if checked:
        try:
            check_layer = int(check_text)
        except ValueError:
            check_layer = -1
        if check_layer < 1:
            raise ValueError(
                f"selections: the check layer after '{CHECK_MARK}' must be an integer >= 1, "
                f"like 'kDeviation#2', got {entry!r}"
            )
    selection, marked, layers_text = rest.partition(FILTER_MARK)
    selection = selection.strip()
    try:
        parse_selection(selection)
    except ValueError as error:
        raise ValueError(f"selections: {error}") from None
    if not marked:
        return SelectionEntry(selection, (), check_layer)
    try:
        layers = tuple(int(part) for part in layers_text.split("/"))
    except ValueError:
        raise ValueError(
            f"selections: filter layers after '{FILTER_MARK}' must be integers separated by "
            f"'/', like 'kDeviation@4' or 'kDeviation@4/8', got {entry!r}"
        ) from None
    return SelectionEntry(selection, layers, check_layer)


class Prefill(Protocol):
    # Next-token logits at the last prompt position, [vocab].
    logits: torch.Tensor
    num_reused_tokens: int
    num_hole_tokens: int
    num_recomputed_tokens: int
    ttft_s: float
    request_s: float
    prompt: SegmentedPrompt
    reuse: SegmentReuse | None
    # The check layer's deviation per compared cached token, and the positions selected.
    deviation: torch.Tensor
    selected_positions: torch.Tensor


class Engine(Protocol):
    """The part of the blend engine the bench uses."""

    def build_prompt(
        self, system: str, documents: Sequence[str], question: str
    ) -> SegmentedPrompt: ...

    def prefill(self, prompt: SegmentedPrompt, mode: str, ratio: float) -> Prefill: ...

    def score(self, prefill: Prefill, token_ids: Sequence[int]) -> torch.Tensor: ...

    def generate(self, prefill: Prefill, max_new_tokens: int) -> list[int]: ...

    def wait_for_stores(self, timeout: float | None = None) -> bool: ...

    def store_stats(self) -> Any: ...

    def close(self) -> None: ...

    # The engine's own KV store (keys() and remove(key): pass 3 resets it).
    store: Any


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class BenchConfig:
    workload: WorkloadConfig
    # Recompute ratios swept for each blend mode.
    ratios: tuple[float, ...] = (0.05, 0.15, 0.3, 0.5, 1.0)
    # Blend modes compared against full prefill (which always runs, as the reference).
    modes: tuple[str, ...] = BLEND_MODES
    # Store policies swept for each blend mode and ratio (see BlendConfig.store_policy).
    store_policies: tuple[str, ...] = (IN_CONTEXT,)
    max_new_tokens: int = 20
    # Pass 3: pass 2's prompts again on the same cache state (shapes seen).
    repeat: bool = False
    # Selection strategies swept for each mode and ratio: `BlendConfig.selection` strings,
    # each optionally with "@layers" for `filter_layers` and "#layer" for the check layer
    # (parse_selection_entry).
    selections: tuple[str, ...] = (K_DEVIATION,)
    # Every engine shares one KV store: pass 1 goes once, and what a measured send stores
    # is removed after it (needs the in-context store policy alone).
    shared_store: bool = False
    # The layer the engines check deviation at (filter layers must lie above it).
    check_layer: int = DEFAULT_CHECK_LAYER

    def __post_init__(self) -> None:
        if not self.ratios:
            raise ValueError("ratios: need at least one ratio")
        for ratio in self.ratios:
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"ratios: {ratio} is outside [0, 1]")
        if not self.modes:
            raise ValueError(f"modes: need at least one of {BLEND_MODES}")
        for mode in self.modes:
            if mode not in BLEND_MODES:
                raise ValueError(f"modes: expected some of {BLEND_MODES}, got {mode!r}")
        if not self.store_policies or not set(self.store_policies) <= set(STORE_POLICIES):
            raise ValueError(
                f"store_policies: expected some of {STORE_POLICIES}, got {self.store_policies}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not self.selections:
            raise ValueError(f"selections: need at least one, e.g. {K_DEVIATION!r}")
        if len(set(self.selections)) != len(self.selections):
            raise ValueError(f"selections: an entry appears twice in {list(self.selections)}")
        for entry in self.selections:
            _, layers, check_layer = parse_selection_entry(entry)
            check_layer = self.check_layer if check_layer is None else check_layer
            if layers and (layers[0] <= check_layer or list(layers) != sorted(set(layers))):
                raise ValueError(
                    f"selections: filter layers of {entry!r} must be strictly increasing and "
                    f"above the check layer {check_layer}"
                )
        if self.shared_store and self.store_policies != (IN_CONTEXT,):
            raise ValueError(
                f"store_policies: a shared store needs {IN_CONTEXT!r} alone (an isolated "
                f"store's background jobs would outlive the send they belong to), got "
                f"{list(self.store_policies)}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Request:
    """A workload prompt as sent in one pass."""

    prompt: SegmentedPrompt
    # Gold answer tokens, as the assistant would write them.
    gold_ids: tuple[int, ...]
    # Words of every accepted gold answer (F1 vs gold is the best over them).
    gold_words: tuple[tuple[str, ...], ...]
    question_words: tuple[str, ...]
    # Wall and CPU seconds building the prompt took (tokenizing it): every send of it pays
    # them before its prefill, in every mode, so they are added to its timings.
    build_s: float = 0.0
    build_cpu_s: float = 0.0

    def f1_vs_gold(self, words: Sequence[str]) -> float:
        """Plain answer-word F1 against the best gold answer: every gold word counts, also
        one that occurs in the question (only `f1_vs_full` skips those)."""
        return max(answer_f1(words, gold) for gold in self.gold_words)


@dataclass(frozen=True, eq=False)
class Reference:
    """Full prefill of one request: what blended answers are compared with."""

    answer_ids: tuple[int, ...]
    answer_words: tuple[str, ...]
    # Logits predicting each reference answer token, [len(answer_ids) or 1, vocab].
    span_logits: torch.Tensor
    measure: RequestMeasure


# (mode, ratio, store policy, selection entry); all but the mode are None for full prefill.
SweepPoint = tuple[str, float | None, str | None, str | None]
MeasureKey = tuple[str, float | None, str | None, str | None, int]
FULL_POINT: SweepPoint = (FULL, None, None, None)


class BenchRunner:
    """`new_engine(store_policy, selection_entry)` gives an engine (sharing the loaded
    model and its foreground activity) whose blend config has that store policy and
    selection, with an empty KV store of its own, or the one shared store when
    `config.shared_store`; the first one runs full prefill, one more per sweep point
    blends."""

    def __init__(
        self, new_engine: Callable[[str, str], Engine], tokenizer: Tokenizer, config: BenchConfig
    ) -> None:
        self.new_engine = new_engine
        self.tokenizer = tokenizer
        self.config = config
        self.engine = new_engine(config.store_policies[0], config.selections[0])
        # Pass 1 when regrouped (not measured): requests, documents and seconds sent.
        self.first_pass_record: dict[str, Any] | None = None

    @property
    def regrouped(self) -> bool:
        return self.config.workload.regroup_first_pass

    @property
    def passes(self) -> tuple[int, ...]:
        """The measured passes (a regrouped pass 1 only fills the stores)."""
        passes = PASSES[1:] if self.regrouped else PASSES
        return (*passes, REPEAT_PASS) if self.config.repeat else passes

    def num_requests(self, num_prompts: int) -> int:
        """Measured prefills: references plus every (sweep point, pass)."""
        return num_prompts * len(self.passes) * (1 + len(self.sweep_points()))

    def sweep_points(self) -> list[SweepPoint]:
        c = self.config
        return [
            (m, r, s, e)
            for m in c.modes
            for r in c.ratios
            for e in c.selections
            for s in c.store_policies
        ]

    def run(
        self,
        workload: Sequence[QAPrompt],
        show_progress: bool = True,
        warm_up: QAPrompt | None = None,
    ) -> list[dict[str, Any]]:
        """`warm_up`: a prompt outside the workload to warm up on (default: the first
        prompt's pass 2, which pass 2 then sends to a warm machine)."""
        measures, background_s = self.run_measures(workload, show_progress, warm_up)
        return self._rows(measures, background_s)

    def run_measures(
        self,
        workload: Sequence[QAPrompt],
        show_progress: bool = True,
        warm_up: QAPrompt | None = None,
    ) -> tuple[dict[MeasureKey, list[RequestMeasure]], dict[MeasureKey, float]]:
        """Per-prompt measures (in workload order) of every (sweep point, measured pass),
        full prefill's under `FULL_POINT`; and background store seconds per key."""
        sent = [p for p in PASSES if p in self.passes]
        requests = {p: [self.request(qa, pass_number=p) for qa in workload] for p in sent}
        # Each sweep point's engine shares the loaded model and owns an empty store (or
        # the shared one).
        engines = {point: self.new_engine(point[2], point[3]) for point in self.sweep_points()}
        measures: dict[MeasureKey, list[RequestMeasure]] = defaultdict(list)
        background_s: dict[MeasureKey, float] = {}
        forget_each = self.config.shared_store
        total = self.num_requests(len(workload))
        with tqdm(
            total=total, desc="holeblend-bench", unit="req", disable=not show_progress
        ) as bar:
            self._warm_up(
                requests[2][0] if warm_up is None else self.request(warm_up, pass_number=2)
            )
            if self.regrouped:
                self._send_first_pass(workload, engines)
            for pass_number in sent:
                computed = {point: e.store_stats().compute_s for point, e in engines.items()}
                # Of that pass's background compute, what pass 3's sends queued.
                repeated_s = dict.fromkeys(engines, 0.0)
                for index, request in enumerate(requests[pass_number]):
                    reference = self._reference(request)
                    measures[(*FULL_POINT, pass_number)].append(reference.measure)
                    is_repeated = pass_number == PASSES[-1] and self.config.repeat
                    if is_repeated:
                        again = self._again(self.engine, (FULL, 1.0), request, reference.measure)
                        measures[(*FULL_POINT, REPEAT_PASS)].append(again)
                    bar.update(1 + is_repeated)
                    for point, engine in _rotated(list(engines.items()), index):
                        forget = is_repeated or forget_each
                        stored = set(engine.store.keys()) if forget else set()
                        measure = self._measure(engine, point, request, reference)
                        measures[(*point, pass_number)].append(measure)
                        if is_repeated:
                            _forget_stored_since(engine, stored)
                            before_s = engine.store_stats().compute_s
                            again = self._again(engine, point[:2], request, measure)
                            measures[(*point, REPEAT_PASS)].append(again)
                            _forget_stored_since(engine, stored)
                            repeated_s[point] += engine.store_stats().compute_s - before_s
                        elif forget:
                            _forget_stored_since(engine, stored)
                        bar.update(1 + is_repeated)
                for point, engine in engines.items():
                    engine.wait_for_stores()
                    # Background compute of this pass: in the gaps between requests and
                    # in the drain just now; pass 3's sends' part goes to pass 3's rows.
                    background_s[(*point, pass_number)] = (
                        engine.store_stats().compute_s - computed[point] - repeated_s[point]
                    )
                    if pass_number == PASSES[-1] and self.config.repeat:
                        background_s[(*point, REPEAT_PASS)] = repeated_s[point]
        for engine in engines.values():
            engine.close()
        return measures, background_s

    def _send_first_pass(
        self, workload: Sequence[QAPrompt], engines: dict[SweepPoint, Engine]
    ) -> None:
        """Fill the stores: once into the shared one, else into every sweep point's."""
        first_pass, order = regrouped_first_pass_plan(workload, self.config.workload.seed)
        targets = list(engines.items())[:1] if self.config.shared_store else engines.items()
        started = time.perf_counter()
        for request in first_pass:
            prompt = self.engine.build_prompt(request.system, request.documents, request.question)
            for (mode, ratio, _, _), engine in targets:
                engine.prefill(prompt, mode, ratio)
        for _, engine in targets:
            engine.wait_for_stores()
        self.first_pass_record = {
            "num_requests": len(first_pass),
            "num_documents": sum(len(r.documents) for r in first_pass),
            "sent_to_engines": len(list(targets)),
            "wall_s": time.perf_counter() - started,
            "regrouped": True,
            **order.to_dict(),
        }

    def request(self, qa: QAPrompt, *, pass_number: int) -> Request:
        shuffle = self.config.workload.shuffle_first_pass and pass_number == 1
        documents = qa.document_texts(
            without_holes=pass_number == 1,
            shuffle_seed=self.config.workload.seed if shuffle else None,
        )
        started, cpu_started = time.perf_counter(), time.process_time()
        prompt = self.engine.build_prompt(qa.system, documents, qa.question)
        # Read before the gold answer is tokenized: only the prompt is what a user pays.
        build_s, build_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        return Request(
            prompt=prompt,
            gold_ids=tuple(self.tokenizer.encode(qa.gold_answer)),
            gold_words=tuple(tuple(answer_words(gold)) for gold in qa.gold_answers),
            question_words=tuple(answer_words(qa.question)),
            build_s=build_s,
            build_cpu_s=build_cpu_s,
        )

    def _warm_up(self, request: Request) -> None:
        # First calls pay for lazy allocations and code paths; keep them out of every
        # timing: full prefill, then a throwaway engine's cold and warm blend.
        self.engine.prefill(request.prompt, FULL, 1.0)
        engine = self.new_engine(self.config.store_policies[0], self.config.selections[0])
        before = set(engine.store.keys())  # a shared store must not keep the warm-up's
        for _ in range(2):
            engine.prefill(request.prompt, self.config.modes[0], self.config.ratios[0])
        _forget_stored_since(engine, before)
        engine.close()

    def _reference(self, request: Request) -> Reference:
        cpu_started = time.process_time()
        prefill = self.engine.prefill(request.prompt, FULL, 1.0)
        cpu_s = time.process_time() - cpu_started
        gold_loss = _gold_loss(self.engine, prefill, request)
        answer_ids = tuple(self.engine.generate(prefill, self.config.max_new_tokens))
        words = tuple(answer_words(self.tokenizer.decode(answer_ids)))
        span_logits = _span_logits(self.engine, prefill, answer_ids)
        measure = RequestMeasure(
            num_prompt_tokens=request.prompt.num_tokens,
            num_reused_tokens=prefill.num_reused_tokens,
            num_hole_tokens=prefill.num_hole_tokens,
            num_recomputed_tokens=prefill.num_recomputed_tokens,
            ttft_s=request.build_s + prefill.ttft_s,
            request_s=request.build_s + prefill.request_s,
            f1_vs_full=answer_f1(words, words, request.question_words),
            top1_vs_full=top1_agreement(span_logits, span_logits),
            kl_vs_full=kl_divergence(span_logits, span_logits).mean().item(),
            gold_loss=gold_loss,
            f1_vs_gold=request.f1_vs_gold(words),
            request_cpu_s=request.build_cpu_s + cpu_s,
            **_blend_figures(prefill),
        )
        return Reference(answer_ids, words, span_logits, measure)

    def _rows(
        self,
        measures: dict[MeasureKey, list[RequestMeasure]],
        background_s: dict[MeasureKey, float],
    ) -> list[dict[str, Any]]:
        full = {p: measures[(*FULL_POINT, p)] for p in self.passes}
        points: list[SweepPoint] = [FULL_POINT, *self.sweep_points()]
        return [
            summarize(
                mode,
                ratio,
                p,
                measures[(mode, ratio, policy, selection, p)],
                full_ttft_mean_s=statistics.fmean(m.ttft_s for m in full[p]),
                full_request_mean_s=statistics.fmean(m.request_s for m in full[p]),
                store_policy=policy,
                background_store_s=background_s.get((mode, ratio, policy, selection, p), 0.0),
                selection=selection,
            )  # fmt: skip
            for mode, ratio, policy, selection in points
            for p in self.passes
        ]

    def _again(
        self,
        engine: Engine,
        mode_ratio: tuple[str, float | None],
        request: Request,
        first: RequestMeasure,
    ) -> RequestMeasure:
        """The prefill of `request` once more, timed (with building its prompt, as
        `request.build_s` says); the rest of `first` (same state)."""
        mode, ratio = mode_ratio
        cpu_started = time.process_time()
        prefill = engine.prefill(request.prompt, mode, 1.0 if ratio is None else ratio)
        cpu_s = time.process_time() - cpu_started
        return replace(
            first,
            ttft_s=request.build_s + prefill.ttft_s,
            request_s=request.build_s + prefill.request_s,
            request_cpu_s=request.build_cpu_s + cpu_s,
        )

    def _measure(
        self, engine: Engine, point: SweepPoint, request: Request, reference: Reference
    ) -> RequestMeasure:
        mode, ratio, _, _ = point
        cpu_started = time.process_time()
        prefill = engine.prefill(request.prompt, mode, ratio)
        cpu_s = time.process_time() - cpu_started
        span_logits = _span_logits(engine, prefill, reference.answer_ids)
        gold_loss = _gold_loss(engine, prefill, request)
        words = answer_words(
            self.tokenizer.decode(engine.generate(prefill, self.config.max_new_tokens))
        )
        return RequestMeasure(
            num_prompt_tokens=request.prompt.num_tokens,
            num_reused_tokens=prefill.num_reused_tokens,
            num_hole_tokens=prefill.num_hole_tokens,
            num_recomputed_tokens=prefill.num_recomputed_tokens,
            ttft_s=request.build_s + prefill.ttft_s,
            request_s=request.build_s + prefill.request_s,
            f1_vs_full=answer_f1(words, reference.answer_words, request.question_words),
            top1_vs_full=top1_agreement(reference.span_logits, span_logits),
            kl_vs_full=kl_divergence(reference.span_logits, span_logits).mean().item(),
            gold_loss=gold_loss,
            f1_vs_gold=request.f1_vs_gold(words),
            request_cpu_s=request.build_cpu_s + cpu_s,
            **_blend_figures(prefill),
        )


def _blend_figures(prefill: Prefill) -> dict[str, float | None]:
    """What the prefill's blend saw (`RequestMeasure`'s deviation fields, None where nothing
    was blended) and the first token's margin: log-probability of the most likely next
    token minus the second's, in nats."""
    top = torch.log_softmax(prefill.logits.float(), dim=-1).topk(2).values
    figures: dict[str, float | None] = {
        "first_token_margin": float(top[0] - top[1]),
        "deviation_mean": None,
        "residual_deviation": None,
    }
    if prefill.reuse is not None:
        args = (prefill.prompt, prefill.reuse, prefill.deviation)
        # All of it (nothing recomputed), and what the blend's picks left.
        figures["deviation_mean"] = residual_deviation(*args, prefill.selected_positions[:0])
        figures["residual_deviation"] = residual_deviation(*args, prefill.selected_positions)
    return figures


def _rotated(items: list[Any], shift: int) -> list[Any]:
    """`items` starting at `shift` (mod its length): prompt i goes to the sweep points
    in an order rotated by i, so no point always runs right after full prefill."""
    shift %= len(items) or 1
    return items[shift:] + items[:shift]


def regrouped_first_pass(workload: Sequence[QAPrompt], seed: int) -> tuple[FirstPassRequest, ...]:
    """The regrouped pass 1: groups of a pass-1 prompt's size (documents minus holes)."""
    return regrouped_first_pass_plan(workload, seed)[0]


def regrouped_first_pass_plan(
    workload: Sequence[QAPrompt], seed: int
) -> tuple[tuple[FirstPassRequest, ...], NeighbourOrder]:
    """The regrouped pass 1 and how its order was drawn (`first_pass_plan`)."""
    first = workload[0]
    group_size = max(1, len(first.documents) - len(first.hole_documents))
    return first_pass_plan(workload, seed, group_size)


def shuffled_first_pass_record(workload: Sequence[QAPrompt], seed: int) -> dict[str, Any]:
    """How the per-prompt pass 1 of `WorkloadConfig.shuffle_first_pass` was ordered: each
    prompt's `first_pass_order` method, and the predecessors no order could avoid."""
    orders = [qa.first_pass_order(seed) for qa in workload]
    return {
        "regrouped": False,
        "order": [order.method for order in orders],
        "kept_predecessors": sum(order.kept_predecessors for order in orders),
        "exact_prefixes": sum(order.exact_prefixes for order in orders),
    }


def _forget_stored_since(engine: Engine, before: set[str]) -> None:
    """Remove what the engine stored since its store held `before` (background stores
    drained first), so a prompt can be sent again on the same cache state."""
    engine.wait_for_stores()
    for key in set(engine.store.keys()) - before:
        engine.store.remove(key)


def _span_logits(engine: Engine, prefill: Prefill, token_ids: Sequence[int]) -> torch.Tensor:
    """Row i predicts token_ids[i] after the prompt; an empty answer (EOS first) still
    has its first-token distribution to compare."""
    if not token_ids:
        return prefill.logits.reshape(1, -1)
    return engine.score(prefill, list(token_ids))


def _gold_loss(engine: Engine, prefill: Prefill, request: Request) -> float:
    return mean_nll(_span_logits(engine, prefill, request.gold_ids), request.gold_ids)
