"""`holeblend_runtime.quality.scores` on distributions that rule tokens out (probability
0, logit -inf): a masked vocabulary or a certain model."""

import math

import pytest
import torch

from holeblend_runtime.quality.scores import kl_divergence


def test_kl_counts_nothing_for_a_token_the_reference_rules_out():
    certain = torch.tensor([[1.0, 0.0], [0.5, 0.5]]).log()
    unsure = torch.tensor([[0.9, 0.1], [0.5, 0.5]]).log()
    kl = kl_divergence(certain, unsure)
    assert kl.tolist() == [pytest.approx(math.log(1 / 0.9)), pytest.approx(0.0)]
    masked = torch.tensor([[0.0, 1.0, -math.inf]])  # the same token masked in both
    assert kl_divergence(masked, masked).item() == pytest.approx(0.0)


def test_kl_is_infinite_where_the_candidate_rules_out_a_token_the_reference_expects():
    certain = torch.tensor([[1.0, 0.0]]).log()
    unsure = torch.tensor([[0.9, 0.1]]).log()
    assert kl_divergence(unsure, certain).item() == math.inf
