"""holeblend-bench: full prefill vs standard CacheBlend (prefix) vs hole mode.

On SmolLM2 (real weights) or a named model shape with random weights (`--model
llama-3-8b`), on any device (`--device cuda --dtype bfloat16`); clocks wait for the
device. Prints one table row per (mode, ratio, store policy, pass) and optionally writes
them as JSON; every row names the device, dtype and model shape, so a GPU run writes the
same JSON as a CPU run. With --load: one `holeblend-serve` per mode driven by concurrent
clients with a Zipf RAG stream; one row per mode. With --quality (synthetic documents) or
--musique FILE: the quality sweep over selection strategies and ratios on documents reused
in a new order next to new neighbours, with 95% bootstrap intervals and a frontier PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from holeblend_runtime.bench.device_timing import busy_share, sdpa_reference_s
from holeblend_runtime.bench.frontier import X_KEYS, plot_frontier
from holeblend_runtime.bench.load import LOAD_MODES, LOAD_RESULT_KEYS, LoadConfig, run_load
from holeblend_runtime.bench.load_workload import LoadWorkloadConfig, generate_load_workload
from holeblend_runtime.bench.musique import load_musique, musique_prompt, musique_workload
from holeblend_runtime.bench.quality_report import (
    GOALS,
    LEVEL,
    NUM_RESAMPLES,
    QUALITY_TABLE_KEYS,
    quality_rows,
)
from holeblend_runtime.bench.report import RESULT_KEYS, format_table, write_json
from holeblend_runtime.bench.runner import (
    BLEND_MODES,
    BenchConfig,
    BenchRunner,
    parse_selection_entry,
    regrouped_first_pass,
    shuffled_first_pass_record,
)
from holeblend_runtime.bench.workload import QAPrompt, WorkloadConfig, generate_workload
from holeblend_runtime.blend.config import (
    K_DEVIATION,
    KV_STORE_DTYPES,
    RANDOM,
    STORE_POLICIES,
    BlendConfig,
)
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.kv.store import LocalKVStore
from holeblend_runtime.model.gguf import load_model_files
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import PRESETS, preset_config, random_weights
from holeblend_runtime.model.tokenizer import TextTokenizer

# Settings a run uses unless the command line says otherwise; --quick swaps in the second.
DEFAULTS: dict[str, Any] = {
    "questions": 4,
    "documents": 10,
    "min_doc_tokens": 124,
    "max_doc_tokens": 181,
    "ratios": "0.05,0.15,0.3,0.5,1.0",
    "max_new_tokens": 20,
}
QUICK: dict[str, Any] = {
    "questions": 2,
    "documents": 6,
    "min_doc_tokens": 100,
    "max_doc_tokens": 140,
    "ratios": "0.15,1.0",
    "max_new_tokens": 16,
}
SELECTIONS = {"kdev": K_DEVIATION, K_DEVIATION: K_DEVIATION, "random": RANDOM}
SMOLLM2 = "smollm2"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Keys every result row gets besides RESULT_KEYS: what ran where.
ROW_CONTEXT_KEYS = ("device", "dtype", "model", "model_shape")
# Flags the load benchmark does not read (its servers run SmolLM2 on their own settings:
# holeblend-serve takes only --config, --host and --port), and flags only it reads.
OFFLINE_FLAGS = (
    "--questions", "--documents", "--inflate", "--holes", "--ratios", "--modes",
    "--store-policies", "--shuffle-first-pass", "--check-layer", "--selection",
    "--selections", "--threads", "--model", "--tokenizer", "--device", "--dtype",
    "--prompt-tokens", "--repeat", "--sdpa-reference", "--profile", "--profile-trace",
    "--store-gib", "--kv-store", "--kv-store-dtype", "--musique-start", "--frontier-x",
)  # fmt: skip
LOAD_FLAGS = (
    "--load-modes", "--load-ratio", "--clients", "--requests", "--warmup", "--blocks",
    "--corpus", "--request-documents", "--zipf", "--workdir",
)  # fmt: skip
# Flags of the synthetic documents that a MuSiQue file decides itself (its passages, their
# number and length).
SYNTHETIC_FLAGS = ("--inflate", "--prompt-tokens", "--min-doc-tokens", "--max-doc-tokens")
# Tokens of a prompt besides its documents (system prompt, question, chat template), and
# per document (separator): to aim --prompt-tokens.
_PROMPT_OVERHEAD_TOKENS = 60
_SEPARATOR_TOKENS = 4


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="holeblend-bench", description=__doc__, allow_abbrev=False
    )
    add = parser.add_argument
    add("--quick", action="store_true", help="small run (under 3 minutes on 2 CPU cores)")
    add(
        "--questions",
        type=int,
        help=f"prompts, one question each (default {DEFAULTS['questions']})",
    )
    add("--documents", type=int, help=f"documents per prompt (default {DEFAULTS['documents']})")
    add("--inflate", type=int, default=0, help="extra distractor documents per prompt")
    add("--min-doc-tokens", type=int, help=f"default {DEFAULTS['min_doc_tokens']}")
    add("--max-doc-tokens", type=int, help=f"default {DEFAULTS['max_doc_tokens']}")
    add("--holes", default="middle", help="documents left out of pass 1: middle, none, or '2,5'")
    add("--ratios", help=f"recompute ratios to sweep (default {DEFAULTS['ratios']})")
    add(
        "--modes",
        help=f"blend modes besides full prefill (default {','.join(BLEND_MODES)}; "
        "with --quality/--musique: hole)",
    )
    add(
        "--store-policies",
        default=BlendConfig.store_policy,
        help=f"store policies to sweep, some of {','.join(STORE_POLICIES)}",
    )
    add(
        "--shuffle-first-pass",
        action="store_true",
        help="send pass 1's documents in a seeded random order",
    )
    add("--check-layer", type=int, default=BlendConfig.check_layer, help="deviation check layer")
    add("--selection", choices=sorted(SELECTIONS), default="kdev", help="recompute selection")
    add(
        "--selections",
        help="selection strategies to sweep, comma-separated: names or budget mixes "
        "('kDeviation,sinks:0.25+kDeviation,random'), each optionally with '@4' or '@4/8' "
        "for filter layers and '#2' for its check layer (default: --selection alone, at "
        "--check-layer)",
    )
    add("--seed", type=int, default=0, help="workload (and random selection) seed, >= 0")
    add("--max-new-tokens", type=int, help=f"answer length (default {DEFAULTS['max_new_tokens']})")
    add("--threads", type=int, default=2, help="torch CPU threads")
    add(
        "--model",
        default=SMOLLM2,
        choices=[SMOLLM2, *sorted(PRESETS)],
        help="smollm2: SmolLM2-135M-Instruct's weights; else that shape with random weights",
    )
    add("--tokenizer", type=Path, help="tokenizer.json for prompts (default: SmolLM2's)")
    add("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, npu, ...")
    add("--dtype", choices=sorted(DTYPES), default="float32", help="weights and KV dtype")
    add(
        "--prompt-tokens",
        type=int,
        help="aim every prompt at about this many tokens (adds distractor documents)",
    )
    add(
        "--repeat",
        action="store_true",
        help="pass 3: pass 2's prompts again on the same cache state (shapes seen)",
    )
    add(
        "--sdpa-reference",
        action="store_true",
        help="also time a plain SDPA forward of the same weights on pass 2's prompts",
    )
    add("--profile", action="store_true", help="device busy share of one prefill per mode")
    add(
        "--profile-trace",
        type=Path,
        metavar="DIR",
        help="with --profile: write each profiled prefill's trace as DIR/MODE.json "
        "(Chrome trace format: chrome://tracing, ui.perfetto.dev)",
    )
    add("--store-gib", type=float, default=2.0, help="KV store size per engine, GiB")
    add(
        "--kv-store",
        choices=["device", "host"],
        default="device",
        help="keep stored KV where it was computed, or in (pinned) host memory",
    )
    add(
        "--kv-store-dtype",
        choices=KV_STORE_DTYPES,
        default="auto",
        help="the dtype the store holds KV in (blend.json kv.storeDtype; auto: the model's)",
    )
    add("--json", type=Path, help="write the results to this JSON file")
    load = parser.add_argument_group("load benchmark (--load)")
    load.add_argument("--load", action="store_true", help="drive holeblend-serve per mode")
    load.add_argument("--load-modes", default=",".join(LOAD_MODES), help="servers to drive")
    load.add_argument("--load-ratio", type=float, default=0.15, help="recompute ratio")
    load.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    load.add_argument("--requests", type=int, default=32, help="measured requests per mode")
    load.add_argument("--warmup", type=int, default=8, help="unmeasured requests first")
    load.add_argument("--blocks", type=int, default=4, help="rounds over the modes")
    load.add_argument("--corpus", type=int, default=40, help="documents in the corpus")
    load.add_argument("--request-documents", type=int, default=6, help="documents per request")
    load.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of popularity")
    load.add_argument("--workdir", type=Path, help="server configs and logs (default: temp)")
    quality = parser.add_argument_group("quality sweep (--quality, --musique)")
    quality.add_argument(
        "--quality",
        action="store_true",
        help="quality sweep on the synthetic documents: pass 1 regrouped (new order, new "
        "neighbours), one shared KV store, intervals over prompts",
    )
    quality.add_argument(
        "--musique",
        type=Path,
        metavar="FILE",
        help="quality sweep on MuSiQue questions from FILE (the bundled copy: "
        "runtime/bench/data/musique_s_dev.json); implies --quality",
    )
    quality.add_argument(
        "--musique-start",
        type=int,
        default=0,
        help="first MuSiQue item to use (a held-out run takes other questions)",
    )
    quality.add_argument("--png", type=Path, help="write the frontier plot to this PNG")
    quality.add_argument(
        "--frontier-x",
        choices=sorted(X_KEYS),
        default="ttft",
        help="x axis of the frontier: TTFT or call-to-return speedup over full prefill",
    )
    add("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    if args.load and (ignored := _given(parser, args, OFFLINE_FLAGS)):
        parser.error(
            f"{ignored[0]}: not read by the load benchmark (its servers run SmolLM2 on "
            "their own settings; its flags: --load-modes, --load-ratio, --clients, "
            "--requests, ...): drop it, or run without --load"
        )
    if not args.load and (ignored := _given(parser, args, LOAD_FLAGS)):
        parser.error(f"{ignored[0]}: a flag of the load benchmark; add --load")
    if args.musique is not None and (ignored := _given(parser, args, SYNTHETIC_FLAGS)):
        parser.error(
            f"{ignored[0]}: shapes the synthetic documents; a MuSiQue file brings its own "
            "passages: drop it, or run --quality without --musique"
        )
    if args.musique is None and _given(parser, args, ("--musique-start",)):
        parser.error("--musique-start: picks the first MuSiQue item; add --musique FILE")
    if args.png is None and _given(parser, args, ("--frontier-x",)):
        parser.error("--frontier-x: the x axis of the --png frontier plot; add --png FILE")
    if args.musique is not None:
        args.quality = True
    if args.modes is None:
        args.modes = "hole" if args.quality else ",".join(BLEND_MODES)
    if args.png is not None and not args.quality:
        parser.error("--png: the frontier plot belongs to the quality sweep; add --quality")
    if args.quality:
        others = [flag for flag, on in (("--load", args.load), ("--profile", args.profile),
                                        ("--sdpa-reference", args.sdpa_reference)) if on]  # fmt: skip
        if others:
            parser.error(f"{others[0]}: not part of the quality sweep; run it without --quality")
    if args.profile_trace is not None and not args.profile:
        parser.error("--profile-trace: traces the --profile prefills; add --profile")
    if args.threads < 1:
        parser.error(f"--threads: must be >= 1, got {args.threads}")
    if args.seed < 0:
        # random.Random(-7) draws what random.Random(7) draws: the same workload under
        # another name, which numpy's bootstrap would refuse only after the whole sweep.
        parser.error(f"--seed: must be >= 0, got {args.seed}")
    if not 0 < args.store_gib < math.inf:
        # int() of it raises only once the model is loaded (OverflowError for inf).
        parser.error(f"--store-gib: must be a positive number of GiB, got {args.store_gib}")
    if (problem := _device_problem(args.device)) is not None:
        parser.error(f"--device: {problem}")
    for flag, path in (("--json", args.json), ("--png", args.png)):
        if path is not None and (problem := _output_problem(path)) is not None:
            parser.error(f"{flag}: {problem}")
    if args.png is not None:  # before the sweep, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(
                "--png: the frontier plot needs matplotlib (pip install matplotlib, or "
                "holeblend's dev extra)"
            )
    preset = QUICK if args.quick else DEFAULTS
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _given(
    parser: argparse.ArgumentParser, args: argparse.Namespace, flags: Sequence[str]
) -> list[str]:
    """The `flags` set to other than their default: given on the command line."""
    dests = {flag: flag.removeprefix("--").replace("-", "_") for flag in flags}
    return [f for f, dest in dests.items() if getattr(args, dest) != parser.get_default(dest)]


def _device_problem(name: str) -> str | None:
    """Why torch cannot run on device `name`, or None: checked before anything loads."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        return f"{name!r} is not a torch device ({str(error).splitlines()[0]})"
    if device.type not in ("cuda", "npu"):
        return None
    backend = getattr(torch, device.type, None)  # torch.npu exists once torch_npu is loaded
    if backend is None or not backend.is_available():
        return f"{name!r}: no {device.type} device is available here"
    count = backend.device_count()
    if device.index is not None and device.index >= count:
        return f"{name!r}: this machine has {count} {device.type} device(s)"
    return None


