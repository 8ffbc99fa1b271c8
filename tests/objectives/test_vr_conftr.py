"""VR-ConfTr: ConfTr's loss at the exact batch quantile, whose gradient is the mean gradient of the
m calibration scores nearest to it."""

import math

import pytest
import torch

from dpsm_ray.conformal import hard_batch_quantile, label_scores, soft_set_size
from dpsm_ray.cards import build_objective
from dpsm_ray.objectives import VRConfTr, hps_scores, variance_reduced_quantile

ALPHA, WEIGHT, SIGMOID_T = 0.3, 0.5, 0.2


def vr_conftr(neighbours=3, **overrides):
    kwargs = dict(alpha=ALPHA, conformal_weight=WEIGHT, sigmoid_temperature=SIGMOID_T, vr_neighbours=neighbours)
    return build_objective("vr_conftr", **{**kwargs, **overrides})


def softmax(row):
    exps = [math.exp(v - max(row)) for v in row]
    return [e / sum(exps) for e in exps]


def sigmoid(v):
    return 1 / (1 + math.exp(-v))


def slow_loss_and_gradient(logits1, labels1, logits2, labels2, neighbours):
    """The loss and its gradient with respect to every logit, written out in plain Python floats:
    the softmax Jacobian dp_k/dz_j = p_k (delta_kj - p_j), CE's (p - e_y) / n, the soft size's
    sigmoid' / T, and tau's gradient the mean of dS_i/dz over the m B1 scores nearest to tau."""
    p1, p2 = [softmax(r) for r in logits1], [softmax(r) for r in logits2]
    k, n1, n2 = len(logits1[0]), len(logits1), len(logits2)
    s1 = [1 - p[y] for p, y in zip(p1, labels1)]
    rank = min(math.ceil((n1 + 1) * (1 - ALPHA)), n1)
    tau = sorted(s1)[rank - 1]
    nearest = sorted(range(n1), key=lambda i: abs(s1[i] - tau))[:neighbours]
    n = n1 + n2
    ce = -sum(math.log(p[y]) for p, y in zip(p1 + p2, labels1 + labels2)) / n
    size = sum(sigmoid((tau - (1 - p[c])) / SIGMOID_T) for p in p2 for c in range(k)) / n2
    grad1 = [[(p[j] - (j == y)) / n for j in range(k)] for p, y in zip(p1, labels1)]
    grad2 = [[(p[j] - (j == y)) / n for j in range(k)] for p, y in zip(p2, labels2)]
    slope = lambda v: sigmoid(v) * (1 - sigmoid(v)) / SIGMOID_T  # d/d(tau - S) of sigmoid((tau - S) / T), v = (tau - S) / T
    dsize_dtau = 0.0
    for i, p in enumerate(p2):
        for c in range(k):
            g = slope((tau - (1 - p[c])) / SIGMOID_T) / n2
            dsize_dtau += g
            for j in range(k):  # S = 1 - p_c: dS/dz_j = -p_c (delta_cj - p_j), and the size falls as S rises
                grad2[i][j] += WEIGHT * g * p[c] * ((c == j) - p[j])
    for i in nearest:  # dtau/dz of B1 row i: (1/m) dS_i/dz, S_i = 1 - p_y
        p, y = p1[i], labels1[i]
        for j in range(k):
            grad1[i][j] += WEIGHT * dsize_dtau * (-p[y] * ((y == j) - p[j])) / len(nearest)
    return ce + WEIGHT * size, tau, grad1, grad2


