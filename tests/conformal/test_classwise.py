"""Clustered and RC3P calibrations: against a slow reference written from the papers, and against
TorchCP's implementations (torchcp 1.1.0, a test dependency) on the same probabilities."""

from __future__ import annotations

import importlib
import importlib.util
import math
import pathlib
import sys
import types
from fractions import Fraction

import pytest
import torch

from dpsm_ray.conformal.classwise import (
    EMBEDDING_QUANTILES, clustered_calibration, clustering_parameters, label_ranks, rank_sets, rc3p_calibration,
)
from dpsm_ray.conformal.levels import min_calibration_size
from dpsm_ray.conformal.quantile import class_order_statistic

pytestmark = pytest.mark.quick


def problem(seed: int, num_classes: int = 20, per_class: int = 60, rare: tuple[int, ...] = ()):
    """Probabilities of a model whose confidence differs by class (so classes cluster), and labels."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    keep = torch.ones(len(labels), dtype=torch.bool)
    for label in rare:  # a rare class keeps 3 points
        keep &= ~((labels == label) & (torch.arange(len(labels)) % per_class >= 3))
    labels = labels[keep]
    sharpness = 0.5 + 3.0 * (torch.arange(num_classes) % 4).to(torch.float64)
    logits = torch.randn(len(labels), num_classes, generator=generator, dtype=torch.float64)
    logits[torch.arange(len(labels)), labels] += sharpness[labels] * torch.rand(len(labels), generator=generator, dtype=torch.float64)
    return logits.softmax(dim=1), labels


def hps(probs: torch.Tensor) -> torch.Tensor:
    return 1.0 - probs


# ------------------------------------------------------------------ slow references, from the papers


def reference_rc3p(scores, ranks, labels, num_classes, alpha):
    a = Fraction(repr(alpha))
    thresholds, limits = [], []
    for y in range(num_classes):
        own = sorted(float(s) for s, label in zip(scores, labels) if label == y)
        own_ranks = [int(r) for r, label in zip(ranks, labels) if label == y]
        n = len(own)
        if n < min_calibration_size(alpha):  # the conservative fallback: every set holds the class
            thresholds.append(math.inf), limits.append(num_classes)
            continue
        k = next(k for k in range(1, num_classes + 1) if Fraction(sum(r > k for r in own_ranks), n) < a)
        level = a - Fraction(sum(r > k for r in own_ranks), n)
        rank = math.ceil((n + 1) * (1 - level))
        thresholds.append(own[rank - 1] if rank <= n else math.inf)
        limits.append(k)
    return thresholds, limits


def reference_clustered(scores, labels, num_classes, alpha, clustering, clusters):
    """Thresholds from a given clustering part and class-to-cluster map (the k-means itself is
    scikit-learn's): each cluster's conformal quantile over the rest, the null cluster the marginal one."""
    rest = [(float(s), int(y)) for s, y, c in zip(scores, labels, clustering) if not c]

    def quantile(values):
        values = sorted(values)
        rank = math.ceil((len(values) + 1) * (1 - Fraction(repr(alpha))))
        return values[rank - 1] if rank <= len(values) else math.inf

    null = quantile([s for s, _ in rest])
    out = []
    for y in range(num_classes):
        cluster = int(clusters[y])
        out.append(null if cluster < 0 else quantile([s for s, label in rest if int(clusters[label]) == cluster]))
    return out


def test_label_ranks_count_from_one_and_break_ties_by_class_index():
    probs = torch.tensor([[0.2, 0.5, 0.3], [0.4, 0.2, 0.4]])
    assert label_ranks(probs).tolist() == [[3, 1, 2], [1, 3, 2]]


def test_class_order_statistic_by_hand():
    scores = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 0, 1])
    # class 0: 0.1, 0.3, 0.5; class 1: 0.7, 0.9; class 2: none
    assert class_order_statistic(scores, labels, 3, torch.tensor([2, 3, 1])).tolist() == [0.3, math.inf, math.inf]
    assert class_order_statistic(scores, labels, 3, torch.tensor([3, 1, 1])).tolist() == [0.5, 0.7, math.inf]


def test_rc3p_by_hand():
    # class 0: ranks 1, 1, 2, 1 (one of four below the top); class 1: ranks 1, 3
    scores = torch.tensor([0.1, 0.2, 0.6, 0.3, 0.4, 0.8], dtype=torch.float64)
    ranks = torch.tensor([1, 1, 2, 1, 1, 3])
    labels = torch.tensor([0, 0, 0, 0, 1, 1])
    # (a finite quantile needs 3 points at alpha 0.3, 1 at 0.6: class 1's 2 points at 0.3 take the fallback, k = K)
    # alpha 0.3: class 0, k=1 misses 1/4 < 0.3 -> level 0.3 - 0.25 = 0.05, rank ceil(5 * 0.95) = 5 > 4: inf
    # class 1, k=1 misses 1/2, k=2 misses 1/2, k=3 misses 0 -> level 0.3, rank ceil(3 * 0.7) = 3 > 2: inf
    found = rc3p_calibration(scores, ranks, labels, 3, 0.3)
    assert found.rank_limits.tolist() == [1, 3, 3] and found.thresholds.tolist() == [math.inf] * 3
    # alpha 0.6: class 0, k=1 (1/4 < 0.6), level 0.35, rank ceil(5 * 0.65) = 4: 0.6; class 1, k=1 (1/2 < 0.6),
    # level 0.1, rank ceil(3 * 0.9) = 3 > 2: inf; class 2 holds no point
    found = rc3p_calibration(scores, ranks, labels, 3, 0.6)
    assert found.rank_limits.tolist() == [1, 1, 3] and found.thresholds.tolist() == [0.6, math.inf, math.inf]


@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2])
def test_rc3p_equals_the_slow_reference(alpha):
    probs, labels = problem(3, rare=(4, 11))
    scores = hps(probs)[torch.arange(len(labels)), labels]
    ranks = label_ranks(probs)[torch.arange(len(labels)), labels]
    found = rc3p_calibration(scores, ranks, labels, 20, alpha)
    thresholds, limits = reference_rc3p(scores.tolist(), ranks.tolist(), labels.tolist(), 20, alpha)
    assert found.thresholds.tolist() == thresholds and found.rank_limits.tolist() == limits


def test_rc3p_covers_every_class_on_held_out_points():
    probs, labels = problem(5, num_classes=10, per_class=2000)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cal, test = order[: len(order) // 2], order[len(order) // 2:]
    ranks = label_ranks(probs)
    found = rc3p_calibration(hps(probs)[cal, labels[cal]], ranks[cal, labels[cal]], labels[cal], 10, 0.1)
    sets = rank_sets(hps(probs)[test], found.thresholds, ranks[test], found.rank_limits)
    hit = sets[torch.arange(len(test)), labels[test]].double()
    for y in range(10):
        assert hit[labels[test] == y].mean() >= 0.9 - 0.02  # 1000 points a class: 3 standard errors
    threshold_only = hps(probs)[test] <= found.thresholds
    assert (sets <= threshold_only).all() and sets.sum() < threshold_only.sum()  # the rank limits drop labels


def test_clustering_parameters_follow_the_paper():
    # n_min = 50, K' = 20 classes with 50, n_c = floor(50 * 20 / 95) = 10: 5 clusters, fraction 10 / 50
    assert clustering_parameters(torch.tensor([50] * 20 + [60]), 0.1) == (5, 0.2)
    # a class of 3 points floors n_min at the 9 a quantile needs at alpha 0.1: n_c = floor(9 * 21 / 96) = 1
    assert clustering_parameters(torch.tensor([50] * 20 + [3]), 0.1) == (0, 1 / 9)
    assert clustering_parameters(torch.tensor([2, 2]), 0.1) == (0, 0.0)


def test_clustered_equals_the_slow_reference_with_a_null_cluster():
    probs, labels = problem(7, rare=(2, 9))
    scores = hps(probs)[torch.arange(len(labels)), labels]
    found = clustered_calibration(scores, labels, 20, 0.1, seed=1, num_clusters=4, fraction=0.3)
    assert (found.clusters[[2, 9]] == -1).all() and found.clusters.max() >= 1  # the rare classes: the null cluster
    expected = reference_clustered(scores.tolist(), labels.tolist(), 20, 0.1, found.clustering.tolist(), found.clusters.tolist())
    assert found.thresholds.tolist() == expected
    default = clustered_calibration(scores, labels, 20, 0.1, seed=1)  # 3 points in a class: too few to cluster by default
    assert not default.clustering.any() and (default.clusters == -1).all()
    assert default.thresholds.tolist() == [float(scores.kthvalue(math.ceil((len(scores) + 1) * 0.9)).values)] * 20


def test_clustered_with_too_few_classes_is_the_marginal_calibration():
    probs, labels = problem(2, num_classes=3)
    scores = hps(probs)[torch.arange(len(labels)), labels]
    found = clustered_calibration(scores, labels, 3, 0.1, seed=0, num_clusters=3, fraction=0.3)
    assert found.clusters.tolist() == [-1, -1, -1]
    rest = scores[~found.clustering]
    assert found.thresholds.tolist() == [float(rest.kthvalue(math.ceil((len(rest) + 1) * 0.9)).values)] * 3


def test_clustered_rejects_a_fraction_outside_0_1():
    probs, labels = problem(2, num_classes=3)
    with pytest.raises(ValueError, match="fraction must be in"):
        clustered_calibration(hps(probs)[torch.arange(len(labels)), labels], labels, 3, 0.1, fraction=1.0)


# ------------------------------------------------------------------ TorchCP's implementations


def torchcp_predictors():
    """TorchCP's ClusteredPredictor and RC3PPredictor, imported from their modules: the package's
    own ``__init__`` files also import its graph, LLM and loss code, which need torch_geometric,
    transformers and torchsort (a C++ build), none of them used here."""
    spec = importlib.util.find_spec("torchcp")
    assert spec is not None, "torchcp is a test dependency (pyproject.toml)"
    root = pathlib.Path(spec.origin).parent
    saved = {name: sys.modules.get(name) for name in ("torchcp", "torchcp.classification", "torchcp.classification.predictor")}
    try:
        for name, folder in (("torchcp", ""), ("torchcp.classification", "classification"),
                             ("torchcp.classification.predictor", "classification/predictor")):
            module = types.ModuleType(name)
            module.__path__ = [str(root / folder)]
            sys.modules[name] = module
        split = importlib.import_module("torchcp.classification.predictor.split")
        sys.modules["torchcp.classification.predictor"].SplitPredictor = split.SplitPredictor
        cluster = importlib.import_module("torchcp.classification.predictor.cluster")
        rc3p = importlib.import_module("torchcp.classification.predictor.rc3p")
        return cluster.ClusteredPredictor, rc3p.RC3PPredictor
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


class HPSScore:
    """TorchCP's score call shape, ``score(logits, labels=None)``, for this package's HPS (1 - p)."""

    def __call__(self, logits, labels=None):
        scores = 1.0 - logits.softmax(dim=-1)
        return scores if labels is None else scores[torch.arange(len(labels)), labels]


@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2])
def test_rc3p_equals_torchcp(alpha):
    _, RC3PPredictor = torchcp_predictors()
    probs, labels = problem(11, rare=(6,))
    logits = probs.log()
    theirs = RC3PPredictor(HPSScore(), alpha=alpha, device="cpu")
    theirs.num_classes = 20
    theirs.calculate_threshold(logits, labels, alpha)
    scores = hps(probs)[torch.arange(len(labels)), labels]
    ours = rc3p_calibration(scores, label_ranks(probs)[torch.arange(len(labels)), labels], labels, 20, alpha)
    # class 6 holds 3 points, too few for a finite quantile: TorchCP keeps the rank limit they give, here it is lifted
    others = [y for y in range(20) if y != 6]
    assert ours.rank_limits[others].tolist() == theirs.class_rank_limits[others].tolist()
    assert ours.thresholds.float().tolist() == theirs.class_thresholds.tolist()  # TorchCP keeps them in float32
    assert ours.rank_limits[6] == 20 and theirs.class_rank_limits[6] < 20 and math.isinf(ours.thresholds[6])
    theirs.class_rank_limits[6] = 20
    test_probs, _ = problem(12)
    their_sets = theirs.predict_with_logits(test_probs.log())
    assert torch.equal(rank_sets(hps(test_probs), ours.thresholds, label_ranks(test_probs), ours.rank_limits), their_sets)


def test_clustered_equals_torchcp_where_both_define_it():
    """Same split (TorchCP draws it from the global generator: seeded here as ours), same k-means
    seed, no class in the null cluster (TorchCP gives that cluster an infinite threshold where the
    paper gives it the marginal one), and clustering counts whose embedding ranks TorchCP's float32
    arithmetic gets right (it takes ceil(25 * 0.6) as 16)."""
    ClusteredPredictor, _ = torchcp_predictors()
    probs, labels = problem(13, per_class=80)
    scores = hps(probs)[torch.arange(len(labels)), labels]
    seed = 2023  # TorchCP's k-means random_state
    ours = clustered_calibration(scores, labels, 20, 0.1, seed=seed)
    clustered_counts = torch.bincount(labels[ours.clustering], minlength=20)
    for count in clustered_counts.tolist():
        for level in EMBEDDING_QUANTILES:
            assert math.ceil(torch.tensor(float(count), dtype=torch.float32) * level) == math.ceil(count * Fraction(repr(level)))
    assert (clustered_counts >= min_calibration_size(0.1)).all() and (ours.clusters >= 0).all()
    theirs = ClusteredPredictor(HPSScore(), alpha=0.1, device="cpu")
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        theirs.calculate_threshold(probs.log(), labels, 0.1)
    finally:
        torch.random.set_rng_state(state)
    assert torch.equal(theirs.idx1, ours.clustering)
    assert ours.clusters.tolist() == theirs.cluster_assignments.tolist()
    assert torch.allclose(ours.thresholds, theirs.q_hat.double(), rtol=0, atol=1e-6)  # TorchCP keeps them in float32
