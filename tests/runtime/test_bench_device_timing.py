"""holeblend-bench's device figures (`--sdpa-reference`, `--profile`) on a tiny random-weight
model on the CPU: which calls they make and what they leave behind, not how long they take."""

import dataclasses
import threading

import pytest

from holeblend_runtime.bench import device_timing
from holeblend_runtime.bench.cli import _profile, bench_config, parse_args
from holeblend_runtime.bench.runner import BenchRunner
from holeblend_runtime.bench.workload import generate_workload
from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.prompt import PromptBuilder
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.kv.store import LocalKVStore
from holeblend_runtime.kv.store_worker import Activity
from holeblend_runtime.model.gguf import load_model_files
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import random_weights
from holeblend_runtime.model.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tiny():
    """Four layers of width 64 with SmolLM2's vocabulary, and its tokenizer."""
    files = load_model_files()
    config = dataclasses.replace(
        files.config, model_id="tiny", num_layers=4, hidden_size=64, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=96,
    )  # fmt: skip
    return Llama(config, random_weights(config)), TextTokenizer(files.tokenizer, config)


def test_the_sdpa_reference_warms_up_untimed_before_timing_each_prompt_twice(tiny, monkeypatch):
    model, tokenizer = tiny
    builder = PromptBuilder(tokenizer, BlendConfig().separator, 8)
    warm, short, long = (
        builder.build("Answer briefly.", ["A river runs north. " * n], "Where does it run?")
        for n in (2, 3, 5)
    )
    calls, timing = [], []
    forward, timed = device_timing.plain_forward, device_timing._timed

    def counting_forward(model, token_ids):
        calls.append((token_ids.shape[0], bool(timing)))
        return forward(model, token_ids)

    def counting_timed(device, run):
        timing.append(run)
        try:
            return timed(device, run)
        finally:
            timing.pop()

    monkeypatch.setattr(device_timing, "plain_forward", counting_forward)
    monkeypatch.setattr(device_timing, "_timed", counting_timed)
    # (prompt length, timed) of each forward. Without a warm-up prompt the first prompt is
    # the warm-up: once untimed, then timed twice.
    device_timing.sdpa_reference_s(model, [short])
    assert calls == [(short.num_tokens, False), (short.num_tokens, True), (short.num_tokens, True)]
    calls.clear()
    # With the bench's warm-up prompt: it once, untimed, then each prompt's first call (on
    # its new shape) and again, both timed.
    result = device_timing.sdpa_reference_s(model, [short, long], warm)
    assert calls == [
        (warm.num_tokens, False),
        (short.num_tokens, True), (short.num_tokens, True),
        (long.num_tokens, True), (long.num_tokens, True),
    ]  # fmt: skip
    assert result["num_prompts"] == 2 and result["ttft_mean_s"] > 0


def test_the_sdpa_reference_adds_each_prompts_build_time_as_the_engine_rows_do(tiny):
    """The engine rows' TTFT starts when building the prompt starts: a reference of the
    forward alone would make full prefill look slower against it than it is."""
    model, tokenizer = tiny
    builder = PromptBuilder(tokenizer, BlendConfig().separator, 8)
    short, long = (
        builder.build("Answer briefly.", ["A river runs north. " * n], "Where does it run?")
        for n in (2, 5)
    )
    result = device_timing.sdpa_reference_s(model, [short, long], build_s=[10.0, 20.0])
    assert result["build_mean_s"] == 15.0
    assert result["ttft_mean_s"] > 15.0 and result["ttft_seen_mean_s"] > 15.0
    with pytest.raises(ValueError, match="build_s: 1 values for 2 prompts"):
        device_timing.sdpa_reference_s(model, [short, long], build_s=[1.0])


def test_the_bench_times_the_sdpa_reference_with_its_prompts_build(tiny):
    from holeblend_runtime.bench.cli import _sdpa_reference

    model, tokenizer = tiny
    args = parse_args(
        ["--questions", "2", "--documents", "2", "--min-doc-tokens", "20", "--max-doc-tokens",
         "30", "--no-progress"]
    )  # fmt: skip
    config = bench_config(args)
    runner = BenchRunner(
        lambda policy, entry: BlendEngine(model, tokenizer, BlendConfig()), tokenizer, config
    )
    workload = generate_workload(config.workload, lambda text: len(tokenizer.encode(text)))
    warm_up = generate_workload(dataclasses.replace(config.workload, seed=99))[0]
    result = _sdpa_reference(model, runner, workload, warm_up)
    assert result["num_prompts"] == 2
    assert 0.0 < result["build_mean_s"] < result["ttft_mean_s"]
    runner.engine.close()


class CountingEngine(BlendEngine):
    """A real engine that counts its `close` calls."""

    num_closes = 0

    def close(self) -> None:
        self.num_closes += 1
        super().close()


def test_profile_closes_every_engine_it_makes(tiny):
    model, tokenizer = tiny
    args = parse_args(
        ["--questions", "1", "--documents", "3", "--min-doc-tokens", "20", "--max-doc-tokens",
         "30", "--ratios", "0.5", "--store-policies", "isolated", "--no-progress"]
    )  # fmt: skip
    config = bench_config(args)
    activity = Activity()  # shared, as the bench's engines share one
    engines = []

    def new_engine(store_policy: str, entry: str) -> BlendEngine:
        blend = BlendConfig(store_policy=store_policy, selection=entry)
        engine = CountingEngine(model, tokenizer, blend, LocalKVStore(1 << 26), activity=activity)
        engines.append(engine)
        return engine

    runner = BenchRunner(new_engine, tokenizer, config)  # makes its own reference engine
    [qa] = generate_workload(config.workload, lambda text: len(tokenizer.encode(text)))
    engines.clear()
    before = set(threading.enumerate())
    shares = _profile(new_engine, config, runner, qa)
    assert set(shares) == {"ratio", "full", *config.modes}
    # Full prefill's engine and one per mode, each closed once; the blending ones' background
    # store threads (isolated policy) are gone with them.
    assert len(engines) == 1 + len(config.modes)
    assert [engine.num_closes for engine in engines] == [1] * len(engines)
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
