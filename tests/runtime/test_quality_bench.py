"""The quality sweep: bootstrap intervals, rows with paired differences, selection entries
and the CLI's quality options (no model involved)."""

import dataclasses
import statistics
import time
import types

import numpy
import pytest
import torch

from holeblend_runtime.bench.cli import _point_blend, bench_config, parse_args
from holeblend_runtime.bench.frontier import plot_frontier
from holeblend_runtime.bench.quality_report import (
    bootstrap_interval,
    meets_goals,
    quality_rows,
    ratio_of_means_interval,
)
from holeblend_runtime.bench.report import RequestMeasure
from holeblend_runtime.bench.runner import (
    FULL_POINT,
    BenchConfig,
    BenchRunner,
    parse_selection_entry,
)
from holeblend_runtime.bench.workload import WorkloadConfig, generate_workload
from holeblend_runtime.blend.config import BlendConfig


def test_interval_of_a_constant_is_the_constant():
    assert bootstrap_interval([0.5] * 7, seed=0) == [0.5, 0.5]


def test_one_prompt_gives_the_point_itself():
    assert bootstrap_interval([0.25], seed=3) == [0.25, 0.25]


def test_interval_matches_the_normal_approximation_on_many_prompts():
    values = numpy.random.default_rng(1).normal(0.9, 0.05, size=400)
    low, high = bootstrap_interval(values, seed=0)
    half_width = 1.96 * values.std(ddof=1) / len(values) ** 0.5
    assert low < values.mean() < high
    assert (high - low) / 2 == pytest.approx(half_width, rel=0.1)


def test_interval_is_seeded_and_level_sets_its_width():
    values = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert bootstrap_interval(values, seed=5) == bootstrap_interval(values, seed=5)
    wide = bootstrap_interval(values, seed=5, level=0.95)
    narrow = bootstrap_interval(values, seed=5, level=0.5)
    assert wide[0] < narrow[0] <= narrow[1] < wide[1]


def test_a_two_point_sample_spans_both_points():
    # Resamples of [0, 1] have means 0, 0.5 or 1 with probability 1/4, 1/2, 1/4: the
    # 2.5th and 97.5th percentiles are 0 and 1.
    assert bootstrap_interval([0.0, 1.0], seed=0) == [0.0, 1.0]


def test_ratio_of_means_pairs_prompts():
    full = [2.0, 4.0, 6.0]
    low, high = ratio_of_means_interval(full, [1.0, 2.0, 3.0], seed=0)
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)
    with pytest.raises(ValueError, match="denominator"):
        ratio_of_means_interval(full, [1.0], seed=0)


def test_interval_needs_values():
    with pytest.raises(ValueError, match="values"):
        bootstrap_interval([], seed=0)


def _measure(ttft_s: float, top1: float, kl: float = 0.0, f1: float = 1.0) -> RequestMeasure:
    return RequestMeasure(
        num_prompt_tokens=100,
        num_reused_tokens=80,
        num_hole_tokens=10,
        num_recomputed_tokens=20,
        ttft_s=ttft_s,
        request_s=ttft_s + 0.1,
        f1_vs_full=f1,
        top1_vs_full=top1,
        kl_vs_full=kl,
        gold_loss=1.0,
        f1_vs_gold=0.5,
        request_cpu_s=2 * ttft_s,
    )


def _measures():
    full = [_measure(3.0, 1.0), _measure(3.0, 1.0), _measure(3.0, 1.0)]
    kdev = [_measure(1.0, 1.0), _measure(1.0, 0.9), _measure(1.0, 1.0)]
    other = [_measure(1.2, 0.9), _measure(1.2, 0.8), _measure(1.2, 0.9, kl=0.3)]
    return {
        (*FULL_POINT, 2): full,
        ("hole", 0.15, "in-context", "kDeviation", 2): kdev,
        ("hole", 0.15, "in-context", "sinks:0.25+kDeviation@4", 2): other,
    }


