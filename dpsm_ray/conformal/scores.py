"""Non-conformity scores S(x, y) for every label at once (paper appendix A; SAPS, top-k and margin
from the papers each docstring names).

Every score has the same call shape: probabilities ``[n, K]`` in, scores ``[n, K]`` out, so the
scores are interchangeable everywhere (calibration, prediction sets, training).  A label's own
score is ``label_scores(matrix, y)``.  The scores by their card's name (``hps``, ``aps``, ``raps``,
``saps``, ``topk``, ``margin`` and any registered one): ``dpsm_ray.cards.score_matrix``.

The rank-based scores (APS, RAPS, SAPS, top-k) rank labels by probability, descending, tied
probabilities by class index (a stable sort, lower index first), and take one uniform U per
example (``example_uniforms``), U = 1 when not randomised.
"""

from __future__ import annotations

import torch

from dpsm_ray.seeding import counter_uniforms


def hps_matrix(probs: torch.Tensor) -> torch.Tensor:
    """HPS (THR / LAC): ``1 - p_y``."""
    return 1.0 - probs


def aps_matrix(probs: torch.Tensor, u: torch.Tensor | None, *, penalty: float = 0.0, k_reg: int = 0) -> torch.Tensor:
    """APS: the probability mass ranked strictly above ``y`` plus ``U * p_y``; with ``penalty``,
    RAPS: plus ``penalty * max(0, rank(y) - k_reg)``, rank 1-based (the paper's lambda).  Tied
    probabilities are ranked by class index (a stable sort), lower index first."""
    sorted_probs, order = probs.sort(dim=1, descending=True, stable=True)
    mass_above = sorted_probs.cumsum(dim=1) - sorted_probs
    weight = 1.0 if u is None else u.to(probs.dtype)[:, None]
    sorted_scores = mass_above + weight * sorted_probs
    if penalty:
        rank = torch.arange(1, probs.shape[1] + 1, device=probs.device, dtype=probs.dtype)
        sorted_scores = sorted_scores + penalty * (rank - k_reg).clamp(min=0)
    return torch.empty_like(sorted_scores).scatter_(1, order, sorted_scores)


def saps_matrix(probs: torch.Tensor, u: torch.Tensor | None, *, weight: float) -> torch.Tensor:
    """SAPS, sorted adaptive prediction sets (Huang et al., "Conformal prediction for deep classifier
    via label ranking", ICML 2024, section 4, Eq. 10): of the probabilities only the largest, p_max,
    is kept, and a label's rank o(y) (1-based) does the rest::

        S(x, y, u; lambda) = u * p_max                          if o(y) = 1
                             p_max + (o(y) - 2 + u) * lambda    otherwise

    ``weight`` is lambda (the card's default 0.2 is TorchCP's); ``u`` None means U = 1."""
    sorted_probs, order = probs.sort(dim=1, descending=True, stable=True)
    rank = torch.arange(1, probs.shape[1] + 1, device=probs.device, dtype=probs.dtype)
    p_max = sorted_probs[:, :1]
    uniform = torch.ones_like(p_max) if u is None else u.to(probs.dtype)[:, None]
    sorted_scores = torch.where(rank == 1, uniform * p_max, p_max + (rank - 2 + uniform) * weight)
    return torch.empty_like(sorted_scores).scatter_(1, order, sorted_scores)


def topk_matrix(probs: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """Top-k: the label's rank, ``o(y) - 1 + U``.  With U = 1 it is the rank itself, whose sets are
    the k most probable labels for one calibrated k (the Top-K of Angelopoulos et al., "Uncertainty
    sets for image classifiers using conformal prediction", ICLR 2021).  Randomised as TorchCP's
    TOPK: APS's score with every probability replaced by 1, so a set holds the top k - 1 labels and
    the k-th for a share of the examples, and coverage lands on 1 - alpha instead of jumping past it."""
    order = probs.argsort(dim=1, descending=True, stable=True)
    rank = torch.arange(1, probs.shape[1] + 1, device=probs.device, dtype=probs.dtype).expand_as(probs)
    uniform = 1.0 if u is None else u.to(probs.dtype)[:, None]
    return torch.empty_like(probs).scatter_(1, order, rank - 1 + uniform)


def margin_matrix(probs: torch.Tensor) -> torch.Tensor:
    """Margin: ``max_{y' != y} p_y' - p_y`` (Löfström et al., "Bias reduction through conditional
    conformal prediction", 2015, as TorchCP's Margin), in [-1, 1]: negative for the top label, the
    gap to the top for any other; two tied top labels both score 0.  Not randomised."""
    top2 = probs.topk(2, dim=1).values
    best_other = torch.where(probs.argmax(dim=1, keepdim=True) == torch.arange(probs.shape[1], device=probs.device),
                             top2[:, 1:2], top2[:, :1])
    return best_other - probs


def label_scores(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The score of each example's own label: ``[..., n, K]`` and ``[..., n]`` -> ``[..., n]``."""
    return scores.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def example_uniforms(seed: int, example_ids: torch.Tensor) -> torch.Tensor:
    """U ~ Unif(0, 1) for each example, a pure function of ``(seed, example id)``.

    Counter-based rather than drawn from a stateful generator, so an example's U -- and therefore
    its APS/RAPS prediction set -- never depends on batch size, worker count or evaluation order.
    """
    return counter_uniforms(seed, example_ids)
