import math

import pytest
import torch
import torch.nn.functional as F

from dpsm_ray.conformal import empirical_quantile, hard_batch_quantile, label_scores, soft_set_size
from dpsm_ray.cards import METHODS, build_objective
from dpsm_ray.objectives import CUT, DPSM, ConfTr, ConfTrPublished, ConfTS, CrossEntropy, RankWeightedCE, VRConfTr, hps_scores, ks_to_uniform

STAT_KEYS = {"ce", "conformal", "upper", "pinball", "quantile"}


def batch(n=16, k=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k, generator=generator, dtype=torch.float64) * 2
    labels = torch.randint(0, k, (n,), generator=generator)
    return logits, labels


def make(method, **overrides):
    kwargs = dict(alpha=0.1, conformal_weight=0.5, sigmoid_temperature=0.1, sort_temperature=0.0, quantile_lr=0.05)
    kwargs.update(overrides)
    objective = build_objective(method, **kwargs)
    if method == "dpsm":
        objective.q = torch.tensor(0.6, dtype=torch.float64)
    return objective


@pytest.mark.parametrize("method", METHODS)
def test_every_objective_has_the_same_call_shape(method):
    (l1, y1), (l2, y2) = batch(seed=1), batch(seed=2)
    out = make(method)(l1.requires_grad_(), y1, l2.requires_grad_(), y2)
    assert set(out.stats) == STAT_KEYS
    assert out.loss.requires_grad and out.loss.ndim == 0
    assert all(not v.requires_grad for v in out.stats.values())
    assert out.stats["upper"].item() == pytest.approx(out.loss.item())


def test_unknown_method_names_the_choices():
    with pytest.raises(ValueError, match="ce, conftr, conftr_published, confts, cut, dpsm, rwce, vr_conftr"):
        make("thr")


def test_ce_is_cross_entropy_on_both_halves():
    (l1, y1), (l2, y2) = batch(seed=1), batch(seed=2)
    out = make("ce")(l1, y1, l2, y2)
    expected = F.cross_entropy(torch.cat([l1, l2]), torch.cat([y1, y2]))
    assert out.loss.item() == pytest.approx(expected.item())
    assert math.isnan(out.stats["quantile"].item())


def step_ce(ce_batch, l1, y1, l2, y2):
    """CE on the whole batch (the official code) or on B1 (the tex's Algorithm 1), by hand."""
    return F.cross_entropy(l1, y1) if ce_batch == "half" else F.cross_entropy(torch.cat([l1, l2]), torch.cat([y1, y2]))


@pytest.mark.parametrize("ce_batch", ["full", "half"])
def test_dpsm_loss_and_quantile_step_by_hand(ce_batch):
    (l1, y1), (l2, y2) = batch(seed=1), batch(seed=2)
    objective = make("dpsm", conformal_weight=0.5, sigmoid_temperature=0.1, quantile_lr=0.05, ce_batch=ce_batch)
    out = objective(l1, y1, l2, y2)
    p2 = l2.softmax(1)
    size = torch.sigmoid((0.6 - (1 - p2)) / 0.1).sum(1).mean()
    assert out.loss.item() == pytest.approx((step_ce(ce_batch, l1, y1, l2, y2) + 0.5 * size).item())
    s1 = 1 - l1.softmax(1).gather(1, y1[:, None]).squeeze(1)
    below = (s1 < 0.6).double().mean().item()
    assert out.stats["quantile"].item() == pytest.approx(0.6)  # the q the step used
    assert objective.q.item() == pytest.approx(0.6 - 0.05 * (below - 0.9))
    rho = torch.where(s1 >= 0.6, 0.9 * (s1 - 0.6), 0.1 * (0.6 - s1)).mean()
    assert out.stats["pinball"].item() == pytest.approx(rho.item())


@pytest.mark.parametrize("ce_batch", ["full", "half"])
def test_dpsm_model_gradient_is_ce_and_the_soft_size_on_b2_only(ce_batch):
    (l1, y1), (l2, y2) = batch(seed=1), batch(seed=2)
    l1, l2 = l1.requires_grad_(), l2.requires_grad_()
    make("dpsm", ce_batch=ce_batch)(l1, y1, l2, y2).loss.backward()
    ref1, ref2 = l1.detach().clone().requires_grad_(), l2.detach().clone().requires_grad_()
    (step_ce(ce_batch, ref1, y1, ref2, y2) + 0.5 * soft_set_size(hps_scores(ref2), 0.6, 0.1)).backward()
    assert torch.allclose(l1.grad, ref1.grad) and torch.allclose(l2.grad, ref2.grad)
    # with CE on B1 only, D2's examples get the size term's gradient and nothing else
    if ce_batch == "half":
        size_only = l2.detach().clone().requires_grad_()
        (0.5 * soft_set_size(hps_scores(size_only), 0.6, 0.1)).backward()
        assert torch.allclose(l2.grad, size_only.grad)


