"""Prediction sets and the paper's metrics (section 5, appendix E).

Every function accepts leading batch dimensions (one per calibration re-split), so R re-splits are
evaluated in one call: ``sets`` is ``[..., n, K]`` boolean, ``labels`` is ``[..., n]``.
"""

from __future__ import annotations

import math

import torch


# Set-size strata for SSCV (Angelopoulos et al. 2021): inclusive [low, high] bounds.  Sizes above
# the last bound (only possible with K > 1000 classes) are counted in the last stratum.
SSCV_BINS = ((0, 1), (2, 3), (4, 10), (11, 100), (101, 1000))


def prediction_sets(scores: torch.Tensor, q: torch.Tensor | float) -> torch.Tensor:
    """C(x) = {y : S(x, y) <= q}.  ``q`` is a scalar or one threshold per leading batch entry
    (shape ``[...]``, broadcast over examples and labels)."""
    q = torch.as_tensor(q, dtype=scores.dtype, device=scores.device)
    return scores <= q[..., None, None] if q.ndim else scores <= q


def class_prediction_sets(scores: torch.Tensor, class_q: torch.Tensor) -> torch.Tensor:
    """C(x) = {y : S(x, y) <= q_y}: a threshold per class (``class_conformal_quantile``), ``class_q``
    ``[..., K]`` with one row per leading batch entry of ``scores`` ``[..., n, K]``."""
    return scores <= class_q.to(device=scores.device, dtype=scores.dtype).unsqueeze(-2)


