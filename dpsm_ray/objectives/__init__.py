"""Training objectives with one call shape: ``objective(logits1, labels1, logits2, labels2)``
on a batch B1 from D1 and B2 from D2, returning the loss and its diagnostics."""

from dpsm_ray.objectives.base import Objective, ObjectiveOutput, hps_scores
from dpsm_ray.objectives.ce import CrossEntropy
from dpsm_ray.objectives.conftr import CONFTR_SPLITS, ConfTr
from dpsm_ray.objectives.cut import CUT, CUT_SCORES, ks_to_uniform
from dpsm_ray.objectives.dpsm import DPSM, Q_INITS

METHODS = ("ce", "conftr", "cut", "dpsm")


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
    seed: int = 0,
    collective=None,
) -> Objective:
    """``seed`` is the run seed: DPSM's random q_0 and CUT's APS uniforms derive from it."""
    common = {"alpha": alpha, "conformal_weight": conformal_weight, "collective": collective}
    if method == "ce":
        return CrossEntropy(**common)
    if method == "conftr":
        return ConfTr(sigmoid_temperature=sigmoid_temperature, sort_temperature=sort_temperature, split=conftr_split, **common)
    if method == "cut":
        return CUT(sort_temperature=sort_temperature, score=cut_score, seed=seed, **common)
    if method == "dpsm":
        return DPSM(sigmoid_temperature=sigmoid_temperature, quantile_lr=quantile_lr, q_init=q_init, seed=seed, **common)
    raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")


__all__ = ["CONFTR_SPLITS", "CUT", "CUT_SCORES", "DPSM", "METHODS", "Q_INITS", "ConfTr", "CrossEntropy", "Objective", "ObjectiveOutput", "build_objective", "hps_scores", "ks_to_uniform"]