def _output_problem(path: Path) -> str | None:
    """Why a file cannot be written at `path`, or None: checked before the run, which
    would otherwise find out only at its end, its results lost."""
    if path.is_dir():
        return f"{path} is a directory; name a file in it"
    existing = next(parent for parent in path.parents if parent.exists())
    if not existing.is_dir():
        return f"{existing} is not a directory"
    return None


def bench_config(args: argparse.Namespace) -> BenchConfig:
    workload = WorkloadConfig(
        seed=args.seed,
        num_questions=args.questions,
        num_documents=args.documents,
        num_inflate=_num_inflate(args),
        min_document_tokens=args.min_doc_tokens,
        max_document_tokens=args.max_doc_tokens,
        # A MuSiQue file decides the passages per prompt (--documents does not apply):
        # `quality_workload` checks --holes against each item's and records it.
        holes=args.holes if args.musique is None else "none",
        shuffle_first_pass=args.shuffle_first_pass,
        regroup_first_pass=args.quality,
    )
    return BenchConfig(
        workload=workload,
        ratios=_floats(args.ratios, "ratios"),
        modes=_names(args.modes),
        store_policies=_names(args.store_policies),
        max_new_tokens=args.max_new_tokens,
        repeat=args.repeat,
        selections=selections(args),
        shared_store=args.quality,
        check_layer=args.check_layer,
    )


