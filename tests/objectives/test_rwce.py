"""RWCE: each example's cross-entropy weighted by the rank of its true label to the power gamma."""

import math

import pytest
import torch
import torch.nn.functional as F

from dpsm_ray.cards import build_objective
from dpsm_ray.objectives import RankWeightedCE, true_label_rank

# Three classes, four examples (two in B1, two in B2), ranks of the true label by hand:
# [2, 1, 0] label 0 -> rank 1; [0, 3, 1] label 2 -> rank 2; [1, 2, 3] label 0 -> rank 3;
# [0.5, 0.5, 0] label 1 -> rank 1 (the label tied with it does not count against it).
LOGITS = [[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 2.0, 3.0], [0.5, 0.5, 0.0]]
LABELS = [0, 2, 0, 1]
RANKS = [1, 2, 3, 1]


def rwce(gamma):
    return build_objective("rwce", alpha=0.1, conformal_weight=0.5, rank_exponent=gamma)


def split(logits):
    return logits[:2], torch.tensor(LABELS[:2]), logits[2:], torch.tensor(LABELS[2:])


@pytest.mark.parametrize("gamma", [0.0, 1.0, 2.0])
def test_loss_and_gradient_by_hand(gamma):
    """L = mean_i r_i^gamma (log sum_k e^{z_ik} - z_iy), and dL/dz_i = r_i^gamma (p_i - e_y) / n:
    the rank is a weight, not differentiated."""
    logits = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    out = rwce(gamma)(*split(logits))
    ce = [math.log(sum(math.exp(v) for v in row)) - row[y] for row, y in zip(LOGITS, LABELS)]
    assert out.loss.item() == pytest.approx(sum(r**gamma * c for r, c in zip(RANKS, ce)) / 4, rel=1e-12)
    assert out.stats["ce"].item() == pytest.approx(sum(ce) / 4, rel=1e-12)
    assert out.stats["conformal"].item() == pytest.approx(sum(RANKS) / 4)  # the mean rank
    assert out.stats["upper"].item() == pytest.approx(out.loss.item())
    out.loss.backward()
    for i, (row, y, r) in enumerate(zip(LOGITS, LABELS, RANKS)):
        probabilities = [math.exp(v) / sum(math.exp(u) for u in row) for v in row]
        by_hand = [r**gamma * (p - (k == y)) / 4 for k, p in enumerate(probabilities)]
        assert logits.grad[i].tolist() == pytest.approx(by_hand, rel=1e-12, abs=1e-15), i


def test_gamma_zero_is_cross_entropy_and_the_rank_counts_only_larger_logits():
    logits = torch.tensor(LOGITS, dtype=torch.float64)
    assert true_label_rank(logits, torch.tensor(LABELS)).tolist() == RANKS
    assert rwce(0.0)(*split(logits)).loss.item() == pytest.approx(F.cross_entropy(logits, torch.tensor(LABELS)).item(), rel=1e-12)
    assert true_label_rank(torch.zeros(1, 5), torch.tensor([4])).tolist() == [1]  # all tied: first


def test_the_card_s_option_reaches_the_objective_and_a_negative_gamma_is_refused():
    objective = rwce(1.5)
    assert type(objective) is RankWeightedCE and objective.rank_exponent == 1.5 and not objective.uses_quantile
    with pytest.raises(ValueError, match="gamma"):
        rwce(-1.0)
