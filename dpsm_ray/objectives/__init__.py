"""Training objectives with one call shape: ``objective(logits1, labels1, logits2, labels2)``
on a batch B1 and B2, returning the loss and its diagnostics."""

from dpsm_ray.catalog import BASE_MODEL, CE_BATCHES, METHODS, PAPER_METHODS
from dpsm_ray.objectives.base import Objective, ObjectiveOutput, hps_scores
from dpsm_ray.objectives.ce import CrossEntropy
from dpsm_ray.objectives.conftr import CONFTR_SPLITS, ConfTr, ConfTrPublished
from dpsm_ray.objectives.cut import CUT, CUT_SCORES, ks_to_uniform
from dpsm_ray.objectives.dpsm import DPSM, Q_INITS, SPLITS


def build_objective(
    method: str,
    *,
    alpha: float,
    conformal_weight: float,
    sigmoid_temperature: float,
    sort_temperature: float,
    quantile_lr: float,
    q_init: str = "dataset",
    conftr_split: str = "halves",
    cut_score: str = "hps",
    ce_batch: str = "full",
    dpsm_split: str = "halves",
    size_target: float = 0.0,
    ce_weight: float = 0.0,
    seed: int = 0,
    collective=None,
) -> Objective:
    """``seed`` is the run seed: DPSM's random q_0 and CUT's APS uniforms derive from it."""
    common = {"alpha": alpha, "conformal_weight": conformal_weight, "collective": collective}
    if method in ("ce", BASE_MODEL):
        return CrossEntropy(**common)
    if method == "conftr":
        return ConfTr(sigmoid_temperature=sigmoid_temperature, sort_temperature=sort_temperature, split=conftr_split, **common)
    if method == "conftr_published":
        return ConfTrPublished(sigmoid_temperature=sigmoid_temperature, sort_temperature=sort_temperature, size_target=size_target, ce_weight=ce_weight, **common)
    if method == "cut":
        return CUT(sort_temperature=sort_temperature, score=cut_score, seed=seed, ce_batch=ce_batch, **common)
    if method == "dpsm":
        return DPSM(sigmoid_temperature=sigmoid_temperature, quantile_lr=quantile_lr, q_init=q_init, seed=seed, ce_batch=ce_batch, split=dpsm_split, **common)
    raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")


__all__ = [
    "BASE_MODEL", "CE_BATCHES", "CONFTR_SPLITS", "CUT", "CUT_SCORES", "DPSM", "METHODS", "PAPER_METHODS", "Q_INITS", "SPLITS", "ConfTr", "ConfTrPublished", "CrossEntropy",
    "Objective", "ObjectiveOutput", "build_objective", "hps_scores", "ks_to_uniform",
]
