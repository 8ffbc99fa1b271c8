"""ConfTr (Stutz et al. 2021): the soft set size at a *batch* quantile -- the stochastic
approximation that DPSM replaces.

lambda times the soft set size of B2 at tau, the conformal (1 - alpha) quantile of B1's label
scores, plus CE.  tau is differentiable (smooth sort with ``sort_temperature``, or the exact order
statistic when it is 0) and, with several workers, taken over the global B1.

Where B1 and B2 come from is ``split``: ``halves`` -- B1 from D1 calibrates, B2 from D2 predicts,
CE on B1, the fixed halves of Algorithm 1 (so CE never sees D2); ``batch`` -- B1 and B2 are the two
random halves of one batch of the whole training set (the loop draws them so), and CE is on the
whole batch, as in Stutz et al. and the official DPSM code.
"""

from __future__ import annotations

import torch

from dpsm_ray.conformal import hard_batch_quantile, label_scores, pinball_loss, smooth_quantile, soft_set_size
from dpsm_ray.objectives.base import Objective, ObjectiveOutput, cross_entropy, hps_scores

CONFTR_SPLITS = ("halves", "batch")


class ConfTr(Objective):
    name = "conftr"

    def __init__(self, *, sigmoid_temperature: float, sort_temperature: float, split: str = "halves", **kwargs) -> None:
        super().__init__(**kwargs)
        if split not in CONFTR_SPLITS:
            raise ValueError(f"split must be one of {', '.join(CONFTR_SPLITS)}; got {split!r}")
        self.sigmoid_temperature = sigmoid_temperature
        self.sort_temperature = sort_temperature
        self.split = split

    def batch_quantile(self, calibration_scores):
        if self.sort_temperature == 0:
            return hard_batch_quantile(calibration_scores, self.alpha)
        return smooth_quantile(calibration_scores, self.alpha, self.sort_temperature)

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        if self.split == "halves":
            ce = cross_entropy(logits1, labels1)
        else:
            ce = cross_entropy(torch.cat([logits1, logits2]), torch.cat([labels1, labels2]))
        calibration_scores = self.collective.gather(label_scores(hps_scores(logits1), labels1))
        tau = self.batch_quantile(calibration_scores)
        size = soft_set_size(hps_scores(logits2), tau, self.sigmoid_temperature)
        return self._output(ce, size, pinball_loss(tau, calibration_scores, self.alpha), tau)
