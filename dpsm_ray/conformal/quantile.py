"""Quantiles of scores: the exact conformal order statistic, the pinball-loss quantile, and smooth
(differentiable) versions of both for training.

All functions work along the last dimension, so a batch of independent score sets (one per
calibration re-split) is one call.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from dpsm_ray.conformal.levels import check_alpha
from dpsm_ray.conformal.metrics import class_counts


def conformal_rank(n: int, alpha: float) -> int:
    """ceil((n + 1)(1 - alpha)), computed exactly.

    ``alpha`` is read as the decimal it was written as (0.1 is 1/10, not the nearest binary
    float), so ranks that land on an integer are not pushed up by rounding: with n = 9 and
    alpha = 0.7, float arithmetic gives ceil(3.0000000000000004) = 4 instead of 3.
    """
    check_alpha(alpha)
    return math.ceil((n + 1) * (1 - Fraction(repr(float(alpha)))))


def empirical_rank(n: int, level: float) -> int:
    """ceil(n * level): the rank of the smallest minimiser of the average pinball loss at ``level``.

    ``level`` is usually computed as ``1 - alpha`` in floats (1 - 0.7 = 0.30000000000000004), so it
    is read as the nearest fraction with a denominator up to 10^9 (3/10): n = 10 then gives rank 3,
    not 4."""
    return max(1, math.ceil(n * Fraction(repr(float(level))).limit_denominator(10**9)))


def conformal_quantile(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """q_hat: the ceil((n + 1)(1 - alpha))-th smallest of the n calibration scores (last dim).

    Returns +inf where that rank exceeds n (n < 1/alpha - 1): the prediction sets are then every
    label, which is the only choice that keeps the coverage guarantee.
    """
    n = scores.shape[-1]
    rank = conformal_rank(n, alpha)
    if rank > n:
        return torch.full(scores.shape[:-1], math.inf, dtype=scores.dtype, device=scores.device)
    return scores.kthvalue(rank, dim=-1).values


def class_conformal_quantile(scores: torch.Tensor, labels: torch.Tensor, num_classes: int, alpha: float) -> torch.Tensor:
    """q_hat of each class (class-conditional, "Mondrian" split conformal: Vovk et al. 2003; Sadinle,
    Lei and Wasserman, JASA 2019, class-specific coverage): for class y, the ceil((n_y + 1)(1 - alpha))-th smallest of the n_y
    calibration scores whose label is y.  ``scores`` and ``labels`` ``[..., n]``; returns ``[..., K]``.

    Sets {y : S(x, y) <= q_hat_y} then cover every class: P(Y in C(X) | Y = y) >= 1 - alpha.  A
    class with too few points for its alpha (n_y < ``min_calibration_size(alpha)``, none at all
    included) gets +inf, as ``conformal_quantile`` does: every set holds that class, the only
    threshold that keeps its guarantee (the conservative fallback)."""
    counts = class_counts(labels, num_classes)
    ranks = torch.tensor([conformal_rank(size, alpha) for size in range(scores.shape[-1] + 1)], device=counts.device)[counts]
    return class_order_statistic(scores, labels, num_classes, ranks)


def class_order_statistic(scores: torch.Tensor, labels: torch.Tensor, num_classes: int, ranks: torch.Tensor) -> torch.Tensor:
    """The ``ranks[y]``-th smallest of the scores whose label is y, for each class: ``scores`` and
    ``labels`` ``[..., n]``, ``ranks`` ``[..., K]`` (from 1); +inf where the class holds fewer points
    than its rank (none at all included)."""
    n = scores.shape[-1]
    counts = class_counts(labels, num_classes)
    ranks = ranks.to(counts.device).expand_as(counts)
    if n == 0:
        return torch.full(counts.shape, math.inf, dtype=scores.dtype, device=scores.device)
    # ascending scores, then a stable sort by label: each class's scores ascending, the classes in turn
    by_score = scores.argsort(dim=-1, stable=True)
    by_class = by_score.gather(-1, labels.gather(-1, by_score).argsort(dim=-1, stable=True))
    grouped = scores.gather(-1, by_class)
    position = (counts.cumsum(dim=-1) - counts + ranks - 1).clamp(min=0, max=n - 1)
    return torch.where(ranks <= counts, grouped.gather(-1, position), torch.full_like(position, math.inf, dtype=scores.dtype))


def empirical_quantile(scores: torch.Tensor, level: float) -> torch.Tensor:
    """Q_n: the ceil(n * level)-th smallest score (last dim), a minimiser of the average pinball
    loss rho at ``level = 1 - alpha``.  The dataset-level target that DPSM's q tracks."""
    return scores.kthvalue(empirical_rank(scores.shape[-1], level), dim=-1).values


