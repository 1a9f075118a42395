"""The budget-allocation study (devtools/budget_allocation.py) on hand-built curves."""

import json

import pytest

from holeblend_devtools.budget_allocation import evaluate, main

RATIOS = [0.1, 0.2, 0.4]


def _document(kl, top1, deviation, margins=None, selection="kvDeviation"):
    """A quality-bench JSON: per ratio (ascending) the per-prompt KL and top-1 (and the
    blended first token's margin, the same at every ratio, where given)."""
    tokens = [100] * len(deviation)
    rows = [{"mode": "full", "ratio": None, "selection": None, "per_prompt": {}}]
    for i, ratio in enumerate(RATIOS):
        rows.append({
            "mode": "hole", "ratio": ratio, "selection": selection, "check_layer": 2,
            "model_shape": {"num_layers": 30},
            "per_prompt": {
                # Cost in token-layers: 100 x 3 layers up to the check layer, then
                # ratio x 100 recomputed tokens x 27 layers.
                "num_recomputed_tokens": [round(ratio * 100)] * len(deviation),
                "kl_vs_full": [curve[i] for curve in kl],
                "top1_vs_full": [curve[i] for curve in top1],
                "deviation_mean": deviation,
                "num_prompt_tokens": tokens,
                "first_token_margin": margins,
            },
        })  # fmt: skip
    return {"results": rows}


# Prompt 0 is the sensitive one: its KL falls steeply with the ratio, and it deviates most.
KL = [[0.9, 0.5, 0.1], [0.1, 0.09, 0.08], [0.1, 0.09, 0.08]]
TOP1 = [[0.7, 0.8, 1.0], [0.95, 0.95, 0.96], [0.95, 0.95, 0.96]]


def test_the_oracle_and_a_predictive_deviation_move_budget_to_the_sensitive_prompt():
    result = evaluate(_document(KL, TOP1, [4.0, 1.0, 1.0]), ratio=0.2)
    policies = result["policies"]
    uniform = policies["uniform"]
    assert uniform["kl"] == pytest.approx((0.5 + 0.09 + 0.09) / 3)
    assert uniform["kl_diff"] == 0.0 and uniform["budget_spent"] == pytest.approx(1.0)
    for name in ("deviation^1", "oracle"):
        assert policies[name]["budget_spent"] == pytest.approx(1.0, abs=1e-3)
        assert policies[name]["kl"] < uniform["kl"] and policies[name]["top1"] > uniform["top1"]
    # The oracle gives the sensitive prompt the most it can within the budget: 0.4.
    assert policies["oracle"]["ratio_range"] == [0.1, 0.4]
    assert policies["oracle"]["kl"] == pytest.approx((0.1 + 0.1 + 0.1) / 3)
    assert result["correlation_with_kl"]["0.2"]["deviation_pearson"] > 0.9


def test_a_deviation_that_points_the_wrong_way_costs_quality():
    result = evaluate(_document(KL, TOP1, [1.0, 4.0, 4.0]), ratio=0.2)
    assert result["policies"]["deviation^1"]["kl_diff"] > 0
    assert result["correlation_with_kl"]["0.2"]["deviation_pearson"] < 0


def test_escalation_blends_the_unsure_prompt_again_within_the_budget():
    # Budget of ratio 0.3 (3 x 1,110 token-layers): all at 0.1 (3 x 570), then the least
    # sure prompt at 0.4 too (1,380 more); a second one would overspend.
    result = evaluate(_document(KL, TOP1, [1.0, 1.0, 1.0], margins=[0.1, 2.0, 3.0]), 0.3)
    policies = result["policies"]
    assert "escalate(0.1->0.4, 1)" in policies
    escalated = policies["escalate(0.1->0.4, 1)"]
    assert escalated["kl"] == pytest.approx(0.1) and escalated["budget_spent"] <= 1.0
    assert escalated["ratio_range"] == [0.1, 0.4]
    assert escalated["kl_diff"] < 0
    assert result["correlation_with_kl"]["0.1"]["margin_pearson"] < -0.9
    # Without margins there is no escalation row.
    plain = evaluate(_document(KL, TOP1, [1.0, 1.0, 1.0]), 0.3)["policies"]
    assert not any(name.startswith("escalate") for name in plain)


def test_bad_inputs_name_what_is_wrong(tmp_path, capsys):
    with pytest.raises(ValueError, match="deviation_mean"):
        evaluate(_document(KL, TOP1, [None, 1.0, 1.0]), ratio=0.2)
    old = _document(KL, TOP1, [4.0, 1.0, 1.0])
    del old["results"][2]["per_prompt"]["num_recomputed_tokens"]
    with pytest.raises(ValueError, match="num_recomputed_tokens"):
        evaluate(old, ratio=0.2)
    with pytest.raises(ValueError, match="--ratio"):
        evaluate(_document(KL, TOP1, [4.0, 1.0, 1.0]), ratio=0.5)
    mixed = _document(KL, TOP1, [4.0, 1.0, 1.0])
    mixed["results"][1]["selection"] = "kDeviation"
    with pytest.raises(ValueError, match="one hole-mode selection"):
        evaluate(mixed, ratio=0.2)
    path = tmp_path / "q.json"
    path.write_text(json.dumps(mixed))
    assert main([str(path)]) == 2
    assert "one hole-mode selection" in capsys.readouterr().err


def test_the_command_writes_json(tmp_path):
    source, out = tmp_path / "q.json", tmp_path / "out" / "alloc.json"
    source.write_text(json.dumps(_document(KL, TOP1, [4.0, 1.0, 1.0])))
    assert main([str(source), "--ratio", "0.2", "--json", str(out)]) == 0
    written = json.loads(out.read_text())[str(source)]
    assert set(written["policies"]) == {
        "uniform", "deviation^0.5", "deviation^1", "deviation^2", "oracle"
    }  # fmt: skip
