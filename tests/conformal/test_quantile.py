import math

import pytest
import torch

from dpsm_ray.conformal import (
    class_conformal_quantile,
    conformal_quantile,
    conformal_rank,
    empirical_quantile,
    empirical_rank,
    hard_batch_quantile,
    pinball_grad,
    pinball_loss,
    prediction_sets,
    smooth_quantile,
    soft_sort,
)

TENTHS = torch.arange(1, 11, dtype=torch.float64) / 10  # 0.1, 0.2, ..., 1.0


@pytest.mark.parametrize(
    "alpha,expected",
    [
        (0.1, 1.0),  # ceil(11 * 0.9) = ceil(9.9) = 10
        (0.2, 0.9),  # ceil(8.8) = 9
        (0.5, 0.6),  # ceil(5.5) = 6
        (0.9, 0.2),  # ceil(1.1) = 2
        (0.95, 0.1),  # ceil(0.55) = 1
    ],
)
def test_conformal_quantile_by_hand(alpha, expected):
    shuffled = TENTHS[torch.randperm(10, generator=torch.Generator().manual_seed(0))]
    assert conformal_quantile(shuffled, alpha).item() == pytest.approx(expected)


def test_rank_is_exact_where_float_arithmetic_rounds_up():
    # (9 + 1) * (1 - 0.7) is 3.0000000000000004 in floats; the exact rank is 3
    assert conformal_rank(9, 0.7) == 3
    assert conformal_rank(9, 0.1) == 9
    assert conformal_rank(4, 0.2) == 4


def test_fewer_points_than_one_over_alpha_gives_infinite_quantile_and_full_sets():
    scores = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.3])
    q = conformal_quantile(scores, 0.1)  # rank ceil(6 * 0.9) = 6 > 5
    assert math.isinf(q.item()) and q.item() > 0
    sets = prediction_sets(torch.rand(4, 7) * 100, q)
    assert sets.all()


def test_alpha_near_zero_and_near_one():
    scores = torch.rand(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert math.isinf(conformal_quantile(scores, 1e-6).item())  # rank 1001 > 1000
    assert conformal_quantile(scores, 1 - 1e-6).item() == scores.min().item()  # rank 1
    assert conformal_quantile(scores, 0.001).item() == scores.max().item()  # rank ceil(1001*0.999) = 1000


def test_ties_are_kept_together_in_the_set():
    scores = torch.tensor([0.2, 0.5, 0.2, 0.2, 0.5])
    q = conformal_quantile(scores, 0.5)  # rank ceil(6 * 0.5) = 3 -> 0.2
    assert q.item() == pytest.approx(0.2)
    assert prediction_sets(scores[None], q).sum().item() == 3  # all three tied scores are in


def test_invalid_alpha_is_rejected_with_the_allowed_range():
    with pytest.raises(ValueError, match=r"alpha must be in the open interval \(0, 1\); got 1.5"):
        conformal_quantile(torch.rand(10), 1.5)
    with pytest.raises(ValueError, match="got 0.0"):
        conformal_quantile(torch.rand(10), 0.0)


def test_conformal_quantile_matches_slow_reference_on_batches():
    generator = torch.Generator().manual_seed(2)
    for n in (1, 2, 7, 19, 100, 333):
        for alpha in (0.01, 0.05, 0.1, 0.2, 0.37, 0.5, 0.9):
            scores = torch.rand(3, n, generator=generator, dtype=torch.float64)
            fast = conformal_quantile(scores, alpha)
            for row in range(3):
                ordered = sorted(scores[row].tolist())
                rank = math.ceil((n + 1) * (1 - alpha) - 1e-12)
                expected = ordered[rank - 1] if rank <= n else math.inf
                assert fast[row].item() == expected, (n, alpha)


@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2, 0.7])
def test_class_thresholds_are_a_per_class_loop_over_the_exact_quantile(alpha):
    # scores with ties (on a grid of twentieths) and classes of every size, from none to plenty,
    # three calibration parts at once
    generator = torch.Generator().manual_seed(5)
    weights = torch.tensor([0.0, 0.01, 0.04, 0.15, 0.3, 0.5])  # class 0 never drawn; 1 and 2 rarely
    labels = torch.multinomial(weights, 3 * 80, replacement=True, generator=generator).reshape(3, 80)
    scores = torch.randint(0, 20, (3, 80), generator=generator).to(torch.float64) / 20
    fast = class_conformal_quantile(scores, labels, 6, alpha)
    assert fast.shape == (3, 6)
    for row in range(3):
        for label in range(6):
            expected = conformal_quantile(scores[row][labels[row] == label], alpha)  # the project's own quantile, class by class
            assert fast[row, label].item() == expected.item(), (row, label)
    assert math.isinf(fast[0, 0]) and torch.isfinite(fast[:, 5]).all()