def selections(args: argparse.Namespace) -> tuple[str, ...]:
    """--selections, or --selection alone."""
    if args.selections is None:
        return (SELECTIONS[args.selection],)
    entries = _names(args.selections)
    if not entries:
        raise ValueError(
            f"selections: expected comma-separated strategies, got {args.selections!r}"
        )
    return entries


def _num_inflate(args: argparse.Namespace) -> int:
    """Distractor documents: --inflate, or as many as --prompt-tokens needs."""
    if args.prompt_tokens is None:
        return args.inflate
    if args.prompt_tokens < 1:
        raise ValueError(f"prompt_tokens: must be >= 1, got {args.prompt_tokens}")
    per_document = (args.min_doc_tokens + args.max_doc_tokens) / 2 + _SEPARATOR_TOKENS
    wanted = round((args.prompt_tokens - _PROMPT_OVERHEAD_TOKENS) / per_document)
    return max(0, wanted - args.documents)


def load_model(args: argparse.Namespace) -> tuple[Llama, TextTokenizer]:
    """The model on --device in --dtype, and the tokenizer prompts are built with."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    if args.model == SMOLLM2:
        files = load_model_files()
        model = Llama(files.config, files.weights, device=device, dtype=dtype)
        return model, TextTokenizer(_tokenizer(args, files.tokenizer), files.config)
    config = preset_config(args.model)
    weights = random_weights(config, device, dtype, seed=args.seed)
    model = Llama(config, weights, device=device, dtype=dtype)
    del weights  # Llama keeps stacked copies; the loose ones would double the memory
    return model, TextTokenizer(_tokenizer(args), config)


def _tokenizer(args: argparse.Namespace, default: Tokenizer | None = None) -> Tokenizer:
    if args.tokenizer is not None:
        return Tokenizer.from_file(str(args.tokenizer))
    return default if default is not None else load_model_files().tokenizer


def row_context(args: argparse.Namespace, model: Llama) -> dict[str, Any]:
    """What every result row says about where it ran."""
    c = model.config
    shape = {
        name: getattr(c, name)
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size")
    }  # fmt: skip
    return {"device": str(model.device), "dtype": args.dtype, "model": args.model,
            "model_shape": shape}  # fmt: skip


def blend_config(args: argparse.Namespace) -> BlendConfig:
    return BlendConfig(
        check_layer=args.check_layer, selection=SELECTIONS[args.selection], seed=args.seed,
        kv_store_dtype=args.kv_store_dtype,
    )  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the bench; returns the JSON document (also written when --json is given)."""
    config, blend = bench_config(args), blend_config(args)
    started = time.perf_counter()
    model, tokenizer = load_model(args)
    loaded = BlendEngine(model, tokenizer, blend)
    # What a server pays at start-up (a no-op on the CPU): reported, not timed per request.
    warm_up_s = loaded.warm_up()
    store_bytes = int(args.store_gib * (1 << 30))

    def new_engine(store_policy: str, entry: str) -> BlendEngine:
        # Same weights, empty KV store: every sweep point starts cold. One activity for
        # all: a background store waits while any engine works.
        point_blend = _point_blend(blend, store_policy, entry)
        store = LocalKVStore(store_bytes, host_memory=args.kv_store == "host")
        return BlendEngine(model, tokenizer, point_blend, store, activity=loaded.activity)

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    workload = generate_workload(config.workload, count)
    # Warm-up on a prompt of the same size outside the workload: pass 2 then meets only
    # prompts whose shapes the machine has never seen.
    warm_up = generate_workload(dataclasses.replace(config.workload, seed=-1 - args.seed), count)
    runner = BenchRunner(new_engine, tokenizer, config)
    results = runner.run(workload, show_progress=not args.no_progress, warm_up=warm_up[0])
    context = row_context(args, model)
    results = [{**row, **context} for row in results]
    record = _config_record(config, blend, workload, runner, args)
    record["warm_up_s"] = warm_up_s
    # How pass 1 ordered each prompt's documents: as in the prompt, or (shuffled) so that
    # none follows what it follows in pass 2.
    record["first_pass"] = (
        shuffled_first_pass_record(workload, config.workload.seed)
        if config.workload.shuffle_first_pass
        else {"regrouped": False, "order": "prompt"}
    )
    if args.sdpa_reference:
        record["sdpa_reference"] = _sdpa_reference(model, runner, workload, warm_up[0])
    if args.profile:
        record["profile"] = _profile(new_engine, config, runner, workload[0], args.profile_trace)
    document = {"model": model.config.model_id, "config": record, "results": results}
    document["config"]["wall_s"] = time.perf_counter() - started
    if args.json is not None:
        write_json(args.json, document["model"], document["config"], results)
    return document