def test_rows_carry_means_intervals_speedups_and_paired_differences():
    rows = quality_rows(_measures(), [2], workload="synthetic", seed=0)
    assert [(r["mode"], r["selection"]) for r in rows] == [
        ("full", None),
        ("hole", "kDeviation"),
        ("hole", "sinks:0.25+kDeviation@4"),
    ]
    full, kdev, other = rows
    assert full["speedup_vs_full"] == 1.0 and full["meets_goals"] is None
    assert kdev["speedup_vs_full"] == pytest.approx(3.0)
    assert kdev["speedup_request_vs_full"] == pytest.approx(3.1 / 1.1)
    assert kdev["speedup_request_cpu_vs_full"] == pytest.approx(3.0)
    assert kdev["speedup_request_cpu_vs_full_ci"] == pytest.approx([3.0, 3.0])
    assert kdev["top1_vs_full"] == pytest.approx(statistics.fmean([1.0, 0.9, 1.0]))
    low, high = kdev["top1_vs_full_ci"]
    assert 0.9 <= low <= kdev["top1_vs_full"] <= high <= 1.0
    assert kdev["top1_vs_full_diff"] == 0.0 and kdev["top1_vs_full_diff_ci"] == [0.0, 0.0]
    assert other["baseline_selection"] == "kDeviation"
    assert other["filter_layers"] == [4]
    # Paired: every prompt loses exactly 0.1 against kDeviation, so the interval is a point.
    assert other["top1_vs_full_diff"] == pytest.approx(-0.1)
    assert other["top1_vs_full_diff_ci"] == pytest.approx([-0.1, -0.1])
    assert other["kl_vs_full_diff"] == pytest.approx(0.1)
    assert other["ttft_vs_baseline"] == pytest.approx(1.2)
    assert other["request_cpu_s_vs_baseline"] == pytest.approx(1.2)
    assert other["per_prompt"]["top1_vs_full"] == [0.9, 0.8, 0.9]
    assert other["per_prompt"]["full_ttft_s"] == [3.0, 3.0, 3.0]
    for row in rows:
        assert (row["workload"], row["seed"], row["pass"]) == ("synthetic", 0, 2)


def test_a_row_of_one_prompt_has_no_intervals_and_still_plots(tmp_path):
    """Resampling one prompt gives the point itself, [x, x]: printed as an interval it
    would read as a certain result."""
    pytest.importorskip("matplotlib")
    measures = {key: value[:1] for key, value in _measures().items()}
    rows = quality_rows(measures, [2], workload="synthetic", seed=0)
    intervals = [key for key in rows[1] if key.endswith("_ci")]
    assert "top1_vs_full_ci" in intervals and "speedup_vs_full_ci" in intervals
    assert "top1_vs_full_diff_ci" in intervals
    for row in rows:
        assert row["num_prompts"] == 1
        assert all(row[key] is None for key in intervals if key in row)
    assert rows[1]["top1_vs_full"] == 1.0 and rows[1]["speedup_vs_full"] == pytest.approx(3.0)
    path = tmp_path / "one.png"
    plot_frontier(rows, path, "one prompt")
    assert path.read_bytes().startswith(b"\x89PNG")
    two = quality_rows(
        {key: value[:2] for key, value in _measures().items()}, [2], workload="synthetic", seed=0
    )
    assert all(isinstance(two[1][key], list) for key in intervals)


def test_a_check_layer_entry_runs_at_that_layer_and_says_so_in_its_row():
    measures = _measures()
    measures[("hole", 0.15, "in-context", "kDeviation@4#2", 2)] = measures.pop(
        ("hole", 0.15, "in-context", "sinks:0.25+kDeviation@4", 2)
    )
    rows = quality_rows(measures, [2], workload="synthetic", seed=0, check_layer=1)
    assert [(r["selection"], r["check_layer"]) for r in rows] == [
        (None, None), ("kDeviation", 1), ("kDeviation@4#2", 2)
    ]  # fmt: skip
    blend = _point_blend(BlendConfig(check_layer=1), "in-context", "kDeviation@4#2")
    assert (blend.selection, blend.filter_layers, blend.check_layer) == ("kDeviation", (4,), 2)
    plain = _point_blend(BlendConfig(check_layer=3), "in-context", "kvDeviation")
    assert (plain.check_layer, plain.filter_layers) == (3, ())


def test_times_not_measured_give_no_speedup():
    measures = {
        key: [dataclasses.replace(m, request_cpu_s=0.0) for m in value]
        for key, value in _measures().items()
    }
    _, kdev, _ = quality_rows(measures, [2], workload="synthetic", seed=0)
    assert kdev["speedup_request_cpu_vs_full"] is None
    assert kdev["request_cpu_s_vs_baseline_ci"] is None
    assert kdev["speedup_vs_full"] == pytest.approx(3.0)


def test_rows_need_the_same_prompts_as_full_prefill():
    measures = _measures()
    measures[("hole", 0.15, "in-context", "kDeviation", 2)].pop()
    with pytest.raises(ValueError, match="measures"):
        quality_rows(measures, [2], workload="synthetic", seed=0)


