"""Training objectives with one call shape: ``objective(logits1, labels1, logits2, labels2)``
on a batch B1 and B2, returning the loss and its diagnostics.  A method's card
(``dpsm_ray.cards.methods``) names its objective; ``dpsm_ray.cards.build_objective`` builds it."""

from dpsm_ray.facts import CE_BATCHES
from dpsm_ray.objectives.base import STAT_COLUMNS, Objective, ObjectiveOutput, hps_scores
from dpsm_ray.objectives.ce import CrossEntropy
from dpsm_ray.objectives.conftr import CONFTR_SPLITS, ConfTr, ConfTrPublished
from dpsm_ray.objectives.confts import ConfTS, TemperatureScaledLinear
from dpsm_ray.objectives.cut import CUT, CUT_SCORES, ks_to_uniform
from dpsm_ray.objectives.dpsm import DPSM, Q_INITS, SPLITS
from dpsm_ray.objectives.rwce import RankWeightedCE, true_label_rank
from dpsm_ray.objectives.vr_conftr import VRConfTr, variance_reduced_quantile


__all__ = [
    "CE_BATCHES",
    "CONFTR_SPLITS",
    "CUT",
    "CUT_SCORES",
    "DPSM",
    "Q_INITS",
    "SPLITS",
    "STAT_COLUMNS",
    "ConfTS",
    "ConfTr",
    "ConfTrPublished",
    "CrossEntropy",
    "Objective",
    "ObjectiveOutput",
    "RankWeightedCE",
    "TemperatureScaledLinear",
    "VRConfTr",
    "hps_scores",
    "ks_to_uniform",
    "true_label_rank",
    "variance_reduced_quantile",
]
