"""Non-conformity scores S(x, y) for every label at once (paper appendix A).

Every score has the same call shape: probabilities ``[n, K]`` in, scores ``[n, K]`` out, so the
scores are interchangeable everywhere (calibration, prediction sets, training).  A label's own
score is ``score_matrix(...).gather(1, y[:, None])``.
"""

from __future__ import annotations

import torch

from dpsm_ray.catalog import SCORE_KINDS
from dpsm_ray.seeding import counter_uniforms

# RAPS's regularisation (Angelopoulos et al. 2021): lambda per rank beyond k_reg
RAPS_LAMBDA = 0.01
RAPS_K_REG = 5


def check_score_kind(kind: str) -> str:
    if kind not in SCORE_KINDS:
        raise ValueError(f"score kind must be one of {', '.join(SCORE_KINDS)}; got {kind!r}")
    return kind


def score_matrix(
    probs: torch.Tensor,
    kind: str,
    *,
    u: torch.Tensor | None = None,
    raps_lambda: float = RAPS_LAMBDA,
    raps_k_reg: int = RAPS_K_REG,
) -> torch.Tensor:
    """Scores of every label, ``[n, K]``; smaller means more conforming.

    - ``hps`` (THR / LAC): ``1 - p_y``.
    - ``aps``: the probability mass ranked strictly above ``y`` plus ``U * p_y``.
    - ``raps``: APS plus ``raps_lambda * max(0, rank(y) - raps_k_reg)``, rank 1-based.

    ``u`` is one uniform per example (shape ``[n]``), shared by all labels of that example so
    that APS/RAPS sets stay prefixes of the sorted labels; ``None`` means U = 1 (not randomised).
    Tied probabilities are ranked by class index (a stable sort), lower index first.
    """
    check_score_kind(kind)
    if probs.ndim != 2:
        raise ValueError(f"probs must have shape [n, K]; got {tuple(probs.shape)}")
    if kind == "hps":
        return 1.0 - probs
    sorted_probs, order = probs.sort(dim=1, descending=True, stable=True)
    mass_above = sorted_probs.cumsum(dim=1) - sorted_probs
    weight = 1.0 if u is None else u.to(probs.dtype)[:, None]
    sorted_scores = mass_above + weight * sorted_probs
    if kind == "raps":
        rank = torch.arange(1, probs.shape[1] + 1, device=probs.device, dtype=probs.dtype)
        sorted_scores = sorted_scores + raps_lambda * (rank - raps_k_reg).clamp(min=0)
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
