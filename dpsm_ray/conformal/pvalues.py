"""Conformal p-values of every label: the evidence for each label, from which the prediction set at
any alpha follows after the fact.

For a test point x and label y with score s = S(x, y) (the same score, uniforms included, as its
prediction set) and calibration scores s_1..s_n, the split-conformal p-value (Vovk, Gammerman and
Shafer, "Algorithmic learning in a random world", 2005) is::

    p_y = (#{i : s_i > s} + tau * (#{i : s_i = s} + 1)) / (n + 1)

With tau = 1 (the default) it is ``(1 + #{i : s_i >= s}) / (n + 1)`` and, exactly, p_y > alpha if
and only if s <= q_hat, the ceil((n + 1)(1 - alpha))-th smallest s_i (``conformal_quantile``): the
set at alpha is {y : p_y > alpha}, for every alpha at once.  (With k that rank, s <= s_(k) iff
fewer than k scores lie below s, iff #{s_i >= s} >= n + 1 - k = floor((n + 1) alpha), iff the
integer 1 + #{s_i >= s} exceeds (n + 1) alpha; k > n, an infinite q_hat, makes it hold always.)
Such a p-value is super-uniform: P(p_Y <= alpha) <= alpha.  With tau ~ Unif(0, 1), independent of
the scores, it is the smoothed p-value, exactly uniform; its sets {y : p_y > alpha} are randomised
at the threshold and cover exactly 1 - alpha, so they are not the threshold sets.

Class-conditional ("Mondrian") p-values compare s with the calibration scores of label y only, and
the same identity holds with ``class_conformal_quantile``'s per-class thresholds; a class without
enough calibration points for an alpha has p-values above it, as its infinite threshold says.
"""

from __future__ import annotations

import torch


def conformal_p_values(calibration_scores: torch.Tensor, scores: torch.Tensor, tau: torch.Tensor | None = None) -> torch.Tensor:
    """p-values ``[m, K]`` of the scores ``[m, K]`` of every label against the ``n`` calibration
    scores (each calibration point's own label's score); ``tau`` ``[m]``, one per test point (None:
    tau = 1, the p-value whose sets are the threshold sets)."""
    n = calibration_scores.shape[-1]
    ordered = calibration_scores.to(scores.dtype).sort().values.contiguous()
    below = torch.searchsorted(ordered, scores.contiguous(), side="left")  # #{s_i < s}
    if tau is None:
        return (n - below + 1).to(torch.float64) / (n + 1)
    at_most = torch.searchsorted(ordered, scores.contiguous(), side="right")  # #{s_i <= s}
    smoothing = tau.to(torch.float64)[:, None]
    return ((n - at_most) + smoothing * (at_most - below + 1)).to(torch.float64) / (n + 1)


def class_conformal_p_values(
    calibration_scores: torch.Tensor, calibration_labels: torch.Tensor, scores: torch.Tensor, tau: torch.Tensor | None = None
) -> torch.Tensor:
    """Class-conditional p-values ``[m, K]``: label y's column against the calibration scores of
    the points labelled y (``calibration_labels`` ``[n]``); as ``conformal_p_values`` otherwise.
    A class with no calibration point has p-value 1."""
    columns = [
        conformal_p_values(calibration_scores[calibration_labels == label], scores[:, label : label + 1], tau)
        for label in range(scores.shape[1])
    ]
    return torch.cat(columns, dim=1) if columns else scores.new_empty(scores.shape, dtype=torch.float64)