def test_dpsm_needs_its_initial_quantile():
    (l1, y1), (l2, y2) = batch(seed=1), batch(seed=2)
    objective = build_objective("dpsm", alpha=0.1, conformal_weight=0.5, sigmoid_temperature=0.1, sort_temperature=0, quantile_lr=0.05)
    with pytest.raises(RuntimeError, match="initialize"):
        objective(l1, y1, l2, y2)
    scores = torch.rand(100, dtype=torch.float64)
    objective.initialize(scores)
    assert objective.q.item() == empirical_quantile(scores, 0.9).item()


@pytest.mark.parametrize("alpha", [0.1, 0.3])
def test_dpsm_q_converges_to_the_empirical_quantile_on_fixed_scores(alpha):
    logits, labels = batch(n=2000, k=5, seed=3)
    scores = label_scores(hps_scores(logits), labels)
    target = empirical_quantile(scores, 1 - alpha).item()
    # full batch: the pinball subgradient step settles where the fraction below q is 1 - alpha
    objective = make("dpsm", alpha=alpha, quantile_lr=0.05)
    objective.q = torch.tensor(0.0, dtype=torch.float64)  # start far away
    for _ in range(300):
        objective(logits, labels, logits, labels)
    assert abs((scores < objective.q).double().mean().item() - (1 - alpha)) <= 2 / 2000
    assert abs(objective.q.item() - target) < 5e-3
    # mini-batches of 100: the averaged iterates land on the same quantile
    objective.q = torch.tensor(0.0, dtype=torch.float64)
    generator, iterates = torch.Generator().manual_seed(0), []
    for step in range(1500):
        index = torch.randint(0, 2000, (100,), generator=generator)
        objective(logits[index], labels[index], logits[index], labels[index])
        if step >= 500:
            iterates.append(objective.q.item())
    assert abs(sum(iterates) / len(iterates) - target) < 0.01


def graph_size(tensor):
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


def test_dpsm_q_stays_plain_state_without_a_growing_graph():
    objective = make("dpsm")
    sizes = []
    for step in range(30):
        (l1, y1), (l2, y2) = batch(seed=10 + step), batch(seed=50 + step)
        out = objective(l1.requires_grad_(), y1, l2.requires_grad_(), y2)
        sizes.append(graph_size(out.loss))
        assert not objective.q.requires_grad and objective.q.grad_fn is None
    assert len(set(sizes)) == 1


def test_dpsm_state_round_trips():
    objective = make("dpsm")
    other = make("dpsm")
    objective.q = torch.tensor(0.123, dtype=torch.float64)
    other.load_state_dict(objective.state_dict())
    assert other.q.item() == pytest.approx(0.123)


def test_conftr_uses_the_upper_tail_batch_quantile_of_b1_and_differentiates_through_it():
    (l1, y1), (l2, y2) = batch(n=32, seed=4), batch(n=32, seed=5)
    l1 = l1.requires_grad_()
    objective = make("conftr", sort_temperature=0.0)
    out = objective(l1, y1, l2, y2)
    tau = hard_batch_quantile(label_scores(hps_scores(l1.detach()), y1), 0.1)
    assert out.stats["quantile"].item() == pytest.approx(tau.item())
    expected = F.cross_entropy(l1.detach(), y1) + 0.5 * soft_set_size(hps_scores(l2), tau, 0.1)
    assert out.loss.item() == pytest.approx(expected.item())
    out.loss.backward()
    ce_only = l1.detach().clone().requires_grad_()
    F.cross_entropy(ce_only, y1).backward()
    assert not torch.allclose(l1.grad, ce_only.grad)  # tau carries gradient back into B1


def test_conftr_smooth_quantile_approaches_the_hard_one():
    (l1, y1), (l2, y2) = batch(n=64, seed=6), batch(n=64, seed=7)
    hard = make("conftr", sort_temperature=0.0)(l1, y1, l2, y2).stats["quantile"].item()
    smooth = make("conftr", sort_temperature=1e-5)(l1, y1, l2, y2).stats["quantile"].item()
    assert smooth == pytest.approx(hard, abs=1e-6)


