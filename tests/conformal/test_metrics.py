import math

import pytest
import torch

from dpsm_ray.conformal import (
    accuracy,
    class_counts,
    class_coverage,
    class_set_size,
    coverage,
    covered,
    covgap,
    prediction_sets,
    set_size,
    soft_set_size,
    sscv,
    worst_slab,
    wsc,
)

# Four examples, three classes.  Sets: {0}, {0, 1}, {}, {0, 1, 2}; labels 0, 2, 1, 2.
SCORES = torch.tensor([[0.1, 0.6, 0.9], [0.2, 0.4, 0.7], [0.8, 0.6, 0.9], [0.1, 0.2, 0.3]])
LABELS = torch.tensor([0, 2, 1, 2])
Q = 0.5


def test_sets_coverage_and_size_by_hand():
    sets = prediction_sets(SCORES, Q)
    assert sets.tolist() == [[True, False, False], [True, True, False], [False, False, False], [True, True, True]]
    assert covered(sets, LABELS).tolist() == [True, False, False, True]
    assert coverage(sets, LABELS).item() == pytest.approx(0.5)
    assert set_size(sets).item() == pytest.approx((1 + 2 + 0 + 3) / 4)


def test_per_batch_thresholds_broadcast():
    q = torch.tensor([0.15, 0.5])
    sets = prediction_sets(SCORES.expand(2, -1, -1), q)
    assert sets[0].sum().item() == 2 and torch.equal(sets[1], prediction_sets(SCORES, 0.5))


def test_soft_set_size_by_hand_and_limit():
    scores = torch.tensor([[0.3, 0.7]], dtype=torch.float64)
    # sigmoid(2) + sigmoid(-2) = 1 exactly
    assert soft_set_size(scores, 0.5, 0.1).item() == pytest.approx(1.0)
    expected = 1 / (1 + math.exp(-(0.5 - 0.3) / 1.0)) + 1 / (1 + math.exp(-(0.5 - 0.7) / 1.0))
    assert soft_set_size(scores, 0.5, 1.0).item() == pytest.approx(expected)
    generator = torch.Generator().manual_seed(0)
    many = torch.rand(50, 10, generator=generator, dtype=torch.float64)
    hard = set_size(prediction_sets(many, 0.4)).item()
    assert soft_set_size(many, 0.4, 1e-6).item() == pytest.approx(hard, abs=1e-6)
    assert soft_set_size(many, math.inf, 1.0).item() == pytest.approx(10.0)


def test_accuracy_by_hand():
    probs = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.9, 0.1]])
    assert accuracy(probs, torch.tensor([0, 0, 0])).item() == pytest.approx(2 / 3)


def test_covgap_by_hand_ignores_absent_classes():
    sets = prediction_sets(SCORES, Q)
    # class 0: 1/1 covered; class 1: 0/1; class 2: 1/2; class 3 (K=4 column of an absent class) ignored
    per_class = class_coverage(sets, LABELS, 3)
    assert per_class.tolist() == [1.0, 0.0, 0.5]
    expected = 100 * (abs(1.0 - 0.9) + abs(0.0 - 0.9) + abs(0.5 - 0.9)) / 3
    assert covgap(sets, LABELS, 0.1).item() == pytest.approx(expected)
    padded = torch.cat([sets, torch.zeros(4, 1, dtype=torch.bool)], dim=1)
    assert covgap(padded, LABELS, 0.1).item() == pytest.approx(expected)


def test_class_counts_and_set_sizes_by_hand():
    sets = prediction_sets(SCORES, Q)  # sizes 1, 2, 0, 3 for labels 0, 2, 1, 2
    assert class_counts(LABELS, 4).tolist() == [1, 1, 2, 0]
    per_class = class_set_size(sets, LABELS, 4)
    assert per_class[:3].tolist() == [1.0, 0.0, (2 + 3) / 2] and math.isnan(per_class[3])
    # over re-splits: one row per leading index
    both = class_set_size(sets.expand(2, -1, -1), LABELS.expand(2, -1), 3)
    assert both.tolist() == [[1.0, 0.0, 2.5]] * 2


def test_sscv_by_hand():
    # sizes 1, 2, 0, 3 -> strata {0-1}: examples 0 and 2 (covered 1 of 2); {2-3}: 1 and 3 (1 of 2)
    sets = prediction_sets(SCORES, Q)
    assert sscv(sets, LABELS, 0.1).item() == pytest.approx(0.4)
    # make stratum 2-3 fully covered: violation there is 0.1, stratum 0-1 keeps 0.4
    assert sscv(sets, torch.tensor([0, 0, 1, 2]), 0.1).item() == pytest.approx(0.4)
    assert sscv(sets, torch.tensor([0, 0, 1, 2]), 0.5).item() == pytest.approx(0.5)


