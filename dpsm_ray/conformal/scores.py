"""Non-conformity scores S(x, y) for every label at once (paper appendix A).

Every score has the same call shape: probabilities ``[n, K]`` in, scores ``[n, K]`` out, so the
scores are interchangeable everywhere (calibration, prediction sets, training).  A label's own
score is ``label_scores(matrix, y)``.  The scores by their card's name (``hps``, ``aps``, ``raps``
and any registered one): ``dpsm_ray.cards.score_matrix``.
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


def label_scores(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The score of each example's own label: ``[..., n, K]`` and ``[..., n]`` -> ``[..., n]``."""
    return scores.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def example_uniforms(seed: int, example_ids: torch.Tensor) -> torch.Tensor:
    """U ~ Unif(0, 1) for each example, a pure function of ``(seed, example id)``.

    Counter-based rather than drawn from a stateful generator, so an example's U -- and therefore
    its APS/RAPS prediction set -- never depends on batch size, worker count or evaluation order.
    """
    return counter_uniforms(seed, example_ids)
