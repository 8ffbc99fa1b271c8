"""Conformal p-values against their definition, and the identity that makes them worth having: the
prediction set at any alpha is {y : p_y > alpha}, for every score, marginal and class-conditional."""

import math

import pytest
import torch

from dpsm_ray.cards import score_matrix, score_names
from dpsm_ray.conformal import (
    class_conformal_p_values, class_conformal_quantile, class_prediction_sets, conformal_p_values, conformal_quantile, label_scores,
    prediction_sets,
)


def slow_p_values(calibration, scores, tau=None):
    """(#{s_i > s} + tau (#{s_i = s} + 1)) / (n + 1), counted in Python."""
    out = torch.empty(scores.shape, dtype=torch.float64)
    for i in range(scores.shape[0]):
        t = 1.0 if tau is None else float(tau[i])
        for y in range(scores.shape[1]):
            s = scores[i, y].item()
            above = sum(c > s for c in calibration.tolist())
            equal = sum(c == s for c in calibration.tolist())
            out[i, y] = (above + t * (equal + 1)) / (len(calibration) + 1)
    return out


def eighths(generator, *shape):
    """Scores on a grid of eighths: plenty of ties, between calibration and test scores too."""
    return torch.randint(0, 8, shape, generator=generator).to(torch.float64) / 8


@pytest.mark.parametrize("smoothed", [False, True])
def test_p_values_match_the_definition_with_ties(smoothed):
    generator = torch.Generator().manual_seed(0)
    calibration, scores = eighths(generator, 25), eighths(generator, 30, 4)
    tau = torch.rand(30, generator=generator, dtype=torch.float64) if smoothed else None
    assert torch.allclose(conformal_p_values(calibration, scores, tau), slow_p_values(calibration, scores, tau), atol=1e-15, rtol=0)


def test_class_p_values_match_the_definition_class_by_class():
    generator = torch.Generator().manual_seed(2)
    calibration, scores = eighths(generator, 40), eighths(generator, 20, 4)
    labels = torch.tensor([0] * 25 + [1] * 12 + [2] * 3)  # class 3: no calibration point
    fast = class_conformal_p_values(calibration, labels, scores)
    for label in range(4):
        expected = slow_p_values(calibration[labels == label], scores[:, label : label + 1])
        assert torch.allclose(fast[:, label : label + 1], expected, atol=1e-15, rtol=0), label
    assert (fast[:, 3] == 1.0).all()


def probabilities(seed, n, k=5):
    """Softmax rows, some of them tied, with labels drawn from them."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n, k, generator=generator, dtype=torch.float64) * 2, dim=1)
    probs[: n // 10] = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1], dtype=torch.float64)  # a tenth of the rows identical, with ties
    labels = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    labels[labels == 4] = torch.where(torch.rand(int((labels == 4).sum()), generator=generator) < 0.9, 3, 4)  # class 4 is rare
    return probs, labels, torch.rand(n, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("kind", score_names())
def test_the_set_at_alpha_is_the_labels_whose_p_value_exceeds_alpha(kind):
    probs, labels, u = probabilities(4, 300)
    scores = score_matrix(probs, kind, u=u)
    cal, test = torch.arange(120), torch.arange(120, 300)
    cal_scores = label_scores(scores[cal], labels[cal])
    marginal = conformal_p_values(cal_scores, scores[test])
    per_class = class_conformal_p_values(cal_scores, labels[cal], scores[test])
    for alpha in (0.01, 0.05, 0.1, 0.2, 0.5, 0.9):  # at 0.01 every threshold is infinite; class 4 falls back at most alphas
        assert torch.equal(prediction_sets(scores[test], conformal_quantile(cal_scores, alpha)), marginal > alpha), (kind, alpha)
        class_q = class_conformal_quantile(cal_scores, labels[cal], 5, alpha)
        assert torch.equal(class_prediction_sets(scores[test], class_q), per_class > alpha), (kind, alpha)
    assert math.isinf(class_conformal_quantile(cal_scores, labels[cal], 5, 0.1)[4])  # the fallback was exercised


def test_smoothed_p_values_are_exactly_uniform_and_conservative_ones_are_not_below():
    # over many exchangeable draws the smoothed p-value of the true label is Unif(0, 1):
    # P(p <= alpha) = alpha; the conservative one is below it by at most 1/(n + 1)
    generator = torch.Generator().manual_seed(6)
    n, draws, alpha = 9, 20000, 0.25
    scores = torch.randint(0, 5, (draws, n + 1), generator=generator).to(torch.float64)  # heavy ties
    tau = torch.rand(draws, generator=generator, dtype=torch.float64)
    smoothed = torch.stack([conformal_p_values(row[:n], row[n:].reshape(1, 1), tau[i : i + 1]) for i, row in enumerate(scores)])
    plain = torch.stack([conformal_p_values(row[:n], row[n:].reshape(1, 1)) for row in scores])
    standard_error = (alpha * (1 - alpha) / draws) ** 0.5
    assert abs((smoothed <= alpha).double().mean().item() - alpha) < 4 * standard_error
    assert (plain <= alpha).double().mean().item() <= alpha + 4 * standard_error
    assert (plain >= smoothed).all()
