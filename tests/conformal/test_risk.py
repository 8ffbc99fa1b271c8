"""Conformal risk control for a class-weighted miss cost: lambda_hat against a slow reference and
split conformal, its guarantee on held-out points, and its edge cases."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from dpsm_ray.conformal.quantile import conformal_quantile
from dpsm_ray.conformal.risk import check_costs, crc_threshold, miss_cost

pytestmark = pytest.mark.quick


def reference(scores, labels, costs, level):
    """inf { lambda : n/(n+1) R_n(lambda) + B/(n+1) <= level } over the candidates, in rationals."""
    n = len(scores)
    w = [Fraction(repr(float(c))) for c in costs]
    bound, target = max(w), Fraction(repr(level))
    for candidate in sorted(set(scores)):
        risk = sum(w[y] for s, y in zip(scores, labels) if s > candidate) / Fraction(n)
        if Fraction(n, n + 1) * risk + bound / (n + 1) <= target:
            return candidate
    return math.inf


def test_by_hand():
    scores = torch.tensor([0.1, 0.4, 0.2, 0.9, 0.6], dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 1, 0])
    costs = torch.tensor([0.5, 1.0], dtype=torch.float64)
    # B = 1, n = 5: need cost above lambda <= 6 level - 1. Level 0.5: <= 2; above 0.4 lies 0.6 (0.5) and 0.9 (1.0): 1.5 <= 2,
    # above 0.2 also 0.4 (1.0): 2.5 > 2 -> lambda 0.4
    assert crc_threshold(scores, labels, costs, 0.5) == 0.4
    # level 0.3: <= 0.8; above 0.6 only 0.9 (1.0) > 0.8 -> lambda 0.9 (above it: nothing)
    assert crc_threshold(scores, labels, costs, 0.3) == 0.9
    # level 0.15: 6 x 0.15 = 0.9 < B = 1: not even lambda = inf qualifies with 5 points
    assert crc_threshold(scores, labels, costs, 0.15) == math.inf
    # level 0.9: <= 4.4: the smallest score qualifies (3.5 above it), and no smaller lambda is looked at
    assert crc_threshold(scores, labels, costs, 0.9) == 0.1


@pytest.mark.parametrize("seed", range(4))
def test_equals_the_slow_reference_with_ties(seed):
    generator = torch.Generator().manual_seed(seed)
    scores = (torch.rand(60, generator=generator, dtype=torch.float64) * 10).round() / 10  # many ties
    labels = torch.randint(0, 4, (60,), generator=generator)
    costs = torch.tensor([0.0, 0.3, 1.0, 0.55], dtype=torch.float64)
    for level in (0.02, 0.05, 0.1, 0.2, 0.4):
        assert crc_threshold(scores, labels, costs, level) == reference(scores.tolist(), labels.tolist(), costs.tolist(), level)


@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.3])
def test_every_cost_one_is_split_conformal(alpha):
    scores = torch.rand(97, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = torch.zeros(97, dtype=torch.int64)
    assert crc_threshold(scores, labels, torch.ones(1, dtype=torch.float64), alpha) == float(conformal_quantile(scores, alpha))


def test_the_expected_cost_is_at_most_the_level_on_held_out_points():
    """Over 400 random calibration/test splits of exchangeable points, the mean test miss cost is
    at most the level (E over calibration sets and test points: the theorem), within 3 standard errors."""
    generator = torch.Generator().manual_seed(7)
    n, k = 2000, 5
    logits = torch.randn(n, k, generator=generator, dtype=torch.float64) * 2
    probs = logits.softmax(dim=1)
    labels = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    scores = 1 - probs  # HPS
    costs = torch.tensor([1.0, 0.2, 0.2, 0.0, 0.6], dtype=torch.float64)
    level, costs_seen = 0.05, []
    for _ in range(400):
        order = torch.randperm(n, generator=generator)
        cal, test = order[:100], order[100:]
        lam = crc_threshold(scores[cal, labels[cal]], labels[cal], costs, level)
        costs_seen.append(float(miss_cost(scores[test] <= lam, labels[test], costs)))
    seen = torch.tensor(costs_seen)
    assert seen.mean() <= level + 3 * seen.std() / 20
    assert seen.mean() >= level - 0.02  # and not far below it: the control is tight (n = 100: within B / (n + 1) or so)


def test_bad_costs_and_levels_are_named():
    with pytest.raises(ValueError, match="one miss cost per class, 3 of them; got 2"):
        check_costs([0.5, 1.0], 3)
    with pytest.raises(ValueError, match="a miss cost must be in \\[0, 1\\]; class 1's is 1.5"):
        check_costs([0.5, 1.5, 0.0], 3)
    with pytest.raises(ValueError, match="every miss cost is 0"):
        check_costs([0.0, 0.0], 2)
    with pytest.raises(ValueError, match="level .* must be in the open interval"):
        crc_threshold(torch.zeros(3), torch.zeros(3, dtype=torch.int64), torch.ones(1), 1.0)
