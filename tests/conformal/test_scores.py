import pytest
import torch

from dpsm_ray.cards import score_matrix
from dpsm_ray.conformal import example_uniforms, label_scores, prediction_sets


def slow_aps(probs, u, raps_lambda=0.0, k_reg=0):
    """APS/RAPS straight from the definition: loop over examples and labels."""
    n, k = probs.shape
    out = torch.empty(n, k, dtype=torch.float64)
    for i in range(n):
        p = probs[i].tolist()
        # rank by probability, descending; ties by class index (lower first)
        order = sorted(range(k), key=lambda c: (-p[c], c))
        for y in range(k):
            rank = order.index(y) + 1
            above = sum(p[c] for c in order[: rank - 1])
            out[i, y] = above + float(u[i]) * p[y] + raps_lambda * max(0, rank - k_reg)
    return out


def ranks_by_hand(p):
    """1-based ranks of a row of probabilities: descending, ties by class index (lower first)."""
    order = sorted(range(len(p)), key=lambda c: (-p[c], c))
    return [order.index(y) + 1 for y in range(len(p))]


def slow_saps(probs, u, weight):
    """SAPS straight from Huang et al.'s definition: u p_max for rank 1, p_max + (rank - 2 + u) lambda below."""
    out = torch.empty(probs.shape, dtype=torch.float64)
    for i in range(probs.shape[0]):
        p, uniform = probs[i].tolist(), 1.0 if u is None else float(u[i])
        for y, rank in enumerate(ranks_by_hand(p)):
            out[i, y] = uniform * max(p) if rank == 1 else max(p) + (rank - 2 + uniform) * weight
    return out


def slow_topk(probs, u):
    out = torch.empty(probs.shape, dtype=torch.float64)
    for i in range(probs.shape[0]):
        for y, rank in enumerate(ranks_by_hand(probs[i].tolist())):
            out[i, y] = rank - 1 + (1.0 if u is None else float(u[i]))
    return out


def slow_margin(probs):
    out = torch.empty(probs.shape, dtype=torch.float64)
    for i in range(probs.shape[0]):
        p = probs[i].tolist()
        for y in range(len(p)):
            out[i, y] = max(p[c] for c in range(len(p)) if c != y) - p[y]
    return out