def pinball_loss(q: torch.Tensor | float, scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """Mean over the last dim of rho_alpha(q, s) = (1 - alpha)(s - q) if s >= q else alpha (q - s)."""
    diff = scores - q
    return torch.where(diff >= 0, (1 - alpha) * diff, -alpha * diff).mean(dim=-1)


def pinball_grad(q: torch.Tensor | float, scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """d/dq of ``pinball_loss``: mean(1[s < q]) - (1 - alpha)  (a subgradient at ties)."""
    return (scores < q).to(scores.dtype).mean(dim=-1) - (1 - alpha)


def _neuralsort_rows(values: torch.Tensor, ranks: torch.Tensor, temperature: float) -> torch.Tensor:
    """Rows of the relaxed ascending-sort permutation (NeuralSort, Grover et al. 2019).

    Row k is softmax(((2k - n - 1) s - sum_j |s - s_j|) / temperature): it puts its weight on the
    k-th smallest value and becomes that one-hot row as temperature -> 0.  O(n^2) memory: meant for
    mini-batches of scores, not whole datasets.
    """
    if temperature <= 0:
        raise ValueError(f"soft sort temperature must be > 0; got {temperature}")
    n = values.shape[-1]
    spread = (values.unsqueeze(-1) - values.unsqueeze(-2)).abs().sum(dim=-1)  # [..., n]
    coefficient = (2 * ranks.to(values.dtype) - n - 1).unsqueeze(-1)  # [r, 1]
    logits = coefficient * values.unsqueeze(-2) - spread.unsqueeze(-2)  # [..., r, n]
    return (logits / temperature).softmax(dim=-1)


def soft_sort(values: torch.Tensor, temperature: float) -> torch.Tensor:
    """Differentiable ascending sort of the last dim; tends to ``values.sort().values`` as
    temperature -> 0."""
    ranks = torch.arange(1, values.shape[-1] + 1, device=values.device)
    rows = _neuralsort_rows(values, ranks, temperature)
    return (rows * values.unsqueeze(-2)).sum(dim=-1)


def smooth_quantile(scores: torch.Tensor, alpha: float, temperature: float) -> torch.Tensor:
    """Differentiable conformal quantile of a batch: the soft-sorted value at the conformal rank
    (capped at n, since an infinite threshold carries no training signal).  Tends to
    ``hard_batch_quantile`` as temperature -> 0; ConfTr's smooth batch quantile (Stutz et al. 2021).
    The rank sits in the upper (1 - alpha) tail of the non-conformity scores, never at alpha.
    """
    rank = min(conformal_rank(scores.shape[-1], alpha), scores.shape[-1])
    # a fill on the device, not a host-to-device copy (allowed inside a captured CUDA graph)
    rows = _neuralsort_rows(scores, torch.full((1,), rank, device=scores.device), temperature)
    return (rows.squeeze(-2) * scores).sum(dim=-1)


def hard_batch_quantile(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """The conformal order statistic of a batch, capped at rank n; differentiable with respect
    to the selected score (ConfTr's hard batch quantile)."""
    n = scores.shape[-1]
    rank = min(conformal_rank(n, alpha), n)
    return scores.sort(dim=-1).values[..., rank - 1]
