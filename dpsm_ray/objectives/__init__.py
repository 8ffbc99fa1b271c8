"""Training objectives with one call shape: ``objective(logits1, labels1, logits2, labels2)``
on a batch B1 and B2, returning the loss and its diagnostics."""

from dpsm_ray.catalog import BASE_MODEL, CE_BATCHES, METHODS, PAPER_METHODS
from dpsm_ray.methods import method_card, method_fields
from dpsm_ray.objectives.base import Objective, ObjectiveOutput, hps_scores
from dpsm_ray.objectives.ce import CrossEntropy
from dpsm_ray.objectives.conftr import CONFTR_SPLITS, ConfTr, ConfTrPublished
from dpsm_ray.objectives.confts import ConfTS, TemperatureScaledLinear
from dpsm_ray.objectives.cut import CUT, CUT_SCORES, ks_to_uniform
from dpsm_ray.objectives.dpsm import DPSM, Q_INITS, SPLITS
from dpsm_ray.objectives.rwce import RankWeightedCE, true_label_rank
from dpsm_ray.objectives.vr_conftr import VRConfTr, variance_reduced_quantile


def build_objective(method: str, *, seed: int = 0, collective=None, **values) -> Objective:
    """The objective of ``method`` (its card in ``dpsm_ray.methods``) from config field values
    (``alpha``, ``conformal_weight``, ``quantile_lr`` ...); a field the method does not read is
    ignored, one left out takes the objective's default.  ``seed`` is the run seed: DPSM's random
    q_0 and CUT's APS uniforms derive from it."""
    unknown = set(values) - method_fields() - {"alpha", "conformal_weight"}
    if unknown:
        raise TypeError(f"build_objective: no method reads {', '.join(sorted(unknown))}")
    return method_card("ce" if method == BASE_MODEL else method).build(values, seed=seed, collective=collective)


__all__ = [
    "BASE_MODEL",
    "CE_BATCHES",
    "CONFTR_SPLITS",
    "CUT",
    "CUT_SCORES",
    "DPSM",
    "METHODS",
    "PAPER_METHODS",
    "Q_INITS",
    "SPLITS",
    "ConfTS",
    "ConfTr",
    "ConfTrPublished",
    "CrossEntropy",
    "Objective",
    "ObjectiveOutput",
    "RankWeightedCE",
    "TemperatureScaledLinear",
    "VRConfTr",
    "build_objective",
    "hps_scores",
    "ks_to_uniform",
    "true_label_rank",
    "variance_reduced_quantile",
]
