"""Which recompute ratio the pods run with: the spec's, or the tuner's derived from it."""

from holeblend_operator.api import BlendDeployment
from holeblend_operator.render import effective_recompute_ratio, render_children

SPEC = {
    "model": {"name": "m", "source": {"hub": {"id": "org/m"}}},
    "accelerator": {"type": "cpu", "count": 0},
    "blend": {"recomputeRatio": 0.15},
}


def _bd(status: dict, **spec_changes) -> BlendDeployment:
    spec = {**SPEC, **spec_changes}
    return BlendDeployment.model_validate(
        {"metadata": {"name": "r"}, "spec": spec, "status": status}
    )


def test_without_a_tuned_ratio_the_spec_ratio_applies():
    assert effective_recompute_ratio(_bd({})) == 0.15


def test_tuned_ratio_applies_while_it_derives_from_the_current_spec_ratio():
    status = {"recomputeRatio": 0.3, "tuning": {"baseRatio": 0.15}}
    assert effective_recompute_ratio(_bd(status)) == 0.3


def test_editing_the_spec_ratio_overrides_the_tuned_one():
    status = {"recomputeRatio": 0.3, "tuning": {"baseRatio": 0.15}}
    assert effective_recompute_ratio(_bd(status, blend={"recomputeRatio": 0.2})) == 0.2


def test_tuned_ratio_is_clamped_to_the_tuning_bounds():
    status = {"recomputeRatio": 0.9, "tuning": {"baseRatio": 0.15}}
    assert effective_recompute_ratio(_bd(status)) == 0.6


def test_disabled_tuning_ignores_the_tuned_ratio():
    status = {"recomputeRatio": 0.3, "tuning": {"baseRatio": 0.15}}
    assert effective_recompute_ratio(_bd(status, tuning={"enabled": False})) == 0.15


def test_runtime_config_carries_the_effective_ratio():
    status = {"recomputeRatio": 0.3, "tuning": {"baseRatio": 0.15}}
    config = next(c for c in render_children(_bd(status)) if c["kind"] == "ConfigMap")
    assert '"recomputeRatio": 0.3' in config["data"]["blend.json"]
