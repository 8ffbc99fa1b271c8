"""Split-conformal evaluation over R random calibration/test re-splits, as one batched computation."""

from __future__ import annotations

import torch

from dpsm_ray.conformal.metrics import accuracy, coverage, covered, covgap, prediction_sets, set_size, sscv, wsc
from dpsm_ray.conformal.quantile import check_alpha, conformal_quantile
from dpsm_ray.conformal.scores import SCORE_KINDS, check_score_kind, example_uniforms, label_scores, score_matrix

EVAL_COLUMNS = ("score", "split", "alpha", "n_cal", "n_test", "q", "coverage", "set_size", "covgap", "sscv", "wsc", "accuracy")


def resplit(n: int, splits: int, cal_fraction: float, seed: int, device: torch.device | str = "cpu"):
    """R random calibration/test partitions of ``range(n)``: index tensors ``[R, m]`` and ``[R, n - m]``."""
    if splits < 1:
        raise ValueError(f"splits must be >= 1; got {splits}")
    if not 0.0 < cal_fraction < 1.0:
        raise ValueError(f"cal_fraction must be in (0, 1); got {cal_fraction}")
    n_cal = round(n * cal_fraction)
    if not 1 <= n_cal <= n - 1:
        raise ValueError(f"cal_fraction={cal_fraction} of n={n} points leaves an empty calibration or test part")
    generator = torch.Generator().manual_seed(seed)
    order = torch.rand(splits, n, generator=generator).argsort(dim=1).to(device)
    return order[:, :n_cal], order[:, n_cal:]


def evaluate(
    probs: torch.Tensor,
    labels: torch.Tensor,
    alpha: float,
    *,
    scores: tuple[str, ...] = SCORE_KINDS,
    splits: int = 10,
    cal_fraction: float = 0.3,
    seed: int = 0,
    features: torch.Tensor | None = None,
    example_ids: torch.Tensor | None = None,
    raps_lambda: float = 0.01,
    raps_k_reg: int = 5,
    wsc_delta: float = 0.1,
    wsc_directions: int = 256,
) -> list[dict]:
    """One row per (score, re-split): coverage, APSS, CovGap, SSCV, WSC and accuracy on the test part.

    ``probs`` ``[n, K]`` are softmax outputs on the pooled calibration + test points; each re-split
    calibrates on ``round(cal_fraction * n)`` of them and tests on the rest (the paper: 10 re-splits).
    APS/RAPS uniforms are drawn per example from ``(seed, example_ids)`` (default ``arange(n)``), so
    they do not depend on order or batching.  WSC slabs live in ``features`` (default: the
    log-probabilities, i.e. the model's logit space).
    """
    check_alpha(alpha)
    for kind in scores:
        check_score_kind(kind)
    if probs.ndim != 2 or labels.shape != probs.shape[:1]:
        raise ValueError(f"probs must be [n, K] and labels [n]; got {tuple(probs.shape)} and {tuple(labels.shape)}")
    n = probs.shape[0]
    cal, test = resplit(n, splits, cal_fraction, seed, probs.device)
    ids = torch.arange(n, device=probs.device) if example_ids is None else example_ids
    u = example_uniforms(seed, ids).to(probs.device)
    features = probs.clamp(min=1e-30).log() if features is None else features
    test_labels = labels[test]
    test_accuracy = accuracy(probs[test], test_labels)
    rows = []
    for kind in scores:
        all_scores = score_matrix(probs, kind, u=u, raps_lambda=raps_lambda, raps_k_reg=raps_k_reg)
        q = conformal_quantile(label_scores(all_scores, labels)[cal], alpha)
        sets = prediction_sets(all_scores[test], q)
        metrics = {
            "q": q,
            "coverage": coverage(sets, test_labels),
            "set_size": set_size(sets),
            "covgap": covgap(sets, test_labels, alpha),
            "sscv": sscv(sets, test_labels, alpha),
            "wsc": wsc(features[test], covered(sets, test_labels), delta=wsc_delta, directions=wsc_directions, seed=seed),
            "accuracy": test_accuracy,
        }
        for split in range(splits):
            row = {"score": kind, "split": split, "alpha": alpha, "n_cal": cal.shape[1], "n_test": test.shape[1]}
            row.update({name: float(value[split]) for name, value in metrics.items()})
            rows.append(row)
    return rows