def _sdpa_reference(
    model: Llama, runner: BenchRunner, workload: Sequence[QAPrompt], warm_up: QAPrompt
) -> dict[str, Any]:
    """The plain SDPA forward on pass 2's prompts, each with its build time added as the
    engine rows' TTFT has it (`build_mean_s` says how much of the means that is)."""
    requests = [runner.request(qa, pass_number=2) for qa in workload]
    warm_prompt = runner.request(warm_up, pass_number=2).prompt
    prompts, build_s = [r.prompt for r in requests], [r.build_s for r in requests]
    return sdpa_reference_s(model, prompts, warm_prompt, build_s=build_s)


def _point_blend(blend: BlendConfig, store_policy: str, entry: str) -> BlendConfig:
    selection, filter_layers, check_layer = parse_selection_entry(entry)
    return dataclasses.replace(
        blend,
        store_policy=store_policy,
        selection=selection,
        filter_layers=filter_layers,
        check_layer=blend.check_layer if check_layer is None else check_layer,
    )


def quality_workload(
    args: argparse.Namespace, config: BenchConfig, count: Any
) -> tuple[str, BenchConfig, tuple[QAPrompt, ...], QAPrompt | None]:
    """(workload name, config, pass-2 prompts, warm-up prompt outside them)."""
    if args.musique is None:
        prompts = generate_workload(config.workload, count)
        warm = dataclasses.replace(config.workload, seed=-1 - args.seed, num_questions=1)
        return "synthetic", config, prompts, generate_workload(warm, count)[0]
    items = load_musique(args.musique)
    prompts = musique_workload(
        items,
        seed=args.seed,
        num_questions=args.questions,
        holes=args.holes,
        start=args.musique_start,
    )
    # The file decides the passages per prompt (--documents does not apply).
    workload = dataclasses.replace(
        config.workload, num_documents=len(prompts[0].documents), holes=args.holes
    )
    config = dataclasses.replace(config, workload=workload)
    # Warm up on an item outside the run (the one before it, or after it).
    used = range(args.musique_start, args.musique_start + len(prompts))
    outside = [i for i in (used.start - 1, used.stop) if 0 <= i < len(items)]
    warm_up = None
    if outside:
        index = outside[0]
        warm_up = musique_prompt(items[index], seed=-1 - args.seed, index=index, holes=args.holes)
    return f"musique:{args.musique.name}", config, prompts, warm_up