def test_goals_are_checked_on_the_means():
    row = {"speedup_request_vs_full": 2.6, "top1_vs_full": 0.98, "kl_vs_full": 0.02,
           "f1_vs_full": 0.9}  # fmt: skip
    assert meets_goals(row)
    assert not meets_goals({**row, "kl_vs_full": 0.031})
    assert not meets_goals({**row, "speedup_request_vs_full": 2.4})


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("kDeviation", ("kDeviation", (), None)),
        (" sinks:0.25+kDeviation ", ("sinks:0.25+kDeviation", (), None)),
        ("kDeviation@4", ("kDeviation", (4,), None)),
        ("query:0.3+kDeviation@4/8", ("query:0.3+kDeviation", (4, 8), None)),
        ("kvDeviation#2", ("kvDeviation", (), 2)),
        ("kDeviation@4/8#3", ("kDeviation", (4, 8), 3)),
    ],
)
def test_selection_entries_parse(entry, expected):
    assert parse_selection_entry(entry) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--selections", "kDev"], "selections: unknown strategy"),
        (["--selections", "kDeviation@x"], "selections: filter layers"),
        (["--selections", "kDeviation@1"], "above the check layer"),
        (["--selections", "kDeviation@6/4"], "strictly increasing"),
        (["--selections", "kDeviation@2#2"], "above the check layer 2"),
        (["--selections", "kDeviation#0"], "check layer after '#'"),
        (["--selections", "kDeviation#x"], "like 'kDeviation#2'"),
        (["--selections", "random,random"], "appears twice"),
        (["--selections", ","], "selections"),
        (["--quality", "--store-policies", "isolated"], "store_policies"),
    ],
)
def test_bad_selections_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        bench_config(parse_args(argv))


def test_quality_defaults_to_hole_mode_a_regrouped_first_pass_and_a_shared_store():
    config = bench_config(parse_args(["--quality", "--selections", "kDeviation,random"]))
    assert config.modes == ("hole",)
    assert config.selections == ("kDeviation", "random")
    assert config.workload.regroup_first_pass and config.shared_store
    plain = bench_config(parse_args(["--selection", "random"]))
    assert plain.selections == ("random",) and not plain.shared_store
    assert plain.modes == ("prefix", "hole")
    musique = parse_args(["--musique", "x.json"])
    assert musique.quality