def probabilities_with_ties(seed, n=60):
    """Seven classes: random rows, and three with ties (a tied top pair, every class, a tied tail)."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n, 7, generator=generator, dtype=torch.float64) * 2, dim=1)
    probs[0] = torch.tensor([0.25, 0.25, 0.1, 0.1, 0.1, 0.1, 0.1], dtype=torch.float64)
    probs[1] = torch.full((7,), 1 / 7, dtype=torch.float64)
    probs[2] = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.2, 0.3], dtype=torch.float64)  # the top class last
    return probs, torch.rand(n, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("weight", [0.2, 0.05, 1.5])
@pytest.mark.parametrize("randomised", [True, False])
def test_saps_matches_slow_reference(weight, randomised):
    probs, u = probabilities_with_ties(11)
    u = u if randomised else None
    fast = score_matrix(probs, "saps", u=u, parameters={"lambda": weight})
    assert torch.allclose(fast, slow_saps(probs, u, weight), atol=1e-12, rtol=0)


def test_saps_by_hand():
    probs = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)
    # ranks: class 1 first, class 2 second, class 0 third; lambda 0.2 (the card's default), U = 0.25
    expected = torch.tensor([[0.5 + 1.25 * 0.2, 0.25 * 0.5, 0.5 + 0.25 * 0.2]], dtype=torch.float64)
    assert torch.allclose(score_matrix(probs, "saps", u=torch.tensor([0.25], dtype=torch.float64)), expected)
    assert torch.allclose(score_matrix(probs, "saps"), torch.tensor([[0.9, 0.5, 0.7]], dtype=torch.float64))  # U = 1


@pytest.mark.parametrize("randomised", [True, False])
def test_topk_matches_slow_reference_and_is_the_rank_without_u(randomised):
    probs, u = probabilities_with_ties(12)
    u = u if randomised else None
    fast = score_matrix(probs, "topk", u=u)
    assert torch.allclose(fast, slow_topk(probs, u), atol=0, rtol=0)
    assert torch.equal(score_matrix(probs[:1], "topk")[0], torch.tensor([1.0, 2, 3, 4, 5, 6, 7], dtype=torch.float64))


def test_margin_matches_slow_reference_and_ties_at_the_top_score_zero():
    probs, _ = probabilities_with_ties(13)
    fast = score_matrix(probs, "margin")
    assert torch.allclose(fast, slow_margin(probs), atol=1e-15, rtol=0)
    assert fast[0, :2].tolist() == [0.0, 0.0] and fast[1].abs().max() == 0
    assert torch.allclose(fast[2], torch.tensor([0.2] * 5 + [0.1, -0.1], dtype=torch.float64))


@pytest.mark.parametrize("kind", ["saps", "topk"])
def test_rank_scores_give_prefixes_of_the_sorted_labels(kind):
    probs, u = probabilities_with_ties(14, n=200)
    scores = score_matrix(probs, kind, u=u)
    order = probs.argsort(dim=1, descending=True, stable=True)
    for q in (0.1, 0.5, 1.2, 3.7, 6.5):
        in_sorted_order = prediction_sets(scores, q).gather(1, order).int()
        assert (in_sorted_order[:, 1:] <= in_sorted_order[:, :-1]).all()


def test_hps_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    assert torch.allclose(score_matrix(probs, "hps"), torch.tensor([[0.5, 0.7, 0.8]], dtype=torch.float64))


def test_aps_by_hand_with_and_without_u():
    probs = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)
    # sorted: class 1 (0.5), class 2 (0.3), class 0 (0.2)
    expected_u1 = torch.tensor([[0.5 + 0.3 + 0.2, 0.5, 0.5 + 0.3]], dtype=torch.float64)
    assert torch.allclose(score_matrix(probs, "aps"), expected_u1)
    expected_u_quarter = torch.tensor([[0.8 + 0.05, 0.125, 0.5 + 0.075]], dtype=torch.float64)
    u = torch.tensor([0.25], dtype=torch.float64)
    assert torch.allclose(score_matrix(probs, "aps", u=u), expected_u_quarter)


def test_aps_ties_rank_lower_class_index_first():
    probs = torch.tensor([[0.25, 0.5, 0.25]], dtype=torch.float64)
    # class 1 first, then the tie: class 0 before class 2
    assert torch.allclose(score_matrix(probs, "aps"), torch.tensor([[0.75, 0.5, 1.0]], dtype=torch.float64))


def test_raps_penalises_ranks_beyond_k_reg_by_hand():
    probs = torch.tensor([[0.3, 0.2, 0.15, 0.1, 0.09, 0.08, 0.05, 0.03]], dtype=torch.float64)
    scores = score_matrix(probs, "raps", parameters={"lambda": 0.01, "k_reg": 5})
    cumulative = probs.cumsum(1)
    penalty = torch.tensor([[0, 0, 0, 0, 0, 0.01, 0.02, 0.03]], dtype=torch.float64)
    assert torch.allclose(scores, cumulative + penalty)


@pytest.mark.parametrize("kind,raps_lambda,k_reg", [("aps", 0.0, 0), ("raps", 0.01, 5), ("raps", 0.2, 2)])
def test_aps_and_raps_match_slow_reference(kind, raps_lambda, k_reg):
    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(40, 9, generator=generator, dtype=torch.float64) * 2, dim=1)
    probs[0, :3] = probs[0, 3]  # a few exact ties
    probs[0] = probs[0] / probs[0].sum()
    u = torch.rand(40, generator=generator, dtype=torch.float64)
    fast = score_matrix(probs, kind, u=u, parameters={"lambda": raps_lambda, "k_reg": k_reg} if kind == "raps" else None)
    assert torch.allclose(fast, slow_aps(probs, u, raps_lambda, k_reg), atol=1e-12)


def test_aps_sets_are_prefixes_of_the_sorted_labels():
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(200, 12, generator=generator), dim=1)
    u = torch.rand(200, generator=generator)
    scores = score_matrix(probs, "aps", u=u)
    order = probs.argsort(dim=1, descending=True, stable=True)
    for q in (0.2, 0.5, 0.9, 0.99):
        in_sorted_order = prediction_sets(scores, q).gather(1, order).int()
        # a prefix is non-increasing along the sorted labels
        assert (in_sorted_order[:, 1:] <= in_sorted_order[:, :-1]).all()


def test_label_scores_gathers_the_true_label():
    scores = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    assert torch.equal(label_scores(scores, torch.tensor([1, 0])), torch.tensor([0.2, 0.3]))


def test_unknown_score_kind_names_the_allowed_values():
    with pytest.raises(ValueError, match="hps, aps, raps, saps, topk, margin.*'lac'"):
        score_matrix(torch.ones(1, 2) / 2, "lac")


def test_example_uniforms_depend_only_on_seed_and_id():
    ids = torch.arange(1000)
    u = example_uniforms(7, ids)
    assert torch.equal(example_uniforms(7, ids[[5, 900, 3]]), u[[5, 900, 3]])
    assert not torch.equal(example_uniforms(8, ids), u)
    assert ((u > 0) & (u < 1)).all()


def test_example_uniforms_look_uniform():
    u = example_uniforms(0, torch.arange(200_000))
    grid = (torch.arange(1, u.numel() + 1, dtype=torch.float64)) / u.numel()
    ks = (u.sort().values - grid).abs().max().item()
    assert ks < 1.63 / u.numel() ** 0.5  # the 1% critical value of the KS statistic
    # neighbouring ids are not correlated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.01