def run_quality(args: argparse.Namespace) -> dict[str, Any]:
    """The quality sweep; returns the JSON document (also written when --json is given)."""
    config, blend = bench_config(args), blend_config(args)
    started = time.perf_counter()
    model, tokenizer = load_model(args)

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    name, config, prompts, warm_up = quality_workload(args, config, count)
    loaded = BlendEngine(model, tokenizer, blend)
    # What a server pays at start-up (a no-op on the CPU), as in `run`: new shapes' first
    # calls then stay out of the timed rows.
    warm_up_s = loaded.warm_up()
    # One store for every sweep point (pass 1 goes once; each send's stores are removed
    # after it): big enough for every pass-1 document, --store-gib at least.
    first_pass = regrouped_first_pass(prompts, config.workload.seed)
    first_pass_tokens = sum(count(d) for r in first_pass for d in r.documents)
    c = model.config
    bytes_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * DTYPES[args.dtype].itemsize
    needed = int(1.25 * bytes_per_token * (first_pass_tokens + 4096))
    store_bytes = max(int(args.store_gib * (1 << 30)), needed)
    store = LocalKVStore(store_bytes, host_memory=args.kv_store == "host")

    def new_engine(store_policy: str, entry: str) -> BlendEngine:
        point_blend = _point_blend(blend, store_policy, entry)
        return BlendEngine(model, tokenizer, point_blend, store, activity=loaded.activity)

    runner = BenchRunner(new_engine, tokenizer, config)
    measures, _ = runner.run_measures(prompts, show_progress=not args.no_progress, warm_up=warm_up)
    context = row_context(args, model)
    rows = quality_rows(
        measures, runner.passes, workload=name, seed=args.seed, check_layer=config.check_layer
    )
    rows = [{**row, **context} for row in rows]
    record = _config_record(config, blend, prompts, runner, args)
    record.update(
        workload=name,
        musique_file=None if args.musique is None else str(args.musique),
        musique_start=None if args.musique is None else args.musique_start,
        first_pass=runner.first_pass_record,
        warm_up_s=warm_up_s,
        shared_store_bytes=store_bytes,
        bootstrap={"resamples": NUM_RESAMPLES, "level": LEVEL, "seed": args.seed},
        goals=GOALS,
        wall_s=time.perf_counter() - started,
    )
    if args.json is not None:
        write_json(args.json, model.config.model_id, record, rows)
    if args.png is not None:
        measured = [row for row in rows if row["pass"] == 2]
        title = f"{model.config.model_id}, {name}, seed {args.seed}, {len(prompts)} prompts"
        plot_frontier(measured, args.png, title, x=args.frontier_x)
    return {"model": model.config.model_id, "config": record, "results": rows}


