"""Conformal prediction: scores, the exact quantile (marginal and per class), prediction sets,
p-values and metrics.  Imports torch only (and scikit-learn's k-means, for the clustered calibration
when it runs).

The names below are handed on from the modules that define them as they are first used (PEP 562, as
the package's own face hands on ``Predictor``): ``dpsm_ray.conformal.levels`` -- alpha and the calibration
size it needs -- is torch-free, so the command line checks alpha before torch loads."""

from __future__ import annotations

from dpsm_ray.lazy import handed_on

# how a score is calibrated: one threshold (marginal); one per class (class-conditional, "Mondrian"); one per
# cluster of alike classes (clustered, Ding et al. 2023); one per class with a limit on the label's rank (RC3P,
# Shi et al. 2024: conformal/classwise.py).  Here, torch-free, so that the command line checks
# --eval-calibrations before torch loads
CALIBRATIONS = ("marginal", "class", "cluster", "rc3p")
# the sets a predictor gives: a calibration's, or conformal risk control's for a class-weighted miss cost
# (``Predictor.control_risk``: conformal/risk.py), which needs the costs and a level beside the calibration points
SET_RULES = (*CALIBRATIONS, "risk")
CALIBRATION_TITLES = {
    "marginal": "marginal", "class": "class-conditional", "cluster": "clustered", "rc3p": "RC3P", "risk": "risk-controlled",
}

# where each name lives: dpsm_ray/conformal/<module>.py
HANDED_ON = {
    "CLASS_COLUMNS": "evaluation",
    "Calibrated": "evaluation",
    "EVAL_COLUMNS": "evaluation",
    "Resplits": "evaluation",
    "Clustered": "classwise",
    "EMBEDDING_QUANTILES": "classwise",
    "RankCalibrated": "classwise",
    "clustered_calibration": "classwise",
    "label_ranks": "classwise",
    "rank_sets": "classwise",
    "rc3p_calibration": "classwise",
    "evaluate": "evaluation",
    "evaluate_classes": "evaluation",
    "resplit": "evaluation",
    "check_alpha": "levels",
    "check_costs": "risk",
    "check_level": "risk",
    "crc_threshold": "risk",
    "miss_cost": "risk",
    "min_calibration_size": "levels",
    "SSCV_BINS": "metrics",
    "accuracy": "metrics",
    "class_counts": "metrics",
    "class_coverage": "metrics",
    "class_coverage_range": "metrics",
    "classes_under": "metrics",
    "empty_rate": "metrics",
    "singleton_rate": "metrics",
    "top_label_ece": "metrics",
    "class_prediction_sets": "metrics",
    "class_set_size": "metrics",
    "coverage": "metrics",
    "covered": "metrics",
    "covgap": "metrics",
    "prediction_sets": "metrics",
    "set_size": "metrics",
    "soft_set_size": "metrics",
    "sscv": "metrics",
    "worst_slab": "metrics",
    "wsc": "metrics",
    "class_conformal_p_values": "pvalues",
    "conformal_p_values": "pvalues",
    "class_conformal_quantile": "quantile",
    "class_order_statistic": "quantile",
    "conformal_quantile": "quantile",
    "conformal_rank": "quantile",
    "empirical_quantile": "quantile",
    "empirical_rank": "quantile",
    "hard_batch_quantile": "quantile",
    "pinball_grad": "quantile",
    "pinball_loss": "quantile",
    "smooth_quantile": "quantile",
    "soft_sort": "quantile",
    "aps_matrix": "scores",
    "example_uniforms": "scores",
    "hps_matrix": "scores",
    "label_scores": "scores",
    "margin_matrix": "scores",
    "saps_matrix": "scores",
    "topk_matrix": "scores",
}


__getattr__ = handed_on(__name__, HANDED_ON)


__all__ = sorted(["CALIBRATIONS", "CALIBRATION_TITLES", "SET_RULES", *HANDED_ON])