def test_png_needs_the_quality_sweep(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--png", "x.png"])
    assert "--png" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--load", "--profile", "--sdpa-reference"])
def test_other_benchmarks_are_refused_with_the_quality_sweep(capsys, flag):
    with pytest.raises(SystemExit):
        parse_args(["--musique", "x.json", flag])
    assert f"{flag}: not part of the quality sweep" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", [["--inflate", "3"], ["--prompt-tokens", "4000"], ["--min-doc-tokens", "50"],
             ["--max-doc-tokens", "200"]],
)  # fmt: skip
def test_musique_refuses_the_flags_of_the_synthetic_documents(capsys, flag):
    """A MuSiQue file brings its own passages: these flags would change nothing in the run
    while its JSON recorded them."""
    with pytest.raises(SystemExit) as caught:
        parse_args(["--musique", "x.json", *flag])
    assert caught.value.code == 2
    error = capsys.readouterr().err
    assert f"{flag[0]}: shapes the synthetic documents" in error
    assert "run --quality without --musique" in error
    assert bench_config(parse_args(["--quality", *flag])).workload is not None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quality", "--musique-start", "50"], "--musique-start: picks the first MuSiQue item"),
        (["--quality", "--frontier-x", "request"], "--frontier-x: the x axis of the --png"),
    ],
)
def test_quality_flags_without_what_they_modify_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as caught:
        parse_args(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_musique_start_and_frontier_x_pass_with_what_they_modify():
    args = parse_args(
        ["--musique", "x.json", "--musique-start", "50", "--png", "q.png", "--frontier-x",
         "request"]
    )  # fmt: skip
    assert (args.musique_start, args.frontier_x) == (50, "request")


class _Store:
    def __init__(self):
        self.entries: set[str] = set()

    def keys(self):
        return set(self.entries)

    def remove(self, key):
        self.entries.discard(key)


class _Prompt:
    def __init__(self, documents):
        self.documents = tuple(documents)
        self.num_tokens = 10 * len(self.documents)


class _Prefill:
    def __init__(self, found: int):
        self.logits = torch.zeros(8)
        self.num_reused_tokens = 10 * found
        self.num_hole_tokens = self.num_recomputed_tokens = 0
        self.ttft_s = self.request_s = 0.01
        self.reuse = None  # nothing blended: no deviation to report


class _Engine:
    """Caches documents by text in a store it may share; logs what it is sent."""

    def __init__(self, name, store, log):
        self.name, self.store, self.log = name, store, log

    def build_prompt(self, system, documents, question):
        return _Prompt(documents)

    def prefill(self, prompt, mode, ratio):
        found = sum(d in self.store.entries for d in prompt.documents)
        self.log.append((self.name, mode, prompt.documents, found))
        if mode != "full":
            self.store.entries.update(prompt.documents)
        return _Prefill(found)

    def score(self, prefill, token_ids):
        return torch.zeros(len(token_ids), 8)

    def generate(self, prefill, max_new_tokens):
        return [1]

    def wait_for_stores(self, timeout=None):
        return True

    def store_stats(self):
        return types.SimpleNamespace(compute_s=0.0)

    def close(self):
        pass


class _Tokenizer:
    def encode(self, text):
        return [1, 2]

    def decode(self, token_ids):
        return "x"


def test_shared_store_runner_sends_pass_one_once_and_every_point_meets_the_same_cache():
    workload = WorkloadConfig(num_questions=3, num_documents=4, regroup_first_pass=True)
    config = BenchConfig(
        workload=workload, ratios=(0.15,), modes=("hole",), selections=("kDeviation", "random"),
        shared_store=True, max_new_tokens=1,
    )  # fmt: skip
    store, log = _Store(), []
    runner = BenchRunner(lambda _, entry: _Engine(entry, store, log), _Tokenizer(), config)
    prompts = generate_workload(workload)
    warm_up = generate_workload(dataclasses.replace(workload, seed=99))[0]
    measures, _ = runner.run_measures(prompts, show_progress=False, warm_up=warm_up)
    assert runner.passes == (2,)
    # Pass 1: 3 prompts x 3 cached documents, in groups of 3, sent once.
    assert runner.first_pass_record["num_documents"] == 9
    assert runner.first_pass_record["sent_to_engines"] == 1
    first_pass = [e for e in log if len(e[2]) == 3]
    assert len(first_pass) == 3 and all(found == 0 for *_, found in first_pass)
    full_prompts = {p.document_texts(without_holes=False) for p in prompts}
    blended = [(name, found) for name, mode, docs, found in log
               if mode == "hole" and docs in full_prompts]  # fmt: skip
    # Every blended send finds the 3 cached documents, never the hole another send stored,
    # and the warm-up's documents are gone again.
    assert len(blended) == 6 and {found for _, found in blended} == {3}
    assert not {d.text for d in warm_up.documents} & store.entries
    # The points' order rotates by one per prompt.
    order = [name for name, _ in blended]
    assert order == ["kDeviation", "random", "random", "kDeviation", "kDeviation", "random"]
    for selection in ("kDeviation", "random"):
        assert len(measures[("hole", 0.15, "in-context", selection, 2)]) == 3


def test_run_quality_pays_the_engines_start_up_warm_up_and_reports_it(monkeypatch):
    """As the plain bench does: on an accelerator the first call of every bucketed shape
    would otherwise land in the timed rows of whichever prompt reaches it first."""
    from holeblend_runtime.bench import cli

    store, log, warmed = _Store(), [], []

    class _Loaded(_Engine):
        def __init__(self, model, tokenizer, blend, store_=None, activity=None):
            super().__init__(blend.selection, store, log)
            self.activity = activity

        def warm_up(self):
            warmed.append(len(log))
            return 0.25

    shape = dict(num_layers=1, hidden_size=1, num_heads=1, num_kv_heads=1, head_dim=1,
                 intermediate_size=1, vocab_size=8)  # fmt: skip
    model = types.SimpleNamespace(
        config=types.SimpleNamespace(model_id="fake", **shape), device="cpu"
    )
    monkeypatch.setattr(cli, "load_model", lambda args: (model, _Tokenizer()))
    monkeypatch.setattr(cli, "BlendEngine", _Loaded)
    monkeypatch.setattr(cli, "LocalKVStore", lambda *args, **kwargs: store)
    args = parse_args(["--quality", "--questions", "2", "--documents", "3", "--ratios", "0.15",
                       "--max-new-tokens", "1", "--no-progress"])  # fmt: skip
    document = cli.run_quality(args)
    # Once, before any request was sent.
    assert warmed == [0]
    assert document["config"]["warm_up_s"] == 0.25
    first = document["config"]["first_pass"]
    assert first["regrouped"] and first["kept_predecessors"] == first["exact_prefixes"] == 0
    assert first["order"] in ("shuffle", "search")


def test_timings_include_building_the_prompt_the_user_waits_for():
    """Tokenizing the documents and question is on every request's path (the server builds
    each prompt before its prefill), for full prefill and blending alike: leaving it out of
    both clocks would make every speedup look larger than a user sees."""
    build_s = 0.05

    class _SlowBuild(_Engine):
        def build_prompt(self, system, documents, question):
            time.sleep(build_s)
            return _Prompt(documents)

    workload = WorkloadConfig(num_questions=2, num_documents=3)
    config = BenchConfig(workload=workload, ratios=(0.15,), modes=("hole",), max_new_tokens=1,
                         repeat=True)  # fmt: skip
    store, log = _Store(), []
    runner = BenchRunner(lambda _, entry: _SlowBuild(entry, store, log), _Tokenizer(), config)
    prompts = generate_workload(workload)
    warm_up = generate_workload(dataclasses.replace(workload, seed=99))[0]
    measures, _ = runner.run_measures(prompts, show_progress=False, warm_up=warm_up)
    assert {key[4] for key in measures} == {1, 2, 3}
    for key, rows in measures.items():
        for measure in rows:
            assert measure.ttft_s >= build_s, key
            assert measure.request_s >= measure.ttft_s, key


def test_a_prompts_build_time_leaves_out_tokenizing_the_gold_answer(monkeypatch):
    """The gold answer is the bench's yardstick, never part of a user's request: its
    tokenizing must not be charged to the build every mode's timings include."""
    from holeblend_runtime.bench import runner as runner_module

    clock = types.SimpleNamespace(now=0.0)
    clock.perf_counter = clock.process_time = lambda: clock.now

    class _TimedBuild(_Engine):
        def build_prompt(self, system, documents, question):
            clock.now += 0.25
            return _Prompt(documents)

    class _SlowGoldTokenizer(_Tokenizer):
        def encode(self, text):
            clock.now += 1.0
            return super().encode(text)

    monkeypatch.setattr(runner_module, "time", clock)
    workload = WorkloadConfig(num_questions=1, num_documents=3)
    config = BenchConfig(workload=workload, ratios=(0.15,), modes=("hole",), max_new_tokens=1)
    runner = BenchRunner(lambda _, entry: _TimedBuild(entry, _Store(), []), _SlowGoldTokenizer(),
                         config)  # fmt: skip
    [qa] = generate_workload(workload)
    request = runner.request(qa, pass_number=2)
    assert request.gold_ids == (1, 2)
    assert (request.build_s, request.build_cpu_s) == (0.25, 0.25)


# Store compute each blended send queues, done when the engine's stores are waited for.
STORE_S = 1.0


class _BackgroundEngine(_Engine):
    """Stores what it blends in the background, as the isolated policy does: a send queues
    `STORE_S` of compute, spent when the stores are waited for."""

    def __init__(self):
        super().__init__("isolated", _Store(), [])
        self.queued, self.compute_s = [], 0.0

    def prefill(self, prompt, mode, ratio):
        if mode != "full":
            self.queued.append(prompt.documents)
        return _Prefill(0)

    def wait_for_stores(self, timeout=None):
        for documents in self.queued:
            self.compute_s += STORE_S
            self.store.entries.update(documents)
        self.queued = []
        return True

    def store_stats(self):
        return types.SimpleNamespace(compute_s=self.compute_s)


def test_pass_three_reports_its_own_background_store_compute():
    """Each pass-3 send stores its segments again (what its pass-2 send stored is removed
    first): that compute belongs to pass 3's row, not added to pass 2's, or pass 2 looks
    twice as costly in the background and pass 3 free."""
    workload = WorkloadConfig(num_questions=2, num_documents=3)
    config = BenchConfig(workload=workload, ratios=(0.15,), modes=("hole",),
                         store_policies=("isolated",), max_new_tokens=1, repeat=True)  # fmt: skip
    runner = BenchRunner(lambda policy, entry: _BackgroundEngine(), _Tokenizer(), config)
    warm_up = generate_workload(WorkloadConfig(seed=99, num_questions=1, num_documents=3))[0]
    rows = runner.run(generate_workload(workload), show_progress=False, warm_up=warm_up)
    background = {row["pass"]: row["background_store_s_mean"] for row in rows
                  if row["mode"] == "hole"}  # fmt: skip
    assert background == {1: STORE_S, 2: STORE_S, 3: STORE_S}