def brute_force_ks(values):
    """sup over t of |F_n(t) - t|, checked just below and at every jump and at the ends."""
    values = sorted(values)
    n, best = len(values), 0.0
    for t in [0.0, 1.0, *values, *(v - 1e-12 for v in values)]:
        empirical = sum(v <= t for v in values) / n
        best = max(best, abs(empirical - t))
    return best


def test_ks_distance_by_hand_and_by_brute_force():
    values = torch.tensor([0.1, 0.2, 0.9, 0.95], dtype=torch.float64)
    # s_(i) - (i-1)/n at i = 3: 0.9 - 0.5 = 0.4 is the largest gap
    assert ks_to_uniform(values, 0.0).item() == pytest.approx(0.4)
    generator = torch.Generator().manual_seed(8)
    for _ in range(5):
        random_values = torch.rand(25, generator=generator, dtype=torch.float64)
        assert ks_to_uniform(random_values, 0.0).item() == pytest.approx(brute_force_ks(random_values.tolist()), abs=1e-9)
        assert ks_to_uniform(random_values, 1e-5).item() == pytest.approx(brute_force_ks(random_values.tolist()), abs=1e-4)


@pytest.mark.parametrize("ce_batch", ["full", "half"])
def test_cut_penalises_b2_scores_and_trains_ce_on_the_batch_or_b1(ce_batch):
    (l1, y1), (l2, y2) = batch(n=32, seed=9), batch(n=32, seed=10)
    l2 = l2.requires_grad_()
    out = make("cut", conformal_weight=2.0, ce_batch=ce_batch)(l1, y1, l2, y2)
    ks = ks_to_uniform(label_scores(hps_scores(l2.detach()), y2), 0.0)
    assert out.loss.item() == pytest.approx((step_ce(ce_batch, l1, y1, l2.detach(), y2) + 2.0 * ks).item())
    out.loss.backward()
    assert l2.grad.abs().sum() > 0


def test_objectives_are_plain_classes():
    assert {type(make(m)) for m in METHODS} == {CrossEntropy, ConfTr, ConfTrPublished, CUT, DPSM, ConfTS, VRConfTr, RankWeightedCE}


@pytest.mark.parametrize("q_init", ["dataset", "zero", "random"])
def test_dpsm_initial_quantile(q_init):
    scores = torch.linspace(0.0, 0.99, 100, dtype=torch.float64)  # Q_n at 0.9: the 90th smallest, 0.89
    start = lambda seed: build_objective("dpsm", alpha=0.1, conformal_weight=0.5, sigmoid_temperature=0.1, sort_temperature=0, quantile_lr=0.05, q_init=q_init, seed=seed)
    objective = start(3)
    objective.initialize(scores)
    if q_init == "dataset":
        assert objective.q.item() == pytest.approx(0.89)
    elif q_init == "zero":
        assert objective.q.item() == 0.0
    else:  # Unif(0, 1) from the run seed: the same for the same seed, whatever the scores
        again, other = start(3), start(4)
        again.initialize(scores.flip(0) * 0.5)
        other.initialize(scores)
        assert 0.0 <= objective.q.item() < 1.0 and objective.q.item() != pytest.approx(0.89, abs=1e-3)
        assert again.q.item() == objective.q.item() != other.q.item()
    assert objective.q.dtype == scores.dtype and objective.q.ndim == 0


def test_an_unknown_choice_of_an_objective_is_refused():
    with pytest.raises(ValueError, match="dataset, zero, random"):
        make("dpsm", q_init="half")
    with pytest.raises(ValueError, match="halves, batch"):
        make("conftr", conftr_split="thirds")
    with pytest.raises(ValueError, match="hps, aps"):
        make("cut", cut_score="raps")


def test_conftr_batch_split_trains_ce_on_the_whole_batch():
    (l1, y1), (l2, y2) = batch(n=32, seed=4), batch(n=32, seed=5)
    out = make("conftr", sort_temperature=0.0, conftr_split="batch")(l1, y1, l2, y2)
    tau = hard_batch_quantile(label_scores(hps_scores(l1), y1), 0.1)
    expected = F.cross_entropy(torch.cat([l1, l2]), torch.cat([y1, y2])) + 0.5 * soft_set_size(hps_scores(l2), tau, 0.1)
    assert out.loss.item() == pytest.approx(expected.item())
    assert out.stats["ce"].item() == pytest.approx(F.cross_entropy(torch.cat([l1, l2]), torch.cat([y1, y2])).item())


def aps_by_hand(probs, label, u):
    """The randomised APS score of one label: the mass ranked strictly above it plus u times its own."""
    above = sum(p for k, p in enumerate(probs) if p > probs[label] or (p == probs[label] and k < label))
    return above + u * probs[label]


