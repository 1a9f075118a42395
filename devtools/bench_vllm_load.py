"""vLLM under load with and without the connector, driven by vLLM's own `vllm bench serve`:
`make bench-vllm-load` (writes out/vllm-load.json).

The stream: RAG prompts of about 1,900 tokens (a system prompt, documents drawn from a
corpus by Zipf popularity in a new order each time, the question; segments joined with
the separator the connector splits on), sent as text through vLLM's OpenAI completions API
by `vllm.benchmarks.serve` (`--dataset-name custom`, no chat template, stream order kept)
with a fixed number of concurrent clients, greedy answers of `--output-len` tokens (EOS
ignored). The same stream goes to two servers, one after the other (`vllm_server.serve`):

- `connector: false`: vLLM as users run it without holeblend (its own prefix caching on);
- `connector: true`: the connector as the operator renders a vLLM pod (hole mode, ratio
  `--ratio`, quality proxies off so that only the blend is measured), with a node KV tier
  of `--kv-tier-mib`, smaller than the corpus's KV, so that eviction shows; loads are
  stepwise, as by default (each blend spread over vLLM's steps);
- with `--blend-step-tokens N[,M...]`, one more connector arm per value: at most N tokens'
  worth of blend compute per step (`blend_step_tokens` in the row; 0: whole blends, each
  before its step's forward);
- with `--kv-admission A[,B...]`, one more connector arm per value of blend.json's
  `kv.admission` (`connector-always`: the node tier as plain LRU; `kv_admission` in the
  row; the `connector` arm has the operator's default, `frequency`);
- with `--kv-store-dtype D[,E...]`, one more connector arm per value of blend.json's
  `kv.storeDtype` (`connector-bfloat16`: the tiers hold the float32 model's KV in bfloat16,
  half the bytes per document; `connector-float8_e4m3fn`: a quarter; `kv_store_dtype` in
  the row; the `connector` arm has the default, `auto`).

`--connector-only` leaves vLLM alone out (reuse over a long stream needs no baseline; no
ratios then). `--windows W` sends the stream to each server in W consecutive parts and
adds each part's reuse to the row (`windows`): the tier's warm-up, then its steady state
under eviction (`num_stored_segments` against `num_tier_segments`, the segments the tier
still holds at the end).

One row per arm: requests/s, TTFT p50/p99, inter-token latency p50/p99 (every request's, so
those decoding while another request's prefill, blend or store runs), call-to-return mean,
and for the connector the shares of prompt tokens reused, recomputed and in holes (its
Prometheus counters). In vLLM a request returns with its last token (vLLM's own figures
have call-to-return = TTFT + (tokens - 1) x time per output token by definition), so what
the connector's stores cost shows in the steps they run in: the inter-token latency of the
requests decoding then. `ratios` compares the first connector arm with vLLM alone,
`ratios_by_arm` every connector arm (by name). vLLM's own result JSON of each arm is
kept next to it.

Runs in the vLLM environment (`.venv-vllm`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from holeblend_contract.blend_settings import Admission, KVStoreDtype
from holeblend_devtools.hf_export import export_smollm2
from holeblend_devtools.vllm_probe import SEPARATOR
from holeblend_devtools.vllm_server import MODEL, Server, serve
from holeblend_runtime.bench.load_workload import LoadWorkloadConfig, generate_load_workload
from holeblend_runtime.bench.shadow_load import metric_total
from holeblend_runtime.model.gguf import load_model_files

# SmolLM2 in float32 takes 46 KB of KV per token: 4 clients x ~2,100 tokens fit in 512 MiB.
KV_CACHE_BYTES = 512 << 20
MAX_MODEL_LEN = 2560
PERCENTILES = "50,99"


def build_prompts(config: LoadWorkloadConfig) -> tuple[list[str], list[int]]:
    """The stream as prompt texts and their token counts; each is checked to split into
    its segments."""
    tokenizer = load_model_files().tokenizer
    separator = tokenizer.encode(SEPARATOR, add_special_tokens=False).ids

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    prompts, lengths = [], []
    for request in generate_load_workload(config, count):
        parts = [request.system, *request.documents, request.question]
        text = SEPARATOR.join(parts)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        found = sum(ids[i : i + len(separator)] == separator for i in range(len(ids)))
        if found != len(parts) - 1:
            raise ValueError(
                f"request {request.index}: the separator splits it into {found + 1} "
                f"segments, not {len(parts)}"
            )
        prompts.append(text)
        lengths.append(len(ids))
    return prompts, lengths


def write_parts(prompts: list[str], num_parts: int, work_dir: Path) -> list[tuple[Path, int]]:
    """The stream in `num_parts` consecutive datasets of near-equal size: (path, size)."""
    bounds = [round(i * len(prompts) / num_parts) for i in range(num_parts + 1)]
    parts = []
    for index, (start, end) in enumerate(itertools.pairwise(bounds)):
        dataset = work_dir / f"prompts-{index}.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[start:end]))
        parts.append((dataset, end - start))
    return parts


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's figures over several consecutive parts of one stream, from their per-request
    lists (percentiles as vLLM computes them); one part: its own result."""
    import numpy as np

    if len(results) == 1:
        return results[0]
    done = [
        (ttft, itl, latency, out)
        for r in results
        for ttft, itl, latency, out, error in zip(
            r["ttfts"], r["itls"], r["latencies"], r["output_lens"], r["errors"], strict=True
        )
        if not error
    ]
    duration = sum(r["duration"] for r in results)
    ttfts = [d[0] * 1e3 for d in done]
    itls = [gap * 1e3 for d in done for gap in d[1]]
    tpots = [(d[2] - d[0]) * 1e3 / (d[3] - 1) for d in done if d[3] > 1]
    return {
        "completed": len(done),
        "failed": sum(r.get("failed", 0) for r in results),
        "request_throughput": len(done) / duration,
        "output_throughput": sum(d[3] for d in done) / duration,
        "p50_ttft_ms": float(np.percentile(ttfts, 50)),
        "p99_ttft_ms": float(np.percentile(ttfts, 99)),
        "mean_ttft_ms": float(np.mean(ttfts)),
        "p50_itl_ms": float(np.percentile(itls, 50)) if itls else 0.0,
        "p99_itl_ms": float(np.percentile(itls, 99)) if itls else 0.0,
        "mean_tpot_ms": float(np.mean(tpots)) if tpots else 0.0,
        "mean_e2el_ms": float(np.mean([d[2] * 1e3 for d in done])),
    }


