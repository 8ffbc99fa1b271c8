"""Conformal risk control (Angelopoulos, Bates, Fisch, Lei and Schuster, ICLR 2024) for a loss the
user chooses: a class-weighted miss cost.

Split conformal bounds the chance of a miss; a deployment that must rarely miss one class
("malignant") and may often miss another wants the expected *cost* of a miss bounded instead.  With
a cost w_y in [0, 1] for missing class y, the sets C_lambda(x) = {y : S(x, y) <= lambda} have the
loss L(lambda) = w_Y 1{S(X, Y) > lambda}, non-increasing in lambda and bounded by B = max w <= 1.
On n calibration points with empirical risk R_n(lambda), conformal risk control takes

    lambda_hat = inf { lambda : n / (n + 1) R_n(lambda) + B / (n + 1) <= level },

and then E[w_Y 1{Y not in C(X)}] <= level for a new exchangeable point (their Theorem 1).  With every
w_y = 1 it is split conformal at alpha = level (lambda_hat the ceil((n + 1)(1 - level))-th smallest
score).  R_n steps at the calibration scores, so lambda_hat is one of them (the smallest
calibration score when even that one qualifies: the sets need hold nothing more), or +inf when none
does (B / (n + 1) > level: too few points; every set holds every class).  Exact: the costs and the
level are read as the decimals they were written as (``conformal_rank``), so the inequality is
decided in rationals.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch


def check_costs(costs, num_classes: int) -> torch.Tensor:
    """A miss cost per class, ``[K]`` float64 in [0, 1] with at least one above 0 (ValueError naming
    the first bad one)."""
    values = torch.as_tensor(costs, dtype=torch.float64).flatten()
    if values.shape != (num_classes,):
        raise ValueError(f"costs: one miss cost per class, {num_classes} of them; got {values.numel()}")
    bad = ((values < 0) | (values > 1) | values.isnan()).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"costs: a miss cost must be in [0, 1]; class {bad[0]}'s is {values[bad[0]].item()}")
    if not (values > 0).any():
        raise ValueError("costs: every miss cost is 0, so every set may be empty; give the classes whose misses matter a cost above 0")
    return values


def check_level(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level (the expected miss cost to control) must be in the open interval (0, 1); got {level}")
    return level


def crc_threshold(scores: torch.Tensor, labels: torch.Tensor, costs: torch.Tensor, level: float) -> float:
    """lambda_hat of conformal risk control for the class-weighted miss cost: ``scores`` ``[n]`` the
    calibration points' label scores, ``labels`` ``[n]``, ``costs`` ``[K]`` (``check_costs``)."""
    check_level(level)
    n = len(scores)
    exact = [Fraction(repr(float(c))) for c in costs.tolist()]
    bound, target = max(exact), Fraction(repr(float(level)))
    if n == 0 or bound > target * (n + 1):  # even lambda = +inf (R_n = 0) fails
        return math.inf
    order = scores.argsort(stable=True).tolist()
    values = [float(scores[i]) for i in order]
    weights = [exact[int(labels[i])] for i in order]
    # the cost of the points above each candidate lambda = values[k] (ties: all of a value are in the set)
    above, total = [Fraction(0)] * n, Fraction(0)
    for k in range(n - 1, -1, -1):
        above[k] = total if k == n - 1 or values[k] != values[k + 1] else above[k + 1]
        total += weights[k]
    for k in range(n):  # the smallest qualifying candidate: n R_n / (n + 1) + B / (n + 1) <= level
        if above[k] + bound <= target * (n + 1):
            return values[k]
    return math.inf


def miss_cost(sets: torch.Tensor, labels: torch.Tensor, costs: torch.Tensor) -> torch.Tensor:
    """The mean class-weighted miss cost of prediction sets ``[..., n, K]`` on ``labels`` ``[..., n]``."""
    missed = ~sets.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (missed.to(torch.float64) * costs.to(sets.device)[labels]).mean(dim=-1)