class FakeCollective:
    """Rank ``rank`` of ``world_size`` workers, without the communication (gather is local)."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def gather(self, tensor):
        return tensor


def test_cut_aps_scores_by_hand_with_fresh_uniforms_each_step():
    (l1, y1), (l2, y2) = batch(n=8, seed=11), batch(n=8, seed=12)
    objective = make("cut", cut_score="aps", seed=5)
    u0 = objective.uniforms(8, torch.device("cpu"))
    out = objective(l1, y1, l2, y2)
    probs = l2.softmax(1).tolist()
    scores = torch.tensor([aps_by_hand(p, int(y), float(u)) for p, y, u in zip(probs, y2, u0)], dtype=torch.float64)
    assert out.loss.item() == pytest.approx((step_ce("full", l1, y1, l2, y2) + 0.5 * ks_to_uniform(scores, 0.0)).item())
    assert objective.steps.item() == 1
    u1 = objective.uniforms(8, torch.device("cpu"))
    assert ((u0 > 0) & (u0 < 1)).all() and not torch.equal(u0, u1)  # a new U for the next step
    # worker r of 2 draws the U of its own slice of the global B2: the same U as one worker
    halves = []
    for rank in (0, 1):
        worker = make("cut", cut_score="aps", seed=5)
        worker.collective = FakeCollective(rank, 2)
        halves.append(worker.uniforms(4, torch.device("cpu")))
    assert torch.equal(torch.cat(halves), u0)


def test_cut_aps_conformity_scores_are_uniform_for_a_calibrated_model():
    """Labels drawn from the model's own probabilities: randomised APS scores are exactly
    Unif(0, 1) (Einbinder et al.'s premise), HPS scores are not -- a planted check that U is
    drawn and applied per example."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 6, generator=generator, dtype=torch.float64) * 4
    labels = torch.multinomial(logits.softmax(1), 1, generator=generator).squeeze(1)
    aps = make("cut", cut_score="aps", seed=1)(logits, labels, logits, labels).stats["conformal"].item()
    hps = make("cut", cut_score="hps")(logits, labels, logits, labels).stats["conformal"].item()
    # KS against the uniform: 1.36 / sqrt(4000) = 0.022 is its 95% bound (measured: 0.012 for APS, 0.31 for HPS)
    assert aps < 0.03 and hps > 0.2


def test_cut_state_round_trips_and_is_the_step_counter():
    objective, other = make("cut", cut_score="aps"), make("cut", cut_score="aps")
    (l1, y1), (l2, y2) = batch(seed=1), batch(seed=2)
    for _ in range(3):
        objective(l1, y1, l2, y2)
    other.load_state_dict(objective.state_dict())
    assert other.steps.item() == 3 and other.state_tensors() == [other.steps]
    assert torch.equal(other.uniforms(16, torch.device("cpu")), objective.uniforms(16, torch.device("cpu")))
    assert make("cut").state_tensors() == [] and make("ce").state_tensors() == []


@pytest.mark.parametrize("size_target, ce_weight", [(0.0, 0.0), (1.0, 0.5)])
def test_conftr_as_published_by_hand(size_target, ce_weight):
    """Stutz et al.'s loss: log(lambda * Omega + 1e-8) + ce_weight * CE, Omega the mean hinge of
    the soft set size of B2 at the conformal quantile of B1's -log p_y (here the exact order
    statistic: sort temperature 0), every score on -log p."""
    (l1, y1), (l2, y2) = batch(n=20, seed=21), batch(n=20, seed=22)
    out = make("conftr_published", conformal_weight=0.01, sigmoid_temperature=0.1, size_target=size_target, ce_weight=ce_weight)(l1, y1, l2, y2)
    calibration = sorted((-l1.log_softmax(1)).gather(1, y1[:, None]).squeeze(1).tolist())
    tau = calibration[math.ceil(21 * 0.9) - 1]  # the 19th smallest of 20
    omega = sum(max(sum(1 / (1 + math.exp(-(tau - s) / 0.1)) for s in row) - size_target, 0.0) for row in (-l2.log_softmax(1)).tolist()) / 20
    ce = F.cross_entropy(torch.cat([l1, l2]), torch.cat([y1, y2])).item()
    assert out.stats["quantile"].item() == pytest.approx(tau)
    assert out.stats["conformal"].item() == pytest.approx(omega)
    assert out.loss.item() == pytest.approx(math.log(0.01 * omega + 1e-8) + ce_weight * ce)
    assert out.stats["upper"].item() == pytest.approx(out.loss.item())
    assert type(make("conftr_published")) is ConfTrPublished and ConfTrPublished.batch_split == "batch"