def run_arm(
    server: Server,
    dataset: Path,
    args: argparse.Namespace,
    result_dir: Path,
    name: str,
    num_requests: int,
    detailed: bool = False,
) -> dict[str, Any]:
    """`vllm bench serve` against the server; vLLM's result dict (also saved)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    bench_args = parser.parse_args(
        [
            "--backend", "vllm", "--base-url", server.url, "--endpoint", "/v1/completions",
            "--model", MODEL, "--tokenizer", str(export_smollm2()),
            "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--custom-output-len", str(args.output_len), "--skip-chat-template",
            "--disable-shuffle", "--num-prompts", str(num_requests),
            "--max-concurrency", str(args.concurrency), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
            "--save-result", "--result-dir", str(result_dir),
            "--result-filename", f"vllm-bench-{name}.json", "--seed", str(args.seed),
        ]
    )  # fmt: skip
    # Per-request lists (TTFTs, inter-token gaps), to merge several parts of one stream.
    bench_args.save_detailed = detailed
    return main(bench_args)


def row(
    result: dict[str, Any],
    connector: bool,
    reuse: dict[str, float],
    blend_step_tokens: int | None = None,
) -> dict:
    request_s = result["mean_e2el_ms"] / 1e3
    return {
        "connector": connector,
        "blend_step_tokens": blend_step_tokens,
        "num_requests": result["completed"],
        "num_failed": result.get("failed", 0),
        "requests_per_s": result["request_throughput"],
        "output_tokens_per_s": result["output_throughput"],
        "ttft_p50_s": result["p50_ttft_ms"] / 1e3,
        "ttft_p99_s": result["p99_ttft_ms"] / 1e3,
        "ttft_mean_s": result["mean_ttft_ms"] / 1e3,
        "itl_p50_s": result["p50_itl_ms"] / 1e3,
        "itl_p99_s": result["p99_itl_ms"] / 1e3,
        "tpot_mean_s": result["mean_tpot_ms"] / 1e3,
        "request_s_mean": request_s,
        **reuse,
    }


TOKEN_COUNTERS = ("prompt", "reused", "recomputed", "hole")


def reuse_totals(server: Server) -> dict[str, float]:
    """The connector's token counters (prompt, reused, recomputed, hole) so far."""
    samples = server.samples()
    return {
        name: metric_total(samples, f"holeblend_{name}_tokens_total") for name in TOKEN_COUNTERS
    }