def test_class_thresholds_by_hand():
    # class 0: 1 point (too few at alpha 0.5: rank ceil(2 * 0.5) = 1 <= 1, so finite: 0.3);
    # class 1: scores 0.2, 0.2, 0.9 -> rank ceil(4 * 0.5) = 2 -> 0.2 (a tie); class 2: none -> inf
    scores = torch.tensor([0.9, 0.3, 0.2, 0.2], dtype=torch.float64)
    labels = torch.tensor([1, 0, 1, 1])
    assert class_conformal_quantile(scores, labels, 3, 0.5).tolist() == [0.3, 0.2, math.inf]
    assert class_conformal_quantile(scores[:0], labels[:0], 3, 0.5).tolist() == [math.inf] * 3


def test_empirical_rank_reads_a_float_level_as_its_decimal():
    # 1 - 0.7 is 0.30000000000000004 in floats; ceil(10 * 0.3) is 3, the smallest pinball minimiser
    assert empirical_rank(10, 1 - 0.7) == 3
    assert empirical_rank(10, 1 - 0.1) == 9 and empirical_rank(7, 0.5) == 4 and empirical_rank(5, 1e-9) == 1
    scores = torch.arange(1.0, 11.0)
    assert empirical_quantile(scores, 1 - 0.7).item() == 3.0


def test_empirical_quantile_minimises_the_pinball_loss():
    generator = torch.Generator().manual_seed(4)
    for n in (5, 37, 200):
        scores = torch.rand(n, generator=generator, dtype=torch.float64)
        for alpha in (0.05, 0.1, 0.3):
            losses = torch.stack([pinball_loss(candidate, scores, alpha) for candidate in scores])
            best = losses.min()
            assert pinball_loss(empirical_quantile(scores, 1 - alpha), scores, alpha) <= best + 1e-12


def test_pinball_loss_and_gradient_by_hand():
    scores = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    alpha = 0.25
    # q = 1.5: below -> alpha * (1.5 - s) for s in {0, 1}; above -> (1 - alpha)(s - 1.5) for {2, 3}
    expected = (0.25 * 1.5 + 0.25 * 0.5 + 0.75 * 0.5 + 0.75 * 1.5) / 4
    assert pinball_loss(1.5, scores, alpha).item() == pytest.approx(expected)
    assert pinball_grad(1.5, scores, alpha).item() == pytest.approx(0.5 - 0.75)
    step = 1e-6
    numeric = (pinball_loss(1.5 + step, scores, alpha) - pinball_loss(1.5 - step, scores, alpha)) / (2 * step)
    assert numeric.item() == pytest.approx(pinball_grad(1.5, scores, alpha).item(), abs=1e-6)


def test_soft_sort_tends_to_the_sort():
    values = torch.rand(2, 30, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    errors = [(soft_sort(values, t) - values.sort().values).abs().max().item() for t in (1.0, 0.1, 1e-2, 1e-4)]
    assert errors[-1] < 1e-4
    assert errors == sorted(errors, reverse=True)


def test_smooth_quantile_tends_to_the_exact_batch_quantile_and_is_differentiable():
    scores = torch.rand(64, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    exact = hard_batch_quantile(scores, 0.1)
    errors = [abs(smooth_quantile(scores, 0.1, t).item() - exact.item()) for t in (1.0, 0.1, 1e-2, 1e-3, 1e-5)]
    assert errors[-1] < 1e-6
    assert errors == sorted(errors, reverse=True)
    leaf = scores.clone().requires_grad_(True)
    smooth_quantile(leaf, 0.1, 0.05).backward()
    assert leaf.grad.abs().sum() > 0


def test_batch_quantiles_sit_in_the_upper_tail_not_at_alpha():
    # Regression for a peer library's bug: the (1 - alpha) quantile of non-conformity scores,
    # not the alpha one.  Scores 1..100, alpha = 0.1: rank ceil(101 * 0.9) = 91.
    scores = torch.arange(1, 101, dtype=torch.float64)[torch.randperm(100, generator=torch.Generator().manual_seed(0))]
    assert hard_batch_quantile(scores, 0.1).item() == 91.0
    assert smooth_quantile(scores, 0.1, 1e-3).item() == pytest.approx(91.0)
    assert hard_batch_quantile(scores[:5], 0.1).item() == scores[:5].max().item()  # rank capped at n
