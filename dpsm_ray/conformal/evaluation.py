"""Split-conformal evaluation over R random calibration/test re-splits, as one batched computation."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from dpsm_ray.conformal.metrics import (
    accuracy, class_counts, class_coverage, class_set_size, coverage, covered, covgap, prediction_sets, set_size, sscv, wsc,
)
from dpsm_ray.conformal.levels import check_alpha
from dpsm_ray.conformal.quantile import conformal_quantile
from dpsm_ray.conformal.scores import example_uniforms, label_scores

EVAL_COLUMNS = ("score", "split", "alpha", "n_cal", "n_test", "q", "coverage", "set_size", "covgap", "sscv", "wsc", "accuracy")
CLASS_COLUMNS = ("score", "split", "label", "n_test", "coverage", "set_size")


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


@dataclass(frozen=True, eq=False)
class Resplits:
    """The evaluation protocol :func:`evaluate` and :func:`evaluate_classes` share: ``splits``
    random calibration/test re-splits of the pooled points (the paper: 10), each calibrating on
    ``round(cal_fraction * n)`` of them and testing on the rest, for every score in ``scores`` (each
    score's name -> its function ``(probs [n, K], u [n]) -> scores [n, K]``;
    ``dpsm_ray.cards.score_functions`` gives the cards').  APS/RAPS uniforms are drawn per example
    from ``(seed, example_ids)`` (default ``arange(n)``), so they do not depend on order or batching."""

    scores: Mapping[str, Callable]
    splits: int = 10
    cal_fraction: float = 0.3
    seed: int = 0
    example_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.scores, Mapping) or not self.scores or not all(callable(matrix) for matrix in self.scores.values()):
            raise ValueError(
                "scores must map each score's name to its function (probs [n, K], u [n]) -> scores [n, K] (dpsm_ray.cards.score_functions)"
            )

    def calibrated_sets(self, probs: torch.Tensor, labels: torch.Tensor, alpha: float) -> Iterator:
        """For each score: its name, the re-splits' calibration/test indices, the conformal quantile
        of each calibration part ``[R]`` and the prediction sets of its test part ``[R, n_test, K]``."""
        check_alpha(alpha)
        if probs.ndim != 2 or labels.shape != probs.shape[:1]:
            raise ValueError(f"probs must be [n, K] and labels [n]; got {tuple(probs.shape)} and {tuple(labels.shape)}")
        n = probs.shape[0]
        cal, test = resplit(n, self.splits, self.cal_fraction, self.seed, probs.device)
        ids = torch.arange(n, device=probs.device) if self.example_ids is None else self.example_ids
        u = example_uniforms(self.seed, ids).to(probs.device)
        for kind, matrix in self.scores.items():
            all_scores = matrix(probs, u)
            q = conformal_quantile(label_scores(all_scores, labels)[cal], alpha)
            yield kind, cal, test, q, prediction_sets(all_scores[test], q)


def evaluate(
    probs: torch.Tensor,
    labels: torch.Tensor,
    alpha: float,
    resplits: Resplits,
    *,
    features: torch.Tensor | None = None,
    wsc_delta: float = 0.1,
    wsc_directions: int = 256,
) -> list[dict]:
    """One row per (score, re-split) of ``resplits``: coverage, APSS, CovGap, SSCV, WSC and accuracy
    on the test part.  ``probs`` ``[n, K]`` are softmax outputs on the pooled calibration + test
    points.  WSC slabs live in ``features`` (default: the log-probabilities, i.e. the model's logit
    space).
    """
    features = probs.clamp(min=1e-30).log() if features is None else features
    rows = []
    for kind, cal, test, q, sets in resplits.calibrated_sets(probs, labels, alpha):
        test_labels = labels[test]
        metrics = {
            "q": q,
            "coverage": coverage(sets, test_labels),
            "set_size": set_size(sets),
            "covgap": covgap(sets, test_labels, alpha),
            "sscv": sscv(sets, test_labels, alpha),
            "wsc": wsc(features[test], covered(sets, test_labels), delta=wsc_delta, directions=wsc_directions, seed=resplits.seed),
            "accuracy": accuracy(probs[test], test_labels),
        }
        for split in range(resplits.splits):
            row = {"score": kind, "split": split, "alpha": alpha, "n_cal": cal.shape[1], "n_test": test.shape[1]}
            row.update({name: float(value[split]) for name, value in metrics.items()})
            rows.append(row)
    return rows


def evaluate_classes(probs: torch.Tensor, labels: torch.Tensor, alpha: float, resplits: Resplits) -> list[dict]:
    """One row per (score, re-split, class): the class's test points, their coverage (NaN when
    the test part has none) and their average set size -- the same re-splits, uniforms and sets
    as :func:`evaluate` with the same ``resplits``."""
    rows = []
    num_classes = probs.shape[1]
    for kind, _, test, _, sets in resplits.calibrated_sets(probs, labels, alpha):
        test_labels = labels[test]
        metrics = {
            "n_test": class_counts(test_labels, num_classes).tolist(),
            "coverage": class_coverage(sets, test_labels, num_classes).tolist(),
            "set_size": class_set_size(sets, test_labels, num_classes).tolist(),
        }
        for split in range(resplits.splits):
            for label in range(num_classes):
                rows.append(
                    {"score": kind, "split": split, "label": label, **{name: value[split][label] for name, value in metrics.items()}}
                )
    return rows