def shares(totals: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Shares of the prompt tokens reused, recomputed and in holes since `before`."""
    delta = {name: totals[name] - before.get(name, 0.0) for name in TOKEN_COUNTERS}
    prompt = delta["prompt"]
    return {f"{name}_share": delta[name] / prompt if prompt else 0.0 for name in TOKEN_COUNTERS[1:]}


def reuse_figures(server: Server) -> dict[str, float]:
    """The connector's counters: prompt tokens reused, recomputed, holes; failures."""
    samples = server.samples()
    return shares(reuse_totals(server), {}) | {
        "num_load_failures": metric_total(samples, "holeblend_load_failures_total"),
        "num_store_failures": metric_total(samples, "holeblend_store_failures_total"),
        "num_stored_segments": metric_total(samples, "holeblend_stored_segments_total"),
        "num_refused_segments": metric_total(samples, "holeblend_kv_store_refused_total"),
    }


def tier_figures(kv_dir: Path) -> dict[str, float]:
    """The node tier at the end: segments it holds (fewer than stored: evicted)."""
    return {"num_tier_segments": len(list(kv_dir.glob("*.safetensors")))}


def ratios(rows: list[dict]) -> dict[str, float]:
    """With the connector against without: the issue's figures as ratios (> 1 is better,
    except `itl_p99` and `request_s_mean`, where <= 1.25 / the lower the better)."""
    without, with_ = (next(r for r in rows if r["connector"] is c) for c in (False, True))
    return compare(without, with_)


def compare(without: dict, with_: dict) -> dict[str, float]:
    return {
        "requests_per_s": with_["requests_per_s"] / without["requests_per_s"],
        "ttft_p50_lower_by": without["ttft_p50_s"] / with_["ttft_p50_s"],
        "itl_p99": with_["itl_p99_s"] / without["itl_p99_s"],
        "request_s_mean": with_["request_s_mean"] / without["request_s_mean"],
    }


@dataclass(frozen=True)
class Arm:
    """One server of the comparison; None: the deployment's default."""

    name: str
    connector: bool = True
    step_tokens: int | None = None  # blend_step_tokens
    admission: str | None = None  # kv.admission
    store_dtype: str | None = None  # kv.storeDtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", type=int, default=40, help="documents in the corpus")
    parser.add_argument("--documents", type=int, default=8, help="documents per request")
    parser.add_argument("--kv-tier-mib", type=int, default=200, help="the node KV tier")
    parser.add_argument("--work-dir", type=Path, default=Path("out/vllm-load"))
    parser.add_argument("--json", type=Path, default=Path("out/vllm-load.json"))
    parser.add_argument(
        "--blend-step-tokens", default="",
        help="comma-separated budgets: one more connector arm each, with stepwise loads",
    )  # fmt: skip
    parser.add_argument(
        "--kv-admission", default="",
        help="comma-separated kv.admission values (frequency, always): one more connector arm each",
    )  # fmt: skip
    parser.add_argument(
        "--kv-store-dtype", default="",
        help="comma-separated kv.storeDtype values (bfloat16, float16, float8_e4m3fn): one more connector arm each",
    )  # fmt: skip
    parser.add_argument("--connector-only", action="store_true", help="no vLLM-alone arm")
    parser.add_argument("--windows", type=int, default=1, help="stream parts, reuse of each")
    args = parser.parse_args(argv)
    if not 1 <= args.windows <= args.num_requests:
        parser.error(f"--windows: must be between 1 and --num-requests, got {args.windows}")
    step_budgets = [int(value) for value in args.blend_step_tokens.split(",") if value]
    admissions = [value for value in args.kv_admission.split(",") if value]
    for value in admissions:
        if value not in {a.value for a in Admission}:
            parser.error(f"--kv-admission: expected frequency or always, got {value!r}")
    store_dtypes = [value for value in args.kv_store_dtype.split(",") if value]
    for value in store_dtypes:
        if value not in {d.value for d in KVStoreDtype}:
            parser.error(
                f"--kv-store-dtype: expected one of {', '.join(d.value for d in KVStoreDtype)}, "
                f"got {value!r}"
            )
    workload = LoadWorkloadConfig(
        seed=args.seed, num_corpus_documents=args.corpus, documents_per_request=args.documents,
        num_warmup=0, num_requests=args.num_requests,
        min_document_tokens=200, max_document_tokens=260,
    )  # fmt: skip
    prompts, lengths = build_prompts(workload)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    parts = write_parts(prompts, args.windows, args.work_dir)
    started = time.perf_counter()
    rows = []
    arms = [] if args.connector_only else [Arm("plain", connector=False)]
    arms += [Arm("connector")]
    arms += [Arm(f"connector-step{n}", step_tokens=n) for n in step_budgets]
    arms += [Arm(f"connector-{a}", admission=a) for a in admissions]
    arms += [Arm(f"connector-{d}", store_dtype=d) for d in store_dtypes]
    for arm in arms:
        name, connector = arm.name, arm.connector
        with serve(
            args.work_dir / name, args.ratio, quality_proxies=False, connector=connector,
            kv_cache_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
            kv_tier_bytes=args.kv_tier_mib << 20, blend_step_tokens=arm.step_tokens,
            kv_admission=arm.admission, kv_store_dtype=arm.store_dtype,
        ) as server:  # fmt: skip
            results, windows, before = [], [], {}
            for index, (dataset, size) in enumerate(parts):
                part = f"{name}-{index}" if len(parts) > 1 else name
                detailed = len(parts) > 1
                results.append(run_arm(server, dataset, args, args.work_dir, part, size, detailed))
                if connector:
                    totals = reuse_totals(server)
                    windows.append({"num_requests": size} | shares(totals, before))
                    before = totals
            reuse = (
                reuse_figures(server) | tier_figures(args.work_dir / name / "kv")
                if connector
                else {}
            )
        result = merge(results)
        extra = {"windows": windows} if connector and len(parts) > 1 else {}
        extra |= {"kv_admission": arm.admission or Admission.FREQUENCY.value} if connector else {}
        extra |= {"kv_store_dtype": arm.store_dtype or KVStoreDtype.AUTO.value} if connector else {}
        rows.append(row(result, connector, reuse, arm.step_tokens) | {"arm": name} | extra)
        print(json.dumps(rows[-1]), flush=True)
    document = {
        "config": vars(args) | {"json": str(args.json), "work_dir": str(args.work_dir)},
        "prompt_tokens_mean": sum(lengths) / len(lengths),
        "rows": rows,
        "wall_s": time.perf_counter() - started,
    }
    if not args.connector_only:
        document["ratios"] = ratios(rows)
        document["ratios_by_arm"] = {r["arm"]: compare(rows[0], r) for r in rows[1:]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document.get("ratios", rows[-1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