def load_config(args: argparse.Namespace) -> LoadConfig:
    workload = LoadWorkloadConfig(
        seed=args.seed,
        num_corpus_documents=args.corpus,
        documents_per_request=args.request_documents,
        zipf_s=args.zipf,
        num_warmup=args.warmup,
        num_requests=args.requests,
        min_document_tokens=args.min_doc_tokens,
        max_document_tokens=args.max_doc_tokens,
    )
    return LoadConfig(
        workload=workload,
        modes=_names(args.load_modes),
        ratio=args.load_ratio,
        num_clients=args.clients,
        max_tokens=args.max_new_tokens,
        num_blocks=args.blocks,
    )


def run_load_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The load benchmark; returns the JSON document (also written when --json is given)."""
    config = load_config(args)
    started = time.perf_counter()
    files = load_model_files()
    tokenizer = TextTokenizer(files.tokenizer, files.config)
    requests = generate_load_workload(config.workload, lambda t: len(tokenizer.encode(t)))
    with tempfile.TemporaryDirectory(prefix="holeblend-load-") as temporary:
        workdir = args.workdir or Path(temporary)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run_load(config, requests, workdir, tokenizer.encode)
    record = {"load": dataclasses.asdict(config), "wall_s": time.perf_counter() - started}
    if args.json is not None:
        write_json(args.json, files.config.model_id, record, results)
    return {"model": files.config.model_id, "config": record, "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.load:
            document = run_load_bench(args)
        else:
            document = run_quality(args) if args.quality else run(args)
    except ValueError as error:
        print(f"holeblend-bench: {error}", file=sys.stderr)
        return 2
    print(f"model {document['model']}; ratio '-' = full prefill, nothing reused")
    keys = LOAD_RESULT_KEYS if args.load else RESULT_KEYS
    if args.quality:
        keys = QUALITY_TABLE_KEYS
    print(format_table(document["results"], keys))
    for path in (args.json, args.png):
        if path is not None:
            print(f"wrote {path}")
    return 0


def _config_record(
    config: BenchConfig,
    blend: BlendConfig,
    workload: Sequence[Any],
    runner: BenchRunner,
    args: argparse.Namespace,
) -> dict[str, Any]:
    prompt_lengths = [runner.request(qa, pass_number=2).prompt.num_tokens for qa in workload]
    return {
        "bench": config.to_dict(),
        "blend": dataclasses.asdict(blend),
        "quick": args.quick,
        "threads": args.threads,
        "num_prompt_tokens_full": prompt_lengths,
    }


def _profile(
    new_engine: Any,
    config: BenchConfig,
    runner: BenchRunner,
    qa: QAPrompt,
    trace_dir: Path | None = None,
) -> dict[str, Any]:
    """Device busy share of one pass-2 prefill per mode (after its pass 1), warm; each
    profiled prefill's trace written to `trace_dir`/MODE.json when given. Every engine it
    makes is closed when its mode is done (their background stores stop)."""

    def trace(mode: str) -> Path | None:
        return None if trace_dir is None else trace_dir / f"{mode}.json"

    def closing_engine() -> contextlib.closing[BlendEngine]:
        return contextlib.closing(new_engine(config.store_policies[0], config.selections[0]))

    ratio = config.ratios[0]
    first, second = (runner.request(qa, pass_number=p).prompt for p in (1, 2))
    shares: dict[str, Any] = {"ratio": ratio}
    with closing_engine() as full:
        shares["full"] = busy_share(lambda: full.prefill(second, "full", 1.0), trace=trace("full"))
    for mode in config.modes:
        with closing_engine() as blending:
            blending.prefill(first, mode, ratio)
            blending.wait_for_stores()
            snapshot = set(blending.store.keys())

            def send(
                engine: BlendEngine = blending, mode: str = mode, snapshot: set = snapshot
            ) -> None:
                engine.prefill(second, mode, ratio)
                for key in set(engine.store.keys()) - snapshot:
                    engine.store.remove(key)

            shares[mode] = busy_share(send, trace=trace(mode))
    return shares


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _floats(text: str, field: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{field}: expected comma-separated numbers, got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