def test_sscv_counts_sizes_above_the_last_bound_in_the_last_stratum():
    sets = torch.ones(2, 1500, dtype=torch.bool)
    assert sscv(sets, torch.tensor([0, 1]), 0.1).item() == pytest.approx(0.1)


def slow_worst_slab(features, hit, directions, delta, grid):
    """Every direction and every pair of grid edges, one at a time."""
    n = hit.numel()
    edges = [round(i * n / grid) for i in range(grid + 1)]
    best = (math.inf, None)
    for m, v in enumerate(directions):
        z = (features @ v).tolist()
        order = sorted(range(n), key=lambda i: z[i])
        for a in range(grid + 1):
            for b in range(a + 1, grid + 1):
                members = order[edges[a] : edges[b]]
                if len(members) < max(1, math.ceil(delta * n)):
                    continue
                value = sum(bool(hit[i]) for i in members) / len(members)
                if value < best[0]:
                    best = (value, m)
    return best


def test_worst_slab_matches_brute_force():
    generator = torch.Generator().manual_seed(11)
    features = torch.randn(120, 3, generator=generator, dtype=torch.float64)
    hit = torch.rand(120, generator=generator) < 0.8
    directions = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    m, low, high, value = worst_slab(features[None], hit[None], directions, 0.2, 10)
    expected_value, _ = slow_worst_slab(features, hit, directions, 0.2, 10)
    assert value.item() == pytest.approx(expected_value)
    z = features @ directions[m.item()]
    inside = (z >= low) & (z <= high)
    assert inside.sum().item() >= 24
    assert hit[inside].double().mean().item() == pytest.approx(expected_value)


def test_wsc_finds_a_planted_failure_region():
    generator = torch.Generator().manual_seed(0)
    features = torch.rand(4000, 2, generator=generator)
    hit = torch.rand(4000, generator=generator) < 0.97
    hit[features[:, 0] > 0.85] = False  # coverage broken only in one region of feature space
    marginal = hit.double().mean().item()
    assert 0.8 < marginal < 0.85
    assert wsc(features, hit, delta=0.1, seed=3).item() < 0.3


def test_wsc_without_a_failure_region_is_close_to_marginal():
    generator = torch.Generator().manual_seed(1)
    features = torch.rand(4000, 2, generator=generator)
    hit = torch.rand(4000, generator=generator) < 0.9
    # 0.885 held out; the worst slab chosen and measured on the same 4000 points covers 0.8425
    # (selection bias), so a WSC that skipped the fit / held-out split would fail this bound
    assert wsc(features, hit, delta=0.1, seed=3).item() > 0.86


def test_wsc_rejects_labels_in_place_of_covered():
    # Regression for a peer library calling WSC with (labels, covered) swapped.
    with pytest.raises(TypeError, match="covered must be a boolean"):
        wsc(torch.rand(10, 2), torch.randint(0, 3, (10,)))


def test_wsc_batches_over_leading_dims():
    generator = torch.Generator().manual_seed(2)
    features = torch.rand(3, 2000, 2, generator=generator)
    hit = torch.rand(3, 2000, generator=generator) < 0.95
    hit[1, features[1, :, 1] < 0.15] = False  # a failure region in the middle row only
    batched = wsc(features, hit, seed=5)
    assert batched.shape == (3,)
    assert batched[1] < 0.3 and batched[0] > 0.85 and batched[2] > 0.85


def test_wsc_of_a_model_that_says_the_same_for_every_input_is_a_number_not_nan():
    """A model at chance: the same log-probabilities for every input.  Every slab holds every point,
    so WSC is the held-out part's coverage; the slab's edges and the held-out points' projections
    round differently (a matrix product against a sum), which once left the slab [c, c] empty: NaN."""
    uniform = torch.full((3, 500, 10), math.log(0.1))
    same = torch.log_softmax(torch.randn(10, generator=torch.Generator().manual_seed(0)), 0).repeat(500, 1)
    for features in (uniform, same):
        shape = features.shape[:-1]
        everything = torch.ones(shape, dtype=torch.bool)  # every set holds every class
        assert wsc(features, everything).flatten().tolist() == [1.0] * shape[:-1].numel()
        hit = (torch.arange(500) % 10 != 0).expand(shape)  # 90% covered
        value = wsc(features, hit)
        assert torch.isfinite(value).all() and ((value - 0.9).abs() < 0.05).all(), value