def covered(sets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Whether each example's true label is in its set, ``[..., n]`` boolean."""
    return sets.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def coverage(sets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Marginal coverage: the fraction of examples whose label is in the set."""
    return covered(sets, labels).to(torch.float64).mean(dim=-1)


def set_size(sets: torch.Tensor) -> torch.Tensor:
    """Average prediction set size (APSS)."""
    return sets.sum(dim=-1).to(torch.float64).mean(dim=-1)


def soft_set_size(scores: torch.Tensor, q: torch.Tensor | float, temperature: float) -> torch.Tensor:
    """Mean over x of sum_y sigmoid((q - S(x, y)) / T): the differentiable set size.

    ``T`` is the paper's tau_Sigmoid.  Stays differentiable in ``scores`` (and in ``q`` if it is a
    tensor that requires grad), which is how ConfTr and DPSM train on it.
    """
    if temperature <= 0:
        raise ValueError(f"sigmoid temperature must be > 0; got {temperature}")
    q = torch.as_tensor(q, dtype=scores.dtype, device=scores.device)
    if q.ndim:
        q = q[..., None, None]
    return torch.sigmoid((q - scores) / temperature).sum(dim=-1).mean(dim=-1)


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy."""
    return (probs.argmax(dim=-1) == labels).to(torch.float64).mean(dim=-1)


def class_counts(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Examples of each class, ``[..., K]`` int64."""
    shape = (*labels.shape[:-1], num_classes)
    return torch.zeros(shape, dtype=torch.int64, device=labels.device).scatter_add_(-1, labels, torch.ones_like(labels))


def _class_mean(values: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Mean of ``values`` ``[..., n]`` over the examples of each class, ``[..., K]``; NaN for a
    class with no example."""
    shape = (*labels.shape[:-1], num_classes)
    sums = torch.zeros(shape, dtype=torch.float64, device=labels.device).scatter_add_(-1, labels, values.to(torch.float64))
    counts = class_counts(labels, num_classes)
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.nan)


def class_coverage(sets: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Coverage of each class, ``[..., K]``; NaN for a class with no example."""
    return _class_mean(covered(sets, labels), labels, num_classes)


def class_set_size(sets: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Average set size over the examples of each class, ``[..., K]``; NaN for a class with no
    example."""
    return _class_mean(sets.sum(dim=-1), labels, num_classes)


def covgap(sets: torch.Tensor, labels: torch.Tensor, alpha: float) -> torch.Tensor:
    """CovGap (Ding et al. 2023), in percent: mean over the classes present of
    |class coverage - (1 - alpha)|."""
    per_class = class_coverage(sets, labels, sets.shape[-1])
    return 100.0 * (per_class - (1 - alpha)).abs().nanmean(dim=-1)


def sscv(
    sets: torch.Tensor, labels: torch.Tensor, alpha: float, bins: tuple[tuple[int, int], ...] = SSCV_BINS
) -> torch.Tensor:
    """Size-stratified coverage violation: max over non-empty size strata of
    |coverage in the stratum - (1 - alpha)|."""
    sizes = sets.sum(dim=-1)
    hit = covered(sets, labels).to(torch.float64)
    worst = torch.zeros(sizes.shape[:-1], dtype=torch.float64, device=sets.device)
    for index, (low, high) in enumerate(bins):
        high = math.inf if index == len(bins) - 1 else high
        member = ((sizes >= low) & (sizes <= high)).to(torch.float64)
        count = member.sum(dim=-1)
        violation = ((hit * member).sum(dim=-1) / count.clamp(min=1) - (1 - alpha)).abs()
        worst = torch.where(count > 0, torch.maximum(worst, violation), worst)
    return worst


def worst_slab(
    features: torch.Tensor, covered: torch.Tensor, directions: torch.Tensor, delta: float, grid: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slab {x : low <= v.x <= high} of lowest coverage among those holding >= ``delta`` of
    the points, searched over the rows of ``directions`` (``[M, d]``) and, per direction, over slab
    edges at ``grid + 1`` evenly spaced order statistics of v.x.

    ``features`` ``[B, n, d]``, ``covered`` ``[B, n]``; returns per batch row the index of the
    direction, ``low``, ``high`` and the slab's coverage on these points.
    """
    return _worst_of(_sorted_projections(features, directions), covered, delta, grid)


def _sorted_projections(features: torch.Tensor, directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v.x of every point ``[B, n, d]`` on every direction ``[M, d]``, sorted per direction: the
    values and the order, ``[B, M, n]``.  Most of the slab search's time, and the same for every
    ``covered`` of the same points."""
    return (features @ directions.T).transpose(1, 2).sort(dim=-1)


def _worst_of(projections: tuple[torch.Tensor, torch.Tensor], covered: torch.Tensor, delta: float, grid: int):
    """``worst_slab`` from the points' sorted projections."""
    z_sorted, z_order = projections
    n = covered.shape[-1]
    hit_sorted = covered.unsqueeze(1).expand(-1, z_order.shape[1], -1).gather(-1, z_order)
    prefix = torch.nn.functional.pad(hit_sorted.to(torch.float64).cumsum(-1), (1, 0))  # [B, M, n+1]
    edges = torch.round(torch.linspace(0, n, grid + 1, dtype=torch.float64)).long().to(z_sorted.device)
    cum = prefix[..., edges]  # [B, M, G+1]
    count = edges[None, :] - edges[:, None]  # slab [a, b) holds sorted positions edges[a] .. edges[b]-1
    slab_cov = (cum[..., None, :] - cum[..., :, None]) / count.clamp(min=1)
    slab_cov = torch.where(count >= max(1, math.ceil(delta * n)), slab_cov, torch.inf)
    best = slab_cov.flatten(1).argmin(dim=1)
    m, a, b = torch.unravel_index(best, slab_cov.shape[1:])
    rows = torch.arange(z_sorted.shape[0], device=z_sorted.device)
    return m, z_sorted[rows, m, edges[a]], z_sorted[rows, m, edges[b] - 1], slab_cov[rows, m, a, b]


class Slabs:
    """:func:`wsc`'s search over fixed points ``features`` ``[..., n, d]``: its random unit
    directions, its fit/held-out split and the fit part's sorted projections, made once; then
    ``coverage(covered)`` is the WSC of any ``covered`` ``[..., n]`` of these points.  An evaluation
    shares one between every score and calibration of a test part: projecting and sorting is most of
    WSC's time (16.5 of 22 s for CIFAR-100's 7000 test points x 10 re-splits on 2 cores)."""

    def __init__(
        self, features: torch.Tensor, *, delta: float = 0.1, directions: int = 256, grid: int = 40, fit_fraction: float = 0.5,
        seed: int = 0,
    ) -> None:
        if not 0 < delta <= 1:
            raise ValueError(f"wsc: delta must be in (0, 1]; got {delta}")
        self.shape, self.delta, self.grid = features.shape[:-1], delta, grid
        n, dim = features.shape[-2], features.shape[-1]
        x = features.reshape(-1, n, dim).to(torch.float64)
        generator = torch.Generator().manual_seed(seed)
        v = torch.randn(directions, dim, generator=generator, dtype=torch.float64)
        self.directions = (v / v.norm(dim=1, keepdim=True).clamp(min=1e-12)).to(x.device)
        order = torch.rand(x.shape[0], n, generator=generator).argsort(dim=1).to(x.device)
        n_fit = max(1, min(n - 1, int(n * fit_fraction)))
        self.fit, self.held = order[:, :n_fit], order[:, n_fit:]
        self.projections = _sorted_projections(_gather_points(x, self.fit), self.directions)
        self.held_points = _gather_points(x, self.held)
        # A held-out point with the features of a slab edge is in the slab, however its projection
        # rounds (a sum here, a matrix product for the edges): the edges widen by the rounding bound of
        # a d-term dot product, d eps |x| with |v| = 1.  Without it a model whose outputs are the same
        # for every input (one at chance) got a slab [c, c] that no held-out point fell in: WSC NaN.
        self.slack = 4 * dim * torch.finfo(torch.float64).eps * x.norm(dim=-1).amax(dim=-1)

    def coverage(self, covered: torch.Tensor) -> torch.Tensor:
        if covered.dtype != torch.bool:
            raise TypeError(f"wsc: covered must be a boolean tensor (is the label in the set?); got {covered.dtype}")
        if covered.shape != self.shape:
            raise ValueError(f"wsc: features {tuple(self.shape)} (without their last dim) and covered {tuple(covered.shape)} disagree")
        hit = covered.reshape(-1, covered.shape[-1])
        m, low, high, _ = _worst_of(self.projections, hit.gather(1, self.fit), self.delta, self.grid)
        z_held = (self.held_points * self.directions[m][:, None, :]).sum(-1)
        inside = (z_held >= (low - self.slack)[:, None]) & (z_held <= (high + self.slack)[:, None])
        inside_hits = (hit.gather(1, self.held) & inside).sum(1).to(torch.float64)
        result = torch.where(inside.any(1), inside_hits / inside.sum(1).clamp(min=1), torch.nan)
        return result.reshape(self.shape[:-1])


def wsc(
    features: torch.Tensor,
    covered: torch.Tensor,
    *,
    delta: float = 0.1,
    directions: int = 256,
    grid: int = 40,
    fit_fraction: float = 0.5,
    seed: int = 0,
) -> torch.Tensor:
    """Worst-slab coverage (Romano et al. 2020), estimated without selection bias.

    Each row of ``features`` (``[..., n, d]``) is split at random: on the first ``fit_fraction``
    :func:`worst_slab` picks the lowest-coverage slab over ``directions`` random unit directions;
    the returned value is that slab's coverage on the other part (NaN if no held-out point falls
    in it: too few test points).  ``covered`` is the boolean ``[..., n]`` from :func:`covered` --
    never the labels, a mix-up a peer library makes silently.  (:class:`Slabs` does the same for
    several ``covered`` of the same points.)
    """
    if covered.dtype != torch.bool:
        raise TypeError(f"wsc: covered must be a boolean tensor (is the label in the set?); got {covered.dtype}")
    if features.shape[:-1] != covered.shape:
        raise ValueError(f"wsc: features {tuple(features.shape)} and covered {tuple(covered.shape)} disagree")
    slabs = Slabs(features, delta=delta, directions=directions, grid=grid, fit_fraction=fit_fraction, seed=seed)
    return slabs.coverage(covered)


def _gather_points(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, i], :]`` for ``x`` ``[B, n, d]`` and ``index`` ``[B, k]``."""
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


def empty_rate(sets: torch.Tensor) -> torch.Tensor:
    """The fraction of prediction sets with no class."""
    return (sets.sum(dim=-1) == 0).to(torch.float64).mean(dim=-1)


def singleton_rate(sets: torch.Tensor) -> torch.Tensor:
    """The fraction of prediction sets with exactly one class."""
    return (sets.sum(dim=-1) == 1).to(torch.float64).mean(dim=-1)


def classes_under(sets: torch.Tensor, labels: torch.Tensor, alpha: float) -> torch.Tensor:
    """The number of classes (among those with a test point) whose coverage is below 1 - alpha
    (TorchCP's VioClasses), ``[...]`` int64."""
    return (class_coverage(sets, labels, sets.shape[-1]) < 1 - alpha).sum(dim=-1)


def class_coverage_range(sets: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest and highest coverage of a class, over the classes with a test point."""
    per_class = class_coverage(sets, labels, sets.shape[-1])
    present = ~per_class.isnan()
    low = torch.where(present, per_class, torch.inf).amin(dim=-1)
    high = torch.where(present, per_class, -torch.inf).amax(dim=-1)
    return low, high


def top_label_ece(probs: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> torch.Tensor:
    """Expected calibration error of the top class's probability (Guo et al. 2017): the points
    binned by that probability into ``bins`` equal-width bins of (0, 1] (bin b holds (b/B, (b+1)/B]),
    sum over bins of (points in the bin / n) x |accuracy in the bin - mean probability in the bin|."""
    confidence, predicted = probs.to(torch.float64).max(dim=-1)
    correct = (predicted == labels).to(torch.float64)
    index = (confidence * bins).ceil().long().clamp(min=1, max=bins) - 1
    shape = (*confidence.shape[:-1], bins)
    # a bin's (points / n) x |accuracy - mean probability| is |its sum of (correct - probability)| / n
    gap = torch.zeros(shape, dtype=torch.float64, device=probs.device).scatter_add_(-1, index, correct - confidence)
    return gap.abs().sum(dim=-1) / confidence.shape[-1]
