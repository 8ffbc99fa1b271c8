"""Split-conformal evaluation over R random calibration/test re-splits, as one batched computation:
every score calibrated marginally (one threshold, coverage 1 - alpha on average over the classes)
and, when asked, class-conditionally (a threshold per class, coverage 1 - alpha in every class),
clustered or by RC3P (a threshold per class from fewer points a class: ``conformal.classwise``)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dpsm_ray.conformal import CALIBRATIONS
from dpsm_ray.conformal.classwise import clustered_calibration, label_ranks, rank_sets, rc3p_calibration
from dpsm_ray.conformal.metrics import (
    Slabs, accuracy, class_counts, class_coverage, class_coverage_range, class_prediction_sets, class_set_size, classes_under, coverage,
    covered, covgap, empty_rate, prediction_sets, set_size, singleton_rate, sscv, top_label_ece,
)
from dpsm_ray.conformal.levels import check_alpha, min_calibration_size
from dpsm_ray.conformal.quantile import class_conformal_quantile, conformal_quantile
from dpsm_ray.conformal.scores import example_uniforms, label_scores
from dpsm_ray.seeding import derive_seed

EVAL_COLUMNS = (
    "score", "calibration", "split", "alpha", "n_cal", "n_test", "q", "coverage", "set_size", "covgap", "sscv", "wsc", "accuracy",
    "empty_rate", "singleton_rate", "classes_under", "class_coverage_min", "class_coverage_max", "ece",
)
CLASS_COLUMNS = ("score", "calibration", "split", "label", "n_cal", "n_test", "q", "coverage", "set_size")


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


class Calibrated(NamedTuple):
    """One score calibrated one way on every re-split of a ``Resplits``."""

    score: str
    calibration: str  # marginal | class | cluster | rc3p
    cal: torch.Tensor  # [R, m] calibration indices
    test: torch.Tensor  # [R, n - m] test indices
    q: torch.Tensor  # the thresholds: [R] (marginal) or [R, K] (the others; +inf for a class with too few points)
    sets: torch.Tensor  # [R, n - m, K] the test part's prediction sets
    rank_limits: torch.Tensor | None = None  # [R, K] RC3P's limit on each label's rank (None for the others)


@dataclass(frozen=True, eq=False)
class Resplits:
    """The evaluation protocol :func:`evaluate` and :func:`evaluate_classes` share: ``splits``
    random calibration/test re-splits of the pooled points (the paper: 10), each calibrating on
    ``round(cal_fraction * n)`` of them and testing on the rest, for every score in ``scores`` (each
    score's name -> its function ``(probs [n, K], u [n]) -> scores [n, K]``;
    ``dpsm_ray.cards.score_functions`` gives the cards') and every calibration in ``calibrations``
    (``marginal``, the default: ``conformal_quantile``; ``class``: ``class_conformal_quantile``, a
    threshold per class; ``cluster`` and ``rc3p``: ``conformal.classwise``; ``CALIBRATIONS``: all).  APS/RAPS/SAPS/top-k
    uniforms are drawn per example from ``(seed, example_ids)`` (default
    ``arange(n)``), so they do not depend on order or batching."""

    scores: Mapping[str, Callable]
    splits: int = 10
    cal_fraction: float = 0.3
    seed: int = 0
    example_ids: torch.Tensor | None = None
    calibrations: tuple[str, ...] = ("marginal",)

    def __post_init__(self) -> None:
        if not isinstance(self.scores, Mapping) or not self.scores or not all(callable(matrix) for matrix in self.scores.values()):
            raise ValueError(
                "scores must map each score's name to its function (probs [n, K], u [n]) -> scores [n, K] (dpsm_ray.cards.score_functions)"
            )
        if not self.calibrations or not set(self.calibrations) <= set(CALIBRATIONS) or isinstance(self.calibrations, str):
            raise ValueError(f"calibrations must be some of {', '.join(CALIBRATIONS)}; got {self.calibrations!r}")

    def calibrated_sets(self, probs: torch.Tensor, labels: torch.Tensor, alpha: float) -> Iterator[Calibrated]:
        """For each score and calibration: the re-splits' calibration/test indices, the thresholds
        of each calibration part and the prediction sets of its test part (``Calibrated``).  A class
        with fewer calibration points than its alpha needs gets an infinite threshold (every set holds
        it), and a warning names the classes."""
        check_alpha(alpha)
        if probs.ndim != 2 or labels.shape != probs.shape[:1]:
            raise ValueError(f"probs must be [n, K] and labels [n]; got {tuple(probs.shape)} and {tuple(labels.shape)}")
        n, num_classes = probs.shape
        cal, test = resplit(n, self.splits, self.cal_fraction, self.seed, probs.device)
        ids = torch.arange(n, device=probs.device) if self.example_ids is None else self.example_ids
        u = example_uniforms(self.seed, ids).to(probs.device)
        if {"class", "rc3p"} & set(self.calibrations):
            _warn_short_classes(class_counts(labels[cal], num_classes), alpha)
        ranks = label_ranks(probs) if "rc3p" in self.calibrations else None  # every class's, and (below) the label's
        label_rank = ranks.gather(1, labels[:, None]).squeeze(1) if ranks is not None else None
        cluster_seed = derive_seed(self.seed, "clusters")
        for kind, matrix in self.scores.items():
            all_scores = matrix(probs, u)
            cal_scores = label_scores(all_scores, labels)[cal]
            for calibration in self.calibrations:
                limits = None
                if calibration == "marginal":
                    q = conformal_quantile(cal_scores, alpha)
                    sets = prediction_sets(all_scores[test], q)
                elif calibration == "class":
                    q = class_conformal_quantile(cal_scores, labels[cal], num_classes, alpha)
                    sets = class_prediction_sets(all_scores[test], q)
                elif calibration == "cluster":
                    q = torch.stack([clustered_calibration(cal_scores[r], labels[cal[r]], num_classes, alpha,
                                                           seed=cluster_seed).thresholds
                                     for r in range(self.splits)])
                    sets = class_prediction_sets(all_scores[test], q)
                else:
                    found = [rc3p_calibration(cal_scores[r], label_rank[cal[r]], labels[cal[r]], num_classes, alpha)
                             for r in range(self.splits)]
                    q, limits = torch.stack([f.thresholds for f in found]), torch.stack([f.rank_limits for f in found])
                    sets = rank_sets(all_scores[test], q, ranks[test], limits)
                yield Calibrated(kind, calibration, cal, test, q, sets, limits)


def _warn_short_classes(counts: torch.Tensor, alpha: float) -> None:
    """Warn, naming them, of the classes some calibration part (a row of ``counts`` ``[R, K]``)
    holds too few points of for a finite class-conditional threshold at ``alpha``."""
    need = min_calibration_size(alpha)
    short = (counts < need).any(dim=0).nonzero().flatten().tolist()
    if short:
        named = ", ".join(map(str, short[:20])) + (f", ... ({len(short)} classes)" if len(short) > 20 else "")
        warnings.warn(
            f"class-conditional calibration at alpha={alpha:g} needs at least {need} calibration points of a class; class"
            f"{'es' if len(short) > 1 else ''} {named} had fewer in some re-split (as few as {int(counts.min())}): their threshold is"
            " infinite there, so every prediction set holds them",
            stacklevel=2,
        )


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
    """One row per (score, calibration, re-split) of ``resplits``: coverage, APSS, CovGap, SSCV, WSC,
    accuracy, the empty-set and singleton rates, the classes under 1 - alpha, the class coverage
    range and the top-label ECE of the probabilities, on the test part, and the threshold ``q`` (NaN
    for rows with a threshold per class, which are :func:`evaluate_classes`'s).  ``probs`` ``[n, K]`` are softmax outputs on the
    pooled calibration + test points.  WSC slabs live in ``features`` (default: the
    log-probabilities, i.e. the model's logit space); every score and calibration shares their
    search's projections (``Slabs``: the test parts are the same).
    """
    features = probs.clamp(min=1e-30).log() if features is None else features
    rows, slabs = [], None
    for found in resplits.calibrated_sets(probs, labels, alpha):
        test, sets = found.test, found.sets
        test_labels = labels[test]
        if slabs is None:
            slabs = Slabs(features[test], delta=wsc_delta, directions=wsc_directions, seed=resplits.seed)
        metrics = {
            "q": found.q if found.calibration == "marginal" else torch.full(found.q.shape[:1], math.nan),
            "coverage": coverage(sets, test_labels),
            "set_size": set_size(sets),
            "covgap": covgap(sets, test_labels, alpha),
            "sscv": sscv(sets, test_labels, alpha),
            "wsc": slabs.coverage(covered(sets, test_labels)),
            "accuracy": accuracy(probs[test], test_labels),
            "empty_rate": empty_rate(sets),
            "singleton_rate": singleton_rate(sets),
            "classes_under": classes_under(sets, test_labels, alpha),
            **dict(zip(("class_coverage_min", "class_coverage_max"), class_coverage_range(sets, test_labels))),
            "ece": top_label_ece(probs[test], test_labels),
        }
        for split in range(resplits.splits):
            row = {"score": found.score, "calibration": found.calibration, "split": split, "alpha": alpha, "n_cal": found.cal.shape[1],
                   "n_test": test.shape[1]}
            row.update({name: value[split].item() for name, value in metrics.items()})
            rows.append(row)
    return rows


def evaluate_classes(probs: torch.Tensor, labels: torch.Tensor, alpha: float, resplits: Resplits) -> list[dict]:
    """One row per (score, calibration, re-split, class): the class's calibration and test points,
    the threshold its label was held to (the marginal q, or the class's own), its test points'
    coverage (NaN when the test part has none) and their average set size -- the same re-splits,
    uniforms and sets as :func:`evaluate` with the same ``resplits``."""
    rows = []
    num_classes = probs.shape[1]
    for found in resplits.calibrated_sets(probs, labels, alpha):
        test_labels = labels[found.test]
        thresholds = found.q if found.q.ndim == 2 else found.q[:, None].expand(-1, num_classes)
        metrics = {
            "n_cal": class_counts(labels[found.cal], num_classes).tolist(),
            "n_test": class_counts(test_labels, num_classes).tolist(),
            "q": thresholds.tolist(),
            "coverage": class_coverage(found.sets, test_labels, num_classes).tolist(),
            "set_size": class_set_size(found.sets, test_labels, num_classes).tolist(),
        }
        for split in range(resplits.splits):
            for label in range(num_classes):
                rows.append({"score": found.score, "calibration": found.calibration, "split": split, "label": label,
                             **{name: value[split][label] for name, value in metrics.items()}})
    return rows