def test_loss_and_gradient_against_a_slow_reference():
    generator = torch.Generator().manual_seed(7)
    l1, l2 = (torch.randn(8, 4, generator=generator, dtype=torch.float64) * 1.5 for _ in range(2))
    y1, y2 = (torch.randint(0, 4, (8,), generator=generator) for _ in range(2))
    l1.requires_grad_(), l2.requires_grad_()
    out = vr_conftr(neighbours=3)(l1, y1, l2, y2)
    out.loss.backward()
    loss, tau, grad1, grad2 = slow_loss_and_gradient(l1.tolist(), y1.tolist(), l2.tolist(), y2.tolist(), 3)
    assert out.stats["quantile"].item() == pytest.approx(tau, rel=1e-12)  # the 7th of 8 (ceil(9 * 0.7))
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(l1.grad, torch.tensor(grad1, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(l2.grad, torch.tensor(grad2, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    # three B1 rows carry tau's gradient besides their CE: the others only their CE
    ce_only = l1.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(torch.cat([ce_only, l2.detach()]), torch.cat([y1, y2])).backward()
    assert (l1.grad - ce_only.grad).abs().sum(dim=1).gt(1e-12).sum().item() == 3


def test_one_neighbour_is_conftr_at_its_exact_quantile():
    """m = 1: the nearest score is the selected one, so VR-ConfTr is this project's ConfTr with the
    exact batch quantile and the batch split -- the same loss and the same gradient."""
    generator = torch.Generator().manual_seed(8)
    l1, l2 = (torch.randn(10, 5, generator=generator, dtype=torch.float64) for _ in range(2))
    y1, y2 = (torch.randint(0, 5, (10,), generator=generator) for _ in range(2))
    grads = []
    for objective in (vr_conftr(neighbours=1),
                      build_objective("conftr", alpha=ALPHA, conformal_weight=WEIGHT, sigmoid_temperature=SIGMOID_T, sort_temperature=0.0,
                                      conftr_split="batch")):
        a, b = l1.clone().requires_grad_(), l2.clone().requires_grad_()
        out = objective(a, y1, b, y2)
        out.loss.backward()
        grads.append((out.loss.item(), a.grad, b.grad))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-12)
    torch.testing.assert_close(grads[0][1], grads[1][1])
    torch.testing.assert_close(grads[0][2], grads[1][2])


def test_the_estimate_of_the_quantile_s_gradient_varies_less_across_batches():
    """Scores S_i = 1 - sigmoid(theta a_i + b_i) with a, b independent normals: at a given score
    dS_i/dtheta still varies with a_i, which is the noise the estimator averages away.  Over 300
    random calibration batches of 64, d tau / d theta from the m = 8 scores nearest the quantile
    varies less than the batch quantile's own gradient (one score's), around a mean within 15% of
    it (measured: variance 0.00097 against 0.0062, means 0.102 and 0.113; the population value,
    from the 400 of 20000 scores nearest their 0.9 quantile, 0.112)."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(20000, generator=generator, dtype=torch.float64) for _ in range(2))
    estimates = {1: [], 8: []}
    batches = torch.Generator().manual_seed(1)
    for _ in range(300):
        index = torch.randint(0, a.numel(), (64,), generator=batches)
        for neighbours in estimates:
            theta = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
            tau = variance_reduced_quantile(1 - torch.sigmoid(theta * a[index] + b[index]), 0.1, neighbours)
            estimates[neighbours].append(torch.autograd.grad(tau, theta)[0].item())
    single, reduced = torch.tensor(estimates[1]), torch.tensor(estimates[8])
    assert reduced.var() < 0.5 * single.var()
    assert reduced.mean().item() == pytest.approx(single.mean().item(), rel=0.15)


def test_the_quantile_keeps_its_value_and_m_is_capped_at_the_batch():
    scores = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.4], dtype=torch.float64, requires_grad=True)
    tau = variance_reduced_quantile(scores, 0.2, 10)  # rank ceil(6 * 0.8) = 5: the largest; m capped at 5
    assert tau.item() == hard_batch_quantile(scores.detach(), 0.2).item() == 0.9
    tau.backward()
    torch.testing.assert_close(scores.grad, torch.full((5,), 0.2, dtype=torch.float64))
    with pytest.raises(ValueError, match="m"):
        vr_conftr(neighbours=0)


def test_the_card_s_options_reach_the_objective():
    objective = vr_conftr(neighbours=6)
    assert type(objective) is VRConfTr and objective.neighbours == 6 and objective.batch_split == "batch"
    assert objective.uses_quantile and objective.sort_temperature == 0.0
    (l1, y1) = (torch.randn(6, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2]))
    tau = hard_batch_quantile(label_scores(hps_scores(l1), y1), ALPHA)
    expected = torch.nn.functional.cross_entropy(torch.cat([l1, l1]), torch.cat([y1, y1])) + WEIGHT * soft_set_size(hps_scores(l1), tau, SIGMOID_T)
    assert objective(l1, y1, l1, y1).loss.item() == pytest.approx(expected.item(), rel=1e-12)
