"""Class-wise thresholds from few calibration points a class: clustered conformal prediction (Ding,
Fermanian, Angelopoulos, Bates, Jordan and Tibshirani, NeurIPS 2023) and rank-calibrated
class-conditional conformal prediction, RC3P (Shi, Ghosh, Belkhouja, Doppa and Yan, NeurIPS 2024).

Class-conditional ("Mondrian") calibration holds each class to the conformal quantile of its own
points: with 100+ classes and a few calibration points each, those quantiles are extreme order
statistics, or infinite (every set holds the class).  Both methods here keep a threshold per class
and need fewer points a class:

- *Clustered*: a part of the calibration points embeds each class by quantiles of its scores;
  k-means groups classes that look alike; every class then takes the conformal quantile of the
  other points of its cluster.  Classes too rare to embed share a "null" cluster, held to the
  marginal quantile of those points (the paper's ``null_qhat="standard"``).  Coverage 1 - alpha
  holds within each cluster, and approximately within each class when the clusters are alike.
- *RC3P*: class y also limits the rank of y among the model's probabilities: k_y is the smallest k
  whose class-wise top-k error eps_y^k = P(rank > k | Y = y) on the calibration points is below
  alpha, and y's score threshold is the class's conformal quantile at alpha - eps_y^{k_y} (a level
  above 1 - alpha less what the rank limit already misses).  The set is {y : S(x, y) <= q_y and
  rank(x, y) <= k_y}; class-wise coverage 1 - alpha holds as for Mondrian sets, and the rank limit
  drops labels that the threshold alone would admit.

Ranks count from 1 (the most probable class); ties go to the lower class index.  Everything is
exact: alpha and the embedding quantiles are read as the decimals they were written as
(``conformal_rank``).  Imports torch; the clustering's k-means is scikit-learn's, imported when used.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import torch

from dpsm_ray.conformal.levels import check_alpha, min_calibration_size
from dpsm_ray.conformal.metrics import class_counts
from dpsm_ray.conformal.quantile import class_conformal_quantile, class_order_statistic, conformal_quantile

# the quantiles of a class's scores that embed it for k-means (the paper's)
EMBEDDING_QUANTILES = (0.5, 0.6, 0.7, 0.8, 0.9)


def label_ranks(probs: torch.Tensor) -> torch.Tensor:
    """The rank of every class among each example's probabilities, ``[..., n, K]`` int64: 1 for the
    most probable, ties to the lower class index."""
    order = probs.argsort(dim=-1, descending=True, stable=True)
    steps = torch.arange(1, probs.shape[-1] + 1, device=probs.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, steps)


def rank_sets(scores: torch.Tensor, thresholds: torch.Tensor, ranks: torch.Tensor, rank_limits: torch.Tensor) -> torch.Tensor:
    """RC3P's sets {y : S(x, y) <= q_y and rank(x, y) <= k_y}: ``scores`` and ``ranks`` ``[..., n, K]``,
    ``thresholds`` and ``rank_limits`` ``[..., K]`` (one row per leading batch entry)."""
    within = scores <= thresholds.to(device=scores.device, dtype=scores.dtype).unsqueeze(-2)
    return within & (ranks <= rank_limits.to(ranks.device).unsqueeze(-2))


class RankCalibrated(NamedTuple):
    thresholds: torch.Tensor  # [K] q_y, the class's conformal quantile at alpha - eps_y (+inf: too few points)
    rank_limits: torch.Tensor  # [K] int64 k_y, the largest rank of y a set may hold it at (K: no limit)


def rc3p_calibration(scores: torch.Tensor, ranks: torch.Tensor, labels: torch.Tensor, num_classes: int, alpha: float) -> RankCalibrated:
    """RC3P's thresholds and rank limits from the calibration points' label scores ``[n]``, their
    labels' ranks ``[n]`` (``label_ranks`` gathered at the label) and labels ``[n]``.

    For class y with n_y points, c_y(k) of them ranked below k: k_y is the smallest k with c_y(k) /
    n_y < alpha (k = K always qualifies: c_y(K) = 0), and q_y the ceil((n_y + 1)(1 - alpha + c_y(k_y)
    / n_y))-th smallest of the class's scores, +inf when that rank exceeds n_y.  A class with fewer
    points than a finite quantile at alpha needs (``min_calibration_size``), none included: q_y = +inf
    and k_y = K, so that every set holds it (the conservative fallback, as class-conditional sets)."""
    check_alpha(alpha)
    a = Fraction(repr(float(alpha)))
    counts = class_counts(labels.cpu(), num_classes)
    by_rank = torch.zeros(num_classes, num_classes + 1, dtype=torch.int64)
    by_rank.index_put_((labels.cpu(), ranks.cpu()), torch.ones_like(labels.cpu()), accumulate=True)
    beyond = counts[:, None] - by_rank[:, 1:].cumsum(dim=1)  # [K, K]: c_y(k) for k = 1..K
    # c_y(k) / n_y < alpha  <=>  c_y(k) < alpha n_y  <=>  c_y(k) <= ceil(alpha n_y) - 1, in integers
    allowed = torch.tensor([math.ceil(a * n) - 1 for n in counts.tolist()], dtype=torch.int64)
    limits = (beyond <= allowed[:, None]).to(torch.int64).argmax(dim=1) + 1
    missed = beyond.gather(1, (limits - 1)[:, None]).squeeze(1)
    need = [math.ceil((n + 1) * (1 - a + Fraction(c, n))) if n else 1 for n, c in zip(counts.tolist(), missed.tolist())]
    thresholds = class_order_statistic(scores, labels, num_classes, torch.tensor(need, dtype=torch.int64, device=scores.device))
    # too few points for even alpha's quantile: no rank limit either, so that every set holds the class (the
    # conservative fallback of the other calibrations; TorchCP keeps the limit its one or two points give)
    limits = torch.where(counts >= min_calibration_size(alpha), limits, num_classes)
    return RankCalibrated(thresholds, limits.to(scores.device))


class Clustered(NamedTuple):
    thresholds: torch.Tensor  # [K] each class's cluster's conformal quantile (+inf: too few points in the cluster)
    clusters: torch.Tensor  # [K] int64 each class's cluster, -1 for the null cluster (the marginal quantile)
    clustering: torch.Tensor  # [n] bool: the calibration points that embedded the classes (the rest calibrate)


def clustering_parameters(counts: torch.Tensor, alpha: float) -> tuple[int, float]:
    """The paper's default number of clusters and fraction of calibration points that embed the
    classes, from the classes' calibration counts: with n_min the smallest count (at least what a
    finite quantile needs) and K' the classes holding that many, n_c = floor(n_min K' / (75 + K'))
    points a class embed it, in floor(n_c / 2) clusters; the fraction is n_c / n_min."""
    n_min = max(int(counts.min()), min_calibration_size(alpha))
    remaining = int((counts >= n_min).sum())
    n_clustering = (n_min * remaining) // (75 + remaining)
    return n_clustering // 2, n_clustering / n_min


def clustered_calibration(
    scores: torch.Tensor, labels: torch.Tensor, num_classes: int, alpha: float, *, seed: int = 0, num_clusters: int | None = None,
    fraction: float | None = None,
) -> Clustered:
    """Clustered conformal thresholds from the calibration points' label scores ``[n]`` and labels
    ``[n]``.  Each point joins the clustering part with probability ``fraction`` (a generator seeded
    by ``seed``); ``num_clusters`` and ``fraction`` default to ``clustering_parameters``.  On the
    clustering part, every class with enough points for a finite quantile at ``alpha`` is embedded by
    the ``EMBEDDING_QUANTILES`` of its scores (the ceil(n q)-th smallest) and k-means (10
    initialisations from ``seed``, each class weighted by the square root of its points) groups them;
    the other classes form the null cluster.  With fewer than two clusters or no fewer clusters than
    classes (the defaults': n_c below 4, or at least 2K -- ten classes cluster with 34 to 169 points in
    the smallest, 141 classes with up to 431), no point clusters and every class is in the null cluster:
    the sets are the marginal ones; so too, from the calibration points left, with no more embeddable
    classes than clusters."""
    check_alpha(alpha)
    counts = class_counts(labels.cpu(), num_classes)
    if fraction is not None and not 0 < fraction < 1:
        raise ValueError(f"clustered calibration: the clustering fraction must be in (0, 1); got {fraction}")
    default_clusters, default_fraction = clustering_parameters(counts, alpha)
    num_clusters = default_clusters if num_clusters is None else num_clusters
    fraction = default_fraction if fraction is None else fraction
    if not 2 <= num_clusters < num_classes:  # nothing to cluster (the defaults: few points a class, or few classes): all calibrate
        fraction = 0.0
    clustering = (torch.rand(len(labels), generator=torch.Generator().manual_seed(seed)) < fraction).to(labels.device)
    clusters = _cluster_classes(scores[clustering], labels[clustering], num_classes, alpha, num_clusters, seed)
    rest, rest_labels = scores[~clustering], labels[~clustering]
    groups = clusters.to(labels.device)[rest_labels]
    named = clusters.max().item() + 1
    member = groups >= 0
    by_cluster = class_conformal_quantile(rest[member], groups[member], max(named, 1), alpha)
    null = conformal_quantile(rest, alpha)
    thresholds = torch.where(clusters.to(scores.device) >= 0, by_cluster[clusters.clamp(min=0).to(scores.device)], null)
    return Clustered(thresholds.to(scores.device), clusters.to(scores.device), clustering)


def _cluster_classes(scores: torch.Tensor, labels: torch.Tensor, num_classes: int, alpha: float, num_clusters: int, seed: int):
    """Each class's cluster, ``[K]`` int64 (-1: the null cluster), from the clustering part's label
    scores and labels (``clustered_calibration``)."""
    counts = class_counts(labels.cpu(), num_classes)
    embeddable = (counts >= min_calibration_size(alpha)).nonzero().flatten().tolist()
    clusters = torch.full((num_classes,), -1, dtype=torch.int64)
    if len(embeddable) <= num_clusters or num_clusters < 2:
        return clusters
    from sklearn.cluster import KMeans

    scores, labels = scores.detach().cpu().to(torch.float64), labels.cpu()
    embedding = torch.empty(len(embeddable), len(EMBEDDING_QUANTILES), dtype=torch.float64)
    for row, label in enumerate(embeddable):
        own, n = scores[labels == label], int(counts[label])
        for column, level in enumerate(EMBEDDING_QUANTILES):
            embedding[row, column] = own.kthvalue(math.ceil(n * Fraction(repr(level)))).values
    weights = counts[embeddable].to(torch.float64).sqrt()
    found = KMeans(n_clusters=num_clusters, n_init=10, random_state=seed % 2**32).fit(embedding.numpy(), sample_weight=weights.numpy())
    clusters[embeddable] = torch.from_numpy(found.labels_).to(torch.int64)
    return clusters
