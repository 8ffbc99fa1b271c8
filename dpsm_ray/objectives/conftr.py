"""ConfTr (Stutz et al. 2021): the soft set size at a *batch* quantile -- the stochastic
approximation that DPSM replaces.

CE on B1, plus lambda times the soft set size of B2 at tau, the conformal (1 - alpha) quantile of
B1's label scores.  tau is differentiable (smooth sort with ``sort_temperature``, or the exact
order statistic when it is 0) and, with several workers, taken over the global B1.
"""

from __future__ import annotations

from dpsm_ray.conformal import hard_batch_quantile, label_scores, pinball_loss, smooth_quantile, soft_set_size
from dpsm_ray.objectives.base import Objective, ObjectiveOutput, cross_entropy, hps_scores


class ConfTr(Objective):
    name = "conftr"

    def __init__(self, *, sigmoid_temperature: float, sort_temperature: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sigmoid_temperature = sigmoid_temperature
        self.sort_temperature = sort_temperature

    def batch_quantile(self, calibration_scores):
        if self.sort_temperature == 0:
            return hard_batch_quantile(calibration_scores, self.alpha)
        return smooth_quantile(calibration_scores, self.alpha, self.sort_temperature)

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        ce = cross_entropy(logits1, labels1)
        calibration_scores = self.collective.gather(label_scores(hps_scores(logits1), labels1))
        tau = self.batch_quantile(calibration_scores)
        size = soft_set_size(hps_scores(logits2), tau, self.sigmoid_temperature)
        return self._output(ce, size, pinball_loss(tau, calibration_scores, self.alpha), tau)
